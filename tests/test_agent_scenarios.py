"""The whole boot under each interruption and ending the issues ask for, with real parts:
`spotagent run` processes against the IMDS and strict EC2 emulators, loop devices, real mounts,
a real chroot of a busybox root and a trainer that speaks the protocol (tests/agent_world.py).

systemd stop (twice), rebalance (checkpoint and continue; or drain), hibernate, a notice from
before this boot, trainer crashes and the restart budget, job complete, `spotagent status`,
pool.on_empty wait and fail, and the sd_notify watchdog during a slow attach.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from agent_world import (
    TRAINER_LOG,
    Agent,
    assert_released,
    attachments,
    emulated_world,
    pool_volumes,
    run_cli,
    running,
    settings,
    volume_files,
)

from spotagent.runner import kernel_boot_time
from spotagent.testbed.world import World

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("needs root (loop devices, mounts, chroot)", allow_module_level=True)

CKPT = "home/trainer/ckpt/step"


def on_volume(world: World, volume_id: str) -> tuple[str, int | None]:
    """(trainer log, committed step) read from the released volume's image."""
    files = volume_files(world, volume_id, TRAINER_LOG, CKPT)
    log, step = files[TRAINER_LOG], files[CKPT]
    assert log is not None, files
    return log, int(step) if step is not None else None


def test_systemd_stop_checkpoints_releases_and_a_second_sigterm_does_not_interrupt(
        world: World, volume: str) -> None:
    # A checkpoint that takes a second: the second SIGTERM lands in the middle of the drain.
    inst = world.launch(pool="dl", settings=settings(trainer={"env": {"COMMIT_SECONDS": "1"}}))
    with running(inst) as agent:
        agent.training_past(5)
        agent.signal(signal.SIGTERM)
        agent.wait_for(lambda s: s.state == "draining", timeout=10, what="draining")
        agent.signal(signal.SIGTERM)
        assert agent.wait_exit(60) == 0, agent.output()
        st = agent.status()
        assert st is not None and st.state == "released" and st.cause == "volume released"
        assert st.error is None
        committed = st.last_committed_step
        assert committed is not None and committed >= 5
        causes = [e["cause"] for e in agent.events("state_changed")]
        assert causes.count("stop:systemd") == 1, causes
        signals = [e["signal"] for e in agent.events("trainer_signal")]
        assert signals == ["SIGTERM"], signals   # one SIGTERM reached the trainer, no kill
        assert not agent.events("trainer_killed")
    tags = assert_released(world, inst, volume, generation=1)
    assert tags["spotagent:checkpoint-step"] == str(committed)
    log, step = on_volume(world, volume)
    assert step == committed
    assert log.count("signal TERM") == 1 and f"committed {committed}" in log


def test_rebalance_checkpoints_and_training_continues(world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    with running(inst) as agent:
        agent.training_past(3)
        world.imds.fire_rebalance(inst.instance_id)
        st = agent.wait_for(lambda s: (s.last_committed_step or 0) >= 3, timeout=20,
                            what="a checkpoint after the rebalance")
        committed = st.last_committed_step
        assert committed is not None
        st = agent.wait_for(lambda s: (s.step or 0) >= committed + 5, timeout=20,
                            what="training past the rebalance checkpoint")
        assert st.state == "training" and st.notice is not None
        assert st.notice.startswith("rebalance:")
        assert [e["signal"] for e in agent.events("trainer_signal")] == ["SIGUSR1"]
        # The checkpoint answered the rebalance; nothing was drained or released.
        assert attachments(world, volume)[0]["InstanceId"] == inst.instance_id
        proc = agent.cli("drain", "--wait", "--timeout", "60")
        assert proc.returncode == 0, proc.stdout + proc.stderr + agent.output()
        assert agent.wait_exit(30) == 0
    assert_released(world, inst, volume)
    log, step = on_volume(world, volume)
    assert "signal USR1" in log and f"committed {committed}" in log
    assert step is not None and step > committed


def test_rebalance_with_on_rebalance_drain_drains(world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings(drain={"on_rebalance": "drain"}))
    with running(inst) as agent:
        agent.training_past(3)
        world.imds.fire_rebalance(inst.instance_id)
        assert agent.wait_exit(60) == 0, agent.output()
        st = agent.status()
        assert st is not None and st.state == "released"
        assert "notice:rebalance:rebalance" in [e["cause"] for e in agent.events("state_changed")]
        assert [e["signal"] for e in agent.events("trainer_signal")] == ["SIGTERM"]
        committed = st.last_committed_step
    tags = assert_released(world, inst, volume)
    assert tags["spotagent:checkpoint-step"] == str(committed)


def test_hibernate_notice_stops_the_trainer_at_once_and_releases(
        world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    with running(inst) as agent:
        agent.training_past(3)
        world.imds.fire_spot_action(inst.instance_id, "hibernate")
        assert agent.wait_exit(60) == 0, agent.output()
        st = agent.status()
        assert st is not None and st.state == "released" and st.deadline is not None
        # No two-minute guarantee for hibernation: SIGTERM at once (not at a deadline), and a
        # best-effort deadline of drain.stop_deadline from detection, so the trainer commits.
        notice = next(e for e in agent.events("interruption_notice") if "detected_at" in e)
        detected = datetime.fromisoformat(notice["detected_at"]).timestamp()
        assert st.deadline <= detected + 90 + 0.001
        sig = agent.events("trainer_signal")[0]
        assert sig["signal"] == "SIGTERM"
        signalled = datetime.fromisoformat(sig["timestamp"]).timestamp()
        assert signalled - detected < 5.0   # generous bound: "at once", not "at a deadline"
        assert st.last_committed_step is not None and st.last_committed_step >= 3
        assert not agent.events("trainer_killed")
    assert_released(world, inst, volume)


def test_notices_from_before_this_boot_are_ignored(world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    boot = kernel_boot_time()
    # Left over from an earlier boot, present at the agent's very first poll.
    world.imds.fire_spot_action(inst.instance_id, "terminate", at=boot - timedelta(minutes=2))
    world.imds.fire_rebalance(inst.instance_id, notice_time=boot - timedelta(hours=1))
    with running(inst) as agent:
        st = agent.training_past(15)
        assert st.notice is None and "notice" not in st.timeline
        ignored = [e["cause"] for e in agent.events("notice_ignored")]
        assert len(ignored) == 2 and all("predates this boot" in c for c in ignored), ignored
        assert not agent.events("trainer_signal")
        proc = agent.cli("drain", "--wait", "--timeout", "60")
        assert proc.returncode == 0, proc.stdout + proc.stderr + agent.output()
    assert_released(world, inst, volume)


def test_trainer_crashes_restart_with_backoff_until_the_budget_is_spent(
        world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings(
        trainer={"env": {"FAIL": "1"}, "restart_budget": 2, "restart_backoff": 0.2}))
    with running(inst) as agent:
        code = agent.wait_exit(60)
        assert code != 0, agent.output()
        st = agent.status()
        assert st is not None and st.state == "failed"
        assert st.error is not None and "restart budget exhausted" in st.error
        assert "exited with code 3" in st.error and "\n" not in st.error
        delays = [e["delay"] for e in agent.events("trainer_restart_scheduled")]
        assert len(delays) == 2 and delays[0] < delays[1], delays   # backoff grows
        assert agent.events("trainer_failed")
        proc = agent.cli("status")
        assert proc.returncode == 0 and "restart budget exhausted" in proc.stdout
        assert proc.stdout.splitlines()[0].startswith("failed")
    tags = assert_released(world, inst, volume)
    assert "spotagent:done" not in tags
    log, _ = on_volume(world, volume)
    for n in range(3):
        assert f"restart={n} " in log, log


def test_trainer_exit_0_completes_the_job_and_a_done_volume_is_never_claimed(
        world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings(trainer={"env": {"MAX_STEPS": "12"}}))
    with running(inst) as agent:
        assert agent.wait_exit(60) == 0, agent.output()
        st = agent.status()
        assert st is not None and st.state == "completed" and st.last_committed_step == 12
    tags = assert_released(world, inst, volume, generation=1)
    assert tags["spotagent:done"] == "true"
    assert tags["spotagent:checkpoint-step"] == "12"

    later = world.launch(pool="dl", settings=settings(pool={"wait_max_backoff": 1}))
    with running(later) as agent:
        agent.wait_for(lambda s: s.state == "waiting", timeout=30, what="waiting")
        refused = agent.events("candidate_refused")
        assert refused and refused[0]["volume_id"] == volume
        time.sleep(1.5)   # a retry or two: still nothing claimed
        assert attachments(world, volume) == []
        agent.signal(signal.SIGTERM)
        assert agent.wait_exit(30) == 0
        st = agent.status()
        assert st is not None and st.state == "released" and st.volume_id is None
    assert world.volume(volume)["TagMap"]["spotagent:generation"] == "1"


def test_status_shows_training_then_the_notice_and_deadline_of_the_drain(
        world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings(trainer={"env": {"COMMIT_SECONDS": "2"}}))
    with running(inst) as agent:
        agent.wait_for(lambda s: (s.step or 0) >= 3 and s.last_commit_time is not None,
                       what="training with progress")
        proc = agent.cli("status", "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["state"] == "training"
        assert doc["instance_id"] == inst.instance_id
        assert doc["availability_zone"] == inst.availability_zone
        assert doc["volume_id"] == volume and doc["generation"] == 1
        assert doc["device"].startswith("/dev/loop")
        assert doc["mount_point"] == str(inst.mount_point)
        assert doc["trainer_pid"] and doc["agent_pid"] == agent.pid
        assert doc["step"] >= 3 and doc["last_committed_step"] == 0
        assert doc["notice"] is None and doc["deadline"] is None
        for phase in ("start", "claimed", "mounted", "trainer_started", "first_step"):
            assert phase in doc["timeline"], phase
        assert doc["summary"].startswith(f"training, volume {volume}, step ")

        text = agent.cli("status")
        assert text.returncode == 0
        lines = text.stdout.splitlines()
        rows = {line.split()[0]: line for line in lines[1:] if line and line[0] != " "}
        assert rows["state"].split()[1] == "training"
        assert inst.instance_id in rows["instance"] and volume in rows["volume"]
        assert str(inst.mount_point) in rows["mount"] and "pid" in rows["trainer"]
        assert rows["checkpoint"].startswith("checkpoint  step 0")
        assert "timeline:" in lines and any(line.endswith("first_step") for line in lines)

        world.imds.fire_spot_action(inst.instance_id, "terminate")
        agent.wait_for(lambda s: s.state == "draining", timeout=10, what="draining")
        doc = json.loads(agent.cli("status", "--json").stdout)
        assert doc["state"] == "draining" and doc["notice"].startswith("spot:terminate at ")
        assert doc["deadline"] is not None and doc["deadline"] > time.time()
        assert "notice" in doc["timeline"]
        assert "notice spot:terminate" in doc["summary"] and "deadline in" in doc["summary"]
        text = agent.cli("status").stdout
        assert "spot:terminate" in text and "deadline" in text
        assert agent.wait_exit(60) == 0
        doc = json.loads(agent.cli("status", "--json").stdout)
        assert doc["state"] == "released"
        for phase in ("checkpoint_committed", "trainer_exited", "unmounted",
                      "volume_available"):
            assert phase in doc["timeline"], phase
    assert_released(world, inst, volume)


def test_on_empty_wait_claims_the_volume_the_moment_another_instance_releases_it(
        world: World, volume: str) -> None:
    a = world.launch(pool="dl", settings=settings())
    b = world.launch(pool="dl", settings=settings(pool={"wait_max_backoff": 1}))
    with running(a) as agent_a:
        agent_a.training_past(3)
        agent_b = Agent(b).start()
        st = agent_b.wait_for(lambda s: s.state == "waiting", timeout=30, what="B waiting")
        assert st.volume_id is None
        proc = run_cli(b, "status")
        assert proc.returncode == 0 and proc.stdout.startswith("waiting")
        world.imds.fire_spot_action(a.instance_id, "terminate")
        assert agent_a.wait_exit(60) == 0
        committed = agent_a.status().last_committed_step  # type: ignore[union-attr]
        assert committed is not None
        released_at = time.monotonic()
        st = agent_b.wait_for(lambda s: s.state == "training" and (s.step or 0) > committed,
                              timeout=60, what="B training past A's checkpoint")
        assert time.monotonic() - released_at < 30   # bound: it retried, it did not give up
        assert st.volume_id == volume and st.generation == 2
        proc = agent_b.cli("drain", "--wait", "--timeout", "60")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_released(world, b, volume, generation=2)
    log, _ = on_volume(world, volume)
    assert f"resumed from {committed} " in log


def test_on_empty_fail_exits_non_zero_with_a_clear_error(world: World) -> None:
    inst = world.launch(pool="dl", settings=settings(pool={"on_empty": "fail"}))
    with running(inst) as agent:
        assert agent.wait_exit(60) == 1
        st = agent.status()
        assert st is not None and st.state == "failed"
        assert st.error == "no free volume in the pool"
        proc = agent.cli("status")
        assert proc.stdout.splitlines()[0] == "failed, error: no free volume in the pool"
        assert any(e["cause"] == "pool empty: on_empty=fail"
                   for e in agent.events("state_changed"))
    pool = world.client.describe_volumes(
        Filters=[{"Name": "tag-key", "Values": ["spotagent:pool"]}])["Volumes"]
    assert pool == []   # nothing created, nothing claimed


class _NotifySocket:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET; records what arrives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.received: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.received.append((time.time(), data.decode()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def test_watchdog_pings_do_not_starve_during_a_slow_attach(tmp_path: Path, image: Path) -> None:
    watchdog_usec = 2_000_000   # systemd would kill the agent after 2 s without WATCHDOG=1
    with emulated_world(tmp_path, attach_delay=3.0) as world:
        volume = pool_volumes(world, image)[0]
        inst = world.launch(pool="dl", settings=settings())
        notify = _NotifySocket(tmp_path / "notify.sock")
        try:
            env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(watchdog_usec)}
            with running(inst, env=env) as agent:
                agent.training_past(3)
                world.imds.fire_spot_action(inst.instance_id, "terminate")
                assert agent.wait_exit(60) == 0, agent.output()
        finally:
            notify.close()
        claim = agent.events("volume_claimed")[0]
        assert claim["seconds"] >= 2.5   # the attach really blocked the main loop
        claimed = datetime.fromisoformat(claim["timestamp"]).timestamp()
        window = (claimed - claim["seconds"], claimed)
        pings = [t for t, msg in notify.received if "WATCHDOG=1" in msg.split("\n")]
        during = [window[0], *(t for t in pings if window[0] < t < window[1]), window[1]]
        gaps = [b - a for a, b in itertools.pairwise(during)]
        assert max(gaps) < watchdog_usec / 1e6, gaps   # never starved while the claim blocked
        assert max(b - a for a, b in itertools.pairwise(pings)) < watchdog_usec / 1e6
        assert any("READY=1" in msg for _, msg in notify.received)
        assert any("STOPPING=1" in msg for _, msg in notify.received)
        assert_released(world, inst, volume)
