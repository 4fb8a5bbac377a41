"""The device plane: loop devices and by-id links that follow attach and detach (needs root)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from spotagent import subp
from spotagent.testbed.devices import (
    DeviceBusyError,
    DevicePlane,
    DevicePlaneError,
    link_name,
    loops_backing,
)
from spotagent.testbed.ec2 import StrictEc2Server

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="loop devices need root"),
]

VOL = "vol-0123456789abcdef0"
AZ = "us-east-1a"
MARKER_OFFSET = 512 * 1024 * 1024  # well inside a 1 GiB volume, far from the start


def write_marker(image: Path, data: bytes, offset: int = MARKER_OFFSET) -> None:
    with open(image, "r+b") as f:
        f.seek(offset)
        f.write(data)


def read_device(device: Path, length: int, offset: int = MARKER_OFFSET) -> bytes:
    with open(device, "rb") as f:
        f.seek(offset)
        return f.read(length)


def loops_under(image_dir: Path) -> list[Path]:
    return [loop for image in image_dir.glob("*.img") for loop in loops_backing(image)]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[DevicePlane]:
    image_dir = tmp_path / "images"
    dp = DevicePlane(image_dir)
    try:
        yield dp
    finally:
        dp.close()
        leftovers = loops_under(image_dir)
        for loop in leftovers:  # never leak, even when the assertion below fails the test
            subp.run(["losetup", "-d", str(loop)], check=False)
    assert leftovers == []


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """mount(device) -> mount point; unmounted at teardown whatever happened."""
    points: list[Path] = []

    def mount(device: Path) -> Path:
        subp.run(["mkfs.ext4", "-q", "-F", str(device)], timeout=120)
        point = tmp_path / f"mnt{len(points)}"
        point.mkdir()
        subp.run(["mount", str(device), str(point)])
        points.append(point)
        return point

    try:
        yield mount
    finally:
        for point in reversed(points):
            subp.run(["umount", str(point)], check=False)


# -- the plane on its own --------------------------------------------------------------------


def test_attach_links_a_block_device_holding_the_image(plane: DevicePlane,
                                                       tmp_path: Path) -> None:
    by_id = tmp_path / "by-id"
    plane.register_instance("i-1", by_id)
    plane.on_create(VOL, 1, None)
    image = plane.image_path(VOL)
    assert image.stat().st_size == 1024**3
    assert image.stat().st_blocks * 512 < 16 * 1024 * 1024  # sparse
    write_marker(image, b"spotagent-marker")

    loop = plane.on_attach("i-1", VOL)
    link = by_id / "nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"
    assert link_name(VOL) == link.name
    assert sorted(p.name for p in by_id.iterdir()) == [link.name]  # no "_1" or temp names
    assert link.resolve() == loop
    assert stat.S_ISBLK(os.stat(link).st_mode)
    assert read_device(link, 16) == b"spotagent-marker"
    assert plane.device_of(VOL) == loop
    assert loops_backing(image) == [loop]

    plane.on_detach("i-1", VOL)
    assert not link.exists() and not link.is_symlink()
    assert plane.device_of(VOL) is None
    assert loops_backing(image) == []
    assert plane.violations == []


def test_register_after_attach_links_the_attached_volume(plane: DevicePlane,
                                                         tmp_path: Path) -> None:
    plane.on_create(VOL, 1, None)
    loop = plane.on_attach("i-1", VOL)
    assert plane.link_of(VOL) is None
    plane.register_instance("i-1", tmp_path / "by-id")
    link = tmp_path / "by-id" / link_name(VOL)
    assert link.resolve() == loop
    plane.on_detach("i-1", VOL)
    assert not link.is_symlink()


def test_volume_from_registered_snapshot_image_holds_its_content(plane: DevicePlane,
                                                                 tmp_path: Path) -> None:
    source = tmp_path / "env.img"
    with open(source, "wb") as f:
        f.truncate(1024**3)
    write_marker(source, b"warm-environment")
    plane.register_snapshot_image("snap-0123456789abcdef0", source)
    plane.on_create(VOL, 1, "snap-0123456789abcdef0")
    write_marker(plane.image_path(VOL), b"changed-on-copy!")
    assert read_device(source, 16) == b"warm-environment"  # a copy, not the source itself
    loop = plane.on_attach("i-1", VOL)
    assert read_device(loop, 16) == b"changed-on-copy!"
    plane.on_detach("i-1", VOL)


def test_detach_of_a_mounted_device_is_refused_and_recorded(
        plane: DevicePlane, tmp_path: Path, mounted: Callable[[Path], Path]) -> None:
    plane.register_instance("i-1", tmp_path / "by-id")
    plane.on_create(VOL, 1, None)
    loop = plane.on_attach("i-1", VOL)
    point = mounted(loop)
    with pytest.raises(DeviceBusyError):
        plane.on_detach("i-1", VOL)
    assert len(plane.violations) == 1 and str(point) in plane.violations[0]
    assert plane.device_of(VOL) == loop  # nothing hidden: link and device still there
    assert (tmp_path / "by-id" / link_name(VOL)).is_symlink()
    subp.run(["umount", str(point)])
    plane.on_detach("i-1", VOL)
    assert loops_backing(plane.image_path(VOL)) == []


def test_misuse_is_refused(plane: DevicePlane) -> None:
    with pytest.raises(DevicePlaneError):
        plane.image_path("vol-unknown")
    plane.on_create(VOL, 1, None)
    plane.on_attach("i-1", VOL)
    with pytest.raises(DevicePlaneError):
        plane.on_attach("i-2", VOL)
    with pytest.raises(DevicePlaneError):
        plane.on_detach("i-2", VOL)
    plane.on_detach("i-1", "vol-never-attached")  # a no-op


def test_close_detaches_everything_it_made(tmp_path: Path) -> None:
    plane = DevicePlane(tmp_path / "images")
    try:
        for n in range(3):
            vol = f"vol-{n:017x}"
            plane.on_create(vol, 1, None)
            plane.on_attach("i-1", vol)
        assert len(loops_under(tmp_path / "images")) == 3
    finally:
        plane.close()
    assert loops_under(tmp_path / "images") == []
    plane.close()  # twice is fine


# -- driven by the EC2 emulator ----------------------------------------------------------------


@pytest.fixture
def ec2_with_plane(plane: DevicePlane) -> Iterator[tuple[StrictEc2Server, EC2Client]]:
    server = StrictEc2Server(device_plane=plane).start()
    try:
        yield server, server.client()
    finally:
        server.stop()
    assert server.errors == []


def instance(ec2: EC2Client) -> str:
    reply = ec2.run_instances(ImageId="ami-12345678", MinCount=1, MaxCount=1,
                              Placement={"AvailabilityZone": AZ})
    return reply["Instances"][0]["InstanceId"]


def state(ec2: EC2Client, volume_id: str) -> tuple[str, str | None]:
    vol: Any = ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]
    attachments = vol["Attachments"]
    return vol["State"], attachments[0]["State"] if attachments else None


def test_ec2_attach_and_detach_make_and_remove_the_device(
        ec2_with_plane: tuple[StrictEc2Server, EC2Client], plane: DevicePlane,
        tmp_path: Path) -> None:
    server, ec2 = ec2_with_plane
    server.set_delays(attach=0.5, detach=0.5)
    inst = instance(ec2)
    by_id = tmp_path / "by-id"
    plane.register_instance(inst, by_id)
    vol = ec2.create_volume(Size=1, AvailabilityZone=AZ)["VolumeId"]
    write_marker(plane.image_path(vol), b"from-the-pool")
    link = by_id / link_name(vol)

    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    assert state(ec2, vol) == ("in-use", "attaching")
    assert not link.is_symlink()  # no device before the attach completes
    wait_for(lambda: state(ec2, vol) == ("in-use", "attached"))
    assert read_device(link, 13) == b"from-the-pool"

    ec2.detach_volume(VolumeId=vol, InstanceId=inst)
    assert not link.is_symlink()  # gone at the start of detaching
    assert state(ec2, vol) == ("in-use", "detaching")
    wait_for(lambda: state(ec2, vol) == ("available", None))
    assert loops_backing(plane.image_path(vol)) == []


def test_ec2_detach_of_a_mounted_volume_stays_detaching_until_unmounted(
        ec2_with_plane: tuple[StrictEc2Server, EC2Client], plane: DevicePlane,
        mounted: Callable[[Path], Path]) -> None:
    _server, ec2 = ec2_with_plane
    inst = instance(ec2)
    vol = ec2.create_volume(Size=1, AvailabilityZone=AZ)["VolumeId"]
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    loop = plane.device_of(vol)
    assert loop is not None
    point = mounted(loop)
    ec2.detach_volume(VolumeId=vol)
    time.sleep(0.5)
    assert state(ec2, vol) == ("in-use", "detaching")  # busy, as on AWS
    assert plane.violations and vol in plane.violations[0]
    subp.run(["umount", str(point)])
    wait_for(lambda: state(ec2, vol) == ("available", None))
    assert plane.device_of(vol) is None


def test_ec2_terminate_removes_the_instances_devices_only(
        ec2_with_plane: tuple[StrictEc2Server, EC2Client], plane: DevicePlane) -> None:
    _server, ec2 = ec2_with_plane
    a, b = instance(ec2), instance(ec2)
    va = ec2.create_volume(Size=1, AvailabilityZone=AZ)["VolumeId"]
    vb = ec2.create_volume(Size=1, AvailabilityZone=AZ)["VolumeId"]
    ec2.attach_volume(VolumeId=va, InstanceId=a, Device="/dev/sdf")
    ec2.attach_volume(VolumeId=vb, InstanceId=b, Device="/dev/sdf")
    ec2.terminate_instances(InstanceIds=[a])
    assert plane.device_of(va) is None
    assert plane.device_of(vb) is not None
    assert state(ec2, va) == ("available", None)


def test_ec2_snapshot_carries_the_volumes_content_to_new_volumes(
        ec2_with_plane: tuple[StrictEc2Server, EC2Client], plane: DevicePlane) -> None:
    _server, ec2 = ec2_with_plane
    inst = instance(ec2)
    source = ec2.create_volume(Size=1, AvailabilityZone=AZ)["VolumeId"]
    write_marker(plane.image_path(source), b"checkpoint-42")
    snap = ec2.create_snapshot(VolumeId=source)["SnapshotId"]
    write_marker(plane.image_path(source), b"later-change!")
    restored = ec2.create_volume(AvailabilityZone=AZ, SnapshotId=snap)["VolumeId"]
    ec2.attach_volume(VolumeId=restored, InstanceId=inst, Device="/dev/sdf")
    loop = plane.device_of(restored)
    assert loop is not None
    assert read_device(loop, 13) == b"checkpoint-42"
