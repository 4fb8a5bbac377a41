"""The image under QEMU (TCG): EC2's attach hot-plugs an NVMe disk whose serial is the volume id,
a spot notice drains, and the detach unplugs it.

Level 5 of the test pyramid: the guest runs its own kernel (Debian's cloud kernel from the
image), udev, systemd and the unit as built by Packer; the agent finds the volume by the NVMe
serial in sysfs, exactly as on a Nitro instance (no by-id link is made for it).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from pathlib import Path

import image as imagemod
import nspawn
import pytest
import qemu
from conftest import MOUNT_POINT_IN_IMAGE, STATE_DIR_IN_IMAGE, record, write_dropin

# Generous bounds to catch hangs: a cold first test also debootstraps and runs packer build.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

BOOT_TIMEOUT = 600   # TCG: no KVM on these machines


def _no_qemu() -> bool:
    return shutil.which("qemu-system-x86_64") is None


def wait_guest(vm: qemu.Vm, command: str, pred, *, timeout: float, what: str) -> str:
    end = time.monotonic() + timeout
    out = ""
    while time.monotonic() < end:
        proc = vm.ssh(command, check=False, timeout=60)
        out = proc.stdout
        if proc.returncode == 0 and pred(out):
            return out
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}: {out}\n"
                         + vm.ssh("systemctl status spotagent --no-pager --lines=30",
                                  check=False).stdout + vm.tail())


@pytest.mark.skipif(_no_qemu(), reason="qemu-system-x86_64 missing (make test-slow installs it)")
def test_under_qemu_attach_hot_plugs_nvme_and_the_release_unplugs_it(
        spotagent_image: imagemod.Image, tmp_path: Path) -> None:
    from agent_world import TRAINER_SETTINGS, busybox_image

    with contextlib.ExitStack() as stack:
        world = stack.enter_context(qemu.QemuWorld(tmp_path / "world"))
        snap = world.make_snapshot(busybox_image(tmp_path / "volume"))
        vid = world.make_pool_volumes("dl", 1, snapshot_id=snap)[0]
        serial = vid.replace("-", "")
        inst = world.launch(pool="dl", settings={
            "trainer": TRAINER_SETTINGS,
            "volume": {"mount_point": MOUNT_POINT_IN_IMAGE},
            "agent": {"state_dir": STATE_DIR_IN_IMAGE},
            "devices": {"by_id_dir": "/dev/disk/by-id", "timeout": 120},
            "pool": {"attach_timeout": 120},
        })
        config = inst.config_path.read_text().replace("127.0.0.1", qemu.HOST_FROM_GUEST)
        key = imagemod.ssh_key(tmp_path / "ssh")
        with nspawn.overlay(spotagent_image.lowers, tmp_path / "overlay") as root:
            (root / "etc/spotagent/config.toml").write_text(config)
            write_dropin(root)
            qemu.guest_files(root, key)
            vm = stack.enter_context(qemu.boot_vm(root, tmp_path / "vm", key))
        stack.callback(world.plane.remove_vm, inst.instance_id)
        world.plane.add_vm(inst.instance_id, vm.qmp)

        vm.wait_ssh(BOOT_TIMEOUT)
        wait_guest(vm, "systemctl is-active spotagent", lambda o: o.strip() == "active",
                   timeout=BOOT_TIMEOUT, what="spotagent READY in the guest")
        record("qemu: qemu start -> unit READY (host clock)", time.monotonic() - vm.started_at)
        ready_us = vm.ssh("systemctl show spotagent -p ActiveEnterTimestampMonotonic --value"
                          ).stdout.strip()
        record("qemu: guest boot -> unit READY (guest clock)", int(ready_us) / 1e6)
        assert world.plane.log == [f"plug {vid} into {inst.instance_id}"]
        serials = vm.ssh("cat /sys/class/nvme/*/serial").stdout.split()
        assert serials == [serial]
        found = vm.ssh(f"grep -l {serial} /sys/class/nvme/*/serial").stdout.strip()
        ctrl = found.split("/")[-2]
        st = wait_guest(vm, "/opt/spotagent/venv/bin/spotagent status --json",
                        lambda o: '"state": "training"' in o and '"step": ' in o,
                        timeout=300, what="training in the guest")
        assert re.search(rf'"device": "/dev/{ctrl}n1"', st), st
        assert vm.ssh(f"findmnt -n -o SOURCE {MOUNT_POINT_IN_IMAGE}").stdout.strip() == \
            f"/dev/{ctrl}n1"
        status = vm.ssh("systemctl status spotagent --no-pager", check=False).stdout
        assert "Active: active (running)" in status, status
        assert re.search(rf'Status: "training, volume {vid}', status), status

        # Unlike the containers, the guest enforces a unit's device policy (cgroup v2 BPF), so
        # a unit change that takes block devices away from the agent would fail here.
        probe = "systemd-run --wait --quiet {} head -c1 /dev/vda >/dev/null"
        assert vm.ssh(probe.format(""), check=False).returncode == 0
        assert vm.ssh(probe.format("-p DevicePolicy=closed"), check=False).returncode != 0

        noticed = time.monotonic()
        world.imds.fire_spot_action(inst.instance_id, "terminate")
        end = time.monotonic() + 300
        while time.monotonic() < end:
            vol = world.volume(vid)
            if vol["State"] == "available" and "spotagent:owner" not in vol["TagMap"]:
                break
            time.sleep(0.5)
        record("qemu: spot notice -> volume available (unplugged)", time.monotonic() - noticed)
        vol = world.volume(vid)
        assert vol["State"] == "available", vm.ssh("journalctl -u spotagent --no-pager -n 60",
                                                   check=False).stdout
        assert int(vol["TagMap"]["spotagent:checkpoint-step"]) >= 1
        assert world.plane.log == [f"plug {vid} into {inst.instance_id}",
                                   f"unplug {vid} from {inst.instance_id}"]
        assert vm.ssh("cat /sys/class/nvme/*/serial", check=False).stdout.split() == []
        wait_guest(vm, "systemctl show spotagent -p ActiveState --value",
                   lambda o: o.strip() == "inactive", timeout=120, what="unit inactive")
        journal = vm.ssh("journalctl -u spotagent --no-pager -o cat").stdout
        # The agent unmounted before it detached (EC2 took the device away after that).
        unmounted = journal.index('"event": "unmounted"')
        assert unmounted < journal.index('"event": "volume_released"')
