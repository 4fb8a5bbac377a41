"""`spotagent demo`: one spot interruption end to end on this machine, with its figures.

Emulated AWS (IMDS, strict EC2, loop devices as EBS volumes), everything else real: a pool
volume that starts as a copy of a Debian root with torch and the reference trainer
(`testbed.images.torch_image`, built once and cached), instance A's `spotagent run` claims it,
mounts it, chroots and trains; a spot notice makes A commit and release; instance B claims the
same volume and resumes at the next step; `spotagent drain` ends B. The demo prints each
timeline and the figures against their targets, and leaves nothing mounted or attached.

This module's one job is driving that scenario: it starts agent processes and reads what they
report (state files, logs, the trainer's log on the volume); the agents do the work. The bench
(`bench/lifecycle.py`) reuses the same pieces to repeat the measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from spotagent import log as logmod
from spotagent import status as statusmod
from spotagent.errors import SpotagentError

POOL = "demo"
CHECKPOINT_EVERY = 20
NOTICE_AT_STEP = 40
TRAINER_LOG = "var/log/spotagent/trainer.log"
# A small ResNet on 32x32 synthetic images, one CPU thread: a step takes about 0.2 s and a
# checkpoint (weights, momentum, RNG and data-order state) is about 10 MB.
TORCH_COMMAND = (
    "python3", "-m", "spottrainer.train", "--image-size", "32", "--width", "32", "--depth", "1",
    "--num-classes", "10", "--batch-size", "32", "--dataset-size", "100000",
    "--steps", "1000000", "--checkpoint-every-steps", str(CHECKPOINT_EVERY),
    "--log-every", "1", "--threads", "1", "--keep", "2",
)
# The product's default poll interval (the testbed's config uses a faster one for tests): the
# agent's CPU figure is that of a real configuration.
AGENT_SETTINGS: dict[str, dict[str, Any]] = {"imds": {"poll_interval": 0.5}}

# Targets of the issue "The whole boot ... and `make demo`".
COMMIT_FACTOR = 1.15
COMMIT_SLACK_S = 1.0
RELEASE_TARGET_S = 5.0
AGENT_OWN_TARGET_S = 2.0
CPU_TARGET_PCT = 0.5
RSS_TARGET_MB = 60.0
USAGE_WINDOW_S = 10.0

Say = Callable[[str], None]


class DemoError(SpotagentError):
    """The demo saw something go wrong (it cleans up, then exits non-zero)."""


class DemoStopped(DemoError):
    """SIGTERM arrived: the demo stops at its next wait and cleans up."""


# Set by the SIGTERM handler (which does nothing else); every wait of the demo checks it, so a
# `timeout`, a CI cancel or a systemd stop still ends with nothing mounted or attached.
_stop = threading.Event()


def _on_term(_signum: int, _frame: FrameType | None) -> None:
    _stop.set()


def install_stop_handler() -> None:
    signal.signal(signal.SIGTERM, _on_term)


def check_stop() -> None:
    if _stop.is_set():
        raise DemoStopped("stopped by SIGTERM")


def say(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --- agent processes --------------------------------------------------------------------------


class AgentRun:
    """One instance's `spotagent run` process and what it reports."""

    def __init__(self, label: str, inst: Any) -> None:
        self.label = label
        self.inst = inst
        self.log_path: Path = inst.home / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.exec_time = 0.0

    def start(self) -> AgentRun:
        with open(self.log_path, "ab") as out:
            self.exec_time = time.time()
            self.proc = subprocess.Popen(  # noqa: S603 - our own argv
                self.inst.agent_argv("run"), env=self.inst.agent_env(), stdout=out,
                stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self) -> statusmod.AgentStatus | None:
        try:
            return statusmod.read(self.inst.state_dir)
        except statusmod.StatusError:
            return None  # being replaced right now; the next read sees it

    def wait_for(self, pred: Callable[[statusmod.AgentStatus], bool], *, timeout: float,
                 what: str) -> statusmod.AgentStatus:
        end = time.monotonic() + timeout
        while True:
            st = self.status()
            if st is not None and pred(st):
                return st
            if self.proc is not None and self.proc.poll() is not None:
                raise DemoError(f"agent {self.label} exited with {self.proc.returncode} "
                                f"before {what}", state=st.state if st else "-",
                                error=(st.error if st else None) or "-", log=self.log_path)
            if time.monotonic() >= end:
                raise DemoError(f"agent {self.label}: timed out waiting for {what}",
                                state=st.state if st else "-", log=self.log_path)
            check_stop()
            time.sleep(0.05)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return _wait_process(self.proc, timeout, f"agent {self.label}")

    def events(self) -> list[dict[str, Any]]:
        """The agent's JSON log events (its stderr is a file, so it logs JSON lines)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def trainer_segments(self) -> list[Segment]:
        """The trainer's runs under this agent, from the output lines the agent logged."""
        lines = [str(e.get("line", "")) for e in self.events()
                 if e.get("event") == "trainer_output"]
        return trainer_segments("\n".join(lines))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


# --- measurements -----------------------------------------------------------------------------


def _wait_process(proc: subprocess.Popen[Any], timeout: float, what: str) -> int:
    end = time.monotonic() + timeout
    while (code := proc.poll()) is None:
        if time.monotonic() >= end:
            raise DemoError(f"{what} did not exit within {timeout:g} s")
        check_stop()
        time.sleep(0.05)
    return code


def fsync_write_bandwidth(directory: Path, nbytes: int, *, repeats: int = 5) -> float:
    """Median bytes/s of writing `nbytes` to a new file in `directory` and fsyncing it."""
    import statistics

    nbytes = max(nbytes, 1 << 20)
    block = os.urandom(1 << 20)
    rates = []
    for i in range(repeats):
        path = directory / f".fsync-probe-{os.getpid()}-{i}"
        try:
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                left = nbytes
                while left > 0:
                    n = min(left, len(block))
                    f.write(block[:n])
                    left -= n
                f.flush()
                os.fsync(f.fileno())
            rates.append(nbytes / (time.perf_counter() - t0))
        finally:
            path.unlink(missing_ok=True)
    return statistics.median(rates)


def sample_usage(pid: int, seconds: float = USAGE_WINDOW_S) -> tuple[float, float]:
    """(CPU % of one core, peak RSS MB) of process `pid` over `seconds` (children excluded)."""
    p = psutil.Process(pid)
    t0 = time.monotonic()
    c0 = p.cpu_times()
    rss = p.memory_info().rss
    while time.monotonic() - t0 < seconds:
        check_stop()
        time.sleep(0.5)
        rss = max(rss, p.memory_info().rss)
    c1 = p.cpu_times()
    wall = time.monotonic() - t0
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return 100.0 * cpu / wall, rss / 1e6


def _ts(event: Mapping[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"])).timestamp()


@dataclass
class BootTimes:
    """Process start to trainer exec, and the parts of it spent waiting on AWS."""

    total: float          # `spotagent run` exec -> trainer exec
    claim: float          # DescribeVolumes + AttachVolume + waiting for `attached`
    device: float         # waiting for the attached volume's block device
    own: float            # total - claim - device

    def line(self) -> str:
        return (f"exec->trainer {self.total:.3f} s = own {self.own:.3f} s + claim "
                f"{self.claim:.3f} s + device wait {self.device:.3f} s")


def busy_after_unmount(run: AgentRun) -> float:
    """Seconds the agent waited for its unmounted device to become detachable (its
    `detach_waiting` event to `volume_detaching`), 0 when it did not have to."""
    evs = run.events()
    start = next((e for e in evs if e.get("event") == "detach_waiting"), None)
    if start is None:
        return 0.0
    end = next((e for e in evs if e.get("event") in ("volume_detaching", "detach_refused")
                and _ts(e) >= _ts(start)), None)
    return (_ts(end) if end is not None else time.time()) - _ts(start)


def boot_times(run: AgentRun, st: statusmod.AgentStatus) -> BootTimes:
    """From the agent's log: `agent_started` (identity known, about to look at the pool) to
    `volume_claimed` is the claim; `device_found.waited_s` is the device wait. The timeline
    alone cannot split these out (it has no phase for the start of the claim)."""
    evs = run.events()

    def first(name: str) -> Mapping[str, Any]:
        for e in evs:
            if e.get("event") == name:
                return e
        raise DemoError(f"agent {run.label} never logged {name}", log=run.log_path)

    started, claimed, found = first("agent_started"), first("volume_claimed"), first("device_found")
    trainer = st.timeline.get("trainer_started")
    if trainer is None:
        raise DemoError(f"agent {run.label} has no trainer_started in its timeline")
    total = trainer - run.exec_time
    claim = _ts(claimed) - _ts(started)
    device = float(found.get("waited_s", 0.0))
    return BootTimes(total, claim, device, total - claim - device)


@dataclass
class Segment:
    """One run of the trainer in its log: the step it restored and the steps it executed."""

    restored: int
    steps: list[int] = field(default_factory=list)
    committed: list[tuple[int, int]] = field(default_factory=list)  # (step, bytes)


def trainer_segments(text: str) -> list[Segment]:
    """Split a trainer log (JSON lines of spottrainer.train, or the busybox test trainer's
    `resumed from N` / `step N` / `committed N`) into one segment per trainer start."""
    segs: list[Segment] = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            ev, step = doc.get("event"), doc.get("step")
            if ev == "checkpoint_restored" and isinstance(step, int):
                segs.append(Segment(step))
            elif ev == "no_checkpoint":
                segs.append(Segment(0))
            elif segs and ev == "step" and isinstance(step, int):
                segs[-1].steps.append(step)
            elif segs and ev == "checkpoint_committed" and isinstance(step, int):
                segs[-1].committed.append((step, int(doc.get("bytes") or 0)))
            continue
        m = re.match(r"resumed from (\d+)", line)
        if m:
            segs.append(Segment(int(m.group(1))))
            continue
        m = re.fullmatch(r"(step|committed) (\d+)", line.strip())
        if m and segs:
            n = int(m.group(2))
            (segs[-1].steps.append(n) if m.group(1) == "step"
             else segs[-1].committed.append((n, 0)))
    return segs


def steps_lost(before: Segment, after: Segment) -> int:
    """Work thrown away at a handover: steps executed before that the next run redoes, plus
    any gap (a step nobody executed). 0 means the next run starts at last step + 1."""
    last = max(before.steps) if before.steps else before.restored
    first = min(after.steps) if after.steps else after.restored + 1
    return (last - after.restored) + (first - (after.restored + 1))


@dataclass
class Cycle:
    """What one instance's run (boot, train, then a notice or a drain, release) measured."""

    label: str
    boot: BootTimes
    segment: Segment                # the trainer's run under this instance
    committed_step: int
    commit_to_available: float
    notice_to_commit: float = math.nan   # nan for a drain
    cpu_pct: float = math.nan
    rss_mb: float = math.nan
    # Unmounted, but the device stayed busy: a copy of the mount in another mount namespace
    # (a container or `unshare` started on this machine while the volume was mounted, even
    # one detached lazily and so in no mountinfo) pins it until that namespace lets go.
    busy_after_unmount: float = 0.0

    @property
    def last_step(self) -> int:
        return max(self.segment.steps) if self.segment.steps else self.segment.restored

    @property
    def checkpoint_bytes(self) -> int:
        sizes = [b for step, b in self.segment.committed if step == self.committed_step]
        return sizes[-1] if sizes else 0


# --- the scenario -----------------------------------------------------------------------------


@dataclass
class Workload:
    """What the pool volume holds and how its trainer is started."""

    name: str
    image: Callable[[Path], Path]          # workdir -> a file-system image
    trainer: dict[str, Any]                # the [trainer] config section


def torch_workload(cache: Path | None = None, progress: Say | None = None) -> Workload:
    from spotagent.testbed import images

    def image(_workdir: Path) -> Path:
        return images.torch_image(cache=cache, progress=progress or images._stderr)

    return Workload("torch", image, {"command": list(TORCH_COMMAND), "user": "trainer",
                                     "restart_backoff": 0.5})


class Scenario:
    """A world with one pool volume made from the workload's image, and agent runs on it."""

    def __init__(self, workdir: Path, workload: Workload, *, say: Say = say) -> None:
        from spotagent.testbed.world import World

        self.workdir = workdir
        self.workload = workload
        self.say = say
        self.world = World(workdir / "world")
        self.runs: list[AgentRun] = []
        self.volume_id = ""
        self.t0 = time.monotonic()

    def note(self, text: str) -> None:
        self.say(f"  [{time.monotonic() - self.t0:7.2f}s] {text}")

    def start(self) -> Scenario:
        self.world.start()
        t = time.monotonic()
        image = self.workload.image(self.workdir)
        self.note(f"image {image} ({image.stat().st_blocks * 512 / 2**30:.2f} GiB used of "
                  f"{image.stat().st_size / 2**30:.2f}), ready in {time.monotonic() - t:.1f} s")
        gib = max(1, math.ceil(image.stat().st_size / 2**30))
        snap = self.world.make_snapshot(image, size_gib=gib)
        self.volume_id = self.world.make_pool_volumes(POOL, 1, snapshot_id=snap,
                                                      size_gib=gib)[0]
        self.note(f"pool '{POOL}': {self.volume_id} ({gib} GiB) from {snap}, a copy of "
                  f"{image.name}")
        return self

    def boot(self, label: str) -> AgentRun:
        inst = self.world.launch(pool=POOL, settings={"trainer": self.workload.trainer,
                                                      **AGENT_SETTINGS})
        run = AgentRun(label, inst).start()
        self.runs.append(run)
        self.note(f"instance {label} {inst.instance_id} boots: spotagent run (pid {run.pid})")
        return run

    def wait_training(self, run: AgentRun, *, past: int = 0) -> BootTimes:
        """Wait until `run` trains beyond step `past`; return its boot times."""
        st = run.wait_for(lambda s: s.state == "training" and (s.step or 0) > past,
                          timeout=300, what=f"training beyond step {past}")
        boot = boot_times(run, st)
        segs = run.trainer_segments()
        resumed = segs[-1].restored if segs else 0
        self.note(f"{run.label} trains on {st.volume_id} (generation {st.generation}), "
                  f"restored step {resumed}; {boot.line()}")
        return boot

    def train_then_notice(self, run: AgentRun, *, until_step: int,
                          measure_usage: bool = True, boot: BootTimes | None = None) -> Cycle:
        """Wait until `run` trains (unless `boot` says it does), measure it, fire a spot
        notice at `until_step`, and wait for the release. Returns the cycle's figures."""
        if boot is None:
            boot = self.wait_training(run)
        cpu = rss = math.nan
        if measure_usage:
            cpu, rss = sample_usage(run.pid)
            self.note(f"{run.label}'s agent over {USAGE_WINDOW_S:g} s of training: "
                      f"{cpu:.2f} % of one core, {rss:.1f} MB RSS")
        st = run.wait_for(lambda s: (s.step or 0) >= until_step, timeout=600,
                          what=f"step {until_step}")
        self.world.imds.fire_spot_action(run.inst.instance_id, "terminate")
        self.note(f"spot notice for {run.label}: terminate in 120 s (its status showed step "
                  f"{st.step})")
        code = run.wait_exit(150)
        st = self._released(run, code, "the notice")
        tl = st.timeline
        committed = st.last_committed_step
        assert committed is not None
        self.note(f"{run.label} committed step {committed} and released; "
                  f"{self.volume_id} is available")
        return Cycle(run.label, boot, self._segment(run), committed,
                     tl["volume_available"] - tl["checkpoint_committed"],
                     notice_to_commit=tl["checkpoint_committed"] - tl["notice"],
                     cpu_pct=cpu, rss_mb=rss, busy_after_unmount=busy_after_unmount(run))

    def drain(self, run: AgentRun, boot: BootTimes) -> Cycle:
        """`spotagent drain --wait` for `run`; returns its cycle (no notice figures)."""
        out_path = run.inst.home / "drain.out"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(  # noqa: S603 - our own argv
                [*run.inst.agent_argv("drain"), "--wait", "--timeout", "120"],
                env=run.inst.agent_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            code = _wait_process(proc, 180, "spotagent drain")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if code != 0:
            raise DemoError("spotagent drain failed", code=code,
                            output=out_path.read_text(errors="replace").strip()[-300:])
        st = self._released(run, run.wait_exit(60), "the drain")
        tl = st.timeline
        committed = st.last_committed_step
        assert committed is not None
        self.note(f"spotagent drain: {run.label} committed step {committed} and released")
        return Cycle(run.label, boot, self._segment(run), committed,
                     tl["volume_available"] - tl["checkpoint_committed"],
                     busy_after_unmount=busy_after_unmount(run))

    def _released(self, run: AgentRun, code: int, after: str) -> statusmod.AgentStatus:
        st = run.status() or statusmod.AgentStatus()
        if code != 0 or st.state != "released":
            raise DemoError(f"agent {run.label} did not release cleanly after {after}",
                            exit_code=code, state=st.state, error=st.error or "-",
                            log=run.log_path)
        vol = self.world.volume(self.volume_id)
        if vol["State"] != "available":
            raise DemoError("volume not available after the release", state=vol["State"])
        for phase in ("checkpoint_committed", "volume_available"):
            if phase not in st.timeline:
                raise DemoError(f"agent {run.label}'s timeline lacks {phase}")
        if st.last_committed_step is None:
            raise DemoError(f"agent {run.label} released without a committed checkpoint")
        tag = vol["TagMap"].get("spotagent:checkpoint-step")
        if tag != str(st.last_committed_step):
            raise DemoError("the volume's checkpoint-step tag is not the committed step",
                            tag=tag, committed=st.last_committed_step)
        return st

    def _segment(self, run: AgentRun) -> Segment:
        segs = run.trainer_segments()
        if not segs:
            raise DemoError(f"no trainer output in agent {run.label}'s log", log=run.log_path)
        return segs[-1]

    def resumed(self, before: Cycle, run: AgentRun) -> int:
        """Check that `run`'s trainer restored `before`'s committed step and went on at the
        next one; return the steps lost at that handover (0 when none)."""
        segs = run.trainer_segments()
        if not segs or not segs[0].steps:
            raise DemoError(f"no training steps in agent {run.label}'s log", log=run.log_path)
        seg = segs[0]
        if seg.restored != before.committed_step:
            raise DemoError(f"{run.label} did not resume from {before.label}'s committed step",
                            restored=seg.restored, committed=before.committed_step)
        return steps_lost(before.segment, seg)

    def print_timeline(self, run: AgentRun) -> None:
        st = run.status()
        self.say(f"{run.label}'s timeline ({run.inst.instance_id}):")
        if st is not None:
            for line in statusmod.render(st).splitlines():
                self.say("    " + line)
        tags = self.world.volume(self.volume_id)["TagMap"]
        self.say("  volume tags: " + ", ".join(f"{k}={v}" for k, v in sorted(tags.items())))

    def close(self) -> list[str]:
        """Stop our agents, undo any mount they left, close the world; return what is still
        mounted or attached under the workdir (empty when clean)."""
        from spotagent import chroot, mounts
        from spotagent.runner import stop_strays

        problems: list[str] = []
        for run in self.runs:
            run.kill()
        for run in self.runs:
            mp = Path(run.inst.mount_point)
            try:
                stop_strays(mp, grace=5.0)
                chroot.Environment(mp, control_dir=run.inst.state_dir / "control").teardown()
                mounts.unmount_tree(mp)
            except SpotagentError as exc:
                problems.append(f"cleanup of {mp}: {exc}")
        self.world.close()
        return problems + leftovers(self.workdir)


def leftovers(workdir: Path) -> list[str]:
    """Mounts and loop devices that still refer to `workdir`."""
    real = os.path.realpath(workdir)
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            mp = line.split()[4]
            if mp == real or mp.startswith(real + "/"):
                found.append(f"mounted: {mp}")
    from spotagent import subp

    out = subp.run(["losetup", "--list", "--json", "--output", "NAME,BACK-FILE"],
                   timeout=30).stdout
    for dev in (json.loads(out).get("loopdevices", []) if out.strip() else []):
        back = str(dev.get("back-file") or "")
        if back.startswith(real + "/"):
            found.append(f"loop device: {dev.get('name')} on {back}")
    return found


# --- the figures ------------------------------------------------------------------------------


@dataclass
class Row:
    what: str
    value: str
    target: str
    ok: bool
    note: str = ""


def figure_rows(cycles: Sequence[Cycle], drained: Cycle | None, *, bandwidth: float,
                lost: Sequence[int]) -> list[Row]:
    """The figures of the issue, one row each (several cycles: the worst one)."""
    rows = []
    worst = max(cycles, key=lambda c: c.notice_to_commit - _commit_target(c, bandwidth))
    target = _commit_target(worst, bandwidth)
    rows.append(Row("notice detected -> checkpoint committed", f"{worst.notice_to_commit:.3f} s",
                    f"<= {target:.3f} s", worst.notice_to_commit <= target,
                    f"1.15 x {worst.checkpoint_bytes / 1e6:.1f} MB / {bandwidth / 1e6:.0f} MB/s"
                    " fsynced + 1 s"))
    rel = [*cycles, *([drained] if drained else [])]
    w = max(rel, key=lambda c: c.commit_to_available)
    note = f"worst of {', '.join(f'{c.label} {c.commit_to_available:.3f}' for c in rel)}"
    if w.busy_after_unmount > 0.05:
        note += (f"; {w.label}'s device stayed busy {w.busy_after_unmount:.1f} s after its "
                 "unmount: another mount namespace on this machine held a copy of the mount")
    rows.append(Row("checkpoint committed -> volume available", f"{w.commit_to_available:.3f} s",
                    f"<= {RELEASE_TARGET_S:g} s", w.commit_to_available <= RELEASE_TARGET_S,
                    note))
    b = max(rel, key=lambda c: c.boot.own)
    rows.append(Row("agent's own time, start -> trainer exec", f"{b.boot.own:.3f} s",
                    f"<= {AGENT_OWN_TARGET_S:g} s", b.boot.own <= AGENT_OWN_TARGET_S,
                    f"{b.label}: {b.boot.line()}"))
    worst_lost = max(lost) if lost else 0
    rows.append(Row("steps lost to a notice", str(worst_lost), "0", worst_lost == 0,
                    "; ".join(f"{c.label} committed {c.committed_step}, last step "
                              f"{c.last_step}" for c in cycles)))
    cpu = max(c.cpu_pct for c in cycles)
    rss = max(c.rss_mb for c in cycles)
    rows.append(Row("agent CPU while training", f"{cpu:.2f} %", f"< {CPU_TARGET_PCT:g} % of a core",
                    cpu < CPU_TARGET_PCT, f"psutil, {USAGE_WINDOW_S:g} s window"))
    rows.append(Row("agent RSS while training", f"{rss:.1f} MB", f"< {RSS_TARGET_MB:g} MB",
                    rss < RSS_TARGET_MB))
    return rows


def _commit_target(c: Cycle, bandwidth: float) -> float:
    return COMMIT_FACTOR * c.checkpoint_bytes / bandwidth + COMMIT_SLACK_S


def render_rows(rows: Sequence[Row]) -> list[str]:
    w = max(len(r.what) for r in rows)
    out = []
    for r in rows:
        out.append(f"  {r.what:<{w}}  {r.value:>9}  {r.target:<22} {'PASS' if r.ok else 'FAIL'}"
                   + (f"  ({r.note})" if r.note else ""))
    return out


# --- the command ------------------------------------------------------------------------------


def run_demo(*, notice_at: int, workdir: Path | None, keep: bool, cache: Path | None) -> int:
    if os.geteuid() != 0:
        raise DemoError("the demo needs root (loop devices, mounts, chroot)")
    t_start = time.monotonic()
    own_dir = workdir is None
    work = Path(tempfile.mkdtemp(prefix="spotagent-demo-")) if workdir is None else workdir
    work.mkdir(parents=True, exist_ok=True)
    demo_log = work / "demo.log"
    with open(demo_log, "a", encoding="utf-8") as logf:
        logmod.configure(json=True, stream=logf)   # emulator logs go to the file, not here
        say("spotagent demo: one spot interruption, end to end, on this machine")
        say("  emulated AWS (IMDS, strict EC2, loop devices as EBS volumes); real mounts, a real")
        say("  Debian + torch chroot, real `spotagent run` processes and the reference trainer")
        say(f"  workdir {work}")
        say()
        scenario = Scenario(work, torch_workload(cache, progress=lambda s: say(f"  {s}")))
        failure: BaseException | None = None
        problems: list[str] = []
        result = 1
        try:
            install_stop_handler()
            result = _scenario(scenario, notice_at)
        except (SpotagentError, KeyboardInterrupt) as exc:
            failure = exc
        finally:
            problems = scenario.close()
    say()
    if problems:
        say("cleanup: FAILED, still present:")
        for p in problems:
            say(f"  {p}")
    else:
        say("cleanup: nothing mounted, no loop device left")
    if not keep and not problems:
        # The volumes' image files are the bulk (a copy of the image each): never left behind
        # unasked; a --workdir of the caller keeps its logs.
        shutil.rmtree(work if own_dir else scenario.world.plane.image_dir, ignore_errors=True)
    if keep or problems:
        say(f"kept {work} (agent logs: <instance>/agent.log, emulators: demo.log)")
    say(f"demo took {time.monotonic() - t_start:.1f} s")
    if isinstance(failure, KeyboardInterrupt):
        return 130
    if isinstance(failure, DemoStopped):
        say("demo stopped by SIGTERM")
        return 143
    if failure is not None:
        say(f"demo FAILED: {failure}")
        return 1
    return 1 if problems else result


def _scenario(s: Scenario, notice_at: int) -> int:
    say("volume image")
    t = time.monotonic()
    s.start()
    s.note(f"world ready in {time.monotonic() - t:.1f} s")
    say()
    say("instance A")
    a = s.boot("A")
    cyc = s.train_then_notice(a, until_step=notice_at)
    say()
    s.print_timeline(a)
    say()
    say("instance B")
    b = s.boot("B")
    boot_b = s.wait_training(b, past=cyc.committed_step + 5)
    lost = s.resumed(cyc, b)
    first_b = min(b.trainer_segments()[0].steps)
    s.note(f"B restored step {cyc.committed_step} and executed step {first_b} first")
    bandwidth = fsync_write_bandwidth(s.world.plane.image_dir, cyc.checkpoint_bytes)
    s.note(f"disk: {bandwidth / 1e6:.0f} MB/s fsynced writes of {cyc.checkpoint_bytes / 1e6:.1f}"
           f" MB (median of 5, beside the volume images)")
    drained = s.drain(b, boot_b)
    say()
    s.print_timeline(b)
    if s.world.plane.violations:
        raise DemoError("the device plane saw violations",
                        detail="; ".join(s.world.plane.violations))
    say()
    say("figures (this run; targets from the issue)")
    for line in render_rows(figure_rows([cyc], drained, bandwidth=bandwidth, lost=[lost])):
        say(line)
    say()
    say(f"steps lost: {lost} (A's last step {cyc.last_step}, committed {cyc.committed_step}; "
        f"B restored {cyc.committed_step} and went on at step {first_b})")
    return 0 if lost == 0 else 1


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(notice_at=args.steps, workdir=args.workdir, keep=args.keep,
                    cache=args.cache)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="one spot interruption end to end on emulated AWS with a real torch root",
        description="Build (once, cached) a Debian + torch volume image, boot instance A, "
        "fire a spot notice, boot instance B that resumes at the next step, print the "
        "timelines and the figures. Needs root.")
    p.add_argument("--steps", type=int, default=NOTICE_AT_STEP, metavar="N",
                   help=f"fire the notice once A has trained N steps (default {NOTICE_AT_STEP};"
                   f" a checkpoint every {CHECKPOINT_EVERY})")
    p.add_argument("--keep", action="store_true",
                   help="keep the work directory (agent logs, volume images) afterwards")
    p.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                   help="work directory (default: a new temporary directory)")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="image cache (default $SPOTAGENT_CACHE or /var/cache/spotagent)")
    p.set_defaults(handler=cmd_demo)
