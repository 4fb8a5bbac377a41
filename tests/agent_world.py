"""Helpers for tests that run real `spotagent run` processes in the emulated world.

Everything here is real: the agents are `python -m spotagent run` processes of emulated
instances, talking HTTP to the IMDS and strict EC2 emulators; volumes are loop devices on file
system images; the trainer is a shell script chrooted into a busybox root on the volume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotagent import status as statusmod
from spotagent.testbed.rootfs import build_busybox_root
from spotagent.testbed.world import Instance, World, make_fs_image

if TYPE_CHECKING:
    import pytest

# A trainer that speaks the agent's protocol in busybox sh: one step every 0.1 s, a checkpoint
# (the step number, committed by rename) on SIGUSR1 (continue) and SIGTERM (exit 0), progress in
# the control directory, and resume from the committed step. Knobs (trainer.env):
#   MAX_STEPS=N       exit 0 after step N (job complete)
#   FAIL=1            exit 3 at once (as does a /fail-on-start file in the root)
#   IGNORE_TERM=1     log SIGTERM and carry on training (killed at the deadline)
#   COMMIT_SECONDS=S  a checkpoint takes S seconds (a drain that can be watched)
FAKE_TRAINER = r"""#!/bin/sh
ck="$SPOTAGENT_CHECKPOINT_DIR"; ctl="$SPOTAGENT_CONTROL_DIR"
step=0; [ -f "$ck/step" ] && step=$(cat "$ck/step")
committed=$step
echo "resumed from $step restart=$SPOTAGENT_RESTART_COUNT run=$SPOTAGENT_RUN_ID uid=$(id -u)"
term=0; usr=0
if [ "${IGNORE_TERM:-0}" = 1 ]; then
  trap 'echo "signal TERM ignored"' TERM
else
  trap 'term=1; echo "signal TERM"' TERM
fi
trap 'usr=1; echo "signal USR1"' USR1
progress() {
  f='{"step": %d, "samples_per_s": 10.0, "loss": 0.5, "last_committed_step": %d, '
  f="$f"'"last_commit_time": %s, "state": "training"}'
  printf "$f" "$step" "$committed" "$(date +%s)" > "$ctl/.progress.tmp"
  mv "$ctl/.progress.tmp" "$ctl/progress.json"
}
commit() {
  [ "${COMMIT_SECONDS:-0}" != 0 ] && sleep "$COMMIT_SECONDS"
  echo "$step" > "$ck/.step.tmp" && mv "$ck/.step.tmp" "$ck/step"; committed=$step
  echo "committed $step"; progress
}
if [ -f /fail-on-start ] || [ "${FAIL:-0}" = 1 ]; then echo "configured to crash"; exit 3; fi
while [ "$step" -lt "${MAX_STEPS:-100000}" ]; do
  step=$((step + 1)); echo "step $step"; progress
  sleep 0.1
  [ "$usr" = 1 ] && { commit; usr=0; }
  [ "$term" = 1 ] && { commit; exit 0; }
done
commit
exit 0
"""

TRAINER_SETTINGS: dict[str, Any] = {
    "command": ["/bin/sh", "/opt/trainer.sh"],
    "user": "trainer",
    "checkpoint_dir": "/home/trainer/ckpt",
    "restart_backoff": 0.2,
}
TRAINER_LOG = "var/log/spotagent/trainer.log"
# A file every pool volume of these tests carries: "nothing lost" means it is still there.
PRECIOUS = "data/precious.txt"
PRECIOUS_TEXT = "results of a week of training\n"


def busybox_image(tmp: Path, *, extra: Callable[[Path], None] | None = None) -> Path:
    root = build_busybox_root(tmp / "rootfs")
    (root / "opt").mkdir(exist_ok=True)
    script = root / "opt" / "trainer.sh"
    script.write_text(FAKE_TRAINER)
    script.chmod(0o755)
    (root / PRECIOUS).parent.mkdir(parents=True, exist_ok=True)
    (root / PRECIOUS).write_text(PRECIOUS_TEXT)
    if extra is not None:
        extra(root)
    return make_fs_image(tmp / "rootfs.img", root, size_mib=64)


def empty_fs_image(tmp: Path) -> Path:
    """An ext4 file system with nothing in it: no root to chroot into."""
    src = tmp / "empty"
    src.mkdir(parents=True, exist_ok=True)
    return make_fs_image(tmp / "empty.img", src, size_mib=64)


_IMAGES: dict[str, Path] = {}


def shared_image(factory: pytest.TempPathFactory, name: str,
                 build: Callable[[Path], Path]) -> Path:
    """An image built once per test session (snapshots copy it; it is never mounted)."""
    if name not in _IMAGES or not _IMAGES[name].exists():
        _IMAGES[name] = build(factory.mktemp(f"image-{name}"))
    return _IMAGES[name]


@contextmanager
def emulated_world(tmp_path: Path, **kwargs: Any) -> Iterator[World]:
    """A started World whose instances are cleaned up (agents, strays, mounts) on exit."""
    w = World(tmp_path / "world", **kwargs).start()
    try:
        yield w
    finally:
        try:
            for agent in list(Agent.started):
                agent.kill()
            Agent.started.clear()
            for inst in w.instances.values():
                cleanup_instance(w, inst)
        finally:
            w.close()


def pool_volumes(world: World, image: Path, pool: str = "dl", count: int = 1) -> list[str]:
    return world.make_pool_volumes(pool, count, snapshot_id=world.make_snapshot(image))


def settings(**sections: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Config sections for `world.launch`: the fake trainer, plus `sections` merged in."""
    out: dict[str, dict[str, Any]] = {"trainer": dict(TRAINER_SETTINGS)}
    for name, values in sections.items():
        out.setdefault(name, {}).update(values)
    return out


class Agent:
    """A real `spotagent run` process of one emulated instance."""

    started: list[Agent] = []

    def __init__(self, inst: Instance, env: Mapping[str, str] | None = None) -> None:
        self.inst = inst
        self.log = inst.home / "agent.log"
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    def start(self) -> Agent:
        self._log_offset = self.log.stat().st_size if self.log.exists() else 0
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        env = {**self.inst.agent_env(), **self.env}
        self.proc = subprocess.Popen(self.inst.agent_argv("run"), env=env,
                                     stdout=out, stderr=subprocess.STDOUT)
        out.close()
        Agent.started.append(self)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self) -> statusmod.AgentStatus | None:
        try:
            return statusmod.read(self.inst.state_dir)
        except statusmod.StatusError:
            return None

    def wait_for(self, pred: Callable[[statusmod.AgentStatus], bool], timeout: float = 60,
                 what: str = "condition") -> statusmod.AgentStatus:
        """Wait until the state file satisfies `pred` (written by this very process)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            if st is not None and st.agent_pid == self.pid and pred(st):
                return st
            if self.proc is not None and self.proc.poll() is not None:
                st = self.status()
                if st is not None and st.agent_pid == self.pid and pred(st):
                    return st
                raise AssertionError(f"agent exited {self.proc.returncode} before {what}:\n"
                                     + self.output())
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; status={self.status()}\n"
                             + self.output())

    def training_past(self, step: int, timeout: float = 60) -> statusmod.AgentStatus:
        return self.wait_for(lambda s: s.state == "training" and (s.step or 0) >= step,
                             timeout=timeout, what=f"training at step {step}")

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("agent did not exit:\n" + self.output()) from None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def crash(self) -> None:
        """SIGKILL: the agent dies without a chance to clean up."""
        self.signal(signal.SIGKILL)
        assert self.wait_exit(10) == -signal.SIGKILL

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-8000:] if self.log.exists() else ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """This run's structlog events (JSON lines of its output), optionally one name."""
        out = []
        with open(self.log, "rb") as f:
            f.seek(self._log_offset)
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and (name is None or doc.get("event") == name):
                out.append(doc)
        return out

    def cli(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """Another spotagent command of this instance (status, drain, release)."""
        return run_cli(self.inst, *args, timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def run_cli(inst: Instance, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(inst.agent_argv(*args), env=inst.agent_env(), capture_output=True,
                          text=True, timeout=timeout)


@contextmanager
def running(inst: Instance, env: Mapping[str, str] | None = None) -> Iterator[Agent]:
    agent = Agent(inst, env).start()
    try:
        yield agent
    finally:
        agent.kill()


def trainer_log(inst: Instance) -> str:
    """The trainer's log on the volume (while it is mounted)."""
    return (inst.mount_point / TRAINER_LOG).read_text(errors="replace")


def mounts_under(path: Path) -> list[str]:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == real or p.startswith(real + "/")]


def volume_files(world: World, volume_id: str, *paths: str) -> dict[str, str | None]:
    """Files on a detached volume, read with debugfs from its image (no mount needed)."""
    image = world.plane.image_path(volume_id)
    out: dict[str, str | None] = {}
    for path in paths:
        proc = subprocess.run(["debugfs", "-R", f"cat /{path}", str(image)],
                              capture_output=True, text=True, timeout=60)
        out[path] = proc.stdout if proc.returncode == 0 and "not found" not in (
            proc.stderr or "") else None
    return out


def assert_released(world: World, inst: Instance, volume_id: str, *,
                    generation: int | None = None) -> dict[str, Any]:
    """The volume is back in the pool and nothing of it is left on the instance: available,
    no owner tag, no device, nothing mounted under the instance, no device-plane violation."""
    vol = world.volume(volume_id)
    assert vol["State"] == "available", vol
    assert "spotagent:owner" not in vol["TagMap"], vol["TagMap"]
    if generation is not None:
        assert vol["TagMap"].get("spotagent:generation") == str(generation), vol["TagMap"]
    assert world.plane.device_of(volume_id) is None
    assert mounts_under(inst.home) == []
    assert world.plane.violations == []
    return dict(vol["TagMap"])


def attachments(world: World, volume_id: str) -> list[dict[str, Any]]:
    return [a for a in world.volume(volume_id).get("Attachments", [])
            if a.get("State") != "detached"]


def cleanup_instance(world: World, inst: Instance) -> None:
    """Undo what a test's agents may have left (strays in the chroot, mounts under the
    instance's home)."""
    from loopdev import unmount_under

    from spotagent.runner import stop_strays

    stop_strays(inst.mount_point, grace=1.0)
    unmount_under(inst.home)
