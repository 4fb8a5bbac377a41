"""Volume id → block device: serial in a fake sysfs, by-id links, Xen names, waiting on events."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopdev import loop_device, needs_root

from spotagent.devices import (
    DeviceTimeoutError,
    by_id_name,
    find_device,
    nvme_serial,
    wait_for_device,
    xen_candidates,
)

VOL = "vol-0123456789abcdef0"
OTHER = "vol-0fedcba9876543210"


# --- pure ------------------------------------------------------------------------------------


def test_nvme_serial_drops_the_dash() -> None:
    assert nvme_serial(VOL) == "vol0123456789abcdef0"
    assert nvme_serial("vol-1234abcd") == "vol1234abcd"  # the old 8-hex ids


@pytest.mark.parametrize("bad", ["", "vol0123456789abcdef0", "vol-0123456789ABCDEF0",
                                 "vol-0123", "vol-0123456789abcdef01", "i-0123456789abcdef0",
                                 "vol-0123456789abcdef0\n", "/dev/vol-0123456789abcdef0"])
def test_nvme_serial_rejects_malformed_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="malformed EBS volume id"):
        nvme_serial(bad)


def test_by_id_name_is_udevs_link_name() -> None:
    assert by_id_name(VOL) == "nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"


def test_xen_candidates_map_sd_to_xvd() -> None:
    assert xen_candidates("/dev/sdf") == [Path("/dev/sdf"), Path("/dev/xvdf")]
    assert xen_candidates("/dev/xvdg") == [Path("/dev/xvdg")]


def test_nothing_found_in_empty_dirs(tmp_path: Path) -> None:
    assert find_device(VOL, by_id_dir=tmp_path / "by-id", sysfs=tmp_path / "sys",
                       dev_dir=tmp_path / "dev", xen_names=[str(tmp_path / "dev" / "sdf")]) is None


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Path]:
    with loop_device(tmp_path / "disk.img", 8 << 20) as dev:
        yield dev


def _devnum(dev: Path) -> str:
    rdev = os.stat(dev).st_rdev
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def fake_nvme(sysfs: Path, ctrl: str, serial: str, namespace: str, devnum: str | None) -> None:
    """A controller dir as the kernel lays it out: class/nvme/<ctrl>/{serial,model,<ns>/dev}.

    The serial is space-padded as the kernel shows it; the model is QEMU's, which must not
    matter (matching is by serial only).
    """
    ctrl_dir = sysfs / "class" / "nvme" / ctrl
    (ctrl_dir / namespace).mkdir(parents=True)
    (ctrl_dir / "serial").write_text(f"{serial:<20}\n")
    (ctrl_dir / "model").write_text("QEMU NVMe Ctrl                          \n")
    if devnum is not None:
        (ctrl_dir / namespace / "dev").write_text(devnum + "\n")


# --- find_device (root: needs real block devices) ------------------------------------------


@needs_root
def test_find_by_id_link(tmp_path: Path, loop: Path) -> None:
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    (by_id / by_id_name(VOL)).symlink_to(loop)
    assert find_device(VOL, by_id_dir=by_id, sysfs=tmp_path / "nosys") == loop


@needs_root
def test_find_by_sysfs_serial_skips_other_controllers(tmp_path: Path, loop: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    fake_nvme(sysfs, "nvme0", nvme_serial(OTHER), "nvme0n1", "7:250")
    fake_nvme(sysfs, "nvme1", nvme_serial(VOL), "nvme1n1", _devnum(loop))
    (dev / "nvme1n1").symlink_to(loop)
    (dev / "nvme0n1").symlink_to("/dev/null")  # exists, but is not this volume's node
    found = find_device(VOL, by_id_dir=tmp_path / "no-by-id", sysfs=sysfs, dev_dir=dev)
    assert found == loop


@needs_root
def test_sysfs_wins_over_a_stale_by_id_link(tmp_path: Path, loop: Path) -> None:
    with loop_device(tmp_path / "other.img", 8 << 20) as other:
        sysfs, dev, by_id = tmp_path / "sys", tmp_path / "dev", tmp_path / "by-id"
        dev.mkdir()
        by_id.mkdir()
        fake_nvme(sysfs, "nvme0", nvme_serial(VOL), "nvme0n1", _devnum(loop))
        (dev / "nvme0n1").symlink_to(loop)
        (by_id / by_id_name(VOL)).symlink_to(other)
        assert find_device(VOL, by_id_dir=by_id, sysfs=sysfs, dev_dir=dev) == loop


@needs_root
def test_sysfs_multipath_path_node_maps_to_head(tmp_path: Path, loop: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    # Native NVMe multipath: class/nvme/nvme3/nvme2c3n1 is a path of head nvme2n1.
    fake_nvme(sysfs, "nvme3", nvme_serial(VOL), "nvme2c3n1", None)
    (sysfs / "class" / "block" / "nvme2n1").mkdir(parents=True)
    (sysfs / "class" / "block" / "nvme2n1" / "dev").write_text(_devnum(loop) + "\n")
    (dev / "nvme2n1").symlink_to(loop)
    assert find_device(VOL, by_id_dir=tmp_path / "none", sysfs=sysfs, dev_dir=dev) == loop


@needs_root
def test_sysfs_node_with_other_devnum_is_not_trusted(tmp_path: Path, loop: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    fake_nvme(sysfs, "nvme0", nvme_serial(VOL), "nvme0n1", "7:4095")
    (dev / "nvme0n1").symlink_to(loop)
    assert find_device(VOL, by_id_dir=tmp_path / "none", sysfs=sysfs, dev_dir=dev) is None


@needs_root
def test_wrong_serial_is_not_matched(tmp_path: Path, loop: Path) -> None:
    sysfs, dev, by_id = tmp_path / "sys", tmp_path / "dev", tmp_path / "by-id"
    dev.mkdir()
    by_id.mkdir()
    fake_nvme(sysfs, "nvme0", nvme_serial(OTHER), "nvme0n1", _devnum(loop))
    (dev / "nvme0n1").symlink_to(loop)
    (by_id / by_id_name(OTHER)).symlink_to(loop)
    # A serial that only starts like ours must not match either.
    fake_nvme(sysfs, "nvme1", nvme_serial(VOL) + "9", "nvme1n1", _devnum(loop))
    (dev / "nvme1n1").symlink_to(loop)
    assert find_device(VOL, by_id_dir=by_id, sysfs=sysfs, dev_dir=dev) is None
    assert find_device(OTHER, by_id_dir=by_id, sysfs=sysfs, dev_dir=dev) == loop


@needs_root
def test_xen_name_fallback(tmp_path: Path, loop: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "xvdf").symlink_to(loop)
    found = find_device(VOL, by_id_dir=tmp_path / "none", sysfs=tmp_path / "nosys",
                        dev_dir=dev, xen_names=[str(dev / "sdf")])
    assert found == loop


def test_link_to_a_regular_file_is_not_a_device(tmp_path: Path) -> None:
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    (tmp_path / "file").write_bytes(b"x")
    (by_id / by_id_name(VOL)).symlink_to(tmp_path / "file")
    assert find_device(VOL, by_id_dir=by_id, sysfs=tmp_path / "nosys") is None


# --- wait_for_device -------------------------------------------------------------------------


def _later(delay: float, action: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        action()  # type: ignore[operator]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@needs_root
def test_wait_returns_promptly_when_link_appears(tmp_path: Path, loop: Path) -> None:
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    t = _later(0.3, lambda: (by_id / by_id_name(VOL)).symlink_to(loop))
    start = time.monotonic()
    # rescan_interval far beyond the bound: only an inotify event can make this prompt.
    found = wait_for_device(VOL, by_id_dir=by_id, timeout=30, sysfs=tmp_path / "nosys",
                            dev_dir=tmp_path, rescan_interval=60)
    elapsed = time.monotonic() - start
    t.join()
    assert found == loop
    assert 0.25 <= elapsed < 5


@needs_root
def test_wait_sees_by_id_dir_created_later(tmp_path: Path, loop: Path) -> None:
    by_id = tmp_path / "disk" / "by-id"  # neither dir exists yet, as before udev's first link

    def make() -> None:
        by_id.mkdir(parents=True)
        time.sleep(0.2)
        (by_id / by_id_name(VOL)).symlink_to(loop)

    t = _later(0.3, make)
    start = time.monotonic()
    found = wait_for_device(VOL, by_id_dir=by_id, timeout=30, sysfs=tmp_path / "nosys",
                            dev_dir=tmp_path / "dev-none", rescan_interval=60)
    t.join()
    assert found == loop
    assert time.monotonic() - start < 5


@needs_root
def test_wait_wakes_on_nvme_node_in_dev_dir(tmp_path: Path, loop: Path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    fake_nvme(sysfs, "nvme0", nvme_serial(VOL), "nvme0n1", _devnum(loop))
    t = _later(0.3, lambda: (dev / "nvme0n1").symlink_to(loop))
    start = time.monotonic()
    found = wait_for_device(VOL, by_id_dir=tmp_path / "by-id", timeout=30, sysfs=sysfs,
                            dev_dir=dev, rescan_interval=60)
    t.join()
    assert found == loop
    assert time.monotonic() - start < 5


@needs_root
def test_wait_already_present_is_immediate(tmp_path: Path, loop: Path) -> None:
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    (by_id / by_id_name(VOL)).symlink_to(loop)
    start = time.monotonic()
    assert wait_for_device(VOL, by_id_dir=by_id, timeout=30, sysfs=tmp_path / "nosys",
                           dev_dir=tmp_path, rescan_interval=60) == loop
    assert time.monotonic() - start < 2


def test_wait_times_out_with_a_clear_message(tmp_path: Path) -> None:
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    start = time.monotonic()
    with pytest.raises(DeviceTimeoutError) as info:
        wait_for_device(VOL, by_id_dir=by_id, timeout=0.5, sysfs=tmp_path / "nosys",
                        dev_dir=tmp_path / "dev", xen_names=["/nonexistent/sdf"])
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 5
    msg = str(info.value)
    assert VOL in msg
    assert "within 0.5 s" in msg
    assert str(by_id) in msg
    assert "vol0123456789abcdef0" in msg
    assert "/nonexistent/sdf" in msg
