"""The pool's EC2 side against the strict EC2 emulator over real HTTP: claim order, the attach
as the lock under a 32-agent race, idempotent re-claim, refusals, timeouts, create, release."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from structlog.testing import capture_logs

from spotagent import ec2, volumes
from spotagent.testbed.ec2 import StrictEc2Server
from spotagent.volumes import (
    AttachTimeoutError,
    ClaimLostError,
    DetachTimeoutError,
    Pool,
    PoolEmptyError,
    StillMountedError,
    VolumeSpec,
)

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

REGION = "us-east-1"
AZ = "us-east-1a"
OTHER_AZ = "us-east-1b"
POOL = "dl-pool"
AMI = "ami-12c6146b"  # one of moto's built-in images, good enough to run instances from


@pytest.fixture(scope="module")
def server() -> Iterator[StrictEc2Server]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.delenv("AWS_PROFILE", raising=False)
        with StrictEc2Server(region=REGION) as srv:
            yield srv
            assert srv.errors == []


@dataclass
class Env:
    server: StrictEc2Server
    client: EC2Client

    def pool(self, seed: int = 0, **kwargs: float) -> Pool:
        """A pool as one agent sees it: its own client, short polls for the emulator."""
        kwargs.setdefault("poll_interval", 0.02)
        return Pool(self.new_client(), POOL, rng=random.Random(seed), **kwargs)  # type: ignore[arg-type]

    def new_client(self) -> EC2Client:
        return ec2.client(region=REGION, endpoint_url=self.server.endpoint_url,
                          max_attempts=2)

    def volumes(self, n: int, az: str = AZ, **tags: str) -> list[str]:
        spec = [{"Key": volumes.POOL_TAG, "Value": POOL}]
        spec += [{"Key": f"spotagent:{k.replace('_', '-')}", "Value": v} for k, v in tags.items()]
        ids = []
        for _ in range(n):
            v = self.client.create_volume(AvailabilityZone=az, Size=1, VolumeType="gp3",
                                          TagSpecifications=[{"ResourceType": "volume",
                                                              "Tags": spec}])  # type: ignore[list-item]
            ids.append(v["VolumeId"])
        return ids

    def instances(self, n: int, az: str = AZ) -> list[str]:
        r = self.client.run_instances(ImageId=AMI, MinCount=n, MaxCount=n,
                                      Placement={"AvailabilityZone": az})
        return [i["InstanceId"] for i in r["Instances"]]

    def tag(self, volume_id: str, **tags: str) -> None:
        self.client.create_tags(Resources=[volume_id], Tags=[
            {"Key": f"spotagent:{k.replace('_', '-')}", "Value": v} for k, v in tags.items()])

    def get(self, volume_id: str) -> volumes.Volume:
        return volumes.describe_volume(self.client, volume_id)

    def wait_state(self, volume_id: str, state: str, timeout: float = 5.0) -> volumes.Volume:
        deadline = time.monotonic() + timeout
        while True:
            v = self.get(volume_id)
            if v.state == state or time.monotonic() > deadline:
                return v
            time.sleep(0.02)


@pytest.fixture
def env(server: StrictEc2Server) -> Iterator[Env]:
    server.reset()
    server.set_delays(0.0, 0.0)
    # The set-up client (run_instances, register_image, ...) needs botocore's full model; every
    # pool of the tests gets the agent's default client, on the trimmed model.
    yield Env(server, ec2.client(region=REGION, endpoint_url=server.endpoint_url, model="full"))
    server.set_delays(0.0, 0.0)


def never_mounted() -> bool:
    return False


# --- pure helpers ------------------------------------------------------------------------------


def test_next_backoff_grows_jittered_and_capped() -> None:
    rng = random.Random(7)
    for attempt in range(12):
        step = min(30.0, 2.0 ** attempt)
        for _ in range(50):
            d = volumes.next_backoff(attempt, 30.0, rng)
            assert step / 2 <= d <= step
    assert volumes.next_backoff(10_000, 30.0, rng) <= 30.0  # no float overflow
    a = [volumes.next_backoff(3, 30.0, random.Random(1)) for _ in range(2)]
    assert a[0] == a[1]  # pure: the same rng state gives the same delay


def test_volume_spec_rejects_snapshot_and_ami_together_and_bad_rate() -> None:
    with pytest.raises(volumes.PoolError, match="not both"):
        VolumeSpec(snapshot_id="snap-12345678", from_ami="ami-12345678")
    with pytest.raises(volumes.PoolError, match="100-300"):
        VolumeSpec(snapshot_id="snap-12345678", init_rate_mib=50)
    with pytest.raises(volumes.PoolError, match="needs a size"):
        VolumeSpec(size_gib=None)


# --- claim order -------------------------------------------------------------------------------


def test_claim_prefers_newest_checkpoint_step_then_warm(env: Env) -> None:
    old_cold, = env.volumes(1, checkpoint_step="100", warm="false")
    new_cold, = env.volumes(1, checkpoint_step="200", warm="false")
    new_warm, = env.volumes(1, checkpoint_step="200", warm="true")
    fresh_warm, = env.volumes(1, warm="true")
    order = [env.pool(seed=i).claim(iid, AZ).volume_id
             for i, iid in enumerate(env.instances(4))]
    assert order == [new_warm, new_cold, old_cold, fresh_warm]


def test_tie_break_is_random_and_follows_the_injected_rng(env: Env) -> None:
    env.volumes(4, checkpoint_step="5", warm="true")
    iid, = env.instances(1)
    picks: dict[int, str] = {}
    for seed in [*range(8), 3]:
        claim = env.pool(seed=seed).claim(iid, AZ)
        assert picks.setdefault(seed, claim.volume_id) == claim.volume_id  # same seed, same pick
        env.pool().release(claim.volume_id, iid, still_mounted=never_mounted)
    assert len(set(picks.values())) > 1


# --- the race -----------------------------------------------------------------------------------


def race(agents: list[Pool], iids: list[str]) -> list[volumes.Claim | Exception]:
    """Every agent claims at once (a barrier), each from its own thread and client."""
    barrier = threading.Barrier(len(agents))
    results: list[volumes.Claim | Exception] = [RuntimeError("did not finish")] * len(agents)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = agents[i].claim(iids[i], AZ)
        except Exception as exc:  # the caller's assertions name what went wrong
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_32_agents_race_for_8_volumes_exactly_8_win_and_none_twice(env: Env) -> None:
    agents = [env.pool(seed=i) for i in range(32)]  # own client each, made once
    observer = Pool(env.client, POOL)
    for _round in range(10):
        env.server.reset()
        vids = set(env.volumes(8))
        iids = env.instances(32)
        with capture_logs() as logs:  # cheap logging, and the events are checked too
            results = race(agents, iids)
        claimed = [e for e in logs if e["event"] == "volume_claimed"]
        assert sorted(e["volume_id"] for e in claimed) == sorted(vids)
        claims = [r for r in results if isinstance(r, volumes.Claim)]
        losers = [r for r in results if not isinstance(r, volumes.Claim)]
        assert len(claims) == 8, results
        assert all(isinstance(r, PoolEmptyError) for r in losers), losers
        assert {c.volume_id for c in claims} == vids  # every volume won once, none twice
        listing = observer.volumes()  # what EC2 says, not what the agents believe
        assert all(v.attachment_state == "attached" for v in listing)
        holders = {v.attached_to: v for v in listing}
        assert len(holders) == 8  # eight distinct instances hold one volume each
        assert {i: v.volume_id for i, v in holders.items()} == {
            c.instance_id: c.volume_id for c in claims}
        for c in claims:
            v = holders[c.instance_id]
            assert v.owner == c.instance_id
            assert v.generation == c.generation == 1


# --- idempotence and stale claims ----------------------------------------------------------------


def test_reclaim_by_the_same_instance_keeps_the_volume_and_generation(env: Env) -> None:
    env.volumes(3)
    iid, = env.instances(1)
    first = env.pool(seed=1).claim(iid, AZ)
    again = env.pool(seed=2).claim(iid, AZ)  # a restarted agent: new client, new rng
    assert again.volume_id == first.volume_id
    assert again.generation == first.generation == 1
    assert again.reused and not first.reused
    assert len(env.pool().volumes(state="in-use")) == 1


def test_restart_between_attach_and_tag_finishes_the_claim(env: Env) -> None:
    vid, = env.volumes(1, generation="4")
    iid, = env.instances(1)
    env.client.attach_volume(VolumeId=vid, InstanceId=iid, Device="/dev/sdf")  # then "crash"
    claim = env.pool().claim(iid, AZ)
    assert (claim.volume_id, claim.generation, claim.reused) == (vid, 5, True)
    assert env.get(vid).owner == iid


def test_stale_owner_tag_on_an_available_volume_does_not_block(env: Env) -> None:
    vid, = env.volumes(1, generation="2")
    gone, iid = env.instances(2)
    env.client.terminate_instances(InstanceIds=[gone])
    env.tag(vid, owner=gone)
    claim = env.pool().claim(iid, AZ)
    assert (claim.volume_id, claim.generation) == (vid, 3)
    assert env.get(vid).owner == iid


def test_an_instance_that_comes_back_can_tell_it_lost_the_volume(env: Env) -> None:
    env.volumes(1)
    a, b = env.instances(2)
    claim_a = env.pool().claim(a, AZ)
    env.pool().release(claim_a.volume_id, a, still_mounted=never_mounted)
    claim_b = env.pool().claim(b, AZ)
    assert claim_b.volume_id == claim_a.volume_id and claim_b.generation == 2
    with pytest.raises(ClaimLostError):
        env.pool().check_claim(claim_a.volume_id, a, claim_a.generation)
    assert env.pool().check_claim(claim_b.volume_id, b, 2).owner == b


# --- refusals -----------------------------------------------------------------------------------


def test_zone_mismatch_is_skipped_and_logged(env: Env) -> None:
    elsewhere, = env.volumes(1, az=OTHER_AZ)
    iid, = env.instances(1, az=AZ)
    with capture_logs() as logs, pytest.raises(PoolEmptyError):
        env.pool().claim(iid, OTHER_AZ)  # the agent was told the wrong AZ
    assert [e["volume_id"] for e in logs if e["event"] == "claim_zone_mismatch"] == [elsewhere]
    assert env.get(elsewhere).state == "available" and env.get(elsewhere).owner is None


def test_io2_multi_attach_volume_is_never_claimed(env: Env) -> None:
    v = env.client.create_volume(
        AvailabilityZone=AZ, Size=4, VolumeType="io2", Iops=1000, MultiAttachEnabled=True,
        TagSpecifications=[{"ResourceType": "volume",
                            "Tags": [{"Key": volumes.POOL_TAG, "Value": POOL}]}])
    iid, = env.instances(1)
    with capture_logs() as logs, pytest.raises(PoolEmptyError):
        env.pool().claim(iid, AZ)
    refused = [e for e in logs if e["event"] == "candidate_refused"]
    assert [e["volume_id"] for e in refused] == [v["VolumeId"]]
    assert "multi-attach" in refused[0]["reason"]


def test_done_volumes_are_skipped(env: Env) -> None:
    done, = env.volumes(1, checkpoint_step="900", done="true", warm="true")
    iid, iid2 = env.instances(2)
    with pytest.raises(PoolEmptyError):
        env.pool().claim(iid, AZ)
    open_vol, = env.volumes(1, checkpoint_step="10")
    assert env.pool().claim(iid2, AZ).volume_id == open_vol
    assert env.get(done).state == "available"


def test_a_volume_stuck_attaching_times_out_clearly_and_leaks_no_claim(env: Env) -> None:
    vid, = env.volumes(1)
    iid, = env.instances(1)
    env.server.stick(vid, "attaching")
    try:
        pool = env.pool(attach_timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(AttachTimeoutError) as err:
            pool.claim(iid, AZ)
        assert time.monotonic() - t0 < 5
    finally:
        env.server.unstick(vid)
    assert vid in str(err.value) and "attaching" in str(err.value)
    v = env.wait_state(vid, "available")
    assert (v.state, v.attached_to, v.owner) == ("available", None, None)
    assert pool.attached_to(iid) is None


def test_an_instance_ec2_still_calls_pending_is_waited_for_not_mistaken_for_an_empty_pool(
        env: Env) -> None:
    vid, = env.volumes(1)
    iid, = env.instances(1)
    env.server.set_instance_state(iid, "pending")
    later = threading.Timer(0.4, env.server.set_instance_state, args=(iid, "running"))
    later.start()
    try:
        with capture_logs() as logs:
            claim = env.pool(attach_timeout=10).claim(iid, AZ)
    finally:
        later.cancel()
    assert claim.volume_id == vid
    assert any(e["event"] == "instance_not_ready" for e in logs)
    assert not any(e["event"] == "claim_conflict" for e in logs)
    other, = env.instances(1)
    env.volumes(1)
    env.server.set_instance_state(other, "pending")
    with pytest.raises(AttachTimeoutError, match=f"instance {other} not attachable"):
        env.pool(attach_timeout=0.3).claim(other, AZ)


# --- create ------------------------------------------------------------------------------------


def test_create_empty_volume_is_tagged_atomically_and_created_empty(env: Env) -> None:
    pool = env.pool()
    vid = pool.create(AZ, VolumeSpec(size_gib=8))
    v = env.get(vid)
    assert (v.state, v.az, v.pool, v.generation, v.size_gib) == ("available", AZ, POOL, 0, 8)
    assert v.created_empty and v.warm and v.snapshot_id is None
    assert set(v.tags) <= set(volumes.CREATE_TAGS)  # what the create policy allows
    pool.clear_created_empty(vid)
    assert not env.get(vid).created_empty


def test_create_from_snapshot_and_from_the_ami_root_snapshot(env: Env) -> None:
    src = env.client.create_volume(AvailabilityZone=AZ, Size=3, VolumeType="gp3")
    snap = env.client.create_snapshot(VolumeId=src["VolumeId"])["SnapshotId"]
    image = env.client.register_image(
        Name="dl-environment", RootDeviceName="/dev/xvda", Architecture="x86_64",
        VirtualizationType="hvm",
        BlockDeviceMappings=[{"DeviceName": "/dev/xvda", "Ebs": {"SnapshotId": snap}},
                             {"DeviceName": "/dev/sdb", "VirtualName": "ephemeral0"}])["ImageId"]
    pool = env.pool()
    from_snap = pool.create_volume(OTHER_AZ, VolumeSpec(snapshot_id=snap, size_gib=None))
    from_ami = pool.create_volume(AZ, VolumeSpec(from_ami=image, size_gib=None))
    for v, az in ((from_snap, OTHER_AZ), (from_ami, AZ)):
        assert (v.snapshot_id, v.az, v.pool, v.state) == (snap, az, POOL, "available")
        assert not v.warm and not v.created_empty  # it holds data: never formatted
        assert set(v.tags) <= set(volumes.CREATE_TAGS)
    with pytest.raises(ec2.Ec2Error, match=r"InvalidAMIID\.NotFound"):
        volumes.root_snapshot(env.client, "ami-0123456789abcdef0")
    no_ebs_root = env.client.register_image(
        Name="instance-store", RootDeviceName="/dev/xvda", Architecture="x86_64",
        BlockDeviceMappings=[{"DeviceName": "/dev/xvda", "VirtualName": "ephemeral0"}])
    with pytest.raises(volumes.PoolError, match="no EBS root snapshot"):
        pool.create(AZ, VolumeSpec(from_ami=no_ebs_root["ImageId"]))


def test_on_empty_create_end_to_end(env: Env) -> None:
    iid, = env.instances(1)
    pool = env.pool()
    with pytest.raises(PoolEmptyError):
        pool.claim(iid, AZ)
    vid = pool.create(AZ, VolumeSpec(size_gib=2))
    claim = pool.claim(iid, AZ)
    assert (claim.volume_id, claim.generation, claim.created_empty) == (vid, 1, True)
    pool.clear_created_empty(vid)  # what the host does after the first format
    pool.mark_warm(vid)
    assert pool.is_warm(vid) and not env.get(vid).created_empty


# --- release -----------------------------------------------------------------------------------


def test_release_detaches_clears_owner_and_records_step_and_done(env: Env) -> None:
    env.server.set_delays(0.1, 0.2)
    env.volumes(1)
    iid, = env.instances(1)
    pool = env.pool()
    claim = pool.claim(iid, AZ)
    pool.release(claim.volume_id, iid, still_mounted=never_mounted, checkpoint_step=1234,
                 done=True)
    v = env.get(claim.volume_id)
    assert (v.state, v.attached_to, v.owner) == ("available", None, None)
    assert (v.checkpoint_step, v.done, v.generation) == (1234, True, 1)
    with pytest.raises(PoolEmptyError):  # done: the job is complete, nobody claims it again
        pool.claim(iid, AZ)


def test_a_release_cut_short_after_the_detach_is_finished_not_leaked(env: Env) -> None:
    # The agent died between DetachVolume and dropping its owner tag (crash point
    # after_detach). Two volumes, so a restart that claimed the *other* one would leave the
    # first tagged as ours for ever; finish_releases drops the tag (the claim of the restarted
    # agent runs it too).
    env.server.set_delays(0.0, 0.3)
    _first, other = env.volumes(2)
    iid, = env.instances(1)
    pool = env.pool()
    claim = pool.claim(iid, AZ)
    env.client.detach_volume(VolumeId=claim.volume_id, InstanceId=iid)   # then "crash"
    assert env.get(claim.volume_id).owner == iid
    assert pool.finish_releases(iid) == [claim.volume_id]
    v = env.get(claim.volume_id)
    assert (v.state, v.attached_to, v.owner, v.generation) == ("available", None, None, 1)
    assert pool.finish_releases(iid) == []   # idempotent
    # A stale owner tag alone (the detach had completed) is dropped by the next claim.
    env.tag(other, owner=iid)
    again = env.pool(seed=5).claim(iid, AZ)
    left = other if again.volume_id == claim.volume_id else claim.volume_id
    assert env.get(left).owner is None and env.get(again.volume_id).owner == iid


def test_release_refuses_while_the_device_is_still_mounted(env: Env) -> None:
    env.volumes(1)
    iid, = env.instances(1)
    pool = env.pool()
    claim = pool.claim(iid, AZ)
    with pytest.raises(StillMountedError):
        pool.release(claim.volume_id, iid, still_mounted=lambda: True, checkpoint_step=7)
    v = env.get(claim.volume_id)
    assert (v.attached_to, v.attachment_state, v.owner) == (iid, "attached", iid)
    pool.release(claim.volume_id, iid, still_mounted=never_mounted, checkpoint_step=7)
    assert env.get(claim.volume_id).state == "available"


def test_release_of_a_volume_that_never_detaches_times_out_clearly(env: Env) -> None:
    vid, = env.volumes(1)
    iid, = env.instances(1)
    pool = env.pool(detach_timeout=0.5)
    pool.claim(iid, AZ)
    env.server.stick(vid, "detaching")
    try:
        with pytest.raises(DetachTimeoutError) as err:
            pool.release(vid, iid, still_mounted=never_mounted, checkpoint_step=3)
        assert vid in str(err.value) and "detaching" in str(err.value)
        assert env.get(vid).owner == iid  # still attached: still ours
    finally:
        env.server.unstick(vid)
    pool.release(vid, iid, still_mounted=never_mounted, checkpoint_step=3)  # resumable
    v = env.wait_state(vid, "available")
    assert (v.owner, v.checkpoint_step) == (None, 3)


def test_release_of_a_volume_held_by_another_instance_is_refused(env: Env) -> None:
    env.volumes(1)
    a, b = env.instances(2)
    claim = env.pool().claim(a, AZ)
    with pytest.raises(ClaimLostError):
        env.pool().release(claim.volume_id, b, still_mounted=never_mounted, done=True)
    assert not env.get(claim.volume_id).done


def test_client_factory_errors_name_the_operation_and_code(env: Env) -> None:
    pool = env.pool()
    with pytest.raises(ec2.Ec2Error) as err:
        pool.get("vol-0123456789abcdef0")
    assert err.value.operation == "DescribeVolumes"
    assert err.value.code == "InvalidVolume.NotFound"
    dead = Pool(ec2.client(region=REGION, endpoint_url="http://127.0.0.1:9", max_attempts=1,
                           connect_timeout=1), POOL)
    with pytest.raises(ec2.Ec2Error) as err:
        dead.volumes()
    assert err.value.code == "EndpointUnreachable"
