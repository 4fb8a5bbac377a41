"""The image under QEMU (TCG): a real kernel, udev and NVMe hot-plug driven by the emulated EC2.

`QemuWorld` is a `World` whose device plane, for instances that are QEMU guests, hot-plugs the
volume's image file as an NVMe controller whose serial is the volume id without its dash
(`device_add nvme,serial=vol…` over QMP) when EC2 completes an attach, and unplugs it
(`device_del`, then `blockdev-del`) when a detach starts — what a Nitro instance sees. Other
instances keep the loop-device behaviour.

`boot_vm()` builds the guest's root disk (mkfs.ext4 -d of the image with the instance's files
on top), starts `qemu-system-x86_64 -accel tcg` with the image's own kernel and initrd, user
networking (the guest reaches the host's 127.0.0.1 emulators as 10.0.2.2, and its sshd is
forwarded to a free port of the host's loopback) and a QMP socket; the QEMU process is always
killed on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nspawn

from spotagent.testbed import images
from spotagent.testbed.devices import DevicePlane, DevicePlaneError
from spotagent.testbed.world import World

HOST_FROM_GUEST = "10.0.2.2"   # QEMU user networking: the host's loopback
# Baseline x86-64: under TCG the guest boots to READY about twice as fast as with "max", whose
# AVX paths (taken by glibc and Python) TCG emulates slowly. SPOTAGENT_QEMU_CPU overrides.
CPU = "qemu64"


class QmpError(AssertionError):
    pass


class Qmp:
    """A minimal QMP client: one command at a time, events kept for `wait_event`."""

    def __init__(self, path: Path, timeout: float = 30) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        end = time.monotonic() + timeout
        while True:
            try:
                self.sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        self.file = self.sock.makefile("rb")
        self.lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self._read()  # greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        line = self.file.readline()
        if not line:
            raise QmpError("QMP connection closed")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        with self.lock:
            msg: dict[str, Any] = {"execute": command}
            if arguments:
                msg["arguments"] = arguments
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
            while True:
                doc = self._read()
                if "event" in doc:
                    self.events.append(doc)
                    continue
                if "error" in doc:
                    raise QmpError(f"{command}: {doc['error']}")
                return doc.get("return")

    def wait_event(self, name: str, timeout: float, **data: str) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                for i, ev in enumerate(self.events):
                    if ev["event"] == name and all(ev.get("data", {}).get(k) == v
                                                   for k, v in data.items()):
                        return self.events.pop(i)
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise QmpError(f"no {name} {data} within {timeout:g} s")
                self.sock.settimeout(remaining)
                try:
                    doc = self._read()
                except TimeoutError:
                    continue
                finally:
                    self.sock.settimeout(30)
                if "event" in doc:
                    self.events.append(doc)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class QemuDevicePlane(DevicePlane):
    """Volumes of QEMU guests are NVMe controllers hot-plugged over QMP; others loop devices."""

    def __init__(self, image_dir: Path) -> None:
        super().__init__(image_dir)
        self.vms: dict[str, Qmp] = {}
        self.plugged: dict[str, str] = {}        # volume id -> instance id
        self.log: list[str] = []                 # what was plugged and unplugged, in order

    def add_vm(self, instance_id: str, qmp: Qmp) -> None:
        with self._lock:
            self.vms[instance_id] = qmp

    def remove_vm(self, instance_id: str) -> None:
        with self._lock:
            self.vms.pop(instance_id, None)
            for vid, iid in list(self.plugged.items()):
                if iid == instance_id:
                    del self.plugged[vid]

    @staticmethod
    def node(volume_id: str) -> str:
        return volume_id.replace("-", "")          # vol<17 hex>: also the NVMe serial

    def on_attach(self, instance_id: str, volume_id: str) -> Path:
        with self._lock:
            qmp = self.vms.get(instance_id)
            if qmp is None:
                return super().on_attach(instance_id, volume_id)
            if volume_id in self.plugged:
                raise DevicePlaneError("volume already plugged", volume_id=volume_id)
            image = self.image_path(volume_id)
            node = self.node(volume_id)
            qmp.execute("blockdev-add", {"driver": "raw", "node-name": node,
                                         "file": {"driver": "file", "filename": str(image)}})
            qmp.execute("device_add", {"driver": "nvme", "id": f"dev-{node}", "drive": node,
                                       "serial": node})
            self.plugged[volume_id] = instance_id
            self.log.append(f"plug {volume_id} into {instance_id}")
            return image

    def on_detach(self, instance_id: str, volume_id: str, *, force: bool = False) -> None:
        with self._lock:
            owner = self.plugged.get(volume_id)
            qmp = self.vms.get(instance_id)
            if owner is None or qmp is None:
                super().on_detach(instance_id, volume_id, force=force)
                return
            if owner != instance_id:
                raise DevicePlaneError("volume plugged into another instance",
                                       volume_id=volume_id, owner=owner)
            node = self.node(volume_id)
            qmp.execute("device_del", {"id": f"dev-{node}"})
            # The guest acknowledges the ACPI eject; only then is the controller gone.
            qmp.wait_event("DEVICE_DELETED", 60, device=f"dev-{node}")
            qmp.execute("blockdev-del", {"node-name": node})
            del self.plugged[volume_id]
            self.log.append(f"unplug {volume_id} from {instance_id}")


class QemuWorld(World):
    def __init__(self, workdir: Path, **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.plane = QemuDevicePlane(workdir / "images")
        self.ec2.device_plane = self.plane


@dataclass
class Vm:
    proc: subprocess.Popen[bytes]
    qmp: Qmp
    ssh_port: int
    key: Path
    console: Path
    started_at: float
    _closed: bool = field(default=False, repr=False)

    def ssh(self, command: str, *, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = ["ssh", "-i", str(self.key), "-p", str(self.ssh_port), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5", "root@127.0.0.1",
                "SYSTEMD_COLORS=0 COLUMNS=500 " + command]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"guest: {command} exited {proc.returncode}:\n"
                                 f"{proc.stdout}{proc.stderr}")
        return proc

    def wait_ssh(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        last = ""
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"qemu exited {self.proc.returncode}:\n{self.tail()}")
            proc = self.ssh("true", check=False, timeout=30)
            if proc.returncode == 0:
                return
            last = proc.stderr
            time.sleep(1)
        raise AssertionError(f"no ssh into the guest in {timeout:g} s ({last}):\n{self.tail()}")

    def tail(self) -> str:
        try:
            return self.console.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(QmpError, OSError):
            self.qmp.execute("quit")
        self.qmp.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def kernel_and_initrd(root: Path) -> tuple[Path, Path]:
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    initrds = sorted((root / "boot").glob("initrd.img-*"))
    if not kernels or not initrds:
        raise AssertionError(f"no kernel/initrd in {root}/boot (is linux-image in the base?)")
    return kernels[-1], initrds[-1]


def guest_files(root: Path, key: Path) -> None:
    """What a VM needs beyond a container: DHCP on its NIC, and ssh for the test."""
    net = root / "etc/systemd/network/10-dhcp.network"
    net.parent.mkdir(parents=True, exist_ok=True)
    net.write_text("[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n")
    subprocess.run(["systemctl", f"--root={root}", "enable", "systemd-networkd.service",
                    "systemd-networkd-wait-online.service"], check=True, capture_output=True,
                   timeout=60)
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
    (ssh_dir / "authorized_keys").chmod(0o600)
    (root / "etc/hostname").write_text("spotagent-vm\n")


def root_disk(root: Path, disk: Path) -> Path:
    size_mib = images.image_size_mib(images.content_bytes(root), 0.5)
    with open(disk, "xb") as f:
        f.truncate(size_mib * 1024 * 1024)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "root", "-d", str(root), str(disk)],
                   check=True, capture_output=True, timeout=900)
    return disk


@contextlib.contextmanager
def boot_vm(root: Path, work: Path, key: Path, *, memory_mib: int = 1536,
            cpus: int = 2) -> Iterator[Vm]:
    """Boot the directory `root` as a VM (its own kernel); QEMU is killed on exit."""
    kernel, initrd = kernel_and_initrd(root)
    work.mkdir(parents=True, exist_ok=True)
    boot_dir = work / "boot"
    boot_dir.mkdir(exist_ok=True)
    kernel = Path(shutil.copy(kernel, boot_dir))
    initrd = Path(shutil.copy(initrd, boot_dir))
    disk = root_disk(root, work / "root.img")
    port = nspawn.free_port()
    qmp_path = work / "qmp.sock"
    console = work / "console.log"
    argv = ["qemu-system-x86_64", "-machine", "pc", "-accel", "tcg,thread=multi",
            "-cpu", os.environ.get("SPOTAGENT_QEMU_CPU", CPU), "-smp", str(cpus),
            "-m", str(memory_mib), "-nodefaults",
            "-display", "none", "-no-reboot",
            "-kernel", str(kernel), "-initrd", str(initrd),
            "-append", "root=/dev/vda rw console=ttyS0 panic=-1 net.ifnames=0",
            "-drive", f"file={disk},if=virtio,format=raw",
            "-netdev", f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:22",
            "-device", "virtio-net-pci,netdev=n0",
            "-serial", f"file:{console}",
            "-qmp", f"unix:{qmp_path},server=on,wait=off"]
    started = time.monotonic()
    with open(work / "qemu.err", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
    vm: Vm | None = None
    try:
        vm = Vm(proc, Qmp(qmp_path), port, key, console, started)
        yield vm
    finally:
        if vm is not None:
            vm.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        disk.unlink(missing_ok=True)
