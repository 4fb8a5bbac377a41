"""Loop devices and mounts for tests: sparse images on real loop devices, always cleaned up.

Independent of spotagent.mounts on purpose, so a bug there cannot leave a test machine with
stale mounts or loop devices. Cleanup may use `umount -l` as a last resort; the agent never does.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

MIB = 1 << 20

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices, mounts)")
F = TypeVar("F", bound=Callable[..., object])


def needs_root(test: F) -> F:
    """Mark a test `root` (it runs in `make test`) and skip it when not running as root."""
    return pytest.mark.root(root_only(test))


def sh(*argv: str | Path, check: bool = True,
       timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a setup command in a test (argv list, no shell)."""
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=check,
                          timeout=timeout)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> list[tuple[int, str, int]]:
    """(index, mount point, devno) of every mount in our namespace."""
    out = []
    for i, line in enumerate(Path("/proc/self/mountinfo").read_text().splitlines()):
        parts = line.split(" ")
        major, minor = parts[2].split(":")
        out.append((i, _unescape(parts[4]), os.makedev(int(major), int(minor))))
    return out


def _force_unmount(targets: list[tuple[int, str, int]]) -> None:
    for _, mp, _ in sorted(targets, key=lambda t: (t[1].count("/"), t[0]), reverse=True):
        if sh("umount", mp, check=False).returncode != 0:
            sh("umount", "-l", mp, check=False)


def unmount_under(prefix: Path) -> None:
    """Unmount everything at or under `prefix` (test cleanup)."""
    root = os.path.realpath(prefix)
    _force_unmount([m for m in _mounts() if m[1] == root or m[1].startswith(root + "/")])


def unmount_device(device: Path) -> None:
    """Unmount every mount of `device` in our namespace (test cleanup)."""
    try:
        devno = os.stat(device).st_rdev
    except OSError:
        return
    _force_unmount([m for m in _mounts() if m[2] == devno])


def attach(image: Path) -> Path:
    return Path(sh("losetup", "--find", "--show", image).stdout.strip())


def detach(device: Path) -> None:
    unmount_device(device)
    sh("losetup", "-d", device, check=False)


@contextlib.contextmanager
def loop_device(image: Path, size: int = 64 * MIB,
                prepare: Callable[[Path], object] | None = None) -> Iterator[Path]:
    """A sparse `size` image at `image` (after `prepare(image)`), attached as a loop device.

    Detached (and unmounted) on exit, also when the test failed.
    """
    with open(image, "wb") as f:
        f.truncate(size)
    if prepare is not None:
        prepare(image)
    device = attach(image)
    try:
        yield device
    finally:
        detach(device)


@contextlib.contextmanager
def mounted(device: Path, mount_point: Path, *options: str) -> Iterator[Path]:
    """Mount with plain mount(8) for test set-up; unmounted on exit."""
    mount_point.mkdir(parents=True, exist_ok=True)
    sh("mount", *(("-o", ",".join(options)) if options else ()), device, mount_point)
    try:
        yield mount_point
    finally:
        unmount_under(mount_point)


def mkfs(fstype: str, target: Path, *extra: str) -> None:
    if fstype == "xfs":
        sh("mkfs.xfs", "-q", "-f", *extra, target)
    else:
        sh(f"mkfs.{fstype}", "-q", "-F", *extra, target)


def read_device(device: Path) -> bytes:
    """The whole device, read past the page cache (O_DIRECT would need alignment: drop cache)."""
    fd = os.open(device, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def write_device(device: Path, offset: int, data: bytes) -> None:
    fd = os.open(device, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
