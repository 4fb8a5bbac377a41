"""The agent's trimmed EC2 model (`spotagent.ec2model`, `spotagent.ec2`): cut from the installed
botocore's own model; it has exactly the operations the code calls (scanned from the source); a
client on it does each of them against the strict EC2 emulator and resolves endpoints as a full
client does; the agent process never parses the full model (a child builds it); a stale,
altered or untrusted model is not used; a failed build falls back to the full model with a
warning; and `spotagent run` imports nothing that only other commands need."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore
import botocore.loaders
import pytest
from botocore import xform_name
from botocore.exceptions import ClientError

from spotagent import cli, ec2, ec2model
from spotagent.testbed.ec2 import StrictEc2Server

AGENT = Path(ec2model.__file__).resolve().parent
REGION = "us-east-1"
AZ = "us-east-1a"
AMI = "ami-12c6146b"  # one of moto's built-in images
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def full_model() -> dict[str, Any]:
    loader = botocore.loaders.Loader(
        extra_search_paths=[botocore.loaders.Loader.BUILTIN_DATA_PATH],
        include_default_search_paths=False)
    model: dict[str, Any] = loader.load_service_model("ec2", "service-2",
                                                      ec2model.latest_api_version())
    return model


@pytest.fixture(scope="module")
def full() -> dict[str, Any]:
    return full_model()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache for the agent's clients: the first one builds the model in a child."""
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("SPOTAGENT_EC2_MODEL", raising=False)
    base = tmp_path / "cache"
    monkeypatch.setenv("SPOTAGENT_CACHE", str(base))
    return base


def agent_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "SPOTAGENT_"))}
    env.update(CREDS, AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true")
    env.update(extra)
    return env


def run_python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=180, check=False)


def events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "event" in doc:
            out.append(doc)
    return out


# --- the operation list and the code ------------------------------------------------------------


def ec2_calls(path: Path, methods: dict[str, str], waiters: dict[str, Any]) -> set[str]:
    """EC2 operations a module calls: `x.<ec2 method>(...)`, `get_paginator("m")`,
    `get_waiter("w")` (its operation) and `operation_model("Op")`."""
    ops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        arg = node.args[0] if node.args else None
        const = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
            else None
        if name in methods:
            ops.add(methods[name])
        elif name in ("get_paginator", "can_paginate"):
            assert const is not None, f"{path}: {name} with a computed name"
            ops.add(methods[const])
        elif name == "get_waiter":
            assert const is not None, f"{path}: get_waiter with a computed name"
            by_method = {xform_name(w): cfg["operation"] for w, cfg in waiters.items()}
            ops.add(by_method[const])
        elif name == "operation_model":
            assert const is not None, f"{path}: operation_model with a computed name"
            ops.add(const)
    return ops


def test_the_operations_are_exactly_the_ec2_calls_of_the_code(full: dict[str, Any]) -> None:
    methods = {xform_name(op): op for op in full["operations"]}
    waiters = botocore.loaders.Loader().load_service_model(
        "ec2", "waiters-2", ec2model.latest_api_version())["waiters"]
    called: dict[str, set[str]] = {}
    # Every module of the agent package; the emulators (testbed/) use full boto3 clients.
    for path in sorted(AGENT.rglob("*.py")):
        if "testbed" in path.relative_to(AGENT).parts:
            continue
        for op in ec2_calls(path, methods, waiters):
            called.setdefault(op, set()).add(path.name)
    assert {"volumes.py"} <= set().union(*called.values())  # the scan sees volumes.py's calls
    missing = set(called) - set(ec2model.OPERATIONS)
    assert not missing, f"called but not in ec2model.OPERATIONS: " \
                        f"{ {op: sorted(called[op]) for op in missing} }"
    unused = set(ec2model.OPERATIONS) - set(called)
    assert not unused, f"in ec2model.OPERATIONS but never called (dead weight): {unused}"


# --- building and checking ----------------------------------------------------------------------


def test_the_trimmed_model_is_cut_from_the_installed_botocore(tmp_path: Path,
                                                              full: dict[str, Any]) -> None:
    root = ec2model.build(tmp_path)
    api = ec2model.latest_api_version()
    assert root == tmp_path / "botocore" / botocore.__version__
    vdir = root / "ec2" / api
    trimmed = json.loads((vdir / "service-2.json").read_text())
    assert trimmed["metadata"] == full["metadata"] and trimmed["metadata"]["apiVersion"] == api
    assert trimmed["version"] == full["version"]
    assert sorted(trimmed["operations"]) == sorted(ec2model.OPERATIONS)
    for name, op in trimmed["operations"].items():
        assert op == full["operations"][name], name
    for name, shape in trimmed["shapes"].items():
        assert shape == full["shapes"][name], name
    # closed (every reference resolves) and nothing more than the closure
    assert ec2model.shape_closure(trimmed, ec2model.OPERATIONS) == set(trimmed["shapes"])
    assert len(trimmed["shapes"]) < len(full["shapes"]) / 10
    stamp = json.loads((vdir / ec2model.STAMP).read_text())
    assert stamp["botocore"] == botocore.__version__ and stamp["api_version"] == api
    assert stamp["operations"] == sorted(ec2model.OPERATIONS)
    assert stamp["source_sha256"] == ec2model.source_digest(api)
    assert json.loads((vdir / ec2model.EXTRAS).read_text())["merge"] == {}
    assert ec2model.check(tmp_path) == root
    assert not list(vdir.glob(".*"))  # no temporaries left by the atomic writes


def test_a_missing_operation_fails_loudly(tmp_path: Path, full: dict[str, Any]) -> None:
    with pytest.raises(ec2model.ModelError, match="NoSuchOperation"):
        ec2model.trim(full, [*ec2model.OPERATIONS, "NoSuchOperation"])
    with pytest.raises(ec2model.ModelError, match="NoSuchOperation"):
        ec2model.build(tmp_path, [*ec2model.OPERATIONS, "NoSuchOperation"])
    ec2model.build(tmp_path)
    # code that needs an operation the model on disk lacks does not take that model
    assert ec2model.check(tmp_path, [*ec2model.OPERATIONS, "RunInstances"]) is None


@pytest.mark.parametrize("spoil", ["model byte", "stamp botocore", "stamp source",
                                   "group-writable dir", "symlinked model", "no stamp"])
def test_a_stale_altered_or_untrusted_model_is_not_used(tmp_path: Path, spoil: str) -> None:
    root = ec2model.build(tmp_path)
    vdir = root / "ec2" / ec2model.latest_api_version()
    model, stamp_path = vdir / ec2model.MODEL, vdir / ec2model.STAMP
    stamp = json.loads(stamp_path.read_text())
    if spoil == "model byte":
        model.write_bytes(model.read_bytes().replace(b"AttachVolume", b"AttachVolumf", 1))
    elif spoil == "stamp botocore":
        stamp_path.write_text(json.dumps({**stamp, "botocore": "0.0.1"}))
    elif spoil == "stamp source":
        stamp_path.write_text(json.dumps({**stamp, "source_sha256": "0" * 64}))
    elif spoil == "group-writable dir":
        vdir.chmod(0o775)
    elif spoil == "symlinked model":
        real = tmp_path / "elsewhere.json"
        model.rename(real)
        model.symlink_to(real)
    elif spoil == "no stamp":
        stamp_path.unlink()
    assert ec2model.check(tmp_path) is None
    vdir.chmod(0o755)
    if model.is_symlink():
        model.unlink()
    assert ec2model.build(tmp_path) == root  # a rebuild repairs it
    assert ec2model.check(tmp_path) == root


def test_the_build_command_writes_and_check_finds(tmp_path: Path) -> None:
    env = agent_env()
    base = tmp_path / "img"
    check = [sys.executable, "-m", "spotagent.ec2model", "check", "--base", str(base)]
    assert subprocess.run(check, env=env, capture_output=True, timeout=60).returncode == 1
    built = subprocess.run([sys.executable, "-m", "spotagent.ec2model", "build",
                            "--base", str(base)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == str(ec2model.data_root(base))
    found = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
    assert found.returncode == 0 and found.stdout.strip() == built.stdout.strip()


# --- a client on the trimmed model --------------------------------------------------------------


@pytest.fixture
def server(cache: Path) -> Iterator[StrictEc2Server]:
    # function scope: moto's state is global, and the real-agent test below runs its own world
    with StrictEc2Server(region=REGION) as srv:
        yield srv
        assert srv.errors == []


def test_a_trimmed_client_does_every_operation_against_the_strict_emulator(
        server: StrictEc2Server, cache: Path) -> None:
    admin = server.client(REGION)  # set-up on botocore's full model
    iid = admin.run_instances(ImageId=AMI, MinCount=1, MaxCount=1,
                              Placement={"AvailabilityZone": AZ})["Instances"][0]["InstanceId"]
    c = ec2.client(region=REGION, endpoint_url=server.endpoint_url, max_attempts=2)
    assert sorted(c.meta.service_model.operation_names) == sorted(ec2model.OPERATIONS)
    assert c.meta.service_model.api_version == ec2model.latest_api_version()
    assert ec2model.check(cache) is not None  # built there (by a child process)
    seen: list[str] = []
    c.meta.events.register("before-call.ec2", lambda model, **_: seen.append(model.name))

    vid = c.create_volume(AvailabilityZone=AZ, Size=1, VolumeType="gp3",
                          ClientToken="trimmed-1",
                          TagSpecifications=[{"ResourceType": "volume", "Tags": [
                              {"Key": "spotagent:pool", "Value": "trim"}]}])["VolumeId"]
    pages = c.get_paginator("describe_volumes").paginate(
        Filters=[{"Name": "tag:spotagent:pool", "Values": ["trim"]}],
        PaginationConfig={"PageSize": 5})
    assert [v["VolumeId"] for p in pages for v in p["Volumes"]] == [vid]
    c.create_tags(Resources=[vid], Tags=[{"Key": "spotagent:owner", "Value": iid}])
    c.attach_volume(VolumeId=vid, InstanceId=iid, Device="/dev/sdf")
    vol = c.describe_volumes(VolumeIds=[vid])["Volumes"][0]
    assert vol["Attachments"][0]["InstanceId"] == iid
    assert {"Key": "spotagent:owner", "Value": iid} in vol["Tags"]
    c.detach_volume(VolumeId=vid, InstanceId=iid)
    c.delete_tags(Resources=[vid], Tags=[{"Key": "spotagent:owner", "Value": iid}])
    res = c.describe_instances(InstanceIds=[iid])["Reservations"]
    assert res[0]["Instances"][0]["State"]["Name"] == "running"
    assert c.describe_images(ImageIds=[AMI])["Images"][0]["ImageId"] == AMI
    # errors parse as with the full model
    with pytest.raises(ClientError) as err:
        c.describe_volumes(VolumeIds=["vol-00000000000000000"])
    assert err.value.response["Error"]["Code"] == "InvalidVolume.NotFound"
    assert set(seen) == set(ec2model.OPERATIONS)  # this test did each of them
    # operations the agent does not call are not there at all
    assert not hasattr(c, "run_instances")


class _Captured(Exception):
    """Raised by the before-send hook: the request was fully prepared, nothing was sent."""

    def __init__(self, url: str, auth: str) -> None:
        super().__init__(url)
        self.url = url
        self.scope = auth.split("Credential=")[1].split(",")[0].split("/", 2)[2] \
            if "Credential=" in auth else auth


def _resolve(model: ec2.Model, region: str, endpoint_url: str | None = None) -> str:
    """Where a DescribeVolumes of this client would go, and its signing scope."""
    try:
        c = ec2.client(region=region, endpoint_url=endpoint_url, model=model, max_attempts=1)

        def capture(request: Any, **_: Any) -> None:
            raise _Captured(request.url, request.headers.get("Authorization", b"").decode())

        c.meta.events.register("before-send.ec2", capture)
        c.describe_volumes()
    except _Captured as got:
        return f"{c.meta.endpoint_url} -> {got.url} [{got.scope}]"
    except Exception as exc:  # the same failure on both models is the same answer
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("the request was sent")


@pytest.mark.parametrize("variant", ["plain", "fips", "dualstack"])
def test_endpoints_resolve_as_with_the_full_model(cache: Path, variant: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if variant == "fips":
        monkeypatch.setenv("AWS_USE_FIPS_ENDPOINT", "true")
    if variant == "dualstack":
        monkeypatch.setenv("AWS_USE_DUALSTACK_ENDPOINT", "true")
    regions = ["us-east-1", "us-west-2", "eu-central-1", "ap-southeast-2", "ca-central-1",
               "cn-north-1", "us-gov-west-1", "us-iso-east-1", "eu-isoe-west-1",
               "mars-central-7"]
    for region in regions:
        assert _resolve("agent", region) == _resolve("full", region), region
    custom = "http://127.0.0.1:5000"
    assert _resolve("agent", "eu-west-1", custom) == _resolve("full", "eu-west-1", custom)
    assert _resolve("agent", "eu-west-1", custom).startswith(f"{custom} -> {custom}/ [")
    if variant == "plain":
        url = "https://ec2.us-east-1.amazonaws.com"
        assert _resolve("agent", "us-east-1") == f"{url} -> {url}/ [us-east-1/ec2/aws4_request]"
        c = ec2.client(region="us-east-1")
        assert c.meta.endpoint_url == url
        assert len(c.meta.service_model.operation_names) == len(ec2model.OPERATIONS)


# --- the agent process --------------------------------------------------------------------------

_CLIENT_SCRIPT = """
    import json, logging, sys
    from spotagent import ec2, log
    log.configure(json=True)
    logging.basicConfig(stream=sys.stderr, format="loader: %(message)s")
    logging.getLogger("botocore.loaders").setLevel(logging.DEBUG)
    c = ec2.client(region="us-east-1", state_dir=None)
    c.can_paginate("describe_volumes")
    print(json.dumps({"operations": len(c.meta.service_model.operation_names)}))
"""


def test_the_agent_process_never_parses_the_full_model(tmp_path: Path) -> None:
    base = tmp_path / "cache"
    env = agent_env(SPOTAGENT_CACHE=str(base))
    builtin = Path(botocore.loaders.Loader.BUILTIN_DATA_PATH) / "ec2"
    for attempt in ("first (builds in a child)", "second (reuses the cache)"):
        proc = run_python(_CLIENT_SCRIPT, env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["operations"] == len(ec2model.OPERATIONS), attempt
        loaded = [line.split("Loading JSON file: ")[1] for line in proc.stderr.splitlines()
                  if "Loading JSON file: " in line]
        models = [p for p in loaded if "/service-2.json" in p]
        assert models == [str(ec2model.data_root(base) / "ec2" / ec2model.latest_api_version()
                              / "service-2.json")], (attempt, loaded)
        # the builtin files it still reads are the small ones (rules, paginators)
        assert not [p for p in loaded if p.startswith(str(builtin)) and "service-2" in p]
        names = [e["event"] for e in events(proc.stderr)]
        assert "ec2_model_selected" in names
        assert ("ec2_model_built" in names) == attempt.startswith("first"), names


def test_a_failed_build_falls_back_to_the_full_model_with_a_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    tmp = tmp_path / "tmp"
    (tmp / f"spotagent-{os.geteuid()}").mkdir(parents=True)
    (tmp / f"spotagent-{os.geteuid()}").chmod(0o777)  # someone else could write there
    env = agent_env(SPOTAGENT_CACHE=str(blocker), TMPDIR=str(tmp))
    proc = run_python(_CLIENT_SCRIPT, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["operations"] > 500  # the full model
    warn = [e for e in events(proc.stderr) if e["event"] == "ec2_model_fallback"]
    assert warn and warn[0]["level"] == "warning" and warn[0]["model"] == "full", proc.stderr
    assert not list((tmp / f"spotagent-{os.geteuid()}").iterdir())  # nothing written there


def test_spotagent_ec2_model_full_is_an_escape_hatch(tmp_path: Path) -> None:
    env = agent_env(SPOTAGENT_CACHE=str(tmp_path / "cache"), SPOTAGENT_EC2_MODEL="full")
    proc = run_python(_CLIENT_SCRIPT, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["operations"] > 500
    sel = [e for e in events(proc.stderr) if e["event"] == "ec2_model_selected"]
    assert sel and sel[0]["model"] == "full"
    assert not (tmp_path / "cache").exists()  # nothing built


# --- import cost of the start path ----------------------------------------------------------------


def test_spotagent_run_imports_nothing_only_other_commands_need() -> None:
    script = """
        import json, sys
        from spotagent import cli
        cli.build_parser("run")
        # what cmd_run imports
        import spotagent.ec2, spotagent.imds, spotagent.monitors, spotagent.runner
        import spotagent.volumes
        print(json.dumps(sorted(sys.modules)))
    """
    proc = run_python(script, agent_env())
    assert proc.returncode == 0, proc.stderr
    mods = set(json.loads(proc.stdout))
    assert "spotagent.runner" in mods and "botocore.session" in mods
    unwanted = {m for m in mods if m.split(".")[0] in ("boto3", "s3transfer", "moto", "werkzeug")
                or m.startswith(("spotagent.testbed", "spotagent.demo", "spotagent.pool_cli"))}
    assert not unwanted


def test_every_command_is_registered_by_the_module_cli_names() -> None:
    def commands(parser: Any) -> set[str]:
        sub = next(a for a in parser._actions if a.dest == "command")
        return set(sub.choices)

    assert commands(cli.build_parser()) == {"config", *cli._COMMANDS}
    for command in cli._COMMANDS:
        assert command in commands(cli.build_parser(command)), command
    assert commands(cli.build_parser("config")) == {"config"}


# --- a real agent ---------------------------------------------------------------------------------


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices, mounts, chroot)")
def test_a_real_agent_builds_and_uses_the_trimmed_model(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from agent_world import (
        TRAINER_SETTINGS,
        busybox_image,
        emulated_world,
        pool_volumes,
        running,
        shared_image,
    )

    with emulated_world(tmp_path) as world:
        pool_volumes(world, shared_image(tmp_path_factory, "busybox", busybox_image))
        inst = world.launch(pool="dl", settings={"trainer": TRAINER_SETTINGS})
        base = tmp_path / "cache"
        with running(inst, env={"SPOTAGENT_CACHE": str(base)}) as agent:
            agent.training_past(2)
            built = agent.events("ec2_model_built")
            selected = agent.events("ec2_model_selected")
            assert built and selected and selected[0]["model"] == "trimmed", agent.output()
            assert selected[0]["path"] == str(ec2model.data_root(base))
            assert not agent.events("ec2_model_fallback")
            world.imds.fire_spot_action(inst.instance_id, "terminate")
            assert agent.wait_exit(60) == 0, agent.output()
