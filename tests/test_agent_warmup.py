"""A cold pool volume is read end to end in the background while the trainer runs, shown in the
status, and tagged spotagent:warm=true; a warm volume is not read again."""

from __future__ import annotations

import os
import time

import pytest
from agent_world import TRAINER_SETTINGS, running

from spotagent.testbed.world import World

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("needs root (loop devices, mounts, chroot)", allow_module_level=True)


def test_cold_volume_is_warmed_and_tagged(world: World, volume: str) -> None:
    vol = volume
    inst = world.launch(pool="dl", settings={
        "trainer": TRAINER_SETTINGS,
        "volume": {"warmup": True, "warmup_rate_mib": 256},  # 1 GiB volume: ~4 s
    })
    with running(inst) as agent:
        st = agent.wait_for(lambda s: s.state == "training" and s.warmup is not None,
                            what="warm-up under way")
        assert st.warmup is not None
        agent.wait_for(lambda s: s.warmup == "done", timeout=60, what="warm-up done")
        end = time.monotonic() + 10
        while time.monotonic() < end and world.volume(vol)["TagMap"].get("spotagent:warm") != \
                "true":
            time.sleep(0.1)
        assert world.volume(vol)["TagMap"].get("spotagent:warm") == "true"
        assert agent.status() is not None and agent.status().state == "training"  # type: ignore[union-attr]
        world.imds.fire_spot_action(inst.instance_id, "terminate")
        assert agent.wait_exit(60) == 0
    assert world.volume(vol)["State"] == "available"
    assert world.plane.violations == []

    # The next instance finds it warm and does not read it again.
    b = world.launch(pool="dl", settings={"trainer": TRAINER_SETTINGS,
                                          "volume": {"warmup": True}})
    with running(b) as agent_b:
        agent_b.wait_for(lambda s: s.state == "training" and (s.step or 0) >= 2,
                         what="B training")
        st_b = agent_b.status()
        assert st_b is not None and st_b.warmup is None
        world.imds.fire_spot_action(b.instance_id, "terminate")
        assert agent_b.wait_exit(60) == 0
