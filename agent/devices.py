"""Volume id → block device: NVMe serial in sysfs, then the by-id link, then the Xen name.

Discovery order (first hit wins):

1. sysfs: every `<sysfs>/class/nvme/*/serial` equal to the volume id without its dash
   (`vol0123456789abcdef0`) — the serial, never the model (QEMU reports "QEMU NVMe Ctrl",
   EBS "Amazon Elastic Block Store") — gives the namespace `nvmeXnY`; its node is
   `<dev_dir>/nvmeXnY`, checked against the namespace's `dev` (major:minor) file.
2. `<by_id_dir>/nvme-Amazon_Elastic_Block_Store_<serial>` (udev's link).
3. The Xen names the volume was attached as (`/dev/sdf` shows as `/dev/xvdf` on Xen types).
   These are names, not identities: pass only the name this instance gave to AttachVolume.

`sysfs`, `by_id_dir` and `dev_dir` are injectable so tests can build a fake sysfs tree and a
link directory pointing at loop devices. This module only reads; `wait_for_device` waits on
file-system events (watchdog/inotify) in the link and device directories.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from spotagent.errors import SpotagentError
from spotagent.log import get_logger

log = get_logger("devices")

BY_ID_PREFIX = "nvme-Amazon_Elastic_Block_Store_"
_VOLUME_ID = re.compile(r"vol-([0-9a-f]{8}|[0-9a-f]{17})")
# nvme<subsys-or-ctrl>n<nsid>, or a multipath path node nvme<subsys>c<ctrl>n<nsid> whose block
# device is the head nvme<subsys>n<nsid>.
_NAMESPACE = re.compile(r"nvme(\d+)(?:c\d+)?n(\d+)")
_XEN_SD = re.compile(r"sd([a-z]+)")


class DeviceError(SpotagentError):
    """The block device of a volume cannot be found or is not what it should be."""


class DeviceTimeoutError(DeviceError):
    """The volume did not show up as a block device before the deadline."""


def nvme_serial(volume_id: str) -> str:
    """`vol-0abc…` → `vol0abc…` (the NVMe serial EBS reports). ValueError on malformed ids."""
    if not isinstance(volume_id, str) or not _VOLUME_ID.fullmatch(volume_id):
        raise ValueError(f"malformed EBS volume id {volume_id!r} (expected vol- and 8 or 17 hex)")
    return volume_id.replace("-", "", 1)


def by_id_name(volume_id: str) -> str:
    """The udev by-id link name of a volume on Nitro."""
    return BY_ID_PREFIX + nvme_serial(volume_id)


def xen_candidates(name: str) -> list[Path]:
    """`/dev/sdf` → [/dev/sdf, /dev/xvdf]: the name given to AttachVolume and its Xen spelling."""
    path = Path(name)
    out = [path]
    m = _XEN_SD.fullmatch(path.name)
    if m:
        out.append(path.with_name("xvd" + m.group(1)))
    return out


def _read_devnum(path: Path) -> int | None:
    """Parse a sysfs `dev` file ("259:0") into a device number; None when absent/garbled."""
    try:
        major, minor = path.read_text().strip().split(":")
        return os.makedev(int(major), int(minor))
    except (OSError, ValueError):
        return None


def _block_device(path: Path) -> Path | None:
    """`path` resolved, if it is (or links to) a block device; else None."""
    try:
        resolved = path.resolve(strict=True)
        st = resolved.stat()
    except (OSError, RuntimeError):
        return None
    return resolved if stat.S_ISBLK(st.st_mode) else None


def _from_sysfs(serial: str, sysfs: Path, dev_dir: Path) -> Path | None:
    nvme_class = sysfs / "class" / "nvme"
    try:
        controllers = sorted(nvme_class.iterdir())
    except OSError:
        return None
    for ctrl in controllers:
        try:
            ctrl_serial = (ctrl / "serial").read_text().strip()
        except OSError:
            continue
        if ctrl_serial != serial:
            continue
        namespaces: list[tuple[int, str, Path]] = []
        try:
            entries = list(ctrl.iterdir())
        except OSError:
            continue
        for entry in entries:
            m = _NAMESPACE.fullmatch(entry.name)
            if m:
                namespaces.append((int(m.group(2)), f"nvme{m.group(1)}n{m.group(2)}", entry))
        for _nsid, block_name, ns_dir in sorted(namespaces):
            node = _block_device(dev_dir / block_name)
            if node is None:
                continue
            expected = _read_devnum(ns_dir / "dev")
            if expected is None:
                expected = _read_devnum(sysfs / "class" / "block" / block_name / "dev")
            if expected is not None and node.stat().st_rdev != expected:
                # A stale or reused node name: the serial says one device, /dev another.
                log.warning("nvme_node_mismatch", serial=serial, node=str(node),
                            expected=f"{os.major(expected)}:{os.minor(expected)}")
                continue
            return node
    return None


def _from_by_id(volume_id: str, by_id_dir: Path) -> Path | None:
    return _block_device(by_id_dir / by_id_name(volume_id))


def _from_xen(xen_names: Sequence[str]) -> Path | None:
    for name in xen_names:
        for candidate in xen_candidates(name):
            node = _block_device(candidate)
            if node is not None:
                return node
    return None


def find_device(
    volume_id: str,
    *,
    by_id_dir: Path = Path("/dev/disk/by-id"),
    sysfs: Path = Path("/sys"),
    xen_names: Sequence[str] = (),
    dev_dir: Path = Path("/dev"),
) -> Path | None:
    """The block device of `volume_id` (resolved path), or None if it is not there yet.

    Order: NVMe serial in sysfs, the by-id link, then the Xen names. ValueError on a
    malformed volume id.
    """
    serial = nvme_serial(volume_id)
    found = _from_sysfs(serial, sysfs, dev_dir)
    method = "nvme_serial"
    if found is None:
        found, method = _from_by_id(volume_id, by_id_dir), "by_id"
    if found is None:
        found, method = _from_xen(xen_names), "xen_name"
    if found is not None:
        log.debug("device_lookup_hit", volume_id=volume_id, device=str(found), method=method)
    return found


class _Wake(FileSystemEventHandler):
    """Any event in a watched directory wakes the waiter, which then re-runs the lookup."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__()
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._wake.set()


def _nearest_existing(path: Path) -> Path:
    """`path` if it is a directory, else its nearest existing ancestor (/dev/disk/by-id may
    not exist until udev makes its first link; watching the ancestor sees it appear)."""
    current = path
    while not current.is_dir() and current != current.parent:
        current = current.parent
    return current


def _watch_dirs(by_id_dir: Path, dev_dir: Path, xen_names: Sequence[str]) -> list[Path]:
    dirs = [_nearest_existing(by_id_dir), _nearest_existing(dev_dir)]
    dirs += [_nearest_existing(Path(name).parent) for name in xen_names]
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def wait_for_device(
    volume_id: str,
    *,
    by_id_dir: Path,
    timeout: float,
    sysfs: Path = Path("/sys"),
    xen_names: Sequence[str] = (),
    dev_dir: Path = Path("/dev"),
    rescan_interval: float = 5.0,
) -> Path:
    """Wait until `find_device` finds the volume; return its block device.

    Woken by inotify events (watchdog) in `by_id_dir` (or its nearest existing ancestor until it
    exists), `dev_dir` and the directories of the Xen names, so it returns within milliseconds
    of the node or link appearing. sysfs gives no inotify events, so the lookup is also re-run
    every `rescan_interval` seconds as a backstop; that is not what makes it prompt.

    Raises DeviceTimeoutError naming the volume, the watched directories and the timeout.
    """
    serial = nvme_serial(volume_id)
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout}")
    start = time.monotonic()
    deadline = start + timeout
    wake = threading.Event()
    handler = _Wake(wake)
    observer = Observer()
    watched: list[Path] = []

    def watch_new_dirs() -> None:
        for d in _watch_dirs(by_id_dir, dev_dir, xen_names):
            if d not in watched:
                try:
                    observer.schedule(handler, str(d), recursive=False)
                except OSError as exc:  # removed between the check and the watch: next pass
                    log.debug("device_watch_failed", path=str(d), error=str(exc))
                    continue
                watched.append(d)

    watch_new_dirs()
    observer.start()
    try:
        log.info("device_wait_started", volume_id=volume_id, serial=serial,
                 watched=[str(d) for d in watched], timeout=timeout)
        while True:
            # Look after the watch is armed: a device that appeared before is found here, one
            # that appears during the lookup sets `wake` and is found on the next pass.
            wake.clear()
            watch_new_dirs()
            device = find_device(volume_id, by_id_dir=by_id_dir, sysfs=sysfs,
                                 xen_names=xen_names, dev_dir=dev_dir)
            if device is not None:
                log.info("device_found", volume_id=volume_id, device=str(device),
                         waited_s=round(time.monotonic() - start, 3))
                return device
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeviceTimeoutError(
                    f"volume {volume_id} did not appear as a block device within {timeout:g} s",
                    volume_id=volume_id,
                    serial=serial,
                    watched=",".join(str(d) for d in watched),
                    by_id=str(by_id_dir / by_id_name(volume_id)),
                    xen_names=",".join(xen_names) or "-",
                    timeout=timeout,
                )
            wake.wait(min(remaining, rescan_interval))
    finally:
        observer.stop()
        observer.join(timeout=5)
