"""Configuration: layering, sources, and one clear line plus exit code 2 for every bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spotagent import cli, config

GOOD = '[pool]\nname = "dl-pool"\n'


def run_check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["config", "check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


# (id, config file text, user data text or None, tags, expected fragments of the error line)
MALFORMED: list[tuple[str, str | None, str | bytes | None, list[str], list[str]]] = [
    ("toml-syntax", '[pool\nname = "x"\n', None, [], ["malformed TOML", "line 1"]),
    ("toml-dup-key", '[pool]\nname = "a"\nname = "b"\n', None, [], ["malformed TOML"]),
    ("unknown-section", GOOD + "[trainr]\nuser = \"x\"\n", None, [],
     ["trainr", "unknown section"]),
    ("unknown-key", GOOD + "[trainer]\nusr = \"x\"\n", None, [], ["trainer.usr", "unknown key"]),
    ("section-not-table", 'pool = "x"\n', None, [], ["pool", "must be a table"]),
    ("missing-pool-name", "[trainer]\nuser = \"bob\"\n", None, [],
     ["pool.name is required"]),
    ("pool-name-bad-chars", '[pool]\nname = "my pool!"\n', None, [],
     ["pool.name", '"my pool!"', "letters, digits"]),
    ("pool-name-wrong-type", "[pool]\nname = 42\n", None, [], ["pool.name = 42", "string"]),
    ("on-empty-choice", GOOD + 'on_empty = "panic"\n', None, [],
     ["pool.on_empty", '"panic"', "wait, create, fail"]),
    ("poll-interval-negative", GOOD + "[imds]\npoll_interval = -1\n", None, [],
     ["imds.poll_interval = -1", "between"]),
    ("poll-interval-string", GOOD + '[imds]\npoll_interval = "fast"\n', None, [],
     ["imds.poll_interval", "must be a number"]),
    ("poll-interval-bool", GOOD + "[imds]\npoll_interval = true\n", None, [],
     ["imds.poll_interval = true", "must be a number"]),
    ("imds-url-scheme", GOOD + '[imds]\nurl = "169.254.169.254"\n', None, [],
     ["imds.url", "http://"]),
    ("release-margin-range", GOOD + "[drain]\nrelease_margin = 500\n", None, [],
     ["drain.release_margin = 500", "between 0 and 110"]),
    ("command-string", GOOD + '[trainer]\ncommand = "python3 train.py"\n', None, [],
     ["trainer.command", '"python3 train.py"', "not a string"]),
    ("command-empty", GOOD + "[trainer]\ncommand = []\n", None, [],
     ["trainer.command = []", "must not be empty"]),
    ("command-mixed", GOOD + '[trainer]\ncommand = ["python3", 3]\n', None, [],
     ["trainer.command", "list of strings"]),
    ("checkpoint-dir-relative", GOOD + '[trainer]\ncheckpoint_dir = "ckpt"\n', None, [],
     ["trainer.checkpoint_dir", "absolute path inside the chroot"]),
    ("checkpoint-dir-dotdot", GOOD + '[trainer]\ncheckpoint_dir = "/a/../../etc"\n', None, [],
     ["trainer.checkpoint_dir", "'..'"]),
    ("mount-point-relative", GOOD + '[volume]\nmount_point = "mnt"\n', None, [],
     ["volume.mount_point", "absolute path"]),
    ("state-dir-int", GOOD + "[agent]\nstate_dir = 3\n", None, [], ["agent.state_dir = 3"]),
    ("restart-budget-float", GOOD + "[trainer]\nrestart_budget = 2.5\n", None, [],
     ["trainer.restart_budget = 2.5", "integer"]),
    ("env-reserved", GOOD + '[trainer.env]\nSPOTAGENT_RUN_ID = "x"\n', None, [],
     ["trainer.env", "reserved"]),
    ("snapshot-and-ami", GOOD + 'snapshot_id = "snap-0123456789abcdef0"\n'
     'from_ami = "ami-0123456789abcdef0"\n', None, [], ["pool.from_ami", "not both"]),
    ("create-without-source", GOOD + 'on_empty = "create"\n', None, [],
     ["pool.on_empty", "needs pool.snapshot_id or pool.from_ami"]),
    ("region-bad", GOOD + '[aws]\nregion = "Virginia"\n', None, [],
     ["aws.region", '"Virginia"', "AWS region"]),
    # user data
    ("ud-toml-syntax", GOOD, "#spotagent\n[trainer\n", [], ["user-data", "malformed TOML"]),
    ("ud-unknown-key", GOOD, "#spotagent\n[pool]\nnmae = \"x\"\n", [],
     ["user-data", "pool.nmae", "unknown key"]),
    ("ud-bad-value", GOOD, '#spotagent\n[pool]\non_empty = "retry"\n', [],
     ["user-data", "pool.on_empty", '"retry"']),
    ("ud-imds-file-only", GOOD, '#spotagent\n[imds]\nurl = "http://10.0.0.1"\n', [],
     ["user-data", "imds.url", "only be set in the config file"]),
    ("ud-marker-line", GOOD, "#spotagent please\n[pool]\n", [], ["user-data", "first line"]),
    ("ud-command-string", GOOD, '#spotagent\n[trainer]\ncommand = "train.sh"\n', [],
     ["user-data", "trainer.command", "not a string"]),
    ("ud-bad-gzip", GOOD, b"\x1f\x8b\x08garbage", [], ["user-data", "gzip"]),
    # tags
    ("tag-no-dot", GOOD, None, ["spotagent:poolname=x"], ["instance tag spotagent:poolname",
                                                          "spotagent:<section>.<key>"]),
    ("tag-unknown-key", GOOD, None, ["spotagent:pool.nam=x"],
     ["instance tag spotagent:pool.nam", "unknown key"]),
    ("tag-unknown-section", GOOD, None, ["spotagent:pol.name=x"],
     ["instance tag spotagent:pol.name", "unknown section"]),
    ("tag-bad-number", GOOD, None, ["spotagent:drain.release_margin=soon"],
     ["instance tag spotagent:drain.release_margin", '"soon"', "number"]),
    ("tag-range", GOOD, None, ["spotagent:trainer.restart_budget=-3"],
     ["spotagent:trainer.restart_budget", "between"]),
    ("tag-command-string", GOOD, None, ["spotagent:trainer.command=python3 train.py"],
     ["instance tag spotagent:trainer.command", "not a string"]),
    ("tag-bool", GOOD, None, ["spotagent:volume.warmup=yes"],
     ["spotagent:volume.warmup", "true or false"]),
    ("tag-file-only", GOOD, None, ["spotagent:imds.poll_interval=0.1"],
     ["spotagent:imds.poll_interval", "only be set in the config file"]),
]


@pytest.mark.parametrize(("file_text", "user_data", "tags", "expected"),
                         [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_configuration_gives_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], file_text: str | None,
    user_data: str | bytes | None, tags: list[str], expected: list[str],
) -> None:
    args = ["--config", str(write(tmp_path, "config.toml", file_text or ""))]
    if user_data is not None:
        args += ["--user-data", str(write(tmp_path, "user-data", user_data))]
    for t in tags:
        args += ["--tag", t]
    if user_data is None and not tags:
        args.append("--no-imds")
    code, out, err = run_check(capsys, *args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("spotagent: config error: ")
    for fragment in expected:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    if user_data is None and not tags:
        assert str(tmp_path / "config.toml") in line or "is required" in line


def test_there_are_at_least_25_malformed_cases() -> None:
    assert len(MALFORMED) >= 25


def test_missing_config_file_named_on_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_check(capsys, "--config", str(tmp_path / "nope.toml"), "--no-imds")
    assert code == 2
    assert f"{tmp_path / 'nope.toml'}: file not found" in err


def test_exit_code_2_through_the_real_console_script(tmp_path: Path) -> None:
    cfg = write(tmp_path, "c.toml", GOOD + "[imds]\npoll_interval = 0\n")
    proc = subprocess.run([sys.executable, "-m", "spotagent", "config", "check", "--config",
                           str(cfg), "--no-imds"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("imds.poll_interval = 0: must be between 0.05 and 60")


def test_precedence_default_file_user_data_tags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "c.toml", GOOD + '[trainer]\nuser = "alice"\nrestart_budget = 3\n'
                "[drain]\nrelease_margin = 30\n")
    ud = write(tmp_path, "ud", '#spotagent\n[trainer]\nuser = "bob"\n[drain]\n'
               "release_margin = 25\n")
    code, out, err = run_check(capsys, "--config", str(cfg), "--user-data", str(ud),
                               "--tag", "spotagent:drain.release_margin=12.5",
                               "--tag", "Name=ignored", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["values"]["trainer"]["user"] == "bob"
    assert doc["sources"]["trainer.user"] == "user-data"
    assert doc["values"]["trainer"]["restart_budget"] == 3
    assert doc["sources"]["trainer.restart_budget"] == str(cfg)
    assert doc["values"]["drain"]["release_margin"] == 12.5
    assert doc["sources"]["drain.release_margin"] == "instance tag spotagent:drain.release_margin"
    assert doc["sources"]["pool.on_empty"] == "default"


def test_text_output_names_each_source(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "c.toml", GOOD)
    code, out, _ = run_check(capsys, "--config", str(cfg), "--tag",
                             'spotagent:trainer.command=["python3", "-m", "t"]')
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert rows["pool.name"].endswith(f"# {cfg}")
    assert '["python3", "-m", "t"]' in rows["trainer.command"]
    assert rows["trainer.command"].endswith("# instance tag spotagent:trainer.command")
    assert rows["agent.state_dir"].endswith("# default")


def test_user_data_that_is_not_ours_is_left_to_cloud_init() -> None:
    assert config.parse_user_data(b"#cloud-config\npackages: [htop]\n") is None
    assert config.parse_user_data(b"#!/bin/bash\necho hi\n") is None
    assert config.parse_user_data(b"\xff\xfe binary") is None
    assert config.parse_user_data(None) is None


def test_user_data_gzip_and_mime_multipart() -> None:
    layer = config.parse_user_data(gzip.compress(b'#spotagent\n[pool]\nname = "gz"\n'))
    assert layer is not None and layer.data["pool"]["name"] == "gz"
    mime = (
        'Content-Type: multipart/mixed; boundary="XX"\nMIME-Version: 1.0\n\n'
        '--XX\nContent-Type: text/cloud-config; charset="us-ascii"\n\n#cloud-config\n'
        'packages: [htop]\n\n--XX\nContent-Type: text/x-spotagent; charset="us-ascii"\n\n'
        '[pool]\nname = "mime"\non_empty = "create"\nsnapshot_id = "snap-0123456789abcdef0"\n'
        '\n--XX--\n'
    )
    layer = config.parse_user_data(mime.encode())
    assert layer is not None
    built = config.build([layer])
    assert built.pool.name == "mime" and built.pool.on_empty == "create"
    assert built.sources[("pool", "name")] == "user-data (text/x-spotagent part)"


def test_tag_values_take_their_toml_meaning() -> None:
    layer = config.parse_tags({"spotagent:pool.name": "p", "spotagent:volume.warmup": "false",
                               "spotagent:trainer.restart_budget": "7",
                               "spotagent:volume.mount_options": '["noatime", "nodiratime"]',
                               "aws:cloudformation:stack": "x"})
    assert layer is not None
    built = config.build([layer])
    assert built.volume.warmup is False
    assert built.trainer.restart_budget == 7
    assert built.volume.mount_options == ("noatime", "nodiratime")
    assert built.pool.name == "p"


def test_config_is_frozen() -> None:
    built = config.build([config.parse_toml(GOOD, "t")])
    with pytest.raises(AttributeError):
        built.values = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        built.values[("pool", "name")] = "other"  # type: ignore[index]
