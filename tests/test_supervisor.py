"""The supervisor: real processes (on the host and chrooted into a busybox root), real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from structlog.testing import capture_logs

from spotagent.chroot import (
    ChrootError,
    Environment,
    TrainerUser,
    leftover_mounts,
    lookup_user,
    unmount_beneath,
)
from spotagent.supervisor import (
    RestartPolicy,
    Supervisor,
    SupervisorError,
    SupervisorStatus,
    TrainerStartError,
    TrainerState,
    trainer_env,
)
from spotagent.testbed.rootfs import build_busybox_root

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, setuid)")
HOST_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
NO_JITTER = RestartPolicy(base=1.0, factor=2.0, cap=3.0, budget=5, window=600.0, jitter=0.0)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    limit = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < limit, f"timed out waiting for {what}"
        time.sleep(0.02)


def poll_until_not(sup: Supervisor, states: set[TrainerState], *, now: float | None = None,
                   timeout: float = 10.0) -> SupervisorStatus:
    """Poll (at a fixed virtual `now` if given) until the state leaves `states`."""
    limit = time.monotonic() + timeout
    while True:
        status = sup.poll(now)
        if status.state not in states:
            return status
        assert time.monotonic() < limit, f"stuck in {status.state}: {status.reason}"
        time.sleep(0.02)


ALIVE = {TrainerState.STARTING, TrainerState.RUNNING}


def host_supervisor(script: str, tmp_path: Path, policy: RestartPolicy = NO_JITTER) -> Supervisor:
    return Supervisor(["/bin/sh", "-c", script], root=None, user=None, env=HOST_ENV,
                      log_path=tmp_path / "trainer.log", policy=policy)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --- policy (pure) ------------------------------------------------------------------------------


def test_delays_grow_exponentially_up_to_the_cap() -> None:
    policy = RestartPolicy(base=1.0, factor=2.0, cap=5.0, budget=10, jitter=0.0)
    history: list[float] = []
    delays = []
    for t in range(6):
        history.append(float(t))
        delays.append(policy.next_delay(history, float(t)))
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_budget_per_window_and_failures_age_out() -> None:
    policy = RestartPolicy(base=1.0, budget=2, window=100.0, jitter=0.0)
    assert policy.next_delay([0.0], 0.0) == 1.0
    assert policy.next_delay([0.0, 10.0], 10.0) == 2.0
    assert policy.next_delay([0.0, 10.0, 20.0], 20.0) is None        # third inside 100 s
    assert policy.next_delay([0.0, 10.0, 150.0], 150.0) == 1.0       # the others aged out
    assert RestartPolicy(budget=0).next_delay([5.0], 5.0) is None


def test_jitter_only_shortens_and_huge_factors_do_not_overflow() -> None:
    policy = RestartPolicy(base=10.0, cap=60.0, jitter=0.2)
    assert 8.0 <= policy.next_delay([0.0], 0.0, rand=0.999) <= 10.0  # type: ignore[operator]
    big = RestartPolicy(base=1.0, factor=1e6, cap=30.0, budget=1000, jitter=0.0)
    assert big.next_delay([float(t) for t in range(500)], 499.0) == 30.0


@pytest.mark.parametrize("kw", [{"base": 0}, {"factor": 0.5}, {"cap": 0.1}, {"budget": -1},
                                {"jitter": 1.0}, {"window": 0}])
def test_bad_policy_values_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(SupervisorError, match="invalid restart policy"):
        RestartPolicy(**kw)  # type: ignore[arg-type]


def test_trainer_env_is_clean_and_protocol_names_are_reserved() -> None:
    user = TrainerUser("trainer", 1000, 1000, (2000,), "/home/trainer")
    env = trainer_env(user=user, checkpoint_dir="/ckpt", run_id="run-1",
                      extra={"NCCL_DEBUG": "WARN"})
    assert env == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/home/trainer", "USER": "trainer", "LOGNAME": "trainer", "LANG": "C.UTF-8",
        "NCCL_DEBUG": "WARN", "SPOTAGENT_CHECKPOINT_DIR": "/ckpt", "SPOTAGENT_RUN_ID": "run-1",
        "SPOTAGENT_CONTROL_DIR": "/run/spotagent",
    }
    with pytest.raises(SupervisorError, match="reserved"):
        trainer_env(user=user, checkpoint_dir="/c", run_id="r",
                    extra={"SPOTAGENT_RESTART_COUNT": "9"})


def test_root_and_userless_chroot_are_refused(tmp_path: Path) -> None:
    root_user = TrainerUser("root", 0, 0, (), "/root")
    with pytest.raises(SupervisorError, match="root"):
        Supervisor(["true"], root=None, user=root_user, env={}, log_path=None,
                   policy=NO_JITTER)
    with pytest.raises(SupervisorError, match="needs a user"):
        Supervisor(["true"], root=tmp_path, user=None, env={}, log_path=None, policy=NO_JITTER)
    with pytest.raises(SupervisorError, match="argv"):
        Supervisor("python3 train.py", root=None, user=None, env={}, log_path=None,
                   policy=NO_JITTER)


# --- host processes -----------------------------------------------------------------------------


def test_output_lines_reach_the_log_file_and_the_log_events(tmp_path: Path) -> None:
    sup = host_supervisor("echo 'step 1 loss 2.5'; echo 'warn: slow' >&2; printf 'no newline'",
                          tmp_path)
    with capture_logs() as events:
        sup.start()
        status = poll_until_not(sup, ALIVE)
    assert status.state is TrainerState.EXITED_OK
    lines = (tmp_path / "trainer.log").read_text().splitlines()
    assert lines[0].startswith("--- spotagent: trainer start restart_count=0")
    assert sorted(lines[1:]) == ["no newline", "step 1 loss 2.5", "warn: slow"]
    output = {(e["stream"], e["line"]) for e in events if e["event"] == "trainer_output"}
    assert output == {("stdout", "step 1 loss 2.5"), ("stderr", "warn: slow"),
                      ("stdout", "no newline")}


def test_trainer_outlives_its_output_reader_so_a_restarted_agent_can_stop_it(
        tmp_path: Path) -> None:
    # The agent holds the read ends of the trainer's output pipes. When the agent dies, the
    # trainer's next line must fail with EPIPE, not kill it with SIGPIPE: the restarted agent
    # asks the stray trainer for a checkpoint (SIGTERM) instead of finding it dead.
    agent = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from spotagent.supervisor import RestartPolicy, Supervisor
        sup = Supervisor(["/bin/sh", "-c", "while :; do echo tick; sleep 0.05; done"],
                         root=None, user=None, env={"PATH": "/usr/bin:/bin"},
                         log_path=Path(sys.argv[1]) / "trainer.log", policy=RestartPolicy())
        (Path(sys.argv[1]) / "pid").write_text(str(sup.start()))
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", agent, str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / "pid").is_file() and
                   (tmp_path / "pid").read_text().strip() != "", what="trainer started")
        pid = int((tmp_path / "pid").read_text())
        wait_until(lambda: "tick" in (tmp_path / "trainer.log").read_text(), what="output")
        proc.kill()   # the agent dies; the kernel closes its ends of the pipes
        proc.wait(timeout=10)
        time.sleep(0.5)   # ten writes into pipes without a reader
        assert not gone(pid), "the trainer died with its output reader"
        sig_ign = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                       .splitlines() if line.startswith("SigIgn:"))
        assert int(sig_ign, 16) & (1 << (signal.SIGPIPE - 1))
    finally:
        proc.kill()
        proc.wait(timeout=10)
        with contextlib.suppress(OSError, ValueError):   # never leave the trainer behind
            os.killpg(int((tmp_path / "pid").read_text()), signal.SIGKILL)


def test_exit_zero_is_complete_and_never_restarted(tmp_path: Path) -> None:
    sup = host_supervisor("exit 0", tmp_path)
    sup.start(now=100.0)
    status = poll_until_not(sup, ALIVE, now=100.0)
    assert (status.state, status.last_exit_code, status.restart_count) == (
        TrainerState.EXITED_OK, 0, 0)
    later = sup.poll(now=10_000.0)
    assert later.state is TrainerState.EXITED_OK and later.pid is None


def test_crashes_restart_with_growing_delays_and_a_visible_restart_count(tmp_path: Path) -> None:
    counts = tmp_path / "counts"
    sup = host_supervisor(f'echo "$SPOTAGENT_RESTART_COUNT" >> {counts}; exit 3', tmp_path)
    t = 1000.0
    sup.start(now=t)
    delays = []
    for _ in range(3):
        status = poll_until_not(sup, ALIVE, now=t)
        assert status.state is TrainerState.BACKOFF, status.reason
        assert status.last_exit_code == 3 and "exited with code 3" in (status.reason or "")
        assert status.next_start_at is not None
        delays.append(status.next_start_at - t)
        assert sup.poll(now=status.next_start_at - 0.01).state is TrainerState.BACKOFF
        t = status.next_start_at
        assert sup.poll(now=t).state is TrainerState.STARTING          # the due restart
    poll_until_not(sup, ALIVE, now=t)
    assert delays == [1.0, 2.0, 3.0]                                    # base, x2, cap
    assert counts.read_text().split() == ["0", "1", "2", "3"]
    assert sup.status().restart_count == 3


def test_budget_exhausted_gives_up_with_the_reason(tmp_path: Path) -> None:
    policy = RestartPolicy(base=1.0, budget=2, window=600.0, jitter=0.0)
    sup = host_supervisor("echo boom >&2; exit 7", tmp_path, policy)
    t = 0.0
    sup.start(now=t)
    for _ in range(2):
        status = poll_until_not(sup, ALIVE, now=t)
        assert status.state is TrainerState.BACKOFF
        t = status.next_start_at or 0.0
        sup.poll(now=t)
    status = poll_until_not(sup, ALIVE, now=t)
    assert status.state is TrainerState.FAILED
    assert "restart budget exhausted: 3 failures within 600s (budget 2)" in (status.reason or "")
    assert "exited with code 7" in (status.reason or "")
    assert "last stderr: boom" in (status.reason or "")
    assert sup.poll(now=t + 10_000).state is TrainerState.FAILED
    assert sup.status().restart_count == 2


def test_missing_command_is_a_start_error_counted_against_the_budget(tmp_path: Path) -> None:
    policy = RestartPolicy(base=1.0, budget=1, jitter=0.0)
    sup = Supervisor(["/nonexistent/train.py", "--epochs", "3"], root=None, user=None,
                     env=HOST_ENV, log_path=tmp_path / "t.log", policy=policy)
    with pytest.raises(TrainerStartError) as err:
        sup.start(now=0.0)
    assert "/nonexistent/train.py --epochs 3" in str(err.value)
    assert "No such file or directory" in str(err.value)
    status = sup.status(now=0.0)
    assert (status.state, status.failures_in_window, status.next_start_at) == (
        TrainerState.BACKOFF, 1, 1.0)
    status = sup.poll(now=1.0)                      # the retry fails too: budget of 1 is spent
    assert status.state is TrainerState.FAILED and "cannot start" in (status.reason or "")


def test_kill_tree_is_final_and_stop_during_backoff_stops(tmp_path: Path) -> None:
    sup = host_supervisor("sleep 30", tmp_path)
    pid = sup.start()
    sup.kill_tree()
    status = poll_until_not(sup, {TrainerState.STOPPING})
    assert status.state is TrainerState.STOPPED and status.last_exit_code == -signal.SIGKILL
    assert gone(pid)
    crash = host_supervisor("exit 1", tmp_path)
    crash.start(now=0.0)
    assert poll_until_not(crash, ALIVE, now=0.0).state is TrainerState.BACKOFF
    assert crash.stop(time.monotonic() + 1) == 1
    assert crash.poll(now=1e6).state is TrainerState.STOPPED      # no restart after a stop


def test_sigterm_ignored_on_the_host_is_killed_at_the_deadline(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    sup = host_supervisor(f"trap '' TERM; touch {ready}; while :; do sleep 0.05; done",
                          tmp_path)
    sup.start()
    wait_until(ready.exists, what="the TERM trap")     # a signal before the trap would kill it
    started = time.monotonic()
    code = sup.stop(started + 0.5)
    elapsed = time.monotonic() - started
    assert code == -signal.SIGKILL
    assert 0.5 <= elapsed < 8.0


# --- chrooted processes -------------------------------------------------------------------------


@pytest.fixture
def rootfs(tmp_path: Path) -> Iterator[Path]:
    """A prepared environment (proc, dev, ...), as the trainer always gets one."""
    root = build_busybox_root(tmp_path / "root")
    env = Environment(root, control_dir=tmp_path / "control",
                      resolv_conf=tmp_path / "no-resolv.conf")
    try:
        env.prepare()
        yield root
    finally:
        try:
            unmount_beneath(root)
        except ChrootError:
            unmount_beneath(root, lazy=True)
        assert leftover_mounts(root) == []


@pytest.fixture
def trainer(rootfs: Path) -> TrainerUser:
    return lookup_user(rootfs, "trainer")


def chroot_supervisor(rootfs: Path, trainer: TrainerUser, script_path: str, tmp_path: Path,
                      cwd: str = "/") -> Supervisor:
    env = trainer_env(user=trainer, checkpoint_dir="/tmp", run_id="run-7")
    return Supervisor([script_path], root=rootfs, user=trainer, env=env,
                      log_path=tmp_path / "trainer.log", policy=NO_JITTER, cwd=cwd)


def write_script(rootfs: Path, path_in_root: str, body: str) -> str:
    host = rootfs / path_in_root.lstrip("/")
    host.write_text("#!/bin/sh\n" + body)
    host.chmod(0o755)
    return path_in_root


MAIN = """\
trap 'echo usr1 >> /tmp/main.got' USR1
trap 'echo term >> /tmp/main.got; exit 0' TERM
/opt/worker.sh &
echo $! > /tmp/worker.pid
id -u > /tmp/main.uid
while :; do sleep 0.05; done
"""
WORKER = """\
trap 'echo usr1 >> /tmp/worker.got' USR1
trap 'echo term >> /tmp/worker.got' TERM
echo ready > /tmp/worker.ready
while :; do sleep 0.05; done
"""


@pytest.mark.root
@root_only
def test_signals_reach_the_main_process_only(rootfs: Path, trainer: TrainerUser,
                                             tmp_path: Path) -> None:
    write_script(rootfs, "/opt/worker.sh", WORKER)
    sup = chroot_supervisor(rootfs, trainer, write_script(rootfs, "/opt/main.sh", MAIN),
                            tmp_path)
    tmp = rootfs / "tmp"
    sup.start()
    try:
        # main writes worker.pid then main.uid; the worker may be ready before either
        wait_until(lambda: (tmp / "worker.ready").exists() and (tmp / "main.uid").exists()
                   and (tmp / "main.uid").read_text().strip() != "", what="worker and main")
        worker_pid = int((tmp / "worker.pid").read_text())
        assert (tmp / "main.uid").read_text().strip() == "1000"
        assert sup.signal_main(signal.SIGUSR1)
        wait_until(lambda: (tmp / "main.got").exists(), what="main's USR1 trap")
        assert sup.poll().state in ALIVE                       # USR1: checkpoint and continue
        code = sup.stop(time.monotonic() + 5)
        # stop() returns once the main process exited and its leftovers were SIGKILLed
        assert gone(worker_pid), "the worker outlived the main process"
    finally:
        sup.kill_tree()
    assert code == 0                                             # TERM trap: exit 0
    assert (tmp / "main.got").read_text().split() == ["usr1", "term"]
    assert not (tmp / "worker.got").exists(), (tmp / "worker.got").read_text()
    assert sup.status().state is TrainerState.STOPPED


IGNORES_TERM = """\
trap '' TERM
sleep 1000 &
echo $! > /tmp/child.pid
setsid sh -c 'trap "" TERM; echo $$ > /tmp/detached.pid; while :; do sleep 0.05; done' &
while :; do sleep 0.05; done
"""


@pytest.mark.root
@root_only
def test_trainer_ignoring_sigterm_is_killed_at_the_deadline_with_its_children(
        rootfs: Path, trainer: TrainerUser, tmp_path: Path) -> None:
    sup = chroot_supervisor(rootfs, trainer,
                            write_script(rootfs, "/opt/stubborn.sh", IGNORES_TERM), tmp_path)
    tmp = rootfs / "tmp"
    pid = sup.start()
    try:
        wait_until(lambda: all((tmp / f).exists() and (tmp / f).read_text().strip()
                               for f in ("detached.pid", "child.pid")), what="children")
        child = int((tmp / "child.pid").read_text())
        detached = int((tmp / "detached.pid").read_text())   # its own session and group
        assert os.getsid(detached) != pid
        started = time.monotonic()
        code = sup.stop(started + 1.0)
        elapsed = time.monotonic() - started
    finally:
        sup.kill_tree()
    assert code == -signal.SIGKILL
    assert 1.0 <= elapsed < 8.0
    for p in (pid, child, detached):
        assert gone(p), f"pid {p} survived"


@pytest.mark.root
@root_only
def test_chrooted_trainer_sees_its_environment_and_cwd(rootfs: Path, trainer: TrainerUser,
                                                       tmp_path: Path) -> None:
    script = write_script(rootfs, "/opt/env.sh",
                          'pwd; echo "user=$USER home=$HOME count=$SPOTAGENT_RESTART_COUNT '
                          'run=$SPOTAGENT_RUN_ID"; env | grep -c . ; test -e /opt/env.sh\n')
    sup = chroot_supervisor(rootfs, trainer, script, tmp_path, cwd="/home/trainer")
    sup.start()
    status = poll_until_not(sup, ALIVE)
    assert status.state is TrainerState.EXITED_OK, status.reason
    lines = (tmp_path / "trainer.log").read_text().splitlines()[1:]
    assert lines[0] == "/home/trainer"
    assert lines[1] == "user=trainer home=/home/trainer count=0 run=run-7"
    assert int(lines[2]) <= 12          # a clean environment, nothing of the agent's


@pytest.mark.root
@root_only
def test_command_missing_in_the_chroot_cannot_start(rootfs: Path, trainer: TrainerUser,
                                                    tmp_path: Path) -> None:
    (tmp_path / "host-train").write_text("#!/bin/sh\n")   # exists on the host only
    (tmp_path / "host-train").chmod(0o755)
    sup = chroot_supervisor(rootfs, trainer, str(tmp_path / "host-train"), tmp_path)
    with pytest.raises(TrainerStartError) as err:
        sup.start()
    assert "command not found inside the chroot" in str(err.value)
    assert str(tmp_path / "host-train") in str(err.value)
    assert sup.status().state is TrainerState.BACKOFF


def test_line_budget_forwards_a_burst_then_the_rate_and_counts_what_it_held_back() -> None:
    from spotagent.supervisor import LineBudget

    now = [0.0]
    budget = LineBudget(rate=10, burst=5, clock=lambda: now[0])
    assert [budget.take()[0] for _ in range(5)] == [True] * 5
    assert budget.take() == (False, 0)
    assert budget.take() == (False, 0)
    now[0] += 0.1                      # one token back
    assert budget.take() == (True, 2)  # forwarded, and 2 lines were held back before it
    assert budget.take() == (False, 0)
    now[0] += 100                      # tokens refill only up to the burst
    assert sum(budget.take()[0] for _ in range(20)) == 5


def test_a_chatty_trainer_keeps_every_line_in_the_log_file_but_not_in_the_journal(
        tmp_path: Path) -> None:
    from spotagent.supervisor import JOURNAL_LINES_BURST

    sup = host_supervisor("i=0; while [ $i -lt 3000 ]; do echo line $i; i=$((i+1)); done",
                          tmp_path)
    with capture_logs() as events:
        sup.start()
        status = poll_until_not(sup, ALIVE)
    assert status.state is TrainerState.EXITED_OK
    lines = (tmp_path / "trainer.log").read_text().splitlines()[1:]
    assert len(lines) == 3000
    forwarded = [e for e in events if e["event"] == "trainer_output"]
    # A burst and the sustained rate for however long the loop ran — far fewer than 3000.
    assert JOURNAL_LINES_BURST <= len(forwarded) < 3000
    # What was held back is counted and said, never silently lost.
    suppressed = [e for e in events if e["event"] == "trainer_output_suppressed"]
    assert suppressed
    assert sum(e["lines"] for e in suppressed) + len(forwarded) == 3000
