"""Fixtures of the systemd tier: the Packer-built image, and emulated instances that boot it.

`spotagent_image` (session): the wheelhouse, then the image provisioned by
`packer build -only=null.local` (cached, see image.py).

`boot_instance` (function): a factory. Each call makes an emulated instance in a fresh `World`
(IMDS + strict EC2 + device plane on 127.0.0.1), writes its config into a fresh overlay of the
image (paths as on an AMI: /dev/disk/by-id, /mnt/spotagent, /run/spotagent), gives the unit the
emulator's credentials in a drop-in (never in the shipped unit), and boots the image with
systemd as PID 1. The instance's by-id link directory is bind-mounted at /dev/disk/by-id and a
`LoopRelay` makes the loop devices' nodes in the container's /dev. Teardown powers the
container off (the agent drains as on a real shutdown), kills what is left, unmounts the
overlay and closes the world (loop devices), also when the test failed.

Nothing here runs at import time: `make unit` collects this directory and deselects it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # agent_world, loopdev

import image as imagemod
import nspawn

TIMINGS: dict[str, list[float]] = {}

# Paths inside the image, as the AMI's config has them.
BY_ID_IN_IMAGE = "/dev/disk/by-id"
MOUNT_POINT_IN_IMAGE = "/mnt/spotagent"
STATE_DIR_IN_IMAGE = "/run/spotagent"


def record(name: str, seconds: float) -> None:
    TIMINGS.setdefault(name, []).append(seconds)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TIMINGS:
        return
    terminalreporter.section("systemd tier timings")
    for name, values in TIMINGS.items():
        vals = sorted(values)
        terminalreporter.write_line(
            f"{name}: median {vals[len(vals) // 2]:.2f} s, min {vals[0]:.2f} s, "
            f"max {vals[-1]:.2f} s (n={len(vals)})")


def _requirements() -> str | None:
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn, overlay and loop devices)"
    for tool in ("systemd-nspawn", "debootstrap", "packer", "nsenter", "ssh-keygen"):
        if not any((Path(d) / tool).exists() for d in os.environ.get("PATH", "").split(":")):
            return f"{tool} is not installed (make setup installs it)"
    return None


@pytest.fixture(scope="session")
def spotagent_image(tmp_path_factory: pytest.TempPathFactory) -> imagemod.Image:
    why = _requirements()
    if why:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("image")
    start = time.monotonic()
    wheelhouse = imagemod.build_wheelhouse(work / "wheelhouse")
    record("wheelhouse build", time.monotonic() - start)
    img = imagemod.provisioned_image(wheelhouse, work)
    record("image (packer build)" if img.built_now else "image (cache hit)", img.seconds)
    return img


@dataclass
class Machine:
    """One emulated instance booted from the image."""

    world: Any                      # spotagent.testbed.world.World
    inst: Any                       # spotagent.testbed.world.Instance
    box: nspawn.Container
    root: Path                      # the overlay's merged directory (the image, writable)
    volume_id: str | None

    UNIT = "spotagent.service"

    def agent_status(self) -> Any:
        from spotagent import status as statusmod

        try:
            return statusmod.read(self.box.host_path(STATE_DIR_IN_IMAGE))
        except statusmod.StatusError:
            return None

    def wait_for(self, pred: Callable[[Any], bool], *, timeout: float = 90,
                 what: str = "condition") -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.agent_status()
            if st is not None and pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; status={self.agent_status()}\n"
                             + self.diagnostics())

    def unit(self, *props: str) -> dict[str, str]:
        return self.box.show(self.UNIT, *props)

    def wait_unit(self, pred: Callable[[dict[str, str]], bool], *props: str,
                  timeout: float = 90, what: str = "unit state") -> dict[str, str]:
        props = props or ("ActiveState", "SubState", "Result", "NRestarts", "MainPID")
        end = time.monotonic() + timeout
        seen: dict[str, str] = {}
        while time.monotonic() < end:
            try:
                seen = self.unit(*props)
            except nspawn.ContainerError as exc:  # PID 1 not answering on its bus yet
                seen = {"error": str(exc).strip().splitlines()[-1]}
            if "error" not in seen and pred(seen):
                return seen
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; unit={seen}\n" + self.diagnostics())

    def wait_ready(self, timeout: float = 120) -> float:
        """Wait for READY=1 (the unit active); return seconds from container start."""
        props = self.wait_unit(lambda p: p["ActiveState"] == "active", "ActiveState",
                               "ActiveEnterTimestampMonotonic", timeout=timeout,
                               what="READY=1 (unit active)")
        ready = (self.box.monotonic_of(props["ActiveEnterTimestampMonotonic"])
                 - self.box.started_at)
        if self.volume_id is not None:  # READY with the trainer running, not while waiting
            record("container start -> unit READY", ready)
        return ready

    def volume(self) -> dict[str, Any]:
        assert self.volume_id is not None
        return dict(self.world.volume(self.volume_id))

    def diagnostics(self) -> str:
        out = []
        with contextlib.suppress(Exception):
            out.append(self.box.status(self.UNIT, lines=0))
            out.append("journal:\n" + self.box.journal(self.UNIT)[-5000:])
        with contextlib.suppress(Exception):
            log = self.box.host_path(MOUNT_POINT_IN_IMAGE) / "var/log/spotagent/trainer.log"
            out.append("trainer log:\n" + log.read_text()[-1500:])
        out.append("console:\n" + self.box.console()[-1500:])
        return "\n".join(out)


def write_dropin(root: Path) -> None:
    """The emulator's fake credentials for the unit: a drop-in the test adds, never the unit."""
    from spotagent.testbed.world import FAKE_CREDENTIALS

    dropin = root / "etc/systemd/system/spotagent.service.d/testbed.conf"
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text("# Written by the systemd tier: credentials the EC2 emulator accepts.\n"
                      "[Service]\n"
                      + "".join(f"Environment={k}={v}\n" for k, v in FAKE_CREDENTIALS.items()))


def mask(root: Path, *units: str) -> None:
    for unit in units:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")


@pytest.fixture
def boot_instance(spotagent_image: imagemod.Image, tmp_path: Path
                  ) -> Iterator[Callable[..., Machine]]:
    from agent_world import TRAINER_SETTINGS, busybox_image

    from spotagent.testbed.world import World

    stack = contextlib.ExitStack()
    counter = iter(range(100))

    def start(*, config_text: Callable[[str], str] | None = None, with_volume: bool = True,
              volume_extra: Callable[[Path], None] | None = None,
              unit_override: str | None = None) -> Machine:
        """Boot one instance. `config_text` edits its config; `volume_extra` adds files to the
        volume's root; `unit_override` is a [Service] drop-in of the test (never shipped)."""
        n = next(counter)
        work = tmp_path / f"m{n}"
        world = stack.enter_context(World(work / "world"))
        volume_id = None
        if with_volume:
            snap = world.make_snapshot(busybox_image(work / "volume", extra=volume_extra))
            volume_id = world.make_pool_volumes("dl", 1, snapshot_id=snap)[0]
        inst = world.launch(pool="dl", settings={
            "trainer": TRAINER_SETTINGS,
            "devices": {"by_id_dir": BY_ID_IN_IMAGE},
            "volume": {"mount_point": MOUNT_POINT_IN_IMAGE},
            "agent": {"state_dir": STATE_DIR_IN_IMAGE},
        })
        text = inst.config_path.read_text()
        if config_text is not None:
            text = config_text(text)
        root = stack.enter_context(nspawn.overlay(spotagent_image.lowers, work / "overlay"))
        (root / "etc/spotagent/config.toml").write_text(text)
        write_dropin(root)
        if unit_override is not None:
            override = root / "etc/systemd/system/spotagent.service.d/test-override.conf"
            override.write_text(f"[Service]\n{unit_override}\n")
        mask(root, "ssh.service", "ssh.socket")  # would listen on the host's port 22
        box = stack.enter_context(nspawn.boot(
            root, machine=f"spotagent-{os.getpid()}-{n}", log_path=work / "console.log",
            binds=[(inst.by_id_dir, BY_ID_IN_IMAGE)], relay_loops=True))
        return Machine(world, inst, box, root, volume_id)

    try:
        yield start
    finally:
        stack.close()


STATUS_LINE = re.compile(r'^\s*Status: "(?P<text>[^"]*)"', re.M)


def status_line(status_text: str) -> str | None:
    m = STATUS_LINE.search(status_text)
    return m.group("text") if m else None
