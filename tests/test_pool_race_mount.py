"""32 agents on 32 emulated instances race for 8 volumes, end to end on real devices: exactly 8
claims, no volume attached twice, every winner finds its device by serial and mounts the volume
(its data intact), the losers are told the pool is empty (their on_empty applies). 10 rounds."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotagent import devices, ec2, mounts
from spotagent.testbed.world import World, make_fs_image
from spotagent.volumes import Claim, Pool, PoolEmptyError

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("needs root (loop devices, mounts)", allow_module_level=True)

AGENTS, VOLUMES, ROUNDS = 32, 8, 10


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(k, "testing")
        w = World(tmp_path / "world").start()
        try:
            yield w
        finally:
            for inst in w.instances.values():
                for m in mounts.mounts_under(inst.home):
                    mounts.unmount(m.mount_point, retries=1)
            w.close()


def test_32_agents_8_volumes_every_winner_mounts_none_twice_10_rounds(
        world: World, tmp_path: Path) -> None:
    src = tmp_path / "content"
    src.mkdir()
    (src / "marker").write_text("warm volume\n")
    snapshot = world.make_snapshot(make_fs_image(tmp_path / "vol.img", src, size_mib=16))
    for round_no in range(ROUNDS):
        race_round(world, snapshot, round_no)


def race_round(world: World, snapshot: str, round_no: int) -> None:
    pool_name = f"race{round_no}"
    vids = set(world.make_pool_volumes(pool_name, VOLUMES, snapshot_id=snapshot))
    insts = [world.launch(pool=pool_name) for _ in range(AGENTS)]
    results: dict[str, object] = {}
    mounted: dict[str, str] = {}
    lock = threading.Lock()
    go = threading.Barrier(AGENTS)

    def agent(i: int) -> None:
        inst = insts[i]
        pool = Pool(ec2.client(region=world.region, endpoint_url=world.ec2.endpoint_url,
                               max_attempts=2), pool_name,
                    rng=random.Random(round_no * 100 + i), poll_interval=0.02)
        go.wait()
        try:
            claim = pool.claim(inst.instance_id, inst.availability_zone)
        except PoolEmptyError as exc:
            with lock:
                results[inst.instance_id] = exc
            return
        dev = devices.wait_for_device(claim.volume_id, by_id_dir=inst.by_id_dir,
                                      timeout=30)
        mounts.mount_volume(dev, inst.mount_point, created_empty_by_agent=False)
        with lock:
            results[inst.instance_id] = claim
            mounted[inst.instance_id] = (inst.mount_point / "marker").read_text()

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == AGENTS, f"round {round_no}: an agent hung or crashed"
    claims = [r for r in results.values() if isinstance(r, Claim)]
    losers = [r for r in results.values() if not isinstance(r, Claim)]
    assert len(claims) == VOLUMES
    assert all(isinstance(r, PoolEmptyError) for r in losers)
    assert {c.volume_id for c in claims} == vids          # each volume won exactly once
    assert set(mounted.values()) == {"warm volume\n"} and len(mounted) == VOLUMES
    for c in claims:                                        # EC2 agrees with the winners
        v = world.volume(c.volume_id)
        assert [a["InstanceId"] for a in v["Attachments"]] == [c.instance_id]
        assert v["TagMap"]["spotagent:owner"] == c.instance_id
    assert world.plane.violations == []
    # Hand the volumes back (unmount, release) before the next round.
    for c in claims:
        inst = world.instances[c.instance_id]
        mounts.unmount(inst.mount_point)
        Pool(world.client, pool_name).release(c.volume_id, c.instance_id,
                                              still_mounted=lambda: False)
    for inst in insts:
        world.terminate(inst)
