"""Device plane of the testbed: loop devices and by-id links that follow EC2 attach and detach.

Each emulated volume is a sparse image file `<image_dir>/<volume-id>.img`. When an attach
completes, the plane sets up a loop device on the image and, for an instance whose agent
watches a link directory (`register_instance`), makes the link udev would make on a Nitro
instance: `<by_id_dir>/nvme-Amazon_Elastic_Block_Store_vol<hex>` -> `/dev/loopN`. The link is
created under a temporary name and renamed into place, as udev does, so a watcher sees a move
(or a create) event. A detach removes the link and the loop device.

A detach of a device that is still mounted (or held by another block device) is an agent bug:
the plane refuses it with `DeviceBusyError` and records it in `violations` instead of hiding
it with a lazy `losetup -d`. The strict EC2 emulator turns that into a volume that stays
`detaching`, as AWS does with a busy device.

Loop devices are set up and torn down only through `spotagent.subp.run` (losetup, cp).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from spotagent import subp
from spotagent.errors import SpotagentError, SubprocessError
from spotagent.log import get_logger

log = get_logger("testbed.devices")

GIB = 1024**3
LINK_PREFIX = "nvme-Amazon_Elastic_Block_Store_"
LOSETUP_TIMEOUT = 30.0
COPY_TIMEOUT = 300.0


class DevicePlaneError(SpotagentError):
    """The device plane could not do what EC2 asked of it (unknown volume, losetup failed)."""


class DeviceBusyError(DevicePlaneError):
    """A detach found the volume's device still mounted or held: an agent bug, never hidden."""


def link_name(volume_id: str) -> str:
    """The by-id link name udev gives an EBS volume on Nitro (serial = id without the dash)."""
    return LINK_PREFIX + volume_id.replace("-", "")


def device_users(device: Path) -> list[str]:
    """Where `device` is in use: mount points (in any mount namespace) and holder devices.

    Mount namespaces are visited once each through `/proc/<pid>/mountinfo`, so a mount made
    inside a container or an unshared namespace counts too.
    """
    try:
        rdev = os.stat(device).st_rdev
    except FileNotFoundError:
        return []
    key = f"{os.major(rdev)}:{os.minor(rdev)}"
    users: list[str] = []
    seen: set[str] = set()
    proc = Path("/proc")
    for entry in [proc / "self", *sorted(proc.iterdir(), key=lambda p: p.name)]:
        if entry.name != "self" and not entry.name.isdigit():
            continue
        try:
            namespace = os.readlink(entry / "ns" / "mnt")
            if namespace in seen:
                continue
            seen.add(namespace)
            text = (entry / "mountinfo").read_text()
        except OSError:
            continue  # the process ended, or it is not ours to read
        for line in text.splitlines():
            fields = line.split()
            if len(fields) > 4 and fields[2] == key:
                users.append(f"mounted at {fields[4]}")
    holders = Path("/sys/class/block") / device.name / "holders"
    if holders.is_dir():
        users.extend(f"held by {h.name}" for h in sorted(holders.iterdir()))
    return users


def loops_backing(image: Path) -> list[Path]:
    """Loop devices whose backing file is `image` (`losetup -j`)."""
    out = subp.run(["losetup", "-j", str(image)], timeout=LOSETUP_TIMEOUT).stdout
    return [Path(line.split(":", 1)[0]) for line in out.splitlines() if ":" in line]


@dataclass
class _Attached:
    instance_id: str
    loop: Path
    link: Path | None


class DevicePlane:
    """Loop devices that appear on attach and disappear on detach, one image file per volume.

    Thread-safe. The plane is owned by whoever created it: call `close()` in a `finally` (or a
    fixture's teardown) to detach every loop device it made, also after a failed test.
    """

    def __init__(self, image_dir: Path) -> None:
        self.image_dir = Path(image_dir).resolve()
        self.image_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._sizes: dict[str, int] = {}
        self._origins: dict[str, str | None] = {}
        self._snapshot_images: dict[str, Path] = {}
        self._instances: dict[str, Path] = {}
        self._attached: dict[str, _Attached] = {}
        self._leftover_loops: list[Path] = []
        self.violations: list[str] = []

    # -- registration -------------------------------------------------------------------

    def register_instance(self, instance_id: str, by_id_dir: Path) -> None:
        """Make links for `instance_id` in `by_id_dir` (its agent's `devices.by_id_dir`).

        Volumes already attached to the instance get their links now.
        """
        by_id_dir = Path(by_id_dir)
        by_id_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._instances[instance_id] = by_id_dir
            for volume_id, att in self._attached.items():
                if att.instance_id == instance_id and att.link is None:
                    att.link = self._make_link(by_id_dir, volume_id, att.loop)

    def register_snapshot_image(self, snapshot_id: str, image: Path) -> None:
        """Volumes created from `snapshot_id` start as a sparse copy of `image`."""
        image = Path(image).resolve()
        if not image.is_file():
            raise DevicePlaneError("snapshot image is not a file", snapshot_id=snapshot_id,
                                   image=image)
        with self._lock:
            self._snapshot_images[snapshot_id] = image

    def knows(self, volume_id: str) -> bool:
        """Whether `on_create` was called for `volume_id`."""
        with self._lock:
            return volume_id in self._sizes

    # -- images -------------------------------------------------------------------------

    def image_path(self, volume_id: str) -> Path:
        """The volume's backing file, created sparse at the volume's size on first use."""
        with self._lock:
            path = self.image_dir / f"{volume_id}.img"
            if path.exists():
                return path
            if volume_id not in self._sizes:
                raise DevicePlaneError("volume unknown to the device plane", volume_id=volume_id)
            with open(path, "xb") as image:
                image.truncate(self._sizes[volume_id] * GIB)
            log.info("device_image_created", volume_id=volume_id, size_gib=self._sizes[volume_id])
            return path

    def on_create(self, volume_id: str, size_gib: int, snapshot_id: str | None) -> None:
        """A volume was created; one made from a registered snapshot image copies it now."""
        with self._lock:
            self._sizes[volume_id] = int(size_gib)
            self._origins[volume_id] = snapshot_id
            source = self._snapshot_images.get(snapshot_id) if snapshot_id else None
            if source is None:
                return
            target = self.image_dir / f"{volume_id}.img"
            subp.run(["cp", "--sparse=always", "--reflink=auto", str(source), str(target)],
                     timeout=COPY_TIMEOUT)
            if target.stat().st_size < size_gib * GIB:
                with open(target, "r+b") as image:
                    image.truncate(size_gib * GIB)
            log.info("device_image_from_snapshot", volume_id=volume_id, snapshot_id=snapshot_id)

    def on_snapshot(self, snapshot_id: str, volume_id: str) -> None:
        """A snapshot was taken: its image is a sparse copy of the volume's image now."""
        with self._lock:
            if volume_id not in self._sizes:
                return  # a volume the plane never saw (an instance's root volume)
            source = self.image_path(volume_id)
            target = self.image_dir / f"{snapshot_id}.img"
            subp.run(["cp", "--sparse=always", "--reflink=auto", str(source), str(target)],
                     timeout=COPY_TIMEOUT)
            self._snapshot_images[snapshot_id] = target
            log.info("device_snapshot_image", snapshot_id=snapshot_id, volume_id=volume_id)

    # -- attach / detach ----------------------------------------------------------------

    def on_attach(self, instance_id: str, volume_id: str) -> Path:
        """Set up a loop device on the volume's image, link it, and return the loop device."""
        with self._lock:
            current = self._attached.get(volume_id)
            if current is not None:
                raise DevicePlaneError("volume already has a device", volume_id=volume_id,
                                       instance_id=current.instance_id, loop=current.loop)
            image = self.image_path(volume_id)
            stale = loops_backing(image)
            if stale:
                # A second loop device on one image is two writers on one disk: say so.
                self._violation("image already backs a loop device", volume_id=volume_id,
                                loops=",".join(map(str, stale)))
            out = subp.run(["losetup", "--find", "--show", str(image)],
                           timeout=LOSETUP_TIMEOUT).stdout.strip()
            loop = Path(out)
            if not out.startswith("/dev/loop"):
                raise DevicePlaneError("losetup printed no loop device", volume_id=volume_id,
                                       output=out[:100])
            by_id_dir = self._instances.get(instance_id)
            link = self._make_link(by_id_dir, volume_id, loop) if by_id_dir else None
            self._attached[volume_id] = _Attached(instance_id, loop, link)
            log.info("device_attached", volume_id=volume_id, instance_id=instance_id,
                     loop=str(loop), link=str(link) if link else None)
            return loop

    def on_detach(self, instance_id: str, volume_id: str, *, force: bool = False) -> None:
        """Remove the link and the loop device of a volume leaving `instance_id`.

        Raises DeviceBusyError (and records a violation) when the device is still mounted or
        held; nothing is changed then. With `force` (a forced detach, or the instance was
        terminated) the link goes anyway and the busy loop device is left for `close()`.
        Detaching a volume the plane has no device for is a no-op.
        """
        with self._lock:
            att = self._attached.get(volume_id)
            if att is None:
                return
            if att.instance_id != instance_id:
                raise DevicePlaneError("volume's device belongs to another instance",
                                       volume_id=volume_id, instance_id=instance_id,
                                       owner=att.instance_id)
            users = device_users(att.loop)
            if users and not force:
                self._violation("detach while the device is in use", volume_id=volume_id,
                                instance_id=instance_id, loop=str(att.loop),
                                users="; ".join(users))
                raise DeviceBusyError("device still in use at detach", volume_id=volume_id,
                                      loop=att.loop, users="; ".join(users))
            if att.link is not None:
                att.link.unlink(missing_ok=True)
            del self._attached[volume_id]
            if users:
                self._violation("forced detach while the device is in use",
                                volume_id=volume_id, instance_id=instance_id,
                                loop=str(att.loop), users="; ".join(users))
                self._leftover_loops.append(att.loop)
                return
            subp.run(["losetup", "-d", str(att.loop)], timeout=LOSETUP_TIMEOUT)
            log.info("device_detached", volume_id=volume_id, instance_id=instance_id,
                     loop=str(att.loop))

    def device_of(self, volume_id: str) -> Path | None:
        """The loop device of an attached volume, else None."""
        with self._lock:
            att = self._attached.get(volume_id)
            return att.loop if att else None

    def link_of(self, volume_id: str) -> Path | None:
        """The by-id link of an attached volume (None when its instance is not registered)."""
        with self._lock:
            att = self._attached.get(volume_id)
            return att.link if att else None

    def close(self) -> None:
        """Detach every loop device this plane made and forget volumes, instances, snapshots.

        Safe to call twice; the plane can be used again afterwards (the EC2 emulator's
        `reset()` relies on that). A device still mounted is detached with autoclear by the
        kernel (it goes when unmounted) and logged as an error.
        """
        with self._lock:
            loops = [att.loop for att in self._attached.values()] + self._leftover_loops
            for att in self._attached.values():
                if att.link is not None:
                    att.link.unlink(missing_ok=True)
            # Only images this plane made: a registered snapshot image elsewhere may be loop
            # mounted by its owner on purpose.
            images = [self.image_dir / f"{v}.img" for v in self._sizes]
            images += [p for p in self._snapshot_images.values() if p.parent == self.image_dir]
            for image in images:
                if image.exists():
                    loops.extend(loops_backing(image))
            for loop in dict.fromkeys(loops):
                users = device_users(loop)
                if users:
                    log.error("device_busy_at_close", loop=str(loop), users="; ".join(users))
                try:
                    subp.run(["losetup", "-d", str(loop)], timeout=LOSETUP_TIMEOUT)
                except SubprocessError as exc:
                    # Already gone (detached by someone else): nothing left to clean.
                    log.warning("device_close_detach_failed", loop=str(loop), error=str(exc))
            self._attached.clear()
            self._leftover_loops.clear()
            self._sizes.clear()
            self._origins.clear()
            self._snapshot_images.clear()
            self._instances.clear()

    def __enter__(self) -> DevicePlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _make_link(self, by_id_dir: Path, volume_id: str, loop: Path) -> Path:
        link = by_id_dir / link_name(volume_id)
        tmp = by_id_dir / f".tmp-{link.name}"
        tmp.unlink(missing_ok=True)
        os.symlink(loop, tmp)
        os.replace(tmp, link)  # like udev: make under a temporary name, rename into place
        return link

    def _violation(self, what: str, **context: str) -> None:
        line = what + " (" + " ".join(f"{k}={v}" for k, v in context.items()) + ")"
        self.violations.append(line)
        log.error("device_plane_violation", what=what, **context)
