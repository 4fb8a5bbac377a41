"""The whole boot with real parts: `spotagent run` processes against the IMDS and strict EC2
emulators, loop devices, a real mount and a real chroot of a busybox root, and a trainer that
speaks the protocol. A notice on instance A ends with the volume available and its checkpoint
step tagged; instance B claims the same volume and resumes at the next step."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from agent_world import (
    TRAINER_SETTINGS,
    mounts_under,
    running,
    trainer_log,
)

from spotagent.testbed.world import World

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("needs root (loop devices, mounts, chroot)", allow_module_level=True)


@pytest.fixture
def pool_volume(volume: str) -> str:
    return volume


def test_notice_releases_and_the_next_instance_resumes_at_the_next_step(
        world: World, pool_volume: str) -> None:
    a = world.launch(pool="dl", settings={"trainer": TRAINER_SETTINGS})
    with running(a) as agent:
        st = agent.wait_for(lambda s: s.state == "training" and (s.step or 0) >= 5,
                            what="training at step 5")
        assert st.volume_id == pool_volume and st.instance_id == a.instance_id
        assert "resumed from 0" in trainer_log(a)
        assert "uid=1000" in trainer_log(a)  # the chroot's user, never root
        world.imds.fire_spot_action(a.instance_id, "terminate")
        assert agent.wait_exit(60) == 0
        st = agent.status()
        assert st is not None and st.state == "released", agent.output()
        committed = st.last_committed_step
        assert committed is not None and committed >= 5
        for phase in ("start", "claimed", "mounted", "trainer_started", "first_step", "notice",
                      "checkpoint_committed", "unmounted", "volume_available"):
            assert phase in st.timeline, phase
    vol = world.volume(pool_volume)
    assert vol["State"] == "available"
    assert "spotagent:owner" not in vol["TagMap"]
    assert vol["TagMap"]["spotagent:checkpoint-step"] == str(committed)
    assert vol["TagMap"]["spotagent:generation"] == "1"
    assert mounts_under(a.home) == []
    assert world.plane.device_of(pool_volume) is None
    assert world.plane.violations == []

    b = world.launch(pool="dl", settings={"trainer": TRAINER_SETTINGS})
    with running(b) as agent_b:
        agent_b.wait_for(lambda s: s.state == "training" and (s.step or 0) > committed,
                         what="B training past A's checkpoint")
        log = trainer_log(b)
        assert f"resumed from {committed} " in log
        steps = [int(m) for m in re.findall(r"^step (\d+)$", log, re.M)]
        # A's steps up to its commit, then B's from commit + 1: none lost, none repeated past
        # the committed one.
        assert f"step {committed + 1}" in log.split(f"resumed from {committed} ")[1]
        assert max(steps) > committed
        proc = subprocess.run([*b.agent_argv("drain"), "--wait", "--timeout", "60"],
                              env=b.agent_env(), capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stdout + proc.stderr + agent_b.output()
        assert agent_b.wait_exit(30) == 0
    vol = world.volume(pool_volume)
    assert vol["State"] == "available"
    assert vol["TagMap"]["spotagent:generation"] == "2"
    assert int(vol["TagMap"]["spotagent:checkpoint-step"]) > committed
    assert world.plane.violations == []
