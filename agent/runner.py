"""The runner: turns the world into lifecycle events and lifecycle actions into effects.

It owns the main loop of `spotagent run`. It decides nothing itself (that is
`lifecycle.next_state`); it polls the monitors, the supervisor, the trainer's progress file and
the signal flags, feeds what it sees to the state machine, and carries out the actions with the
modules that own each side effect (volumes, devices, mounts, chroot, supervisor, systemd).

Guarantees kept here:

- The state file is written on every transition, before and after its actions run.
- An agent restarted on the same instance resumes: the first monitor poll comes before Boot
  (a notice that is already there means release, not train), a volume attached to us is kept
  by the claim (never a second one), a release cut short is finished, and a trainer left in the
  chroot is asked for a checkpoint (SIGTERM) and stopped before anything else runs there.
- An exception nobody expected (a bug) still ends with the held volume released: the runner
  feeds `Failed` to the lifecycle, carries out what it says (kill, release), then re-raises, so
  the process ends non-zero and systemd restarts it.
- sd_notify WATCHDOG=1: the main loop pings on every tick (at most ~0.25 s apart). The actions
  that block (claim, create, mount, release, kill) run while a helper thread keeps pinging at
  the watchdog interval, but only for as long as the action's own worst case
  (`_action_bound`): an action hung past its bound stops the pings and systemd's watchdog
  restarts the agent.
- Test hook: `SPOTAGENT_TEST_CRASH_AT` (see `spotagent.crashpoints`) kills the agent at a named
  point of claim, mount and release; unset in production.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

import psutil

from spotagent import chroot as chrootmod
from spotagent import devices, mounts, status, subp, systemd
from spotagent import lifecycle as lc
from spotagent.config import Config
from spotagent.crashpoints import crash_point
from spotagent.errors import SpotagentError
from spotagent.imds import Identity, ImdsClient
from spotagent.log import get_logger
from spotagent.monitors import Monitor, default_monitors
from spotagent.supervisor import ALIVE, RestartPolicy, Supervisor, TrainerState, trainer_env
from spotagent.volumes import Pool, PoolEmptyError, next_backoff
from spotagent.warmup import Warmup

log = get_logger("runner")

STATUS_EVERY = 1.0        # seconds: least time between two state-file writes without a transition
STATUS_HEARTBEAT = 30.0   # seconds: rewrite an unchanged state file this often (fresh `updated`)

# Wait for a device unmounted here but still in use elsewhere, before the detach: at most
# DETACH_WAIT, at least DETACH_WAIT_MIN seconds (see Runner._wait_detachable).
DETACH_WAIT = 30.0
DETACH_WAIT_MIN = 5.0


def kernel_boot_time() -> datetime:
    """The kernel's boot time (btime in /proc/stat): notices older than this are stale."""
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            if line.startswith("btime "):
                return datetime.fromtimestamp(int(line.split()[1]), UTC)
    raise SpotagentError("no btime in /proc/stat")


@dataclass
class _Flags:
    """Set by signal handlers, read by the main loop (handlers do nothing else)."""

    stop: bool = False
    stop_origin: str = "systemd"


class Runner:
    def __init__(self, cfg: Config, *, imds: ImdsClient, pool: Pool,
                 monitors: list[Monitor] | None = None, boot_time: datetime | None = None,
                 rng: random.Random | None = None, install_signals: bool = True,
                 identity: Identity | None = None) -> None:
        self.cfg = cfg
        self.imds = imds
        self.pool = pool
        self.monitors = monitors if monitors is not None else default_monitors(imds)
        self.rng = rng or random.Random()
        self.flags = _Flags()
        self.install_signals = install_signals
        self.state = lc.State.STARTING
        self.ctx = lc.Context(
            boot_time=boot_time or kernel_boot_time(),
            on_empty=cfg.pool.on_empty, on_rebalance=cfg.drain.on_rebalance,
            on_complete=cfg.agent.on_complete, release_margin=cfg.drain.release_margin,
            stop_deadline=cfg.drain.stop_deadline)
        self.state_dir: Path = cfg.agent.state_dir
        self.control_dir = self.state_dir / "control"
        self.status = status.AgentStatus(pool=cfg.pool.name,
                                         mount_point=str(cfg.volume.mount_point))
        self.identity: Identity | None = identity   # None: read from IMDS at run()
        self._warmup: Warmup | None = None
        self.volume_id: str | None = None
        self.created_empty = False
        self.env: chrootmod.Environment | None = None
        self.sup: Supervisor | None = None
        self.queue: collections.deque[lc.Event] = collections.deque()
        self.retry_at: float | None = None
        self.claim_attempt = 0
        self.deadline_mono: float | None = None
        self.exit_requested = False
        self.stop_handled = False
        self._last_status_write = 0.0
        self._last_summary = ""
        self._next_poll = 0.0
        self._progress_mtime = 0.0
        self._checkpoint_pending: str | None = None
        self._last_status_snapshot = ""
        # WATCHDOG=1 every half WatchdogSec (None: systemd wants no pings), not on every tick.
        every = systemd.watchdog_interval()
        self._watchdog_every: float | None = None if every is None else max(0.05, every)
        self._next_watchdog = 0.0

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> int:
        if self.install_signals:
            signal.signal(signal.SIGTERM, self._on_stop_signal)
            signal.signal(signal.SIGINT, self._on_stop_signal)
        self.status.mark("start")
        self._write_status(force=True)
        try:
            self._boot()
            while not self.exit_requested:
                while self.queue and not self.exit_requested:
                    self._handle(self.queue.popleft())
                if self.exit_requested:
                    break
                self._tick()
        except Exception as exc:
            self._release_after_crash(exc)
            raise
        self._write_status(force=True)
        systemd.status(self.status.summary())
        return 1 if self.state is lc.State.FAILED else 0

    def _boot(self) -> None:
        if self.identity is None:
            self.identity = self.imds.identity()
        self.status.instance_id = self.identity.instance_id
        self.status.availability_zone = self.identity.availability_zone
        log.info("agent_started", instance_id=self.identity.instance_id,
                 availability_zone=self.identity.availability_zone, pool=self.cfg.pool.name,
                 boot_time=self.ctx.boot_time.isoformat())
        # A release the last agent cut short (detach requested, owner tag left) is finished
        # before anything else, so no claim leaks whatever happens next.
        self.pool.finish_releases(self.identity.instance_id)
        held = self.pool.attached_to(self.identity.instance_id)
        if held is not None:
            self.volume_id = held.volume_id
            self.status.volume_id = held.volume_id
            self.status.generation = held.generation
            log.warning("volume_already_attached", volume_id=held.volume_id,
                        instance_id=self.identity.instance_id, generation=held.generation)
        # A notice already there (an agent restarted mid-drain) is seen before Boot, so the
        # lifecycle releases instead of training.
        self._next_poll = time.monotonic() + float(self.cfg.imds.poll_interval)
        self._poll_monitors()
        self.queue.append(lc.Boot(attached_volume=held.volume_id if held else None))

    def _release_after_crash(self, exc: Exception) -> None:
        """An exception nobody expected: let the lifecycle say what a failure means now
        (holding a volume: kill the trainer, release) and do it, then the caller re-raises."""
        if isinstance(exc, SpotagentError):
            reason = str(exc)
        else:
            reason = f"unexpected error: {type(exc).__name__}: {exc}"[:500]
        log.error("agent_crashed", error=reason, state=self.state.value,
                  volume_id=self.volume_id)
        self.exit_requested = False
        self.queue.clear()
        self.queue.append(lc.Failed(reason=reason))
        while self.queue and not self.exit_requested:
            self._handle(self.queue.popleft())
        self._write_status(force=True)

    def _on_stop_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.flags.stop = True
        self.flags.stop_origin = "systemd" if signum == signal.SIGTERM else "interrupt"

    def _handle(self, event: lc.Event) -> None:
        t = lc.next_state(self.state, event, self.ctx)
        if t.context is not None:
            self.ctx = t.context
        if t.ignored:
            if isinstance(event, lc.Notice):
                log.info("notice_ignored", state=self.state.value, cause=t.cause)
            else:
                log.debug("event_ignored", state=self.state.value, cause=t.cause)
            return
        if isinstance(event, lc.Notice):
            self.status.mark("notice")
            self.status.notice = f"{event.source}:{event.kind} at {event.notice_time.isoformat()}"
        if t.state is not self.state:
            log.info("state_changed", old=self.state.value, state=t.state.value,
                     cause=t.cause, volume_id=self.volume_id)
        else:
            log.info("state_kept", state=t.state.value, cause=t.cause,
                     actions=[a.act.value for a in t.actions], volume_id=self.volume_id)
        self.state = t.state
        self.status.state = t.state.value
        self.status.cause = t.cause
        if self.ctx.failure:
            self.status.error = self.ctx.failure
        self._write_status(force=True)
        for action in t.actions:
            follow = self._do(action)
            if follow is not None:
                self.queue.append(follow)
        if t.actions:
            self._write_status(force=True)

    def _tick(self) -> None:
        now = time.monotonic()
        if self.flags.stop and not self.stop_handled:
            self.stop_handled = True
            self.queue.append(lc.StopRequested(requested_at=_utcnow(),
                                               origin=self.flags.stop_origin))
            return
        if self._drain_requested_by_cli():
            return
        if now >= self._next_poll:
            self._next_poll = now + float(self.cfg.imds.poll_interval)
            self._poll_monitors()
        if self.retry_at is not None and now >= self.retry_at:
            self.retry_at = None
            self.queue.append(lc.RetryClaim())
        if self.sup is not None and self.state in (lc.State.TRAINING, lc.State.DRAINING):
            self._poll_trainer()
        if (self.state is lc.State.DRAINING and self.deadline_mono is not None
                and now >= self.deadline_mono and self._trainer_alive()):
            self.deadline_mono = None
            self.queue.append(lc.DeadlinePassed())
        if self._watchdog_every is not None and now >= self._next_watchdog:
            self._next_watchdog = now + self._watchdog_every
            systemd.watchdog()
        self._write_status()
        if not self.queue:
            pause = 0.05 if self.state is lc.State.DRAINING else min(
                0.25, float(self.cfg.imds.poll_interval))
            time.sleep(pause)

    def _drain_requested_by_cli(self) -> bool:
        """`spotagent drain` drops a file in the state directory (works without signals)."""
        req = self.state_dir / "drain-request"
        if req.exists() and not self.stop_handled:
            self.stop_handled = True
            req.unlink(missing_ok=True)
            self.queue.append(lc.StopRequested(requested_at=_utcnow(), origin="spotagent drain"))
            return True
        return False

    def _poll_monitors(self) -> None:
        for mon in self.monitors:
            try:
                events = mon.poll()
            except SpotagentError as exc:
                log.warning("monitor_poll_failed", monitor=mon.name, error=str(exc))
                continue
            for ev in events:
                log.info("interruption_notice", source=ev.source, kind=ev.kind,
                         notice_time=ev.notice_time.isoformat(),
                         detected_at=ev.detected_at.isoformat())
                self.queue.append(lc.Notice(source=ev.source, kind=ev.kind,
                                            notice_time=ev.notice_time,
                                            detected_at=ev.detected_at))

    def _trainer_alive(self) -> bool:
        return self.sup is not None and self.sup.status().state in ALIVE

    def _poll_trainer(self) -> None:
        assert self.sup is not None
        st = self.sup.poll()
        self._read_progress()
        self.status.trainer_pid = st.pid
        self.status.restart_count = st.restart_count
        if self.state is lc.State.DRAINING:
            if st.state not in ALIVE:
                self.status.mark("trainer_exited")
                self.queue.append(lc.TrainerExited(code=st.last_exit_code or 0))
                self.sup = None
            return
        if st.state is TrainerState.EXITED_OK:
            self.status.mark("trainer_exited")
            self.queue.append(lc.TrainerExited(code=0))
            self.sup = None
        elif st.state is TrainerState.FAILED:
            self.status.mark("trainer_exited")
            self.queue.append(lc.TrainerGaveUp(reason=st.reason or "trainer failed"))
            self.sup = None

    def _send_pending_checkpoint(self) -> None:
        """SIGUSR1 only once the trainer has reported progress: before it installs its handler,
        SIGUSR1's default action would kill it. Until then the request waits."""
        if self._checkpoint_pending is None or self.sup is None or self.status.step is None:
            return
        if self.sup.signal_main(signal.SIGUSR1):
            log.info("checkpoint_requested", reason=self._checkpoint_pending)
        self._checkpoint_pending = None

    def _read_progress(self) -> None:
        path = self.control_dir / "progress.json"
        try:
            mtime = path.stat().st_mtime
            if mtime == self._progress_mtime:
                return
            self._progress_mtime = mtime
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(doc, dict):
            return
        step = doc.get("step")
        if isinstance(step, int):
            if self.status.step is None:
                self.status.mark("first_step")
            self.status.step = step
            self._send_pending_checkpoint()
        for key in ("samples_per_s", "loss"):
            if isinstance(doc.get(key), int | float):
                setattr(self.status, key, float(doc[key]))
        committed = doc.get("last_committed_step")
        if isinstance(committed, int) and committed != self.status.last_committed_step:
            self.status.last_committed_step = committed
            ct = doc.get("last_commit_time")
            self.status.last_commit_time = float(ct) if isinstance(ct, int | float) else None
            if self.state is lc.State.DRAINING:
                self.status.mark("checkpoint_committed")
                self.queue.append(lc.CheckpointCommitted(step=committed))

    # --- actions ----------------------------------------------------------------------------

    def _do(self, action: lc.Action) -> lc.Event | None:
        a = action.act
        try:
            with self._keepalive(a):
                return self._do_action(action)
        except SpotagentError as exc:
            log.error("action_failed", action=a.value, error=str(exc), volume_id=self.volume_id)
            return lc.Failed(reason=f"{a.value}: {exc}")

    def _action_bound(self, act: lc.Act) -> float:
        """Worst-case seconds of a blocking action, from the timeouts it runs under; the
        watchdog keep-alive stops after this long."""
        cfg = self.cfg
        attach = float(cfg.pool.attach_timeout) + float(self.pool.detach_timeout)
        drain = float(cfg.drain.stop_deadline)
        release = drain + 2 * mounts.UMOUNT_TIMEOUT + float(self.pool.detach_timeout) + 60
        if act is lc.Act.CLAIM:
            return attach + 60
        if act is lc.Act.CREATE:
            return float(self.pool.create_timeout) + attach + 60
        if act is lc.Act.MOUNT:
            return (float(cfg.devices.timeout) + mounts.FSCK_TIMEOUT + mounts.MKFS_TIMEOUT
                    + mounts.MOUNT_TIMEOUT + drain + 120)
        if act in (lc.Act.RELEASE, lc.Act.RELEASE_DONE):
            return release
        if act is lc.Act.KILL:
            return 60.0
        if act is lc.Act.POWEROFF:
            return 60.0
        return 0.0

    @contextlib.contextmanager
    def _keepalive(self, act: lc.Act) -> Iterator[None]:
        """Ping the systemd watchdog while a blocking action runs, for at most its bound."""
        interval = systemd.watchdog_interval()
        bound = self._action_bound(act)
        if interval is None or bound <= 0:
            yield
            return
        stop = threading.Event()
        give_up = time.monotonic() + bound

        def ping() -> None:
            while not stop.wait(interval):
                if time.monotonic() >= give_up:
                    log.error("watchdog_keepalive_expired", action=act.value, bound=bound)
                    return
                systemd.watchdog()

        pinger = threading.Thread(target=ping, name=f"watchdog-{act.value}", daemon=True)
        systemd.watchdog()
        pinger.start()
        try:
            yield
        finally:
            stop.set()
            pinger.join(timeout=5)

    def _do_action(self, action: lc.Action) -> lc.Event | None:
        a = action.act
        if a is lc.Act.CLAIM:
            return self._claim()
        if a is lc.Act.WAIT:
            delay = next_backoff(self.claim_attempt, float(self.cfg.pool.wait_max_backoff),
                                 self.rng)
            self.claim_attempt += 1
            self.retry_at = time.monotonic() + delay
            log.info("pool_wait", pool=self.cfg.pool.name, retry_in=round(delay, 2))
            return None
        if a is lc.Act.CREATE:
            return self._create()
        if a is lc.Act.MOUNT:
            return self._mount_and_start()
        if a is lc.Act.CHECKPOINT:
            self._checkpoint_pending = action.reason or "requested"
            self._send_pending_checkpoint()
            return None
        if a is lc.Act.DRAIN:
            return self._begin_drain(action)
        if a is lc.Act.KILL:
            if self.sup is not None:
                self.sup.kill_tree()
                log.warning("trainer_killed", reason=action.reason or "deadline")
            return None
        if a in (lc.Act.RELEASE, lc.Act.RELEASE_DONE):
            return self._release(done=a is lc.Act.RELEASE_DONE, deadline=action.deadline)
        if a is lc.Act.POWEROFF:
            subp.run(["systemctl", "poweroff"], timeout=30, check=False)
            return None
        if a is lc.Act.NOTIFY_READY:
            systemd.ready()
            return None
        if a is lc.Act.NOTIFY_STOPPING:
            systemd.stopping()
            budget_us = int((self.ctx.stop_deadline + 60) * 1_000_000)
            systemd.extend_timeout(budget_us)
            return None
        if a is lc.Act.EXIT:
            self.exit_requested = True
            return None
        raise AssertionError(f"unhandled action {a}")

    def _claim(self) -> lc.Event:
        assert self.identity is not None
        try:
            claim = self.pool.claim(self.identity.instance_id, self.identity.availability_zone)
        except PoolEmptyError:
            self.status.error = None
            return lc.PoolEmpty()
        if claim.reused and claim.volume_id != self.volume_id and self.volume_id is not None:
            log.warning("attached_volume_changed", before=self.volume_id, now=claim.volume_id)
        return self._claimed(claim.volume_id, claim.generation, claim.created_empty)

    def _create(self) -> lc.Event:
        assert self.identity is not None
        vid = self.pool.create(self.identity.availability_zone)
        log.info("volume_created", volume_id=vid, availability_zone=self.identity.availability_zone)
        return self._claim()

    def _claimed(self, volume_id: str, generation: int | None, created_empty: bool) -> lc.Event:
        self.volume_id = volume_id
        self.created_empty = created_empty
        self.status.volume_id = volume_id
        self.status.generation = generation
        self.status.mark("claimed")
        return lc.Claimed(volume_id=volume_id)

    def _mount_and_start(self) -> lc.Event:
        assert self.volume_id is not None and self.identity is not None
        cfg = self.cfg
        xen = [str(p) for p in devices.xen_candidates(self.pool.device)]
        dev = devices.wait_for_device(self.volume_id, by_id_dir=cfg.devices.by_id_dir,
                                      timeout=float(cfg.devices.timeout), xen_names=xen)
        self.status.device = str(dev)
        mp: Path = cfg.volume.mount_point
        fstype = mounts.mount_volume(dev, mp, created_empty_by_agent=self.created_empty,
                                     fstype=cfg.volume.fstype, options=cfg.volume.mount_options)
        if self.created_empty:
            self.pool.clear_created_empty(self.volume_id)
            self.created_empty = False
        self.status.mark("mounted")
        log.info("volume_mounted", volume_id=self.volume_id, device=str(dev), mount_point=str(mp),
                 fstype=fstype)
        crash_point("after_mount")
        # A trainer left running by an agent that died must not run twice.
        stop_strays(mp, grace=float(cfg.drain.stop_deadline))
        # Checks first (no mounts made yet), so a bad environment fails with nothing to undo
        # but the volume mount itself.
        chrootmod.looks_like_root(mp)
        user = chrootmod.lookup_user(mp, cfg.trainer.user)
        env = chrootmod.Environment(mp, control_dir=self.control_dir)
        self.env = env
        self.control_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("deadline", "progress.json"):
            (self.control_dir / stale).unlink(missing_ok=True)
        env.prepare(user=user)
        crash_point("after_chroot")
        argv = list(cfg.trainer.command)
        env.check_command(argv, user=user)
        env.ensure_checkpoint_dir(cfg.trainer.checkpoint_dir, user)
        log_path = env.host_path(cfg.trainer.log_file, create_parents=True)
        gpu = env.gpu_report()
        for warning in gpu.warnings:
            log.warning("gpu_warning", detail=warning)
        policy = RestartPolicy(base=float(cfg.trainer.restart_backoff),
                               budget=int(cfg.trainer.restart_budget),
                               window=float(cfg.trainer.restart_window))
        run_id = f"{cfg.pool.name}-{self.volume_id}"
        self.sup = Supervisor(argv, root=mp, user=user, log_path=log_path, policy=policy,
                              cwd=cfg.trainer.workdir,
                              env=trainer_env(user=user,
                                              checkpoint_dir=cfg.trainer.checkpoint_dir,
                                              run_id=run_id, extra=cfg.trainer.env))
        pid = self.sup.start()
        self.status.trainer_pid = pid
        self.status.mark("trainer_started")
        if cfg.volume.warmup:
            self._maybe_warm(dev)
        return lc.TrainerStarted(pid=pid)

    def _maybe_warm(self, dev: Path) -> None:
        """Read a cold volume end to end in the background; tag it warm when done."""
        assert self.volume_id is not None
        if self.pool.is_warm(self.volume_id):
            return
        vid = self.volume_id
        rate = float(self.cfg.volume.warmup_rate_mib) * 1024 * 1024

        def done() -> None:
            try:
                self.pool.mark_warm(vid)
            except SpotagentError as exc:
                log.warning("warmup_tag_failed", volume_id=vid, error=str(exc))

        self._warmup = Warmup(dev, max_bytes_per_s=rate, on_done=done)
        self._warmup.start()

    def _begin_drain(self, action: lc.Action) -> lc.Event | None:
        deadline = action.deadline or _utcnow()
        self.status.deadline = deadline.timestamp()
        self.deadline_mono = time.monotonic() + max(0.0, (deadline - _utcnow()).total_seconds())
        _write_atomic(self.control_dir / "deadline",
                      json.dumps({"deadline": deadline.timestamp(), "reason": action.reason}))
        log.info("drain_started", deadline=deadline.isoformat(), reason=action.reason,
                 volume_id=self.volume_id)
        if self._trainer_alive():
            assert self.sup is not None
            # SIGTERM to the trainer's main process only; no restarts from here. The kill at the
            # deadline is the lifecycle's decision (DeadlinePassed -> KILL).
            self.sup.begin_stop(None, signal.SIGTERM)
            return None
        return lc.TrainerExited(code=0)

    def _release(self, *, done: bool, deadline: datetime | None = None) -> lc.Event:
        """Stop whatever runs in the chroot, tear it down, sync and unmount, detach, untag.
        Idempotent: after a crash half-way, running it again finishes the job."""
        if self._warmup is not None:
            self._warmup.stop()
        if self.sup is not None:
            self.sup.kill_tree()
        self.sup = None
        mp: Path = self.cfg.volume.mount_point
        # A trainer left by an agent that died (we restarted mid-drain) gets its SIGTERM
        # checkpoint within what is left of the deadline.
        stop_strays(mp, grace=self._grace(deadline))
        if self.env is not None:
            self.env.teardown()
        else:
            chrootmod.Environment(mp, control_dir=self.control_dir).teardown()
        if self.volume_id is None:
            return lc.Released()
        mounts.unmount_tree(mp)
        self.status.mark("unmounted")
        crash_point("after_unmount")
        dev = self.status.device
        if dev is None:
            found = devices.find_device(self.volume_id, by_id_dir=self.cfg.devices.by_id_dir)
            dev = str(found) if found is not None else None
        step = self.status.last_committed_step
        if step is None:   # no trainer ran in this process: what the last one committed
            step = _committed_step_from_progress(self.control_dir / "progress.json")
        self._wait_detachable(dev, deadline)
        assert self.identity is not None
        self.pool.release(self.volume_id, self.identity.instance_id, checkpoint_step=step,
                          done=done if done else None,
                          still_mounted=lambda: _still_in_use(dev))
        self.status.mark("volume_available")
        log.info("release_completed", volume_id=self.volume_id, checkpoint_step=step, done=done)
        return lc.Released()

    def _wait_detachable(self, dev: str | None, deadline: datetime | None) -> None:
        """Unmounted here, but the device may still be in use elsewhere: a mount namespace
        that copied the volume's mount (a container or `unshare` started while it was
        mounted), or a holder on its way out. Wait for that to end, for at most DETACH_WAIT
        seconds and no longer than the release may take (the drain deadline plus the release
        margin kept for unmount and detach), but at least DETACH_WAIT_MIN; the pool's own
        guard refuses the detach if it does not end."""
        why = _busy(dev)
        if why is None:
            return
        until = deadline or self.ctx.drain_deadline
        window = DETACH_WAIT
        if until is not None:
            left = (until - _utcnow()).total_seconds() + float(self.ctx.release_margin)
            window = min(DETACH_WAIT, max(DETACH_WAIT_MIN, left))
        end = time.monotonic() + window
        log.warning("detach_waiting", device=dev, volume_id=self.volume_id, reason=why,
                    limit=round(window, 1), opened_by=_openers(dev))
        started = time.monotonic()
        while time.monotonic() < end:
            time.sleep(0.25)
            if _busy(dev) is None:
                log.info("detach_wait_over", device=dev, volume_id=self.volume_id,
                         waited=round(time.monotonic() - started, 2))
                return
        log.error("detach_still_busy", device=dev, volume_id=self.volume_id, reason=_busy(dev),
                  opened_by=_openers(dev))

    def _grace(self, deadline: datetime | None = None) -> float:
        """Seconds a stray trainer gets to checkpoint: what is left of the drain deadline,
        at most drain.stop_deadline, at least one second."""
        cap = float(self.cfg.drain.stop_deadline)
        until = deadline or self.ctx.drain_deadline
        if until is None:
            return cap
        return max(1.0, min(cap, (until - _utcnow()).total_seconds()))

    def _write_status(self, *, force: bool = False) -> None:
        """Persist the status: at once on a transition (`force`), otherwise at most every
        STATUS_EVERY seconds and only when something changed (a heartbeat every
        STATUS_HEARTBEAT keeps `updated` fresh). Most ticks write nothing."""
        now = time.monotonic()
        if not force and now - self._last_status_write < STATUS_EVERY:
            return
        if self._warmup is not None:
            p = self._warmup.progress
            self.status.warmup = ("done" if p.done else
                                  f"{100.0 * p.bytes_read / max(1, p.total_bytes):.0f}%")
        snapshot = repr(self.status.to_json() | {"updated": None})
        if (not force and snapshot == self._last_status_snapshot
                and now - self._last_status_write < STATUS_HEARTBEAT):
            return
        self._last_status_write = now
        self._last_status_snapshot = snapshot
        status.write(self.state_dir, self.status)
        line = self.status.summary()
        if line != self._last_summary:
            self._last_summary = line
            systemd.status(line)


def processes_in_root(root: Path) -> list[psutil.Process]:
    """Processes whose root directory is `root` (a trainer left by an agent that died)."""
    target = os.path.realpath(root)
    found = []
    for p in psutil.process_iter():
        try:
            if os.path.realpath(f"/proc/{p.pid}/root") == target:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def stop_strays(root: Path, *, grace: float) -> None:
    """SIGTERM (a checkpoint, by the trainer protocol) then SIGKILL what runs inside `root`."""
    strays = processes_in_root(root)
    if not strays:
        return
    log.warning("stray_trainer_found", pids=[p.pid for p in strays], root=str(root))
    for p in strays:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _gone, alive = psutil.wait_procs(strays, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def release_leftovers(cfg: Config, pool: Pool, instance_id: str) -> str | None:
    """Undo what a dead agent left on this instance: processes in the chroot (asked for a
    checkpoint first), the chroot's mounts, the volume's mount, the attachment and the claim,
    including a release it cut short. Records the outcome in the state file. Returns the volume
    released."""
    mp: Path = cfg.volume.mount_point
    state_dir: Path = cfg.agent.state_dir
    control = state_dir / "control"
    held = pool.attached_to(instance_id)
    stop_strays(mp, grace=float(cfg.drain.stop_deadline))
    chrootmod.Environment(mp, control_dir=control).teardown()
    mounts.unmount_tree(mp)
    released = None
    step = _committed_step_from_progress(control / "progress.json")
    if held is not None:
        device = devices.find_device(held.volume_id, by_id_dir=cfg.devices.by_id_dir)
        pool.release(held.volume_id, instance_id, checkpoint_step=step,
                     still_mounted=lambda: _still_in_use(str(device) if device else None))
        released = held.volume_id
    finished = pool.finish_releases(instance_id)
    released = released or (finished[0] if finished else None)
    log.info("leftovers_released", instance_id=instance_id, volume_id=released,
             checkpoint_step=step)
    try:
        st = status.read(state_dir)
    except status.StatusError:
        st = None
    if st is not None and released is not None:
        st.state = lc.State.RELEASED.value
        st.cause = "spotagent release (no agent running)"
        st.error = None
        st.trainer_pid = None
        if step is not None:
            st.last_committed_step = step
        st.mark("unmounted")
        st.mark("volume_available")
        status.write(state_dir, st)
    return released


def _committed_step_from_progress(path: Path) -> int | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    step = doc.get("last_committed_step") if isinstance(doc, dict) else None
    return step if isinstance(step, int) else None


def _busy(device: str | None) -> str | None:
    """Why the device may not be detached yet (mounted in some namespace, held, opened
    exclusively), or None."""
    if not device or not Path(device).exists():
        return None
    try:
        mounts.assert_detachable(Path(device))
    except SpotagentError as exc:
        return str(exc)
    return None


def _still_in_use(device: str | None) -> bool:
    """The guard the pool checks right before DetachVolume: never detach a mounted device."""
    why = _busy(device)
    if why is not None:
        log.error("detach_refused", device=device, error=why)
    return why is not None


def _openers(device: str | None) -> list[str]:
    """Processes with the device itself open (for the log: who keeps a detach waiting)."""
    if not device:
        return []
    target = os.path.realpath(device)
    found = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            fds = os.listdir(f"/proc/{p.pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p.pid}/fd/{fd}") == target:
                    found.append(f"{p.pid}({p.info['name']})")
                    break
            except OSError:
                continue
    return found


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

