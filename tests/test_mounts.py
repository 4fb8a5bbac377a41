"""Probe, guarded mkfs, fsck, mount and unmount on real loop devices."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopdev import (
    MIB,
    loop_device,
    mkfs,
    mounted,
    needs_root,
    read_device,
    sh,
    unmount_under,
    write_device,
)

from spotagent.mounts import (
    BusyError,
    FsckError,
    MountError,
    UnsafeVolumeError,
    assert_detachable,
    check_filesystem,
    ensure_filesystem,
    first_nonzero_offset,
    is_mounted,
    mount,
    mount_volume,
    mounts_under,
    parse_blkid_export,
    parse_mountinfo,
    probe,
    read_mountinfo,
    unmount,
    unmount_tree,
)

XFS_SIZE = 300 * MIB  # mkfs.xfs refuses smaller; the image stays sparse

# --- pure parsing ----------------------------------------------------------------------------

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 27 7:3 / /mnt/vol\\040root rw,noatime shared:20 master:3 - ext4 /dev/loop3 rw
41 40 7:3 /data /mnt/vol\\040root/a\\134b rw - ext4 /dev/loop3 rw
42 41 0:30 / /mnt/vol\\040root/a\\134b/c rw - tmpfs tmp\\040fs rw,size=10k
43 40 0:31 / /mnt/vol\\040root/x rw - tmpfs tmpfs rw
44 43 0:32 / /mnt/vol\\040root/x rw - tmpfs tmpfs rw
45 27 7:4 / /mnt/vol\\040rooted rw - ext4 /dev/loop4 rw
garbage line
"""


def test_parse_mountinfo_unescapes_and_splits_optional_fields() -> None:
    entries = parse_mountinfo(MOUNTINFO)
    assert len(entries) == 8
    vol = entries[2]
    assert vol.mount_point == Path("/mnt/vol root")
    assert (vol.major, vol.minor, vol.devno) == (7, 3, os.makedev(7, 3))
    assert vol.fstype == "ext4" and vol.source == "/dev/loop3"
    assert vol.options == ("rw", "noatime")
    assert entries[3].root == "/data"
    assert entries[3].mount_point == Path("/mnt/vol root/a\\b")
    assert entries[4].source == "tmp fs" and entries[4].super_options == ("rw", "size=10k")


def test_mounts_under_is_children_first_and_stacked_top_first(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    ids = [e.mount_id for e in mounts_under(Path("/mnt/vol root"), mountinfo=info)]
    # Every mount before the one it sits on (c before a\b; a\b and x before the volume),
    # the newest first among those free to go (44 is stacked on 43); "/mnt/vol rooted"
    # only shares the prefix string.
    assert ids == [44, 42, 43, 41, 40]


def test_unmount_order_takes_a_hiding_mount_before_the_one_it_hides(tmp_path: Path) -> None:
    # /v/a/b was mounted first, then /v/a on top of its parent, hiding /v/a/b: /v/a/b is not
    # reachable until /v/a is gone, however deep its path.
    info = tmp_path / "mountinfo"
    info.write_text("50 27 7:1 / /v rw - ext4 /dev/loop1 rw\n"
                    "51 50 0:40 / /v/a/b rw - tmpfs t rw\n"
                    "52 50 0:41 / /v/a rw - tmpfs t rw\n")
    assert [e.mount_id for e in mounts_under(Path("/v"), mountinfo=info)] == [52, 51, 50]


def test_parse_mountinfo_keeps_non_utf8_names() -> None:
    raw = b"60 27 7:1 / /mnt/caf\xe9\\040x rw - ext4 /dev/loop1 rw\n"
    (entry,) = parse_mountinfo(raw)
    assert os.fsencode(entry.mount_point) == b"/mnt/caf\xe9 x"


def test_parse_blkid_export_unescapes_and_drops_devname() -> None:
    tags = parse_blkid_export("DEVNAME=/dev/loop0\nLABEL=my\\ label\nTYPE=ext4\n")
    assert tags == {"LABEL": "my label", "TYPE": "ext4"}


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def blank(tmp_path: Path) -> Iterator[Path]:
    with loop_device(tmp_path / "blank.img", 64 * MIB) as dev:
        yield dev


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Path]:
    """An ext4 volume holding data.txt."""
    with loop_device(tmp_path / "ext4.img", 128 * MIB, lambda img: mkfs("ext4", img)) as dev:
        with mounted(dev, tmp_path / "setup") as mp:
            (mp / "data.txt").write_text("precious\n")
        yield dev


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    """A mount point; whatever a test leaves mounted under it is unmounted."""
    path = tmp_path / "mnt point"
    try:
        yield path
    finally:
        unmount_under(tmp_path)


def _digest(dev: Path) -> str:
    return hashlib.sha256(read_device(dev)).hexdigest()


# --- probe and ensure_filesystem ------------------------------------------------------------


@needs_root
def test_blank_volume_created_by_agent_is_formatted(blank: Path) -> None:
    assert probe(blank).clean
    assert ensure_filesystem(blank, created_empty_by_agent=True, label="pool") == "ext4"
    after = probe(blank)
    assert after.fstype == "ext4" and after.label == "pool" and not after.ambiguous


@needs_root
def test_blank_volume_created_by_agent_as_xfs(tmp_path: Path) -> None:
    with loop_device(tmp_path / "x.img", XFS_SIZE) as dev:
        assert ensure_filesystem(dev, created_empty_by_agent=True, fstype="xfs") == "xfs"
        assert probe(dev).fstype == "xfs"


@needs_root
def test_blank_volume_not_created_by_agent_is_refused(blank: Path) -> None:
    with pytest.raises(UnsafeVolumeError, match="did not create empty"):
        ensure_filesystem(blank, created_empty_by_agent=False)
    assert probe(blank).clean
    assert first_nonzero_offset(blank) is None


@needs_root
def test_agent_volume_with_stray_data_is_refused(blank: Path) -> None:
    write_device(blank, 4096 * 7, b"not a signature, but data")
    assert probe(blank).clean
    with pytest.raises(UnsafeVolumeError, match="non-zero data") as info:
        ensure_filesystem(blank, created_empty_by_agent=True)
    assert "nonzero_at=28672" in str(info.value)
    assert probe(blank).clean


@needs_root
def test_ext4_with_data_is_mounted_never_reformatted(ext4: Path, mnt: Path) -> None:
    uuid = probe(ext4).uuid
    # Even a caller that wrongly believes it created the volume empty cannot get it formatted.
    assert ensure_filesystem(ext4, created_empty_by_agent=True) == "ext4"
    assert mount_volume(ext4, mnt, created_empty_by_agent=True) == "ext4"
    assert (mnt / "data.txt").read_text() == "precious\n"
    assert probe(ext4).uuid == uuid
    entry = next(e for e in read_mountinfo() if e.mount_point == mnt)
    assert "noatime" in entry.options


@needs_root
def test_damaged_ext4_superblock_is_refused_not_formatted(tmp_path: Path) -> None:
    payload = os.urandom(64 * 1024)
    with loop_device(tmp_path / "d.img", 128 * MIB, lambda img: mkfs("ext4", img)) as dev:
        with mounted(dev, tmp_path / "setup") as mp:
            (mp / "payload.bin").write_bytes(payload)
        assert payload in read_device(dev)
        write_device(dev, 1024, bytes(1024))  # the primary superblock; data blocks untouched
        assert probe(dev).clean  # what makes a cache- or probe-only check reformat it

        with pytest.raises(UnsafeVolumeError, match="did not create empty") as info:
            ensure_filesystem(dev, created_empty_by_agent=False)
        assert "ext_backup_superblock_at=" in str(info.value)
        with pytest.raises(UnsafeVolumeError, match="non-zero data"):
            ensure_filesystem(dev, created_empty_by_agent=True)
        with pytest.raises(UnsafeVolumeError):
            mount_volume(dev, tmp_path / "mnt", created_empty_by_agent=True)

        assert probe(dev).clean  # nothing was written: no mkfs ran
        assert payload in read_device(dev)
        assert not is_mounted(dev)


@needs_root
def test_xfs_volume_is_kept_even_when_ext4_asked(tmp_path: Path, mnt: Path) -> None:
    with loop_device(tmp_path / "x.img", XFS_SIZE, lambda img: mkfs("xfs", img)) as dev:
        with mounted(dev, tmp_path / "setup") as mp:
            (mp / "data.txt").write_text("xfs data\n")
        assert ensure_filesystem(dev, created_empty_by_agent=True, fstype="ext4") == "xfs"
        assert mount_volume(dev, mnt, created_empty_by_agent=False) == "xfs"
        assert (mnt / "data.txt").read_text() == "xfs data\n"
        unmount(mnt)


@needs_root
def test_two_signatures_are_ambiguous_and_refused(tmp_path: Path) -> None:
    ext4_img = tmp_path / "e.img"
    with open(ext4_img, "wb") as f:
        f.truncate(64 * MIB)
    mkfs("ext4", ext4_img)
    with open(ext4_img, "rb") as f:
        f.seek(1024)
        ext4_sb = f.read(1024)
    # An xfs file system with an ext4 superblock at 1 KiB: blkid -p says "ambivalent" (exit 8).
    with loop_device(tmp_path / "x.img", XFS_SIZE, lambda img: mkfs("xfs", img)) as dev:
        write_device(dev, 1024, ext4_sb)
        before = _digest(dev)
        p = probe(dev)
        assert p.ambiguous and p.fstype is None
        assert "ambivalent" in p.detail
        for created in (False, True):
            with pytest.raises(UnsafeVolumeError, match="ambiguous"):
                ensure_filesystem(dev, created_empty_by_agent=created)
        assert _digest(dev) == before


def test_unreadable_or_missing_device_is_ambiguous_not_clean(tmp_path: Path) -> None:
    # blkid -p exits 2 ("nothing found") for a path it cannot open: that must not read as blank.
    assert sh("blkid", "-p", tmp_path / "missing", check=False).returncode == 2
    for path in (tmp_path / "missing", tmp_path):
        p = probe(path)
        assert p.ambiguous and not p.clean
        with pytest.raises(UnsafeVolumeError, match="ambiguous"):
            ensure_filesystem(path, created_empty_by_agent=True)


@needs_root
def test_partition_table_is_refused(blank: Path) -> None:
    # An MBR with one Linux partition from sector 2048: what a user's hand-made disk looks like.
    mbr = bytearray(512)
    mbr[446:462] = bytes([0, 0, 0, 0, 0x83, 0, 0, 0]) + (2048).to_bytes(4, "little") + \
        (100000).to_bytes(4, "little")
    mbr[510:512] = b"\x55\xaa"
    write_device(blank, 0, bytes(mbr))
    assert probe(blank).pttype == "dos"
    before = _digest(blank)
    for created in (False, True):
        with pytest.raises(UnsafeVolumeError, match="partition table") as info:
            ensure_filesystem(blank, created_empty_by_agent=created)
        assert "pttype=dos" in str(info.value)
    assert _digest(blank) == before


@needs_root
def test_swap_signature_is_not_a_file_system(blank: Path) -> None:
    sh("mkswap", blank)
    with pytest.raises(UnsafeVolumeError, match="not a file system"):
        ensure_filesystem(blank, created_empty_by_agent=True)
    assert probe(blank).fstype == "swap"


# --- check_filesystem -------------------------------------------------------------------------


def _shutdown(mount_point: Path) -> None:
    """Cut the file system off as a power loss would: nothing more reaches the disk."""
    sh("xfs_io", "-x", "-c", "shutdown", mount_point)  # FS_IOC_GOINGDOWN; ext4 has it too


def _dumpe2fs(dev: Path) -> str:
    return sh("dumpe2fs", "-h", dev).stdout


@needs_root
def test_ext4_after_unclean_detach_is_recovered_by_fsck(ext4: Path, tmp_path: Path,
                                                        mnt: Path) -> None:
    with mounted(ext4, tmp_path / "crash") as mp:
        (mp / "synced.txt").write_text("made it\n")
        os.sync()
        _shutdown(mp)
    assert "needs_recovery" in _dumpe2fs(ext4)
    check_filesystem(ext4, "ext4")
    assert "needs_recovery" not in _dumpe2fs(ext4)
    # A file system marked not clean (errors found by the kernel) gets a full preen check.
    sh("debugfs", "-w", "-R", "ssv state 0", ext4)
    assert "not clean" in _dumpe2fs(ext4)
    check_filesystem(ext4, "ext4")
    assert "Filesystem state:         clean" in _dumpe2fs(ext4)
    mount(ext4, mnt, "ext4")
    assert (mnt / "synced.txt").read_text() == "made it\n"
    assert (mnt / "data.txt").read_text() == "precious\n"


@needs_root
def test_ext4_damage_fsck_cannot_fix_raises_and_is_not_mounted(ext4: Path, mnt: Path) -> None:
    sh("debugfs", "-w", "-R", "clri <2>", ext4)  # wipe the root directory's inode
    sh("debugfs", "-w", "-R", "ssv state 0", ext4)
    with pytest.raises(FsckError, match="cannot repair unattended") as info:
        mount_volume(ext4, mnt, created_empty_by_agent=False)
    assert "code=4" in str(info.value)
    assert not is_mounted(ext4)
    assert probe(ext4).fstype == "ext4"  # still the same file system, never reformatted


@needs_root
def test_xfs_dirty_log_is_replayed_by_mounting(tmp_path: Path) -> None:
    with loop_device(tmp_path / "x.img", XFS_SIZE, lambda img: mkfs("xfs", img)) as dev:
        with mounted(dev, tmp_path / "crash") as mp:
            (mp / "synced.txt").write_text("made it\n")
            os.sync()
            (mp / "late.txt").write_text("in the log only\n")
            _shutdown(mp)
        assert sh("xfs_repair", "-n", dev, check=False).returncode != 0
        check_filesystem(dev, "xfs")
        assert sh("xfs_repair", "-n", dev, check=False).returncode == 0
        assert not is_mounted(dev)  # the replay mount is gone
        with mounted(dev, tmp_path / "after") as mp:
            assert (mp / "synced.txt").read_text() == "made it\n"


@needs_root
def test_xfs_damage_raises_fsck_error(tmp_path: Path) -> None:
    with loop_device(tmp_path / "x.img", XFS_SIZE, lambda img: mkfs("xfs", img)) as dev:
        sh("xfs_db", "-x", "-c", "agf 1", "-c", "write -d magicnum 0", dev)
        with pytest.raises(FsckError, match="xfs_repair"):
            check_filesystem(dev, "xfs")
        assert not is_mounted(dev)


@needs_root
def test_fsck_refuses_a_mounted_device(ext4: Path, mnt: Path) -> None:
    mount(ext4, mnt, "ext4")
    with pytest.raises(MountError, match="mounted"):
        check_filesystem(ext4, "ext4")


# --- mount / unmount ---------------------------------------------------------------------------


@needs_root
def test_mount_is_idempotent(ext4: Path, mnt: Path) -> None:
    mount(ext4, mnt, "ext4")
    mount(ext4, mnt, "ext4")
    assert mount_volume(ext4, mnt, created_empty_by_agent=False) == "ext4"
    assert len([e for e in read_mountinfo() if e.mount_point == mnt]) == 1
    assert is_mounted(ext4)
    unmount(mnt)
    unmount(mnt)  # nothing mounted: a no-op
    assert not is_mounted(ext4)


@needs_root
def test_mount_over_an_occupied_mount_point_is_refused(ext4: Path, tmp_path: Path,
                                                        mnt: Path) -> None:
    with loop_device(tmp_path / "other.img", 64 * MIB, lambda img: mkfs("ext4", img)) as other:
        mount(other, mnt, "ext4")
        with pytest.raises(MountError, match="mount point is already in use"):
            mount(ext4, mnt, "ext4")
        assert not is_mounted(ext4)
        unmount(mnt)


@needs_root
def test_device_mounted_elsewhere_is_refused(ext4: Path, tmp_path: Path, mnt: Path) -> None:
    mount(ext4, mnt, "ext4")
    with pytest.raises(MountError, match="already mounted elsewhere"):
        mount(ext4, tmp_path / "second", "ext4")


def _holder(cwd: Path, code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait until it holds the file open
        if any(os.path.realpath(f"/proc/{proc.pid}/fd/{fd}").startswith(str(cwd))
               for fd in os.listdir(f"/proc/{proc.pid}/fd")):
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("holder did not start")


@needs_root
def test_unmount_busy_names_the_holder_then_succeeds(ext4: Path, mnt: Path) -> None:
    mount(ext4, mnt, "ext4")
    proc = _holder(mnt, "import time; f = open('data.txt'); time.sleep(60)")
    try:
        start = time.monotonic()
        with pytest.raises(BusyError) as info:
            unmount(mnt, retries=3, delay=0.1)
        assert time.monotonic() - start >= 0.3  # it did retry
        assert any(h.pid == proc.pid and "open:" in h.how and "cwd" in h.how
                   for h in info.value.holders)
        assert f"{proc.pid}(python" in str(info.value)
        assert is_mounted(ext4)
    finally:
        proc.kill()
        proc.wait()
    unmount(mnt)
    assert not is_mounted(ext4)


@needs_root
def test_unmount_retries_until_holder_exits(ext4: Path, mnt: Path) -> None:
    mount(ext4, mnt, "ext4")
    proc = _holder(mnt, "import time; f = open('data.txt'); time.sleep(0.5)")
    try:
        unmount(mnt, retries=50, delay=0.1)
    finally:
        proc.kill()
        proc.wait()
    assert not is_mounted(ext4)


@needs_root
def test_unmount_tree_with_nested_binds_and_spaces(ext4: Path, tmp_path: Path) -> None:
    top = tmp_path / "vol root"
    src = tmp_path / "src dir"
    (src / "inner").mkdir(parents=True)
    try:
        mount(ext4, top, "ext4")
        (top / "a b").mkdir()
        sh("mount", "--bind", src, top / "a b")
        sh("mount", "--bind", tmp_path / "src dir" / "inner", top / "a b" / "inner")
        # A tmpfs stacked on the same mount point: the top one must go first.
        sh("mount", "-t", "tmpfs", "tmp fs", top / "a b" / "inner")
        under = mounts_under(top)
        assert [e.mount_point for e in under] == [top / "a b" / "inner", top / "a b" / "inner",
                                                  top / "a b", top]
        assert under[0].fstype == "tmpfs" and under[0].source == "tmp fs"
        with pytest.raises(BusyError, match="busy") as info:
            unmount(top, retries=0)  # nested mounts keep it busy
        assert "nested_mounts=" in str(info.value)
        # A mount over a parent directory of an older mount hides it: the hider must go first.
        (top / "h" / "deep").mkdir(parents=True)
        sh("mount", "-t", "tmpfs", "hidden", top / "h" / "deep")
        sh("mount", "-t", "tmpfs", "hider", top / "h")
        unmount_tree(top)
        assert mounts_under(top) == []
        assert not is_mounted(ext4)
    finally:
        unmount_under(tmp_path)


@needs_root
def test_assert_detachable(ext4: Path, mnt: Path) -> None:
    mount(ext4, mnt, "ext4")
    with pytest.raises(MountError, match="still mounted"):
        assert_detachable(ext4)
    unmount(mnt)
    assert_detachable(ext4)


@needs_root
def test_mount_in_another_namespace_blocks_detach(ext4: Path, tmp_path: Path) -> None:
    # A mount made in a private mount namespace (a container, a unit with PrivateMounts) is
    # invisible in ours, but the device is just as busy.
    target = tmp_path / "ns mnt"
    target.mkdir()
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                             'mount "$0" "$1" && exec sleep 60', str(ext4), str(target)])
    try:
        deadline = time.monotonic() + 10
        while not is_mounted(ext4) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert is_mounted(ext4)
        assert not is_mounted(ext4, all_namespaces=False)
        with pytest.raises(MountError, match="still mounted"):
            assert_detachable(ext4)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while is_mounted(ext4) and time.monotonic() < deadline:  # the namespace dies with it
        time.sleep(0.02)
    assert_detachable(ext4)


@needs_root
def test_exclusive_user_blocks_detach(blank: Path) -> None:
    # Not mounted anywhere, but held exclusively (as mkfs, fsck or a device-mapper table would).
    fd = os.open(blank, os.O_RDONLY | os.O_EXCL)
    try:
        assert not is_mounted(blank)
        with pytest.raises(MountError, match="exclusive open refused"):
            assert_detachable(blank)
    finally:
        os.close(fd)
    assert_detachable(blank)
