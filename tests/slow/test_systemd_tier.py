"""The shipped unit under a real systemd: the Packer-built image booted with systemd as PID 1.

Each test boots the image (systemd-nspawn) as one emulated instance whose agent talks to the
IMDS and strict EC2 emulators on the host, claims a pool volume (a loop device the device plane
sets up on attach), mounts it and chroots into it to run a protocol-speaking busybox trainer.
What is checked is what an operator sees: `systemctl status spotagent`, the journal, and the
volume's state and tags in EC2.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import MOUNT_POINT_IN_IMAGE as MOUNT_POINT
from conftest import Machine, record, status_line

# Generous bounds to catch hangs: a cold first test also debootstraps and runs packer build.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

def timespan(text: str) -> float:
    """A systemd time span as `systemctl show` prints it ("30s", "1min 30s", "500ms")."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|min|h)", text)
    assert parts, text
    return sum(float(n) * units[u] for n, u in parts)


def mounts_at(m: Machine, path: str) -> list[str]:
    """Sources of the mounts at `path` in the container's main mount namespace (PID 1's)."""
    out = m.box.run("findmnt", "--noheadings", "--output=SOURCE", "--mountpoint", path,
                    check=False).stdout
    return out.split()


def training(m: Machine, min_step: int = 3) -> object:
    return m.wait_for(lambda s: s.state == "training" and (s.step or 0) >= min_step,
                      what=f"training at step {min_step}")


def wait_status_line(m: Machine, pred, what: str, timeout: float = 60) -> tuple[str, str]:
    end = time.monotonic() + timeout
    text, line = "", None
    while time.monotonic() < end:
        text = m.box.status(m.UNIT)
        line = status_line(text)
        if line is not None and pred(line):
            return text, line
        time.sleep(0.2)
    raise AssertionError(f"no status line {what}:\n{text}")


def test_unit_is_active_running_and_its_status_line_shows_the_step(boot_instance) -> None:
    m = boot_instance()
    ready = m.wait_ready()
    booted = m.box.wait_booted()
    unit = m.unit("ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    agent_start = m.box.monotonic_of(unit["ExecMainStartTimestampMonotonic"]) - m.box.started_at
    record("container start -> agent exec", agent_start)
    print(f"\nboot -> READY: {ready:.2f} s (agent started {agent_start:.2f} s after the "
          f"container; system {booted})")
    training(m)
    # STATUS= is sent when the one-line summary changes; wait for one that carries a step.
    text, line = wait_status_line(m, lambda ln: " step " in ln, "with a step")
    assert re.search(r"Active: active \(running\)", text), text
    assert re.fullmatch(rf"training, volume {m.volume_id}, step \d+.*", line), line
    assert "Loaded: loaded (/etc/systemd/system/spotagent.service; enabled" in text, text
    vol = m.volume()
    assert vol["State"] == "in-use"
    assert vol["Attachments"][0]["InstanceId"] == m.inst.instance_id
    assert vol["TagMap"]["spotagent:owner"] == m.inst.instance_id
    # What an operator's shell on the instance sees: the volume at the mount point (the unit
    # has no mount namespace of its own), the trainer's log on it, and `spotagent status`.
    st = m.agent_status()
    assert mounts_at(m, MOUNT_POINT) == [st.device]
    assert "step " in m.box.run("cat", f"{MOUNT_POINT}/var/log/spotagent/trainer.log").stdout
    out = m.box.run("/opt/spotagent/venv/bin/spotagent", "status").stdout
    assert out.startswith(f"training, volume {m.volume_id}"), out


def test_with_an_empty_pool_the_unit_is_ready_and_waits_then_claims_a_new_volume(
        boot_instance, tmp_path) -> None:
    from agent_world import busybox_image

    m = boot_instance(with_volume=False, config_text=lambda t: t.replace(
        "[pool]\n", "[pool]\nwait_max_backoff = 2\n", 1))
    m.wait_ready()  # READY=1 while waiting: boot is not held up by an empty pool
    text, _ = wait_status_line(m, lambda ln: ln.startswith("waiting"), "waiting")
    assert "Active: active (running)" in text, text
    snap = m.world.make_snapshot(busybox_image(tmp_path / "late"))
    m.volume_id = m.world.make_pool_volumes("dl", 1, snapshot_id=snap)[0]
    training(m)
    wait_status_line(m, lambda ln: ln.startswith(f"training, volume {m.volume_id}, step "),
                     "training on the new volume")
    assert m.volume()["TagMap"]["spotagent:owner"] == m.inst.instance_id


def test_a_spot_notice_drains_and_the_volume_becomes_available(boot_instance) -> None:
    m = boot_instance()
    m.wait_ready()
    training(m)
    noticed = time.monotonic()
    m.world.imds.fire_spot_action(m.inst.instance_id, "terminate")
    # Released: the agent exits 0 after detach and untag; Restart=on-failure leaves it stopped.
    unit = m.wait_unit(lambda p: p["ActiveState"] == "inactive", timeout=120,
                       what="unit inactive after the release")
    record("spot notice -> released, agent exited", time.monotonic() - noticed)
    assert unit["Result"] == "success" and unit["NRestarts"] == "0", unit
    vol = m.volume()
    assert vol["State"] == "available", m.diagnostics()
    assert "spotagent:owner" not in vol["TagMap"]
    assert int(vol["TagMap"]["spotagent:checkpoint-step"]) >= 3
    journal = m.box.journal(m.UNIT)
    assert "interruption_notice" in journal and "volume_released" in journal
    assert m.world.plane.violations == []


def test_systemctl_stop_drains_and_releases(boot_instance) -> None:
    m = boot_instance()
    m.wait_ready()
    st = training(m)
    start = time.monotonic()
    m.box.systemctl("stop", m.UNIT, check=True, timeout=240)
    record("systemctl stop (drain + release)", time.monotonic() - start)
    vol = m.volume()
    assert vol["State"] == "available", m.diagnostics()
    assert "spotagent:owner" not in vol["TagMap"]
    assert int(vol["TagMap"]["spotagent:checkpoint-step"]) >= st.step
    unit = m.unit("ActiveState", "Result", "NRestarts")
    assert unit == {"ActiveState": "inactive", "Result": "success", "NRestarts": "0"}, unit
    assert "drain_started" in m.box.journal(m.UNIT)
    assert m.world.plane.violations == []


# A trainer whose checkpoint on SIGTERM takes 8 s (a big model's save): one step per 0.1 s,
# progress in the control directory, the committed step written last.
SLOW_CHECKPOINT_TRAINER = r"""#!/bin/sh
ck="$SPOTAGENT_CHECKPOINT_DIR"; ctl="$SPOTAGENT_CONTROL_DIR"
step=0; committed=0; term=0
trap 'term=1' TERM
progress() {
  printf '{"step": %d, "last_committed_step": %d, "last_commit_time": %s}' \
    "$step" "$committed" "$(date +%s)" > "$ctl/.p.tmp" && mv "$ctl/.p.tmp" "$ctl/progress.json"
}
while :; do
  step=$((step + 1)); progress; sleep 0.1
  if [ "$term" = 1 ]; then
    echo "saving step $step"; sleep 8
    echo "$step" > "$ck/step"; committed=$step; progress; echo "committed $step"; exit 0
  fi
done
"""


def slow_checkpoint_trainer(root: Path) -> None:
    script = root / "opt/slow-checkpoint.sh"
    script.write_text(SLOW_CHECKPOINT_TRAINER)
    script.chmod(0o755)


def test_a_drain_longer_than_the_stop_timeout_is_granted_by_extend_timeout_usec(
        boot_instance) -> None:
    """STOPPING=1 + EXTEND_TIMEOUT_USEC under a real systemd: with TimeoutStopSec=3 (a test
    drop-in) an 8 s checkpoint still completes, nothing is SIGKILLed, the volume is released."""
    m = boot_instance(
        volume_extra=slow_checkpoint_trainer, unit_override="TimeoutStopSec=3",
        config_text=lambda t: t.replace('["/bin/sh", "/opt/trainer.sh"]',
                                        '["/bin/sh", "/opt/slow-checkpoint.sh"]'))
    m.wait_ready()
    st = training(m)
    assert m.unit("TimeoutStopUSec")["TimeoutStopUSec"] == "3s"
    start = time.monotonic()
    m.box.systemctl("stop", m.UNIT, check=True, timeout=240)
    took = time.monotonic() - start
    record("systemctl stop with an 8 s checkpoint (TimeoutStopSec=3)", took)
    assert took >= 8, f"stop returned after {took:.1f} s: the checkpoint cannot have finished"
    unit = m.unit("ActiveState", "Result")
    assert unit == {"ActiveState": "inactive", "Result": "success"}, m.diagnostics()
    journal = m.box.journal(m.UNIT)
    assert "timed out" not in journal and "SIGKILL" not in journal, journal[-3000:]
    vol = m.volume()
    assert vol["State"] == "available"
    assert int(vol["TagMap"]["spotagent:checkpoint-step"]) >= st.step


def test_a_broken_config_fails_the_unit_with_its_one_line_error(boot_instance) -> None:
    m = boot_instance(config_text=lambda t: t.replace("poll_interval = 0.2",
                                                      "poll_interval = -1"),
                      with_volume=False)
    m.box.wait_booted()
    unit = m.wait_unit(lambda p: p["ActiveState"] == "failed", "ActiveState", "Result",
                       "ExecMainStatus", "NRestarts", timeout=60, what="unit failed")
    assert unit["Result"] == "exit-code" and unit["ExecMainStatus"] == "2", unit
    time.sleep(6)  # longer than RestartSec=5: exit 2 must not be restarted
    assert m.unit("NRestarts", "ActiveState") == {"NRestarts": "0", "ActiveState": "failed"}
    text = m.box.status(m.UNIT)
    errors = [ln for ln in text.splitlines() if "spotagent: config error" in ln]
    assert len(errors) == 1, text
    assert "imds.poll_interval" in errors[0] and "-1" in errors[0], errors[0]
    assert "status=2/INVALIDARGUMENT" in text, text


def test_a_hung_agent_is_restarted_by_the_watchdog_and_keeps_its_volume(boot_instance) -> None:
    m = boot_instance()
    m.wait_ready()
    st = training(m)
    before = m.unit("MainPID", "NRestarts", "WatchdogUSec")
    assert before["NRestarts"] == "0"
    hung = m.box.host_pid(int(before["MainPID"]))
    stopped_at = time.monotonic()
    os.kill(hung, signal.SIGSTOP)
    watchdog_s = timespan(before["WatchdogUSec"])
    after = m.wait_unit(lambda p: p["NRestarts"] == "1" and p["ActiveState"] == "active",
                        timeout=watchdog_s + 90, what="restart by the watchdog")
    record("SIGSTOP -> restarted agent READY", time.monotonic() - stopped_at)
    assert after["MainPID"] != before["MainPID"]
    journal = m.box.journal(m.UNIT)
    assert "Failed with result 'watchdog'" in journal, journal[-3000:]
    st2 = m.wait_for(lambda s: s.state == "training" and s.trainer_pid is not None
                     and (s.step or 0) >= 1 and s.agent_pid != st.agent_pid,
                     what="the restarted agent training")
    # Re-used, not claimed again: same volume, still this instance's, one claim generation;
    # the mount the hung agent made is taken over, not stacked.
    assert st2.volume_id == st.volume_id == m.volume_id
    assert "claim_reused" in journal and "already_mounted" in m.box.journal(m.UNIT)
    assert mounts_at(m, MOUNT_POINT) == [st.device]
    vol = m.volume()
    assert vol["State"] == "in-use"
    assert vol["Attachments"][0]["InstanceId"] == m.inst.instance_id
    assert vol["TagMap"]["spotagent:owner"] == m.inst.instance_id
    assert vol["TagMap"]["spotagent:generation"] == "1"
    assert m.world.plane.violations == []


def test_a_chatty_trainer_does_not_hide_the_agents_drain_from_the_journal(boot_instance) -> None:
    """journald rate-limits the unit as a whole: trainer output forwarded line by line used to
    exhaust it within seconds and the agent's drain events vanished from the journal."""
    spammer = '["/bin/sh", "-c", "while true; do echo progress-bar-line; done"]'
    m = boot_instance(config_text=lambda t: t.replace('["/bin/sh", "/opt/trainer.sh"]', spammer))
    m.wait_ready()
    time.sleep(5)
    m.box.systemctl("stop", m.UNIT, check=True, timeout=240)
    assert m.volume()["State"] == "available"  # the drain itself works
    journal = m.box.journal(m.UNIT)
    assert "progress-bar-line" in journal
    assert '"event": "trainer_output_suppressed"' in journal
    for event in ("drain_started", "volume_released"):
        assert f'"event": "{event}"' in journal, f"{event} is not in the journal"
