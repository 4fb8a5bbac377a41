"""The trainer process: start it in the chroot as its user, pump its output, signal its main
process, restart it within a budget, stop it by a deadline and kill its whole tree.

This is the one place outside `spotagent.subp` that creates a process (a long-running child
needs `subprocess.Popen`). The chroot is entered through coreutils `chroot` as an argv list
(`chroot --userspec=+UID:+GID --groups=+G1,... ROOT ARGV...`) rather than a Python preexec_fn:
Popen's `user=`/`group=` drop privileges *before* preexec_fn runs (so os.chroot there fails),
and a preexec_fn that does everything runs Python between fork and exec, which is not safe in
an agent that has threads. coreutils chroot does chroot, chdir("/"), setgroups, setgid,
setuid, execvp, and the `+` prefix makes it use the numeric ids as given, with no name lookup
on the host or in the root. It execs the trainer in place, so the pid we hold is the trainer's.

The API is poll-based: reader threads only log and append to the log file; every decision
(restart, give up, kill at the deadline) happens inside `poll()`, called by the main loop.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import psutil

from spotagent.chroot import (
    CONTROL_DIR_IN_ROOT,
    DEFAULT_PATH,
    ChrootError,
    TrainerUser,
    resolve_command,
)
from spotagent.errors import SpotagentError
from spotagent.log import get_logger

log = get_logger("supervisor")

JOURNAL_LINES_PER_S = 50.0      # trainer lines forwarded to the journal per second (sustained)
JOURNAL_LINES_BURST = 500.0     # ... and in a burst (a traceback, start-up banners)
MAX_LINE = 64 * 1024            # longer lines are split (a progress bar without newlines)
CHROOT_SEARCH = "/usr/sbin:/usr/bin:/sbin:/bin"
RESERVED_PREFIX = "SPOTAGENT_"


class SupervisorError(SpotagentError):
    """The supervisor was used wrongly or configured badly."""


class TrainerStartError(SupervisorError):
    """The trainer could not be started (command missing, exec failed)."""


class TrainerState(enum.StrEnum):
    IDLE = "idle"              # constructed, start() not called yet
    STARTING = "starting"      # spawned, younger than the startup grace
    RUNNING = "running"
    BACKOFF = "backoff"        # crashed (or failed to start); restarts at next_start_at
    STOPPING = "stopping"      # asked to stop (signal sent); no restart from here
    STOPPED = "stopped"        # stopped on request; last_exit_code says how it ended
    EXITED_OK = "exited_ok"    # exited 0 on its own: training complete
    FAILED = "failed"          # restart budget exhausted


ALIVE = frozenset({TrainerState.STARTING, TrainerState.RUNNING, TrainerState.STOPPING})


# --- policy (pure) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff with a restart budget per sliding time window.

    The n-th failure inside the window waits min(cap, base * factor**(n-1)), shortened by up
    to `jitter` (a fraction) so that many agents restarting together spread out; failure
    number budget+1 inside the window gives up. Failures age out of the window, so a trainer
    that crashes once a day always restarts after `base`.
    """

    base: float = 1.0
    factor: float = 2.0
    cap: float = 60.0
    budget: int = 5
    window: float = 600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        checks = {
            "base": self.base > 0, "factor": self.factor >= 1, "cap": self.cap >= self.base,
            "budget": self.budget >= 0, "window": self.window > 0,
            "jitter": 0 <= self.jitter < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise SupervisorError("invalid restart policy", field=name,
                                      value=getattr(self, name))

    def failures_in_window(self, history: Sequence[float], now: float) -> int:
        return sum(1 for t in history if now - self.window < t <= now)

    def next_delay(self, history: Sequence[float], now: float, *,
                   rand: float = 0.0) -> float | None:
        """Delay before the next start given failure times `history` (including the one that
        just happened), or None when the budget is exhausted. `rand` in [0, 1) scales jitter."""
        n = max(1, self.failures_in_window(history, now))
        if n > self.budget:
            return None
        exponent = (n - 1) * math.log(self.factor) if self.factor > 1 else 0.0
        delay = self.cap if exponent > math.log(self.cap / self.base) else min(
            self.cap, self.base * self.factor ** (n - 1))
        return delay * (1.0 - self.jitter * rand)


# --- environment (pure) -------------------------------------------------------------------------


def trainer_env(
    *,
    user: TrainerUser | None,
    checkpoint_dir: str,
    run_id: str,
    control_dir: str = CONTROL_DIR_IN_ROOT,
    extra: Mapping[str, str] | None = None,
    path: str = DEFAULT_PATH,
    lang: str = "C.UTF-8",
) -> dict[str, str]:
    """The trainer's whole environment: nothing is inherited from the agent.

    SPOTAGENT_RESTART_COUNT is added by the supervisor at each start.
    """
    env = {
        "PATH": path,
        "HOME": user.home if user else "/",
        "USER": user.name if user else "root",
        "LOGNAME": user.name if user else "root",
        "LANG": lang,
    }
    for key, value in (extra or {}).items():
        if key.startswith(RESERVED_PREFIX):
            raise SupervisorError("trainer environment name is reserved", name=key)
        env[key] = value
    env.update({
        "SPOTAGENT_CHECKPOINT_DIR": checkpoint_dir,
        "SPOTAGENT_RUN_ID": run_id,
        "SPOTAGENT_CONTROL_DIR": control_dir,
    })
    return env


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# --- output pump --------------------------------------------------------------------------------


class LineBudget:
    """Token bucket for trainer lines forwarded to the journal (thread-safe).

    journald rate-limits a unit as a whole: a trainer printing thousands of lines a second
    would push the agent's own events (the drain, the release) out of the journal. The log file
    on the volume keeps every line; the journal gets at most `rate` lines a second (bursts of
    `burst`) and one `trainer_output_suppressed` event with the count for what was held back.
    """

    def __init__(self, rate: float = JOURNAL_LINES_PER_S, burst: float = JOURNAL_LINES_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._last = clock()
        self._suppressed = 0
        self._lock = threading.Lock()

    def take(self) -> tuple[bool, int]:
        """(forward this line?, lines suppressed since the last forwarded one)."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                held, self._suppressed = self._suppressed, 0
                return True, held
            self._suppressed += 1
            return False, 0

    def drain(self) -> int:
        """Lines held back and not yet reported (the output ended during a flood)."""
        with self._lock:
            held, self._suppressed = self._suppressed, 0
            return held


class _Pump:
    """Reads the trainer's stdout and stderr line by line into the log and the log file.

    The threads never touch supervisor state; they keep draining even when the log file fails
    (a full pipe would block the trainer).
    """

    def __init__(self, proc: subprocess.Popen[bytes], log_file: IO[bytes] | None,
                 restart_count: int, budget: LineBudget | None = None) -> None:
        self._file = log_file
        self._lock = threading.Lock()
        self._open = 2
        self.last_stderr = ""
        self._pid = proc.pid
        self._restart_count = restart_count
        self._budget = budget if budget is not None else LineBudget()
        assert proc.stdout is not None and proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._run, args=("stdout", proc.stdout), daemon=True,
                             name=f"trainer-stdout-{proc.pid}"),
            threading.Thread(target=self._run, args=("stderr", proc.stderr), daemon=True,
                             name=f"trainer-stderr-{proc.pid}"),
        ]
        for t in self._threads:
            t.start()

    def _run(self, stream: str, pipe: IO[bytes]) -> None:
        try:
            while raw := pipe.readline(MAX_LINE):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if stream == "stderr":
                    self.last_stderr = line
                with self._lock:
                    self._write(raw if raw.endswith(b"\n") else raw + b"\n")
                forward, held = self._budget.take()
                if held:
                    log.warning("trainer_output_suppressed", lines=held, pid=self._pid,
                                detail="journal rate limit; every line is in the log file")
                if forward:
                    log.info("trainer_output", stream=stream, line=line, pid=self._pid,
                             restart_count=self._restart_count)
        finally:
            pipe.close()
            held = self._budget.drain()
            if held:
                log.warning("trainer_output_suppressed", lines=held, pid=self._pid,
                            detail="journal rate limit; every line is in the log file")
            with self._lock:
                self._open -= 1
                if self._open == 0 and self._file is not None:
                    self._file.close()
                    self._file = None

    def _write(self, data: bytes) -> None:
        if self._file is None:
            return
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as exc:
            log.warning("trainer_log_write_failed", error=str(exc))
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))


# --- the supervisor -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisorStatus:
    state: TrainerState
    pid: int | None
    restart_count: int
    last_exit_code: int | None        # negative: killed by that signal
    next_start_at: float | None       # time.monotonic() of the next start (backoff)
    reason: str | None
    failures_in_window: int


class Supervisor:
    """Runs one trainer command; see the module docstring and docs/runtime.md."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        root: Path | None,
        user: TrainerUser | None,
        env: Mapping[str, str],
        log_path: Path | None,
        policy: RestartPolicy,
        cwd: str = "/",
        startup_grace: float = 5.0,
        kill_wait: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) and a for a in argv):
            raise SupervisorError("trainer command must be a non-empty argv list")
        if user is not None and user.uid == 0:
            raise SupervisorError("refusing to run the trainer as root (uid 0)", user=user.name)
        if root is not None and user is None:
            raise SupervisorError("a chroot trainer needs a user (it would run as root)",
                                  root=root)
        self._argv = tuple(argv)
        self._root = root
        self._user = user
        self._env = dict(env)
        self._log_path = log_path
        self._policy = policy
        self._cwd = cwd
        self._startup_grace = startup_grace
        self._kill_wait = kill_wait
        self._rng = rng or random.Random()
        self._chroot_bin: str | None = None
        if root is not None:
            self._chroot_bin = shutil.which("chroot", path=CHROOT_SEARCH)
            if self._chroot_bin is None:
                raise SupervisorError("coreutils chroot not found", searched=CHROOT_SEARCH)

        self._state = TrainerState.IDLE
        self._proc: subprocess.Popen[bytes] | None = None
        self._pump: _Pump | None = None
        self._started_at = 0.0
        self._spawned_wall = 0.0
        self._restart_count = 0
        self._failures: list[float] = []
        self._last_exit: int | None = None
        self._next_start_at: float | None = None
        self._reason: str | None = None
        self._stop_deadline: float | None = None

    # -- queries --

    @property
    def pid(self) -> int | None:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc.pid
        return None

    def status(self, now: float | None = None) -> SupervisorStatus:
        now = time.monotonic() if now is None else now
        return SupervisorStatus(
            state=self._state, pid=self.pid, restart_count=self._restart_count,
            last_exit_code=self._last_exit, next_start_at=self._next_start_at,
            reason=self._reason,
            failures_in_window=self._policy.failures_in_window(self._failures, now))

    # -- starting --

    def _command(self) -> list[str]:
        argv = list(self._argv)
        if self._cwd != "/" and self._root is not None:
            # coreutils chroot always starts in "/": a shell from the root changes directory
            # and execs the trainer in place (same pid).
            argv = ["/bin/sh", "-c", 'cd -- "$1" && shift && exec "$@"', "spotagent-cwd",
                    self._cwd, *argv]
        if self._root is None:
            return argv
        assert self._user is not None and self._chroot_bin is not None
        groups = ",".join(f"+{g}" for g in self._user.groups)
        return [self._chroot_bin, f"--userspec=+{self._user.uid}:+{self._user.gid}",
                f"--groups={groups}", str(self._root), *argv]

    def _set(self, state: TrainerState, reason: str | None = None) -> None:
        previous = self._state
        self._state = state
        if reason is not None:
            self._reason = reason
        if previous is not state:
            log.info("trainer_state", state=str(state), previous=str(previous),
                     reason=self._reason, restart_count=self._restart_count,
                     pid=self._proc.pid if self._proc else None)

    def _spawn(self, now: float) -> int:
        env = dict(self._env)
        env["SPOTAGENT_RESTART_COUNT"] = str(self._restart_count)
        shown = " ".join(self._argv)
        if self._root is not None:
            assert self._user is not None
            try:
                if self._cwd != "/":
                    resolve_command(self._root, "/bin/sh", user=self._user)
                resolve_command(self._root, self._argv[0],
                                search_path=env.get("PATH", DEFAULT_PATH),
                                cwd=self._cwd, user=self._user)
            except ChrootError as exc:
                raise TrainerStartError("trainer cannot start", command=shown,
                                        reason=exc.message, root=self._root) from exc
        log_file: IO[bytes] | None = None
        try:
            if self._log_path is not None:
                self._log_path.parent.mkdir(parents=True, exist_ok=True)
                log_file = self._log_path.open("ab")
                stamp = datetime.now(UTC).isoformat(timespec="seconds")
                log_file.write(f"--- spotagent: trainer start restart_count="
                               f"{self._restart_count} at {stamp} ---\n".encode())
                log_file.flush()
            # On the host (root=None) Popen itself drops to the user; in the chroot the
            # coreutils chroot command does (see the module docstring).
            host_user = self._user if self._root is None else None
            spawned_wall = time.time()
            # restore_signals=False: SIGPIPE stays ignored in the trainer (as systemd's
            # IgnoreSIGPIPE=yes does for services). The read ends of its output pipes live in
            # the agent; when the agent dies, a trainer writing its next line must get EPIPE,
            # not be killed by SIGPIPE before the restarted agent asks it for a checkpoint.
            proc = subprocess.Popen(  # noqa: S603 - argv list, no shell; the one Popen
                self._command(),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, cwd=self._cwd if self._root is None else "/",
                start_new_session=True, close_fds=True, umask=0o022, restore_signals=False,
                user=host_user.uid if host_user else None,
                group=host_user.gid if host_user else None,
                extra_groups=list(host_user.groups) if host_user else None,
            )
        except OSError as exc:
            if log_file is not None:
                log_file.close()
            raise TrainerStartError("trainer cannot start", command=shown,
                                    reason=exc.strerror or str(exc)) from exc
        self._proc = proc
        self._spawned_wall = spawned_wall
        self._started_at = now
        self._next_start_at = None
        self._stop_deadline = None
        self._pump = _Pump(proc, log_file, self._restart_count)
        self._set(TrainerState.STARTING, f"started pid {proc.pid}")
        log.info("trainer_started", pid=proc.pid, restart_count=self._restart_count,
                 command=shown, root=str(self._root) if self._root else None,
                 user=self._user.name if self._user else None)
        return proc.pid

    def start(self, now: float | None = None) -> int:
        """Start the trainer and return its pid.

        A start that fails raises TrainerStartError *and* counts against the budget: the
        status is then `backoff` (poll() retries) or `failed`.
        """
        if self._state is not TrainerState.IDLE:
            raise SupervisorError("trainer already started", state=str(self._state))
        now = time.monotonic() if now is None else now
        try:
            return self._spawn(now)
        except TrainerStartError as exc:
            log.error("trainer_start_failed", error=str(exc))
            self._on_failure(now, str(exc))
            raise

    # -- the loop --

    def poll(self, now: float | None = None) -> SupervisorStatus:
        """Observe the trainer and act: exits, restarts that are due, the stop deadline."""
        now = time.monotonic() if now is None else now
        if self._state in ALIVE and self._proc is not None:
            code = self._proc.poll()
            if code is None:
                if (self._state is TrainerState.STARTING
                        and now - self._started_at >= self._startup_grace):
                    self._set(TrainerState.RUNNING, f"running pid {self._proc.pid}")
                elif (self._state is TrainerState.STOPPING and self._stop_deadline is not None
                      and now >= self._stop_deadline):
                    log.warning("trainer_stop_deadline", pid=self._proc.pid)
                    self._kill(reason="deadline")
                    code = self._proc.returncode
            if code is not None:
                self._on_exit(code, now)
        if (self._state is TrainerState.BACKOFF and self._next_start_at is not None
                and now >= self._next_start_at):
            self._restart_count += 1
            try:
                self._spawn(now)
            except TrainerStartError as exc:
                log.error("trainer_start_failed", error=str(exc),
                          restart_count=self._restart_count)
                self._on_failure(now, str(exc))
        return self.status(now)

    def _on_exit(self, code: int, now: float) -> None:
        assert self._proc is not None
        pid = self._proc.pid
        self._last_exit = code
        self._kill_leftovers()
        if self._pump is not None:
            self._pump.join(timeout=1.0)
        log.info("trainer_exited", pid=pid, code=code, how=describe_exit(code),
                 restart_count=self._restart_count)
        if self._state is TrainerState.STOPPING:
            self._set(TrainerState.STOPPED, f"stopped: {describe_exit(code)}")
        elif code == 0:
            self._set(TrainerState.EXITED_OK, "exited with code 0")
        else:
            reason = describe_exit(code)
            if code in (126, 127) and self._root is not None:
                reason += " (command not found or not executable inside the chroot)"
            if self._pump is not None and self._pump.last_stderr:
                reason += f"; last stderr: {self._pump.last_stderr[:200]}"
            self._on_failure(now, reason)

    def _on_failure(self, now: float, reason: str) -> None:
        self._failures = [t for t in self._failures if now - t < self._policy.window]
        self._failures.append(now)
        delay = self._policy.next_delay(self._failures, now, rand=self._rng.random())
        if delay is None:
            self._next_start_at = None
            self._set(TrainerState.FAILED,
                      f"restart budget exhausted: {len(self._failures)} failures within "
                      f"{self._policy.window:g}s (budget {self._policy.budget}); last: {reason}")
            log.error("trainer_failed", reason=self._reason)
            return
        self._next_start_at = now + delay
        self._set(TrainerState.BACKOFF, f"{reason}; restart in {delay:.2f}s")
        log.info("trainer_restart_scheduled", delay=round(delay, 3),
                 failures_in_window=len(self._failures), reason=reason)

    # -- signals and stopping --

    def signal_main(self, sig: int) -> bool:
        """Send `sig` to the trainer's main process only (never its workers)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return False
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            return False
        log.info("trainer_signal", signal=signal.Signals(sig).name, pid=proc.pid)
        return True

    def begin_stop(self, deadline: float | None = None, sig: int = signal.SIGTERM) -> None:
        """Non-blocking stop: no more restarts; `sig` to the main process; poll() SIGKILLs the
        tree once time.monotonic() reaches `deadline` (None: only kill_tree() does)."""
        if self._state in (TrainerState.STARTING, TrainerState.RUNNING):
            self._set(TrainerState.STOPPING, f"stop requested ({signal.Signals(sig).name})")
            self._stop_deadline = deadline
            self.signal_main(sig)
        elif self._state is TrainerState.STOPPING:
            if deadline is not None:
                self._stop_deadline = (deadline if self._stop_deadline is None
                                       else min(deadline, self._stop_deadline))
        elif self._state in (TrainerState.IDLE, TrainerState.BACKOFF):
            self._next_start_at = None
            self._set(TrainerState.STOPPED, "stopped while not running")

    def stop(self, deadline: float) -> int | None:
        """SIGTERM the main process, wait until `deadline` (time.monotonic()), then SIGKILL the
        whole tree. Returns the exit code (negative: killed by that signal), None if no
        process ran or it could not be killed."""
        self.begin_stop(deadline)
        give_up = deadline + 2 * self._kill_wait + 1.0
        while self.poll().state is TrainerState.STOPPING:
            if time.monotonic() > give_up:
                log.error("trainer_unkillable", pid=self.pid)
                return None
            time.sleep(0.02)
        return self._last_exit

    def kill_tree(self) -> None:
        """SIGKILL the main process and every process of its tree ("already gone" is fine).

        Final: the supervisor ends in `stopped` (poll() reports it), never restarts.
        """
        if self._state in (TrainerState.STARTING, TrainerState.RUNNING, TrainerState.BACKOFF):
            self._next_start_at = None
            if self._state is TrainerState.BACKOFF:
                self._set(TrainerState.STOPPED, "killed while not running")
            else:
                self._set(TrainerState.STOPPING, "kill requested")
        self._kill(reason="kill_tree")

    def _tree(self) -> list[psutil.Process]:
        """Every live process of the trainer's tree except the main one: descendants of the
        main process, plus anything left in its session (orphaned workers)."""
        proc = self._proc
        if proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        if proc.returncode is None:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    found[child.pid] = child
            except psutil.NoSuchProcess:
                pass
        me = os.getpid()
        for p in psutil.process_iter():
            if p.pid in (me, proc.pid) or p.pid in found:
                continue
            try:
                if (os.getsid(p.pid) == proc.pid and p.create_time() >= self._spawned_wall - 1
                        and _alive(p)):
                    found[p.pid] = p
            except (OSError, psutil.Error):
                continue
        return list(found.values())

    def _kill(self, *, reason: str) -> None:
        proc = self._proc
        if proc is None:
            return
        main_alive = proc.returncode is None
        # Snapshot first: once the main process dies its children are reparented, and a worker
        # that left the session (setsid) is then found by nothing.
        victims = self._tree()
        if main_alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        killed = 0
        for _ in range(3):   # a worker may fork between the snapshot and its death
            if not victims:
                break
            killed += len(victims)
            self._kill_processes(victims)
            victims = self._tree()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if main_alive:
            try:
                proc.wait(timeout=self._kill_wait)
            except subprocess.TimeoutExpired:
                log.error("trainer_tree_survivors", pids=str(proc.pid))
        if main_alive or killed:
            log.warning("trainer_killed", pid=proc.pid, reason=reason, tree=killed)

    def _kill_processes(self, victims: list[psutil.Process]) -> None:
        for v in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                v.kill()
        # Not psutil.wait_procs: orphans are reparented to PID 1, which may never reap them,
        # and a zombie is as dead as it gets.
        end = time.monotonic() + self._kill_wait
        alive = [p for p in victims if _alive(p)]
        while alive and time.monotonic() < end:
            time.sleep(0.01)
            alive = [p for p in alive if _alive(p)]
        if alive:
            log.error("trainer_tree_survivors", pids=",".join(str(p.pid) for p in alive))

    def _kill_leftovers(self) -> None:
        """After the main process exited: its workers must not outlive it (they hold GPU
        memory and keep the volume busy)."""
        leftovers = self._tree()
        if leftovers:
            log.warning("trainer_leftovers_killed", count=len(leftovers),
                        pids=",".join(str(p.pid) for p in leftovers))
            self._kill_processes(leftovers)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
