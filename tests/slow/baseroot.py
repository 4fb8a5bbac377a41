"""A cached debootstrapped Debian root for the systemd tier (stand-in for
`spotagent.testbed.images.base_root` until that lands).

`base_root(include)` returns a directory holding a minbase Debian 12 root with `include`
installed, built once with debootstrap and kept under `$SPOTAGENT_CACHE` (default
/var/cache/spotagent) in a directory named after a hash of the suite, mirror and package list.
A build goes to a temporary sibling and is renamed into place when complete, under a file lock,
so a crashed or concurrent build never leaves a half root behind a valid name. Callers treat
the result as read-only (boot it through an overlay).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

SUITE = "bookworm"
MIRROR = os.environ.get("SPOTAGENT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Bump when the way the root is made changes (not the package list: that is in the key).
RECIPE = "1"
DEBOOTSTRAP_TIMEOUT = 1800


def cache_root() -> Path:
    return Path(os.environ.get("SPOTAGENT_CACHE") or "/var/cache/spotagent")


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def key_of(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def base_root(include: Sequence[str]) -> Path:
    """The cached root with `include` installed; built by debootstrap (~1-3 min) on a miss."""
    packages = sorted(set(include))
    key = key_of(RECIPE, SUITE, MIRROR, *packages)
    roots = cache_root() / "roots"
    dest = roots / f"debian-{SUITE}-{key}"
    with locked(roots / ".lock"):
        if (dest / ".spotagent-complete").exists():
            return dest
        tmp = roots / f".build-{dest.name}-{os.getpid()}"
        for stale in [dest, *roots.glob(f".build-{dest.name}-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        try:
            subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                            SUITE, str(tmp), MIRROR], check=True, timeout=DEBOOTSTRAP_TIMEOUT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            shutil.rmtree(tmp / "var/cache/apt/archives", ignore_errors=True)
            (tmp / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
            (tmp / ".spotagent-complete").write_text(" ".join(packages) + "\n")
            tmp.rename(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest
