"""The agent's trimmed EC2 service model: a botocore data directory derived from the installed
botocore's own EC2 model, holding only the operations the agent calls.

botocore parses its whole EC2 model (830 operations, 4400 shapes) for every EC2 client: about
24 MB of the agent's memory for the eight operations it calls. This module's one job is the
directory that replaces it, `<base>/botocore/<botocore version>/ec2/<api version>/`:

- `service-2.json`: the installed model (its sdk extras applied) cut to `OPERATIONS` and the
  transitive closure of their shapes; metadata, protocol and API version unchanged;
- `service-2.sdk-extras.json`: an empty extras file that shadows botocore's own (already applied);
- `spotagent-ec2model.json`: the stamp, written last: botocore version, API version, sha256 of the
  source files and of the trimmed model, the operations kept.

A loader whose search path starts with `<base>/botocore/<version>` finds this `service-2.json`
first and everything else (endpoint rules, partitions, paginators) in botocore's own data
directory as usual. The stamp is checked on every use: another botocore, another source file,
a missing operation or an altered file means "not there", and the model is built again.

Building loads the full model, so the long-running agent never builds in its own process: it
runs `python -m spotagent.ec2model build` (a short-lived child) when the directory is missing,
and an image build can run the same command once (`install.sh`). Writes are atomic.

Bases, first usable wins: `$SPOTAGENT_CACHE` (else `/var/cache/spotagent`), the agent's state
directory, then `<tmp>/spotagent-<uid>`. A directory is only trusted when it and its parents up
to the base belong to root or to us and are not writable by others.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import botocore
import botocore.loaders

from spotagent.errors import SpotagentError

SERVICE = "ec2"
# Every EC2 operation the agent calls (agent/volumes.py; `spotagent pool` calls the same ones).
# tests/test_ec2model.py fails when a `client.<method>(` call in volumes.py or ec2.py is missing
# here, and runs each of them through a trimmed client against the strict EC2 emulator.
OPERATIONS = (
    "AttachVolume",
    "CreateTags",
    "CreateVolume",
    "DeleteTags",
    "DescribeImages",
    "DescribeInstances",
    "DescribeVolumes",
    "DetachVolume",
)
FORMAT = 1  # of what build() writes; a stamp of another format is rebuilt
STAMP = "spotagent-ec2model.json"
MODEL = "service-2.json"
EXTRAS = "service-2.sdk-extras.json"
DEFAULT_CACHE = Path("/var/cache/spotagent")
BUILD_TIMEOUT = 120.0


class ModelError(SpotagentError):
    """The trimmed model cannot be built or used (the agent falls back to the full model)."""


# --- where ---------------------------------------------------------------------------------------


def bases(state_dir: Path | None = None) -> list[Path]:
    """Candidate base directories, best first."""
    env = os.environ.get("SPOTAGENT_CACHE")
    out = [Path(env) if env else DEFAULT_CACHE]
    if state_dir is not None:
        out.append(Path(state_dir))
    out.append(Path(tempfile.gettempdir()) / f"spotagent-{os.geteuid()}")
    return out


def data_root(base: Path) -> Path:
    """The botocore data directory under `base` for the installed botocore."""
    return base / "botocore" / botocore.__version__


def _source_dir(api_version: str) -> Path:
    return Path(botocore.loaders.Loader.BUILTIN_DATA_PATH) / SERVICE / api_version


def latest_api_version() -> str:
    """The newest EC2 API version of botocore's own data (what a client would load)."""
    top = Path(botocore.loaders.Loader.BUILTIN_DATA_PATH) / SERVICE
    versions = [d.name for d in top.iterdir()
                if (d / "service-2.json").is_file() or (d / "service-2.json.gz").is_file()]
    if not versions:
        raise ModelError("botocore has no EC2 model", path=top)
    return max(versions)


def source_digest(api_version: str) -> str:
    """sha256 over botocore's EC2 model files of `api_version` (service-2 and its extras)."""
    h = hashlib.sha256()
    src = _source_dir(api_version)
    for name in ("service-2.json", "service-2.json.gz", "service-2.sdk-extras.json",
                 "service-2.sdk-extras.json.gz"):
        path = src / name
        if path.is_file():
            h.update(name.encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


# --- trimming (pure) -----------------------------------------------------------------------------


def shape_closure(model: Mapping[str, Any], operations: Iterable[str]) -> set[str]:
    """Names of every shape reachable from the operations' input, output and error shapes."""
    shapes = model["shapes"]
    todo: list[str] = []
    for name in operations:
        op = model["operations"][name]
        todo += [op[k]["shape"] for k in ("input", "output") if k in op]
        todo += [e["shape"] for e in op.get("errors", [])]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in shapes:
            raise ModelError("the EC2 model refers to a shape it does not define", shape=name)
        seen.add(name)
        shape = shapes[name]
        todo += [shape[k]["shape"] for k in ("member", "key", "value") if k in shape]
        todo += [m["shape"] for m in shape.get("members", {}).values()]
    return seen


def trim(model: Mapping[str, Any], operations: Sequence[str]) -> dict[str, Any]:
    """`model` cut to `operations` and their shapes; everything else at the top (version,
    metadata, documentation) kept as it is."""
    missing = [op for op in operations if op not in model["operations"]]
    if missing:
        raise ModelError("the installed EC2 model lacks operations the agent calls",
                         missing=",".join(missing))
    keep = shape_closure(model, operations)
    out = {k: v for k, v in model.items() if k not in ("operations", "shapes")}
    out["operations"] = {op: model["operations"][op] for op in sorted(operations)}
    out["shapes"] = {name: model["shapes"][name] for name in sorted(keep)}
    return out


# --- reading -------------------------------------------------------------------------------------


def _trusted(path: Path, base: Path) -> bool:
    """`base` and everything from it down to `path` belong to root or to us, and nothing below
    `base` is writable by group or others or is a symbolic link (a model is code-like input:
    it names the requests the agent sends)."""
    me = os.geteuid()
    try:
        rel = path.relative_to(base).parts
        chain = [base.joinpath(*rel[:i]) for i in range(len(rel) + 1)]
        for i, p in enumerate(chain):
            st = p.stat() if i == 0 else p.lstat()
            if st.st_uid not in (0, me) or st.st_mode & 0o022:
                return False
            if i > 0 and not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                return False
    except (OSError, ValueError):
        return False
    return True


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(base: Path, operations: Sequence[str] = OPERATIONS) -> Path | None:
    """The data root under `base` when its trimmed model is complete, current and trusted;
    None otherwise. Reads only the stamp and hashes files: never parses the model."""
    root = data_root(base)
    try:
        api = latest_api_version()
        vdir = root / SERVICE / api
        stamp = json.loads((vdir / STAMP).read_text())
        ok = (isinstance(stamp, dict)
              and stamp.get("format") == FORMAT
              and stamp.get("botocore") == botocore.__version__
              and stamp.get("api_version") == api
              and set(operations) <= set(stamp.get("operations", ()))
              and all(_trusted(vdir / n, base) for n in (STAMP, MODEL, EXTRAS))
              and stamp.get("source_sha256") == source_digest(api)
              and stamp.get("model_sha256") == _sha256(vdir / MODEL))
    except (OSError, ValueError, ModelError):
        return None
    return root if ok else None


def find(state_dir: Path | None = None,
         operations: Sequence[str] = OPERATIONS) -> Path | None:
    """The first usable data root among `bases(state_dir)`, or None."""
    for base in bases(state_dir):
        root = check(base, operations)
        if root is not None:
            return root
    return None


# --- writing (the child process or an image build) ------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _makedirs(base: Path, path: Path) -> None:
    """Create `base` (0700 under the temporary directory, where another user could have taken
    the name first; 0755 elsewhere), refuse it unless trusted, then create each directory down
    to `path` (0755 whatever the umask would add)."""
    if not base.is_dir():
        private = base.parent == Path(tempfile.gettempdir())
        base.parent.mkdir(parents=True, exist_ok=True)
        base.mkdir(mode=0o700 if private else 0o755, exist_ok=True)
    if not _trusted(base, base):
        raise ModelError("refusing an untrusted cache directory (owner or mode)", path=base)
    for part in path.relative_to(base).parts:
        base = base / part
        base.mkdir(mode=0o755, exist_ok=True)


def build(base: Path, operations: Sequence[str] = OPERATIONS) -> Path:
    """Write the trimmed model under `base`; return its data root. Loads the full model: call
    it in a short-lived process (`python -m spotagent.ec2model build`), not in the agent."""
    api = latest_api_version()
    digest = source_digest(api)  # before loading: a change in between gives a stale stamp
    loader = botocore.loaders.Loader(
        extra_search_paths=[botocore.loaders.Loader.BUILTIN_DATA_PATH],
        include_default_search_paths=False)  # botocore's own model, never ~/.aws/models
    full = loader.load_service_model(SERVICE, "service-2", api)
    trimmed = trim(full, operations)
    _verify(trimmed, operations)
    root = data_root(base)
    vdir = root / SERVICE / api
    try:
        _makedirs(base, vdir)
        if not _trusted(vdir, base):
            raise ModelError("refusing an untrusted cache directory (owner or mode)",
                             path=vdir)
        body = json.dumps(trimmed, separators=(",", ":"), sort_keys=True).encode()
        _atomic_write(vdir / EXTRAS, b'{"version": 1.0, "merge": {}}\n')
        _atomic_write(vdir / MODEL, body)
        stamp = {"format": FORMAT, "botocore": botocore.__version__, "api_version": api,
                 "source_sha256": digest, "model_sha256": hashlib.sha256(body).hexdigest(),
                 "operations": sorted(operations), "shapes": len(trimmed["shapes"]),
                 "source_shapes": len(full["shapes"])}
        _atomic_write(vdir / STAMP, (json.dumps(stamp, indent=1) + "\n").encode())
    except OSError as exc:
        raise ModelError("cannot write the trimmed EC2 model", path=vdir,
                         error=exc.strerror or str(exc)) from exc
    return root


def _verify(model: Mapping[str, Any], operations: Sequence[str]) -> None:
    """botocore itself reads the trimmed model: every operation, every shape resolves."""
    from botocore.model import ServiceModel

    sm = ServiceModel(dict(model), service_name=SERVICE)
    if sorted(sm.operation_names) != sorted(operations):
        raise ModelError("the trimmed model has other operations than asked",
                         operations=",".join(sm.operation_names))
    seen: set[str] = set()
    for name in model["shapes"]:
        _walk(sm.shape_for(name), seen)


def _walk(shape: Any, seen: set[str]) -> None:
    if shape.name in seen:
        return
    seen.add(shape.name)
    for attr in ("member", "key", "value"):
        sub = getattr(shape, attr, None)
        if sub is not None:
            _walk(sub, seen)
    for sub in getattr(shape, "members", {}).values():
        _walk(sub, seen)


def build_any(candidates: Sequence[Path], operations: Sequence[str] = OPERATIONS) -> Path:
    """Build under the first candidate base that works."""
    errors = []
    for base in candidates:
        try:
            return build(base, operations)
        except ModelError as exc:
            errors.append(str(exc))
    raise ModelError("no usable directory for the trimmed EC2 model",
                     tried="; ".join(errors))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spotagent.ec2model",
        description="Build or check the agent's trimmed EC2 service model (a botocore data "
        "directory derived from the installed botocore).")
    parser.add_argument("command", choices=("build", "check"))
    parser.add_argument("--base", type=Path, action="append", default=None, metavar="DIR",
                        help="base directory (repeatable, first usable wins; default "
                        "$SPOTAGENT_CACHE or /var/cache/spotagent, then a private "
                        "temporary directory)")
    parser.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                        help="the agent's state directory, a candidate after the cache")
    args = parser.parse_args(argv)
    candidates = args.base or bases(args.state_dir)
    out = sys.stdout
    if args.command == "check":
        for base in candidates:
            root = check(base)
            if root is not None:
                out.write(f"{root}\n")
                return 0
        out.write("no current trimmed EC2 model in: "
                  + ", ".join(str(b) for b in candidates) + "\n")
        return 1
    try:
        root = build_any(candidates)
    except ModelError as exc:
        sys.stderr.write(f"spotagent.ec2model: {exc}\n")
        return 1
    out.write(f"{root}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
