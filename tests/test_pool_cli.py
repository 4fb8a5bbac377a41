"""`spotagent pool ...` end to end: a real `python -m spotagent` process against the strict EC2
emulator's endpoint; one line per volume, JSON lines with --json, exit 1 on AWS errors, 2 on
bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotagent import ec2, volumes
from spotagent.testbed.ec2 import StrictEc2Server

REGION = "us-east-1"
AZ = "us-east-1a"
AZ_B = "us-east-1b"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server() -> Iterator[StrictEc2Server]:
    with StrictEc2Server(region=REGION) as srv:
        yield srv
        assert srv.errors == []


@pytest.fixture
def emu(server: StrictEc2Server) -> StrictEc2Server:
    server.reset()
    return server


def spotagent(*args: str, endpoint: str | None = None, region: bool = True,
              timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true",  # never reach for a metadata service
               SPOTAGENT_LOG_LEVEL="warning")
    argv = [sys.executable, "-m", "spotagent", "pool", *args]
    if endpoint:
        argv += ["--endpoint-url", endpoint]
    if region:
        argv += ["--region", REGION]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO, check=False)


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_create_then_list_one_line_per_volume(emu: StrictEc2Server) -> None:
    url = emu.endpoint_url
    made = spotagent("create", "--pool", "dl", "--az", AZ, "--count", "3", "--size", "4",
                     "--json", endpoint=url)
    assert made.returncode == 0, made.stderr
    rows = json_lines(made.stdout)
    assert len(rows) == 3
    assert all(r["pool"] == "dl" and r["az"] == AZ and r["state"] == "available"
               and r["created_empty"] and r["size_gib"] == 4 and r["generation"] == 0
               for r in rows)
    other = spotagent("create", "--pool", "other", "--az", AZ_B, endpoint=url)
    assert other.returncode == 0, other.stderr
    header, line = other.stdout.splitlines()
    assert header.split()[:4] == ["VOLUME", "POOL", "AZ", "STATE"]
    assert line.split()[1:4] == ["other", AZ_B, "available"]

    listed = spotagent("list", "--pool", "dl", "--json", endpoint=url)
    assert listed.returncode == 0, listed.stderr
    assert sorted(r["volume_id"] for r in json_lines(listed.stdout)) == sorted(
        r["volume_id"] for r in rows)
    every = spotagent("list", endpoint=url)
    assert every.returncode == 0, every.stderr
    lines = every.stdout.splitlines()
    assert len(lines) == 1 + 4  # header, then one line per volume of every pool
    assert {ln.split()[1] for ln in lines[1:]} == {"dl", "other"}


def test_create_from_snapshot_and_from_ami(emu: StrictEc2Server) -> None:
    c = emu.client()
    src = c.create_volume(AvailabilityZone=AZ, Size=2, VolumeType="gp3")
    snap = c.create_snapshot(VolumeId=src["VolumeId"])["SnapshotId"]
    ami = c.register_image(Name="dl-env", RootDeviceName="/dev/xvda", Architecture="x86_64",
                           BlockDeviceMappings=[{"DeviceName": "/dev/xvda",
                                                 "Ebs": {"SnapshotId": snap}}])["ImageId"]
    for source in (["--snapshot-id", snap], ["--from-ami", ami]):
        r = spotagent("create", "--pool", "dl", "--az", AZ, *source, "--json",
                      endpoint=emu.endpoint_url)
        assert r.returncode == 0, r.stderr
        row, = json_lines(r.stdout)
        assert not row["created_empty"] and not row["warm"]
        assert volumes.describe_volume(c, row["volume_id"]).snapshot_id == snap


def test_list_shows_owner_generation_step_warm_done(emu: StrictEc2Server) -> None:
    c = emu.client()
    pool = volumes.Pool(c, "dl", poll_interval=0.02)
    vid = pool.create(AZ, volumes.VolumeSpec(size_gib=1))
    iid = c.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                          Placement={"AvailabilityZone": AZ})["Instances"][0]["InstanceId"]
    pool.claim(iid, AZ)
    pool.release(vid, iid, still_mounted=lambda: False, checkpoint_step=4200, done=True)
    r = spotagent("list", "--pool", "dl", endpoint=emu.endpoint_url)
    assert r.returncode == 0, r.stderr
    cells = r.stdout.splitlines()[1].split()
    assert cells == [vid, "dl", AZ, "available", "-", "1", "4200", "yes", "yes"]


def test_release_clears_a_stale_claim_and_refuses_a_live_owner(emu: StrictEc2Server) -> None:
    c = emu.client()
    pool = volumes.Pool(c, "dl", poll_interval=0.02)
    stale, alive, attached = (pool.create(AZ, volumes.VolumeSpec(size_gib=1)) for _ in range(3))
    gone, live, holder = (i["InstanceId"] for i in c.run_instances(
        ImageId="ami-12c6146b", MinCount=3, MaxCount=3,
        Placement={"AvailabilityZone": AZ})["Instances"])
    c.terminate_instances(InstanceIds=[gone])
    c.create_tags(Resources=[stale], Tags=[{"Key": volumes.OWNER_TAG, "Value": gone}])
    c.create_tags(Resources=[alive], Tags=[{"Key": volumes.OWNER_TAG, "Value": live}])
    c.attach_volume(VolumeId=attached, InstanceId=holder, Device="/dev/sdf")
    url = emu.endpoint_url

    ok = spotagent("release", stale, "--json", endpoint=url)
    assert ok.returncode == 0, ok.stderr
    assert json_lines(ok.stdout)[0]["owner"] is None
    assert volumes.describe_volume(c, stale).owner is None

    refused = spotagent("release", alive, endpoint=url)
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0
    assert f"owner instance {live} is running" in refused.stderr
    assert volumes.describe_volume(c, alive).owner == live

    busy = spotagent("release", attached, endpoint=url)
    assert busy.returncode == 1 and f"attached to {holder}" in busy.stderr

    missing = spotagent("release", "vol-0123456789abcdef0", endpoint=url)
    assert missing.returncode == 1
    assert "DescribeVolumes" in missing.stderr and "InvalidVolume.NotFound" in missing.stderr


def test_azs_counts_free_and_warm_volumes_best_first(emu: StrictEc2Server) -> None:
    c = emu.client()
    pool = volumes.Pool(c, "dl", poll_interval=0.02)
    a = [pool.create(AZ, volumes.VolumeSpec(size_gib=1)) for _ in range(2)]
    b = [pool.create(AZ_B, volumes.VolumeSpec(size_gib=1)) for _ in range(3)]
    c.create_tags(Resources=[*a, *b[:2]], Tags=[{"Key": volumes.WARM_TAG, "Value": "false"}])
    c.create_tags(Resources=[b[2]], Tags=[{"Key": volumes.DONE_TAG, "Value": "true"}])
    r = spotagent("azs", "--pool", "dl", "--json", endpoint=emu.endpoint_url)
    assert r.returncode == 0, r.stderr
    assert [(x["az"], x["free"], x["warm"]) for x in json_lines(r.stdout)] == [
        (AZ, 2, 0), (AZ_B, 2, 0)]
    mark = spotagent("azs", "--pool", "dl", endpoint=emu.endpoint_url)
    assert mark.stdout.splitlines()[1].split() == [AZ, "2", "0"]
    pool.mark_warm(b[0])
    r = spotagent("azs", "--pool", "dl", "--json", endpoint=emu.endpoint_url)
    assert [(x["az"], x["free"], x["warm"]) for x in json_lines(r.stdout)] == [
        (AZ_B, 2, 1), (AZ, 2, 0)]


def test_unreachable_endpoint_is_one_line_naming_the_operation_exit_1() -> None:
    r = spotagent("list", "--max-attempts", "1", endpoint="http://127.0.0.1:9")
    assert r.returncode == 1
    err = r.stderr.strip()
    assert "\n" not in err
    assert "DescribeVolumes" in err and "EndpointUnreachable" in err


@pytest.mark.parametrize("args, fragment", [
    (["create", "--pool", "dl", "--az", AZ, "--count", "0"], "--count"),
    (["create", "--pool", "dl"], "--az"),
    (["create", "--pool", "bad name", "--az", AZ], "--pool"),
    (["create", "--pool", "dl", "--az", AZ, "--snapshot-id", "snap-12345678",
      "--from-ami", "ami-12345678"], "not allowed with"),
    (["create", "--pool", "dl", "--az", AZ, "--type", "st1"], "--type"),
    (["create", "--pool", "dl", "--az", AZ, "--init-rate", "50"], "--init-rate"),
    (["release", "i-0123456789abcdef0"], "volume id"),
    (["azs"], "--pool"),
])
def test_bad_arguments_exit_2(args: list[str], fragment: str) -> None:
    r = spotagent(*args)
    assert r.returncode == 2, r.stderr
    assert fragment in r.stderr


def test_no_region_is_a_usage_error_exit_2() -> None:
    r = spotagent("list", region=False)
    assert r.returncode == 2
    assert "no AWS region" in r.stderr


def test_credentials_missing_is_one_line_exit_1(emu: StrictEc2Server) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true", SPOTAGENT_LOG_LEVEL="warning")
    r = subprocess.run([sys.executable, "-m", "spotagent", "pool", "list", "--region", REGION,
                        "--endpoint-url", emu.endpoint_url], capture_output=True, text=True,
                       timeout=60, env=env, cwd=REPO, check=False)
    assert r.returncode == 1
    assert "DescribeVolumes" in r.stderr and "NoCredentials" in r.stderr
    assert ec2.Ec2Error.__name__ not in r.stderr  # a message, not a traceback
