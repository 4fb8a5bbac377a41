"""The strict EC2 emulator, through boto3 over real HTTP: AWS's volume rules moto lacks."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from botocore.exceptions import ClientError

from spotagent.testbed.ec2 import Ec2EmulatorError, StrictEc2Server

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

AMI = "ami-12345678"  # moto accepts any image id for RunInstances
AZ = "us-east-1a"
OTHER_AZ = "us-east-1b"


@pytest.fixture(scope="module")
def running_server() -> Iterator[StrictEc2Server]:
    srv = StrictEc2Server().start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def server(running_server: StrictEc2Server) -> Iterator[StrictEc2Server]:
    """The module's server with moto's state, faults and delays wiped for this test."""
    running_server.reset()
    running_server.set_delays(0.0, 0.0)
    running_server.errors.clear()
    yield running_server
    assert running_server.errors == []


@pytest.fixture
def ec2(server: StrictEc2Server) -> EC2Client:
    return server.client()


def run(ec2: EC2Client, count: int = 1, az: str = AZ) -> list[str]:
    reply = ec2.run_instances(ImageId=AMI, MinCount=count, MaxCount=count,
                              InstanceType="t3.micro", Placement={"AvailabilityZone": az})
    return [i["InstanceId"] for i in reply["Instances"]]


def volume(ec2: EC2Client, az: str = AZ, **kwargs: Any) -> str:
    return ec2.create_volume(Size=1, AvailabilityZone=az, **kwargs)["VolumeId"]


def code_of(call: Callable[[], object]) -> str:
    with pytest.raises(ClientError) as info:
        call()
    return str(info.value.response["Error"]["Code"])


def describe(ec2: EC2Client, volume_id: str) -> Any:
    return ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"][0]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# -- rule 1: VolumeInUse / IncorrectState ------------------------------------------------------


def test_attach_of_attached_volume_is_volume_in_use_and_keeps_owner(ec2: EC2Client) -> None:
    a, b = run(ec2, 2)
    vol = volume(ec2)
    assert ec2.attach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdf")["State"] == "attaching"
    err = None
    try:
        ec2.attach_volume(VolumeId=vol, InstanceId=b, Device="/dev/sdf")
    except ClientError as exc:
        err = exc.response["Error"]
    assert err is not None
    assert err["Code"] == "VolumeInUse"
    assert err["Message"] == f"{vol} is already attached to an instance"
    # the same instance again is refused too, and the attachment never moved
    assert code_of(lambda: ec2.attach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdg")) \
        == "VolumeInUse"
    assert [x["InstanceId"] for x in describe(ec2, vol)["Attachments"]] == [a]


def test_attach_of_volume_not_available_is_incorrect_state(server: StrictEc2Server,
                                                           ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)
    server.stick(vol, "creating")
    assert describe(ec2, vol)["State"] == "creating"
    assert code_of(lambda: ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")) \
        == "IncorrectState"
    server.unstick(vol)
    assert describe(ec2, vol)["State"] == "available"
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")


def test_attach_of_detaching_volume_is_volume_in_use(server: StrictEc2Server,
                                                     ec2: EC2Client) -> None:
    a, b = run(ec2, 2)
    vol = volume(ec2)
    ec2.attach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdf")
    server.stick(vol, "detaching")
    ec2.detach_volume(VolumeId=vol)
    assert code_of(lambda: ec2.attach_volume(VolumeId=vol, InstanceId=b, Device="/dev/sdf")) \
        == "VolumeInUse"


# -- rules 2, 3, 4 -----------------------------------------------------------------------------


def test_attach_across_zones_is_zone_mismatch(ec2: EC2Client) -> None:
    (inst,) = run(ec2, az=AZ)
    vol = volume(ec2, az=OTHER_AZ)
    assert code_of(lambda: ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")) \
        == "InvalidVolume.ZoneMismatch"
    assert describe(ec2, vol)["State"] == "available"


def test_attach_at_device_in_use_is_invalid_parameter_value(ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    first, second = volume(ec2), volume(ec2)
    ec2.attach_volume(VolumeId=first, InstanceId=inst, Device="/dev/sdf")
    with pytest.raises(ClientError) as info:
        ec2.attach_volume(VolumeId=second, InstanceId=inst, Device="/dev/sdf")
    assert info.value.response["Error"]["Code"] == "InvalidParameterValue"
    assert "Attachment point /dev/sdf is already in use" in info.value.response["Error"]["Message"]
    # the root volume's device counts as well
    assert code_of(lambda: ec2.attach_volume(VolumeId=second, InstanceId=inst,
                                             Device="/dev/sda1")) == "InvalidParameterValue"
    ec2.attach_volume(VolumeId=second, InstanceId=inst, Device="/dev/sdg")


@pytest.mark.parametrize("state", ["pending", "stopping", "shutting-down"])
def test_attach_to_instance_in_transition_is_incorrect_state(server: StrictEc2Server,
                                                             ec2: EC2Client, state: str) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)
    server.set_instance_state(inst, state)
    assert code_of(lambda: ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")) \
        == "IncorrectState"
    server.set_instance_state(inst, "running")
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")


def test_attach_to_terminated_instance_is_incorrect_state(ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)
    ec2.terminate_instances(InstanceIds=[inst])
    with pytest.raises(ClientError) as info:
        ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    assert info.value.response["Error"]["Code"] == "IncorrectState"
    assert info.value.response["Error"]["Message"] == f"Instance '{inst}' is not 'running'."


def test_attach_to_stopped_instance_is_accepted_as_on_aws(ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)
    ec2.stop_instances(InstanceIds=[inst])
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    assert describe(ec2, vol)["Attachments"][0]["State"] == "attached"


def test_unknown_ids_get_motos_not_found_errors(ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)
    assert code_of(lambda: ec2.attach_volume(VolumeId="vol-0123456789abcdef0", InstanceId=inst,
                                             Device="/dev/sdf")) == "InvalidVolume.NotFound"
    assert code_of(lambda: ec2.attach_volume(VolumeId=vol, InstanceId="i-0123456789abcdef0",
                                             Device="/dev/sdf")) == "InvalidInstanceID.NotFound"
    assert code_of(lambda: ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf",
                                             DryRun=True)) == "DryRunOperation"
    assert describe(ec2, vol)["State"] == "available"


# -- rule 5: detach ----------------------------------------------------------------------------


def test_detach_of_available_volume_is_incorrect_state(ec2: EC2Client) -> None:
    vol = volume(ec2)
    with pytest.raises(ClientError) as info:
        ec2.detach_volume(VolumeId=vol)
    assert info.value.response["Error"]["Code"] == "IncorrectState"
    assert info.value.response["Error"]["Message"] == \
        f"Volume '{vol}' is in the 'available' state."


def test_detach_from_wrong_instance_or_device_is_attachment_not_found(ec2: EC2Client) -> None:
    a, b = run(ec2, 2)
    vol, other = volume(ec2), volume(ec2)
    ec2.attach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdf")
    # b has a volume at the same device name: moto alone would detach vol from a through it
    ec2.attach_volume(VolumeId=other, InstanceId=b, Device="/dev/sdf")
    assert code_of(lambda: ec2.detach_volume(VolumeId=vol, InstanceId=b)) \
        == "InvalidAttachment.NotFound"
    assert code_of(lambda: ec2.detach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdz")) \
        == "InvalidAttachment.NotFound"
    assert describe(ec2, vol)["Attachments"][0]["InstanceId"] == a
    assert describe(ec2, other)["Attachments"][0]["InstanceId"] == b
    reply = ec2.detach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdf")
    assert reply["State"] == "detaching"
    assert reply["InstanceId"] == a
    assert describe(ec2, vol)["State"] == "available"


# -- rule 6: terminate -------------------------------------------------------------------------


def test_terminate_detaches_only_its_own_volumes(ec2: EC2Client) -> None:
    a, b = run(ec2, 2)
    mine, theirs, moved = volume(ec2), volume(ec2), volume(ec2)
    ec2.attach_volume(VolumeId=mine, InstanceId=a, Device="/dev/sdf")
    ec2.attach_volume(VolumeId=theirs, InstanceId=b, Device="/dev/sdf")
    # moved: a held it at /dev/sdg, released it, b holds it now at the same name
    ec2.attach_volume(VolumeId=moved, InstanceId=a, Device="/dev/sdg")
    ec2.detach_volume(VolumeId=moved, InstanceId=a)
    ec2.attach_volume(VolumeId=moved, InstanceId=b, Device="/dev/sdg")
    ec2.terminate_instances(InstanceIds=[a])
    assert describe(ec2, mine)["State"] == "available"
    assert describe(ec2, theirs)["Attachments"][0]["InstanceId"] == b
    assert describe(ec2, moved)["Attachments"][0]["InstanceId"] == b


def test_terminate_ignores_a_stale_mapping_to_a_volume_another_instance_holds(
        server: StrictEc2Server, ec2: EC2Client) -> None:
    """moto's own attach moves a volume and leaves the old instance's mapping behind; the
    emulator refuses that attach, so the stale mapping is made here directly in moto's state to
    pin the terminate-side guard."""
    from moto.backends import get_backend
    from moto.core.models import DEFAULT_ACCOUNT_ID

    a, b = run(ec2, 2)
    vol = volume(ec2)
    ec2.attach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdf")
    backend = get_backend("ec2")[DEFAULT_ACCOUNT_ID]["us-east-1"]
    backend.attach_volume(vol, b, "/dev/sdf")  # moto moves it; a's mapping stays
    ec2.terminate_instances(InstanceIds=[a])
    attachments = describe(ec2, vol)["Attachments"]
    assert [x["InstanceId"] for x in attachments] == [b]


# -- rule 8: delays and faults -----------------------------------------------------------------


def test_attach_delay_shows_attaching_then_attached(server: StrictEc2Server,
                                                    ec2: EC2Client) -> None:
    server.set_delays(attach=0.6, detach=0.0)
    (inst,) = run(ec2)
    vol = volume(ec2)
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    now = describe(ec2, vol)
    assert now["State"] == "in-use"
    assert now["Attachments"][0]["State"] == "attaching"
    assert [v["VolumeId"] for v in ec2.describe_volumes(
        Filters=[{"Name": "attachment.status", "Values": ["attaching"]}])["Volumes"]] == [vol]
    wait_for(lambda: describe(ec2, vol)["Attachments"][0]["State"] == "attached", timeout=5)


def test_detach_delay_shows_detaching_then_available(server: StrictEc2Server,
                                                     ec2: EC2Client) -> None:
    server.set_delays(attach=0.0, detach=0.6)
    (inst,) = run(ec2)
    vol = volume(ec2)
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    assert describe(ec2, vol)["Attachments"][0]["State"] == "attached"
    assert ec2.detach_volume(VolumeId=vol, InstanceId=inst)["State"] == "detaching"
    now = describe(ec2, vol)
    assert now["State"] == "in-use"
    assert now["Attachments"][0]["State"] == "detaching"
    # a repeated detach while detaching is accepted, and the device name stays taken
    assert ec2.detach_volume(VolumeId=vol)["State"] == "detaching"
    wait_for(lambda: describe(ec2, vol)["State"] == "available", timeout=5)
    assert describe(ec2, vol)["Attachments"] == []


def test_stuck_attaching_volume_stays_attaching_until_unstick(server: StrictEc2Server,
                                                              ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)
    server.stick(vol, "attaching")
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    time.sleep(0.5)
    assert describe(ec2, vol)["Attachments"][0]["State"] == "attaching"
    server.unstick(vol)
    assert describe(ec2, vol)["Attachments"][0]["State"] == "attached"


def test_stuck_attaching_volume_can_be_detached_to_give_up(server: StrictEc2Server,
                                                           ec2: EC2Client) -> None:
    a, b = run(ec2, 2)
    vol = volume(ec2)
    server.stick(vol, "attaching")
    ec2.attach_volume(VolumeId=vol, InstanceId=a, Device="/dev/sdf")
    ec2.detach_volume(VolumeId=vol, InstanceId=a, Force=True)
    assert describe(ec2, vol)["State"] == "available"
    server.unstick(vol)
    ec2.attach_volume(VolumeId=vol, InstanceId=b, Device="/dev/sdf")
    assert describe(ec2, vol)["Attachments"][0]["InstanceId"] == b


def test_stuck_detaching_volume_stays_detaching_until_unstick(server: StrictEc2Server,
                                                              ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    server.stick(vol, "detaching")
    ec2.detach_volume(VolumeId=vol)
    time.sleep(0.3)
    assert describe(ec2, vol)["Attachments"][0]["State"] == "detaching"
    server.unstick(vol)
    assert describe(ec2, vol)["State"] == "available"


def test_unknown_fault_states_are_refused(server: StrictEc2Server) -> None:
    with pytest.raises(Ec2EmulatorError):
        server.stick("vol-0123456789abcdef0", "deleting")
    with pytest.raises(Ec2EmulatorError):
        server.set_delays(-1, 0)


# -- rule 9: concurrency -----------------------------------------------------------------------


@pytest.mark.parametrize("round_", range(3))
def test_sixteen_racing_attaches_exactly_one_wins(server: StrictEc2Server, ec2: EC2Client,
                                                  round_: int) -> None:
    instances = run(ec2, 16)
    vol = volume(ec2)
    clients = [server.client() for _ in instances]
    barrier = threading.Barrier(len(instances))
    outcomes: list[str] = []
    lock = threading.Lock()

    def racer(client: EC2Client, instance_id: str) -> None:
        barrier.wait(timeout=30)
        try:
            client.attach_volume(VolumeId=vol, InstanceId=instance_id, Device="/dev/sdf")
            result = "ok"
        except ClientError as exc:
            result = str(exc.response["Error"]["Code"])
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=racer, args=(c, i)) for c, i in zip(clients, instances,
                                                                           strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["VolumeInUse"] * 15 + ["ok"]
    holders = [a["InstanceId"] for a in describe(ec2, vol)["Attachments"]]
    assert len(holders) == 1 and holders[0] in instances


# -- moto features the agent relies on, end to end through the server ---------------------------


def test_filters_and_tags_work_through_the_server(ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    pool = [volume(ec2, TagSpecifications=[{"ResourceType": "volume", "Tags": [
        {"Key": "spotagent:pool", "Value": "p1"}, {"Key": "spotagent:warm", "Value": "1"}]}])
        for _ in range(2)]
    other_az = volume(ec2, az=OTHER_AZ, TagSpecifications=[{"ResourceType": "volume", "Tags": [
        {"Key": "spotagent:pool", "Value": "p1"}]}])
    volume(ec2)  # untagged

    def ids(*filters: tuple[str, list[str]]) -> set[str]:
        reply = ec2.describe_volumes(Filters=[{"Name": n, "Values": v} for n, v in filters])
        return {v["VolumeId"] for v in reply["Volumes"]}

    assert ids(("tag:spotagent:pool", ["p1"])) == {*pool, other_az}
    assert ids(("tag-key", ["spotagent:warm"])) == set(pool)
    assert ids(("tag:spotagent:pool", ["p1"]), ("availability-zone", [AZ])) == set(pool)
    ec2.attach_volume(VolumeId=pool[0], InstanceId=inst, Device="/dev/sdf")
    ec2.create_tags(Resources=[pool[0]], Tags=[{"Key": "spotagent:owner", "Value": inst}])
    assert ids(("tag:spotagent:pool", ["p1"]), ("status", ["available"])) == {pool[1], other_az}
    assert ids(("attachment.instance-id", [inst]), ("tag:spotagent:pool", ["p1"])) == {pool[0]}
    assert ids(("tag:spotagent:owner", [inst])) == {pool[0]}
    ec2.delete_tags(Resources=[pool[0]], Tags=[{"Key": "spotagent:owner"}])
    assert ids(("tag-key", ["spotagent:owner"])) == set()
    tags = {t["Key"]: t["Value"] for t in describe(ec2, pool[1])["Tags"]}
    assert tags == {"spotagent:pool": "p1", "spotagent:warm": "1"}


def test_run_instances_in_a_zone_and_describe(ec2: EC2Client) -> None:
    (inst,) = run(ec2, az=OTHER_AZ)
    reservations = ec2.describe_instances(InstanceIds=[inst])["Reservations"]
    found = reservations[0]["Instances"][0]
    assert found["Placement"]["AvailabilityZone"] == OTHER_AZ
    assert found["State"]["Name"] == "running"


def test_snapshot_volume_and_ami_root_snapshot(ec2: EC2Client) -> None:
    source = volume(ec2)
    snap = ec2.create_snapshot(VolumeId=source, Description="warm env")["SnapshotId"]
    restored = ec2.create_volume(AvailabilityZone=AZ, SnapshotId=snap)
    assert restored["SnapshotId"] == snap
    assert restored["Size"] == 1
    image = ec2.register_image(
        Name="spotagent-env", RootDeviceName="/dev/xvda", Architecture="x86_64",
        VirtualizationType="hvm",
        BlockDeviceMappings=[{"DeviceName": "/dev/xvda", "Ebs": {"SnapshotId": snap,
                                                                  "VolumeType": "gp3"}}])
    found = ec2.describe_images(ImageIds=[image["ImageId"]])["Images"][0]
    assert found["RootDeviceName"] == "/dev/xvda"
    assert found["RootDeviceType"] == "ebs"
    root = [m for m in found["BlockDeviceMappings"] if m["DeviceName"] == "/dev/xvda"]
    assert root[0]["Ebs"]["SnapshotId"] == snap
    assert root[0]["Ebs"]["VolumeSize"] == 1
    assert root[0]["Ebs"]["VolumeType"] == "gp3"
    # "make a volume from the AMI's root snapshot"
    from_ami = ec2.create_volume(AvailabilityZone=AZ, SnapshotId=root[0]["Ebs"]["SnapshotId"])
    assert from_ami["SnapshotId"] == snap
    assert code_of(lambda: ec2.register_image(
        Name="broken", RootDeviceName="/dev/xvda",
        BlockDeviceMappings=[{"DeviceName": "/dev/xvda",
                              "Ebs": {"SnapshotId": "snap-0123456789abcdef0"}}])) \
        == "InvalidSnapshot.NotFound"


# -- server life cycle -------------------------------------------------------------------------


def test_reset_wipes_state_and_the_moto_reset_endpoint_works(server: StrictEc2Server,
                                                             ec2: EC2Client) -> None:
    volume(ec2)
    server.reset()
    assert ec2.describe_volumes()["Volumes"] == []
    volume(ec2)
    request = urllib.request.Request(f"{server.endpoint_url}/moto-api/reset", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
    assert ec2.describe_volumes()["Volumes"] == []


def test_control_api_drives_faults_over_http(server: StrictEc2Server, ec2: EC2Client) -> None:
    (inst,) = run(ec2)
    vol = volume(ec2)

    def control(op: str, **args: object) -> int:
        request = urllib.request.Request(f"{server.endpoint_url}/_spotagent/{op}",
                                         data=json.dumps(args).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    assert control("stick", volume_id=vol, state="attaching") == 200
    ec2.attach_volume(VolumeId=vol, InstanceId=inst, Device="/dev/sdf")
    assert describe(ec2, vol)["Attachments"][0]["State"] == "attaching"
    assert control("unstick", volume_id=vol) == 200
    assert describe(ec2, vol)["Attachments"][0]["State"] == "attached"
    assert control("stick", volume_id=vol, state="bogus") == 400
    assert control("no-such-op") == 400


def test_one_server_per_process(server: StrictEc2Server) -> None:
    with pytest.raises(Ec2EmulatorError):
        StrictEc2Server().start()
    assert server.client().describe_volumes()["Volumes"] == []
