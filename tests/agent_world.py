"""Helpers for tests that run real `spotagent run` processes in the emulated world."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from spotagent import status as statusmod
from spotagent.testbed.rootfs import build_busybox_root
from spotagent.testbed.world import Instance, World, make_fs_image

# A trainer that speaks the agent's protocol in busybox sh: one step every 0.1 s, a checkpoint
# (the step number, committed by rename) on SIGUSR1 (continue) and SIGTERM (exit 0), progress in
# the control directory, and resume from the committed step.
FAKE_TRAINER = r"""#!/bin/sh
ck="$SPOTAGENT_CHECKPOINT_DIR"; ctl="$SPOTAGENT_CONTROL_DIR"
step=0; [ -f "$ck/step" ] && step=$(cat "$ck/step")
committed=$step
echo "resumed from $step restart=$SPOTAGENT_RESTART_COUNT run=$SPOTAGENT_RUN_ID uid=$(id -u)"
term=0; usr=0
trap 'term=1' TERM
trap 'usr=1' USR1
progress() {
  f='{"step": %d, "samples_per_s": 10.0, "loss": 0.5, "last_committed_step": %d, '
  f="$f"'"last_commit_time": %s, "state": "training"}'
  printf "$f" "$step" "$committed" "$(date +%s)" > "$ctl/.progress.tmp"
  mv "$ctl/.progress.tmp" "$ctl/progress.json"
}
commit() {
  echo "$step" > "$ck/.step.tmp" && mv "$ck/.step.tmp" "$ck/step"; committed=$step
  echo "committed $step"; progress
}
[ -f /fail-on-start ] && { echo "configured to crash"; exit 3; }
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


def busybox_image(tmp: Path, *, extra: Callable[[Path], None] | None = None) -> Path:
    root = build_busybox_root(tmp / "rootfs")
    (root / "opt").mkdir(exist_ok=True)
    script = root / "opt" / "trainer.sh"
    script.write_text(FAKE_TRAINER)
    script.chmod(0o755)
    if extra is not None:
        extra(root)
    return make_fs_image(tmp / "rootfs.img", root, size_mib=64)


class Agent:
    """A real `spotagent run` process of one emulated instance."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.log = inst.home / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        out = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(self.inst.agent_argv("run"), env=self.inst.agent_env(),
                                     stdout=out, stderr=subprocess.STDOUT)
        out.close()
        return self

    def status(self) -> statusmod.AgentStatus | None:
        try:
            return statusmod.read(self.inst.state_dir)
        except statusmod.StatusError:
            return None

    def wait_for(self, pred: Callable[[statusmod.AgentStatus], bool], timeout: float = 60,
                 what: str = "condition") -> statusmod.AgentStatus:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            if st is not None and pred(st):
                return st
            if self.proc is not None and self.proc.poll() is not None and (
                    st is None or not pred(st)):
                raise AssertionError(f"agent exited {self.proc.returncode} before {what}:\n"
                                     + self.output())
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; status={self.status()}\n"
                             + self.output())

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("agent did not exit:\n" + self.output()) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextmanager
def running(inst: Instance) -> Iterator[Agent]:
    agent = Agent(inst).start()
    try:
        yield agent
    finally:
        agent.kill()


def cleanup_instance(world: World, inst: Instance) -> None:
    """Undo what a test's agents may have left (mounts under the instance's home)."""
    from loopdev import unmount_under

    from spotagent.runner import stop_strays

    stop_strays(inst.mount_point, grace=1.0)
    unmount_under(inst.home)
