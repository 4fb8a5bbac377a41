"""The environment: real bind mounts into a real busybox root, real chroots, real users."""

from __future__ import annotations

import json
import os
import pwd
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotagent import subp
from spotagent.chroot import (
    CheckpointDirError,
    ChrootError,
    ChrootMountError,
    ChrootTeardownError,
    CommandNotExecutableError,
    CommandNotFoundError,
    Environment,
    MountInfo,
    NotARootError,
    RootUserRefusedError,
    TrainerUser,
    UserNotFoundError,
    _mounts_beneath,
    leftover_mounts,
    lookup_user,
    min_driver_for_cuda,
    parse_driver_version,
    parse_mountinfo,
    read_mountinfo,
    resolve_in_root,
    unmount_beneath,
)
from spotagent.supervisor import (
    RestartPolicy,
    Supervisor,
    TrainerState,
    trainer_env,
)
from spotagent.testbed.rootfs import CHROOT_ONLY_UID, CHROOT_ONLY_USER, build_busybox_root

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, chroot, chown)")
FAKE_RESOLV = "nameserver 192.0.2.53\nsearch spotagent.test\n"
# proc, sys, dev, dev/pts, dev/shm, etc/resolv.conf, run/spotagent
EXPECTED_MOUNTS = 7


def force_unmount(root: Path) -> None:
    """Fixture safety net: nothing may stay mounted under tmp (a later rm -rf of the temp
    directory would walk into the host's /dev through a leftover bind)."""
    try:
        unmount_beneath(root)
    except ChrootError:
        unmount_beneath(root, lazy=True)
    assert leftover_mounts(root) == []


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    return build_busybox_root(tmp_path / "root")


@pytest.fixture
def resolv(tmp_path: Path) -> Path:
    path = tmp_path / "resolv.conf"
    path.write_text(FAKE_RESOLV)
    return path


@pytest.fixture
def env(rootfs: Path, tmp_path: Path, resolv: Path) -> Iterator[Environment]:
    environment = Environment(rootfs, control_dir=tmp_path / "control", resolv_conf=resolv)
    try:
        yield environment
    finally:
        force_unmount(rootfs)


@pytest.fixture
def trainer(rootfs: Path) -> TrainerUser:
    return lookup_user(rootfs, "trainer")


def mounts_under(root: Path) -> list[MountInfo]:
    prefix = str(root.resolve()) + "/"
    return [e for e in read_mountinfo() if e.mount_point.startswith(prefix)]


def run_inside(root: Path, user: TrainerUser, script: str, tmp_path: Path) -> list[str]:
    """Run a shell script in the chroot as `user` through the supervisor; its output lines."""
    log_path = tmp_path / f"run-{uuid.uuid4().hex}.log"
    sup = Supervisor(
        ["/bin/sh", "-c", script], root=root, user=user,
        env=trainer_env(user=user, checkpoint_dir="/tmp", run_id="test"),
        log_path=log_path, policy=RestartPolicy(budget=0))
    sup.start()
    limit = time.monotonic() + 20
    while sup.poll().state in (TrainerState.STARTING, TrainerState.RUNNING):
        assert time.monotonic() < limit, "script hung"
        time.sleep(0.02)
    status = sup.status()
    lines = log_path.read_text().splitlines()[1:]   # first line: the supervisor's marker
    assert status.state is TrainerState.EXITED_OK, (status.reason, lines)
    return lines


# --- pure: mountinfo, paths, versions -----------------------------------------------------------


def test_mountinfo_octal_escapes_are_decoded() -> None:
    text = (rb"36 35 98:0 /my\040dir /mnt/with\040space\134x rw,noatime master:1 - ext4 "
            rb"/dev/my\011disk rw" + b"\n" +
            rb"37 36 0:5 / /mnt/plain rw shared:2 master:3 - tmpfs tmpfs rw" + b"\n" +
            b"garbage line\n")
    first, second = parse_mountinfo(text)
    assert first.mount_point == "/mnt/with space\\x"
    assert first.root == "/my dir"
    assert first.source == "/dev/my\tdisk"
    assert first.propagation == ("master:1",)
    assert (first.mount_id, first.parent_id, first.fstype) == (36, 35, "ext4")
    assert second.propagation == ("shared:2", "master:3")


def test_teardown_order_is_children_first_and_skips_the_root_itself() -> None:
    def m(mid: int, parent: int, point: str) -> MountInfo:
        return MountInfo(mid, parent, "/", point, "rw", (), "x", "x")

    entries = [
        m(10, 1, "/vol"),              # the volume itself: not ours
        m(11, 10, "/vol/dev"),
        m(12, 11, "/vol/dev/pts"),
        m(13, 10, "/vol/proc"),
        m(14, 10, "/vol/dev"),         # stacked on top of 11 (a second prepare, say)
        m(15, 10, "/vol2/other"),      # a sibling whose name shares the prefix
        m(16, 14, "/vol/dev/shm"),
    ]
    order = [e.mount_id for e in _mounts_beneath(Path("/vol"), entries)]
    assert sorted(order) == [11, 12, 13, 14, 16]
    assert order.index(16) < order.index(14) and order.index(12) < order.index(11)


def test_root_slash_is_refused() -> None:
    with pytest.raises(ChrootError, match="refusing to use /"):
        leftover_mounts(Path("/"))
    with pytest.raises(ChrootError, match="refusing to use /"):
        Environment(Path("/tmp/.."), control_dir=Path("/tmp/x"))


def test_symlinks_resolve_relative_to_the_root(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "usr/local/cuda-12.2").mkdir(parents=True)
    (root / "usr/local/cuda").symlink_to("/usr/local/cuda-12.2")
    (root / "etc").mkdir()
    (root / "etc/resolv.conf").symlink_to("../run/systemd/resolve/stub-resolv.conf")
    assert resolve_in_root(root, "/usr/local/cuda/version.json") == \
        root / "usr/local/cuda-12.2/version.json"
    assert resolve_in_root(root, "/../../etc/passwd") == root / "etc/passwd"
    assert resolve_in_root(root, "/etc/resolv.conf") == \
        root / "run/systemd/resolve/stub-resolv.conf"
    assert resolve_in_root(root, "/etc/resolv.conf", follow_last=False) == \
        root / "etc/resolv.conf"
    (root / "loop").symlink_to("/loop")
    with pytest.raises(ChrootError, match="too many levels"):
        resolve_in_root(root, "/loop/x")


def test_min_driver_table() -> None:
    assert min_driver_for_cuda("12.2.2") == "535.54.03"
    assert min_driver_for_cuda("12.7") == "560.28.03"     # no 12.7: nearest release below
    assert min_driver_for_cuda("11.8.89") == "520.61.05"
    assert min_driver_for_cuda("9.0") is None
    assert parse_driver_version(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 19:33:23 UTC 2024\n") == "550.54.15"
    assert parse_driver_version("535.104.05\n") == "535.104.05"
    assert parse_driver_version("nonsense") is None


# --- GPU detection (fake /proc, /sys, /dev; no GPU needed) --------------------------------------


def fake_gpu_host(tmp_path: Path, driver_line: str | None, *, sys_version: str | None = None,
                  uvm: bool = True) -> tuple[Path, Path, Path]:
    proc, sys, dev = tmp_path / "proc", tmp_path / "sys", tmp_path / "dev"
    for d in (proc, sys, dev):
        d.mkdir()
    if driver_line is not None:
        (proc / "driver/nvidia/gpus/0000:00:1e.0").mkdir(parents=True)
        (proc / "driver/nvidia/version").write_text(driver_line)
        for node in ("nvidia0", "nvidiactl") + (("nvidia-uvm",) if uvm else ()):
            (dev / node).touch()
    if sys_version is not None:
        (sys / "module/nvidia").mkdir(parents=True)
        (sys / "module/nvidia/version").write_text(sys_version)
    return proc, sys, dev


def cuda_root(tmp_path: Path, version: str, *, as_json: bool = True,
              libcuda: str | None = None) -> Path:
    root = tmp_path / "envroot"
    if libcuda is not None:
        libdir = root / "usr/lib/x86_64-linux-gnu"
        libdir.mkdir(parents=True)
        (libdir / f"libcuda.so.{libcuda}").write_bytes(b"\x7fELF")
        (libdir / "libcuda.so.1").symlink_to(f"libcuda.so.{libcuda}")
    real = root / f"usr/local/cuda-{version.rsplit('.', 1)[0]}"
    real.mkdir(parents=True)
    (root / "usr/local/cuda").symlink_to(f"/usr/local/{real.name}")   # absolute, as installed
    if as_json:
        (real / "version.json").write_text(json.dumps(
            {"cuda": {"name": "CUDA SDK", "version": version}}))
    else:
        (real / "version.txt").write_text(f"CUDA Version {version}\n")
    return root


def nvrm(version: str) -> str:
    return (f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  "
            "Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n")


def test_gpu_old_driver_for_the_roots_cuda_warns(tmp_path: Path) -> None:
    proc, sys, dev = fake_gpu_host(tmp_path, nvrm("525.85.12"))
    env = Environment(cuda_root(tmp_path, "12.2.2", libcuda="525.85.12"),
                      control_dir=tmp_path / "c", proc_root=proc, sys_root=sys, dev_root=dev)
    report = env.gpu_report()
    assert report.present and report.gpus == ("0000:00:1e.0",)
    assert report.root_libcuda == ("525.85.12",)
    assert report.device_nodes == ("nvidia-uvm", "nvidia0", "nvidiactl")
    assert (report.driver_version, report.cuda_version) == ("525.85.12", "12.2.2")
    assert report.cuda_min_driver == "535.54.03"
    assert len(report.warnings) == 1
    assert "older than CUDA 12.2.2 needs (535.54.03)" in report.warnings[0]
    assert "minor version compatibility" in report.warnings[0]


def test_gpu_driver_below_the_major_floor_will_not_run(tmp_path: Path) -> None:
    proc, sys, dev = fake_gpu_host(tmp_path, nvrm("470.82.01"))
    env = Environment(cuda_root(tmp_path, "12.1.105", libcuda="470.82.01"),
                      control_dir=tmp_path / "c", proc_root=proc, sys_root=sys, dev_root=dev)
    (warning,) = env.gpu_report().warnings
    assert "will not initialise" in warning


def test_gpu_new_enough_driver_from_sysfs_and_version_txt(tmp_path: Path) -> None:
    proc, sys, dev = fake_gpu_host(tmp_path, None, sys_version="550.54.15\n")
    env = Environment(cuda_root(tmp_path, "11.8.89", as_json=False, libcuda="550.54.15"),
                      control_dir=tmp_path / "c", proc_root=proc, sys_root=sys, dev_root=dev)
    report = env.gpu_report()
    assert (report.driver_version, report.cuda_version) == ("550.54.15", "11.8.89")
    assert report.warnings == ()


def test_gpu_without_uvm_node_warns_and_no_gpu_is_quiet(tmp_path: Path) -> None:
    proc, sys, dev = fake_gpu_host(tmp_path, nvrm("580.65.06"), uvm=False)
    env = Environment(cuda_root(tmp_path, "12.4.1", libcuda="580.65.06"),
                      control_dir=tmp_path / "c", proc_root=proc, sys_root=sys, dev_root=dev)
    (warning,) = env.gpu_report().warnings
    assert "nvidia-uvm" in warning
    bare = tmp_path / "bare"
    bare.mkdir()
    proc2, sys2, dev2 = fake_gpu_host(bare, None)
    quiet = Environment(tmp_path / "envroot", control_dir=tmp_path / "c",
                        proc_root=proc2, sys_root=sys2, dev_root=dev2).gpu_report()
    assert not quiet.present and quiet.warnings == () and quiet.driver_version is None


def test_gpu_libcuda_in_the_root_must_match_the_host_module(tmp_path: Path) -> None:
    proc, sys, dev = fake_gpu_host(tmp_path, nvrm("550.54.15"))
    env = Environment(cuda_root(tmp_path, "12.4.1", libcuda="550.54.14"),
                      control_dir=tmp_path / "c", proc_root=proc, sys_root=sys, dev_root=dev)
    (warning,) = env.gpu_report().warnings
    assert "libcuda.so 550.54.14 in the root does not match the host kernel module 550.54.15" \
        in warning
    for lib in (tmp_path / "envroot/usr/lib/x86_64-linux-gnu").iterdir():
        lib.unlink()
    (warning,) = env.gpu_report().warnings
    assert "no libcuda.so in the root" in warning


# --- users --------------------------------------------------------------------------------------


@pytest.mark.root
@root_only
def test_user_only_in_the_chroot_resolves(rootfs: Path) -> None:
    with pytest.raises(KeyError):
        pwd.getpwnam(CHROOT_ONLY_USER)      # the host has no such user
    user = lookup_user(rootfs, CHROOT_ONLY_USER)
    assert (user.uid, user.gid, user.groups) == (CHROOT_ONLY_UID, CHROOT_ONLY_UID, (2000,))
    trainer = lookup_user(rootfs, "trainer")
    assert trainer == TrainerUser("trainer", 1000, 1000, (2000,), "/home/trainer")


@pytest.mark.root
@root_only
@pytest.mark.parametrize("host_user", ["daemon", "nobody"])
def test_user_only_on_the_host_is_refused(rootfs: Path, host_user: str) -> None:
    pwd.getpwnam(host_user)                  # exists on the host
    with pytest.raises(UserNotFoundError) as err:
        lookup_user(rootfs, host_user)
    assert host_user in str(err.value)
    assert str(rootfs / "etc" / "passwd") in str(err.value)


@pytest.mark.root
@root_only
def test_root_user_is_refused(rootfs: Path) -> None:
    with pytest.raises(RootUserRefusedError, match="root"):
        lookup_user(rootfs, "root")


# --- root, command and checkpoint checks --------------------------------------------------------


def test_not_a_root_file_system(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = Environment(empty, control_dir=tmp_path / "c")
    with pytest.raises(NotARootError, match="no /etc/passwd"):
        env.check_command(["/bin/sh"])
    (empty / "etc").mkdir()
    (empty / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    with pytest.raises(NotARootError, match="no /bin or /usr/bin"):
        env.prepare()
    assert leftover_mounts(empty) == []


@pytest.mark.root
@root_only
def test_command_resolution_inside_the_root(rootfs: Path, tmp_path: Path,
                                            trainer: TrainerUser) -> None:
    env = Environment(rootfs, control_dir=tmp_path / "c")
    assert env.check_command(["sh", "-c", "true"], user=trainer) == "/bin/sh"
    with pytest.raises(CommandNotFoundError) as err:
        env.check_command(["train-gpt"])
    assert "command not found inside the chroot" in str(err.value)
    assert "train-gpt" in str(err.value) and str(rootfs) in str(err.value)
    # An absolute symlink is followed inside the root: this one exists only on the host.
    host_only = tmp_path / "host-only-train"
    host_only.write_text("#!/bin/sh\n")
    host_only.chmod(0o755)
    (rootfs / "usr/local/bin/train").symlink_to(host_only)
    with pytest.raises(CommandNotFoundError, match="train"):
        env.check_command(["train"])
    # A script whose interpreter is missing in the root.
    (rootfs / "opt/train.py").write_text("#!/usr/bin/python3\nprint('hi')\n")
    (rootfs / "opt/train.py").chmod(0o755)
    with pytest.raises(CommandNotFoundError, match="interpreter"):
        env.check_command(["/opt/train.py"])
    (rootfs / "opt/train2").write_text("#!/usr/bin/env python3\n")
    (rootfs / "opt/train2").chmod(0o755)
    with pytest.raises(CommandNotFoundError, match="python3"):
        env.check_command(["/opt/train2"])
    # Executable for root only.
    (rootfs / "opt/secret.sh").write_text("#!/bin/sh\n")
    (rootfs / "opt/secret.sh").chmod(0o744)
    with pytest.raises(CommandNotExecutableError, match="trainer user may not execute"):
        env.check_command(["/opt/secret.sh"], user=trainer)


@pytest.mark.root
@root_only
def test_checkpoint_dir_is_created_owned_by_the_user(rootfs: Path, tmp_path: Path,
                                                     trainer: TrainerUser) -> None:
    env = Environment(rootfs, control_dir=tmp_path / "c")
    host = env.ensure_checkpoint_dir("/var/lib/spotagent/checkpoints", trainer)
    assert host == rootfs / "var/lib/spotagent/checkpoints"
    st = host.stat()
    assert (st.st_uid, st.st_gid) == (1000, 1000)
    assert host.parent.stat().st_uid == 0
    assert env.ensure_checkpoint_dir("/var/lib/spotagent/checkpoints", trainer) == host
    # A symlinked data directory stays inside the root.
    (rootfs / "data").symlink_to("/mnt/data")
    host2 = env.ensure_checkpoint_dir("/data/ckpt", trainer)
    assert host2 == rootfs / "mnt/data/ckpt"
    assert not Path("/mnt/data/ckpt").exists()


@pytest.mark.root
@root_only
def test_unwritable_checkpoint_dir_is_refused(rootfs: Path, tmp_path: Path,
                                              trainer: TrainerUser) -> None:
    env = Environment(rootfs, control_dir=tmp_path / "c")
    (rootfs / "srv/ckpt").mkdir(parents=True, mode=0o755)
    with pytest.raises(CheckpointDirError) as err:
        env.ensure_checkpoint_dir("/srv/ckpt", trainer)
    text = str(err.value)
    assert "not writable by the trainer user" in text
    assert "/srv/ckpt" in text and "user=trainer" in text
    (rootfs / "srv/file").write_text("x")
    with pytest.raises(CheckpointDirError, match="not a directory"):
        env.ensure_checkpoint_dir("/srv/file", trainer)
    (rootfs / "srv/closed").mkdir(mode=0o700)
    with pytest.raises(CheckpointDirError, match="not writable"):
        env.ensure_checkpoint_dir("/srv/closed/ckpt", trainer)   # created, but unreachable
    with pytest.raises(CheckpointDirError, match="absolute"):
        env.ensure_checkpoint_dir("srv/ckpt", trainer)


# --- mounts -------------------------------------------------------------------------------------


@pytest.mark.root
@root_only
def test_prepare_gives_proc_resolv_conf_and_a_writable_control_dir(
        env: Environment, rootfs: Path, trainer: TrainerUser, tmp_path: Path) -> None:
    env.prepare(user=trainer)
    points = sorted(e.mount_point for e in mounts_under(rootfs))
    assert points == sorted(str(rootfs / p) for p in (
        "proc", "sys", "dev", "dev/pts", "dev/shm", "etc/resolv.conf", "run/spotagent"))
    lines = run_inside(rootfs, trainer, (
        "cat /proc/self/status; cat /etc/resolv.conf; "
        "echo step=7 > $SPOTAGENT_CONTROL_DIR/progress && echo control-ok; "
        "echo x > /dev/null && test -c /dev/null && echo dev-ok; "
        "test -d /sys/class && echo sys-ok; echo shm > /dev/shm/spotagent-test.$$ && "
        "rm /dev/shm/spotagent-test.$$ && echo shm-ok"), tmp_path)
    uid_line = next(x for x in lines if x.startswith("Uid:"))
    assert uid_line.split()[1:] == ["1000"] * 4
    groups_line = next(x for x in lines if x.startswith("Groups:"))
    assert groups_line.split()[1:] == ["2000"]
    assert "nameserver 192.0.2.53" in lines
    for ok in ("control-ok", "dev-ok", "sys-ok", "shm-ok"):
        assert ok in lines
    progress = tmp_path / "control" / "progress"
    assert progress.read_text() == "step=7\n" and progress.stat().st_uid == 1000


@pytest.mark.root
@root_only
def test_prepare_is_idempotent_and_teardown_leaves_nothing(env: Environment,
                                                           rootfs: Path) -> None:
    env.prepare()
    env.prepare()
    assert len(mounts_under(rootfs)) == EXPECTED_MOUNTS
    env.teardown()
    assert mounts_under(rootfs) == []
    assert leftover_mounts(rootfs) == []
    env.teardown()   # nothing to do is fine


@pytest.mark.root
@root_only
def test_a_fresh_environment_removes_a_crashed_agents_mounts(env: Environment, rootfs: Path,
                                                             tmp_path: Path,
                                                             resolv: Path) -> None:
    env.prepare()
    del env   # the agent "crashes": nothing of it remains but the mounts
    fresh = Environment(rootfs, control_dir=tmp_path / "control", resolv_conf=resolv)
    left = fresh.leftover_mounts()
    assert len(left) == EXPECTED_MOUNTS
    assert left.index(rootfs / "dev/pts") < left.index(rootfs / "dev")
    fresh.teardown()
    assert mounts_under(rootfs) == []


@pytest.mark.root
@root_only
def test_resolv_conf_symlink_and_missing_target(rootfs: Path, tmp_path: Path,
                                                resolv: Path) -> None:
    # A root whose resolv.conf is an absolute symlink (systemd-resolved style): the bind lands
    # inside the root, never on the host path the link names.
    (rootfs / "etc/resolv.conf").symlink_to("/run/systemd/resolve/stub-resolv.conf")
    env = Environment(rootfs, control_dir=tmp_path / "control", resolv_conf=resolv)
    try:
        env.prepare()
        target = rootfs / "run/systemd/resolve/stub-resolv.conf"
        assert str(target) in {e.mount_point for e in mounts_under(rootfs)}
        assert target.read_text() == FAKE_RESOLV
    finally:
        force_unmount(rootfs)


@pytest.mark.root
@root_only
def test_binds_are_slaves_so_unmounts_do_not_reach_the_host(rootfs: Path,
                                                             tmp_path: Path) -> None:
    # A shared source (as everything is under systemd): the bind must not join its peer group.
    control = tmp_path / "control"
    control.mkdir()
    subp.run(["mount", "-t", "tmpfs", "-o", "size=1m", "spotagent-test", str(control)])
    try:
        subp.run(["mount", "--make-shared", str(control)])
        env = Environment(rootfs, control_dir=control, resolv_conf=tmp_path / "nope")
        try:
            env.prepare()
            (bound,) = [e for e in mounts_under(rootfs)
                        if e.mount_point == str(rootfs / "run/spotagent")]
            assert not any(p.startswith("shared:") for p in bound.propagation)
            assert any(p.startswith("master:") for p in bound.propagation)
            (control / "deadline").write_text("soon")        # host -> chroot still works
            assert (rootfs / "run/spotagent/deadline").read_text() == "soon"
            env.teardown()
        finally:
            force_unmount(rootfs)
        assert str(control) in {e.mount_point for e in read_mountinfo()}
        assert not (rootfs / "etc/resolv.conf").exists()     # missing host file: skipped
    finally:
        subp.run(["umount", str(control)])


@pytest.mark.root
@root_only
def test_busy_mount_is_reported_then_lazily_detached(env: Environment, rootfs: Path,
                                                     tmp_path: Path) -> None:
    env.prepare()
    busy = Supervisor(["/bin/sleep", "30"], root=None, user=None, env={"PATH": "/bin"},
                      log_path=None, policy=RestartPolicy(budget=0),
                      cwd=str(rootfs / "dev/shm"))
    busy.start()
    try:
        with pytest.raises(ChrootTeardownError) as err:
            env.teardown()
        assert str(rootfs / "dev/shm") in str(err.value)
        env.teardown(lazy=True)
        assert mounts_under(rootfs) == []
    finally:
        busy.stop(time.monotonic() + 5)


@pytest.mark.root
@root_only
def test_a_failed_prepare_undoes_its_mounts(env: Environment, rootfs: Path) -> None:
    (rootfs / "run/spotagent").write_text("not a directory")     # the last mount fails
    with pytest.raises(ChrootMountError, match="wrong type") as err:
        env.prepare()
    assert "run/spotagent" in str(err.value)
    assert mounts_under(rootfs) == []
