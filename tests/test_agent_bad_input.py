"""Bad input ends cleanly: a trainer command or user missing in the chroot, a volume without a
root file system (an empty ext4, and an empty volume made by pool.on_empty = create), an
unwritable checkpoint directory, a trainer that ignores SIGTERM, a broken config. Each ends
with one clear line in `spotagent status` and the agent log, the volume released (available,
owner tag cleared), its data untouched and nothing left mounted. Real `spotagent run`
processes, emulators over HTTP, loop devices, mounts and chroots."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from agent_world import (
    PRECIOUS,
    PRECIOUS_TEXT,
    TRAINER_LOG,
    Agent,
    assert_released,
    attachments,
    busybox_image,
    empty_fs_image,
    pool_volumes,
    run_cli,
    running,
    settings,
    shared_image,
    volume_files,
)

from spotagent import subp
from spotagent.testbed.world import Instance, World

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("needs root (loop devices, mounts, chroot)", allow_module_level=True)


def fails_cleanly(world: World, inst: Instance, volume_id: str, agent: Agent,
                  expected: str) -> str:
    """The agent ended non-zero with `expected` in one line of status and log, and the volume
    is back in the pool untouched. Returns the error line."""
    assert agent.wait_exit(60) == 1, agent.output()
    st = agent.status()
    assert st is not None and st.state == "failed", st
    error = st.error
    assert error is not None and expected in error and "\n" not in error, error
    proc = agent.cli("status")
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0].endswith(f"error: {error}")
    assert f"error       {error}" in proc.stdout.splitlines()
    logged = [e["error"] for e in agent.events("action_failed")]
    assert logged and expected in logged[0] and "\n" not in logged[0], logged
    assert_released(world, inst, volume_id)
    return error


def precious(world: World, volume_id: str) -> str | None:
    return volume_files(world, volume_id, PRECIOUS)[PRECIOUS]


def test_trainer_command_missing_in_the_chroot(world: World, image: Path) -> None:
    volume, = pool_volumes(world, image)
    inst = world.launch(pool="dl", settings=settings(trainer={"command": ["/opt/no-such"]}))
    with running(inst) as agent:
        error = fails_cleanly(world, inst, volume, agent, "command not found inside the chroot")
        assert "command=/opt/no-such" in error
    assert precious(world, volume) == PRECIOUS_TEXT


def test_trainer_user_missing_in_the_chroots_passwd(world: World, image: Path) -> None:
    volume, = pool_volumes(world, image)
    inst = world.launch(pool="dl", settings=settings(trainer={"user": "nosuchuser"}))
    with running(inst) as agent:
        error = fails_cleanly(world, inst, volume, agent,
                              "trainer user not found in the chroot's passwd")
        assert "user=nosuchuser" in error and "etc/passwd" in error
        assert not agent.events("trainer_started")
    assert precious(world, volume) == PRECIOUS_TEXT


def test_volume_with_an_empty_file_system_has_no_root(
        world: World, tmp_path_factory: pytest.TempPathFactory) -> None:
    empty = shared_image(tmp_path_factory, "empty", empty_fs_image)
    volume, = pool_volumes(world, empty)
    inst = world.launch(pool="dl", settings=settings())
    with running(inst) as agent:
        fails_cleanly(world, inst, volume, agent, "not a root file system: no /etc/passwd")
        assert not agent.events("volume_formatting")   # data is never formatted


def test_an_empty_volume_made_by_pool_create_is_formatted_once_then_refused_as_no_root(
        world: World) -> None:
    # `spotagent pool create` without a source makes an empty, created-empty volume: the only
    # kind the agent may format. It has no environment, so the agent fails cleanly after it.
    from spotagent.volumes import Pool, VolumeSpec

    volume = Pool(world.client, "dl").create(f"{world.region}a",
                                             VolumeSpec(size_gib=1, init_rate_mib=None))
    inst = world.launch(pool="dl", settings=settings())
    with running(inst) as agent:
        assert agent.wait_exit(60) == 1, agent.output()
        assert agent.events("volume_formatted")
        fails_cleanly(world, inst, volume, agent, "not a root file system")
    vol = world.volume(volume)
    # Formatted once; from now on it holds a file system and is never formatted again.
    assert "spotagent:created-empty" not in vol["TagMap"]
    probe = subp.run(["blkid", "-p", "-o", "value", "-s", "TYPE",
                      str(world.plane.image_path(volume))], timeout=30)
    assert probe.stdout.strip() == "ext4"


def test_on_empty_create_makes_a_volume_from_the_pools_snapshot_in_this_az_and_trains(
        world: World, image: Path) -> None:
    snapshot = world.make_snapshot(image)
    inst = world.launch("us-east-1b", pool="dl", settings=settings(
        pool={"on_empty": "create", "snapshot_id": snapshot, "size_gib": 1}))
    with running(inst) as agent:
        st = agent.wait_for(lambda s: s.state == "training" and (s.step or 0) >= 2,
                            what="training on a created volume")
        created = agent.events("volume_created")
        assert created and created[0]["volume_id"] == st.volume_id, agent.output()
        vol = world.volume(st.volume_id or "")
        assert vol["AvailabilityZone"] == "us-east-1b"
        assert vol["TagMap"]["spotagent:pool"] == "dl"
        assert vol["SnapshotId"] == snapshot
        world.imds.fire_spot_action(inst.instance_id, "terminate")
        assert agent.wait_exit(60) == 0, agent.output()
    assert world.volume(st.volume_id or "")["State"] == "available"


def _unwritable_checkpoints(root: Path) -> None:
    ckpt = root / "data" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "step").write_text("42\n")
    os.chown(ckpt, 0, 0)
    ckpt.chmod(0o755)


def test_unwritable_checkpoint_directory(
        world: World, tmp_path_factory: pytest.TempPathFactory) -> None:
    ro = shared_image(tmp_path_factory, "ro-ckpt",
                      lambda tmp: busybox_image(tmp, extra=_unwritable_checkpoints))
    volume, = pool_volumes(world, ro)
    inst = world.launch(pool="dl", settings=settings(trainer={"checkpoint_dir": "/data/ckpt"}))
    with running(inst) as agent:
        error = fails_cleanly(world, inst, volume, agent,
                              "checkpoint directory is not writable by the trainer user")
        assert "path=/data/ckpt" in error and "user=trainer" in error
    files = volume_files(world, volume, "data/ckpt/step", PRECIOUS)
    assert files == {"data/ckpt/step": "42\n", PRECIOUS: PRECIOUS_TEXT}


def test_trainer_ignoring_sigterm_is_killed_at_the_deadline_and_the_release_completes(
        world: World, image: Path) -> None:
    volume, = pool_volumes(world, image)
    inst = world.launch(pool="dl", settings=settings(
        trainer={"env": {"IGNORE_TERM": "1"}}, drain={"release_margin": 5}))
    with running(inst) as agent:
        agent.training_past(3)
        # The instance goes in 8 s; 5 s are kept for the release: 3 s to checkpoint.
        at = datetime.now(UTC) + timedelta(seconds=8)
        world.imds.fire_spot_action(inst.instance_id, "terminate", at=at)
        fired = time.monotonic()
        assert agent.wait_exit(60) == 0, agent.output()
        took = time.monotonic() - fired
        st = agent.status()
        assert st is not None and st.state == "released" and st.error is None
        assert st.deadline is not None and abs(st.deadline - (at.timestamp() - 5)) < 1.0
        kept = [(e["cause"], e["actions"]) for e in agent.events("state_kept")]
        assert ("drain deadline passed: killing the trainer", ["kill", "release"]) in kept
        killed = agent.events("trainer_killed")
        assert killed, agent.output()
        assert 2.0 <= took < 30.0, took   # killed at the deadline, not before; no hang
    tags = assert_released(world, inst, volume)
    log = volume_files(world, volume, TRAINER_LOG)[TRAINER_LOG]
    assert log is not None and "signal TERM ignored" in log
    assert tags["spotagent:checkpoint-step"] == "0"   # it never committed; step 0 stands
    assert precious(world, volume) == PRECIOUS_TEXT


def test_broken_config_exits_2_with_one_line_and_claims_nothing(
        world: World, image: Path) -> None:
    volume, = pool_volumes(world, image)
    inst = world.launch(pool="dl", settings=settings(pool={"on_empty": "sometimes"}))
    proc = run_cli(inst, "run", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f'spotagent: config error: {inst.config_path}: pool.on_empty = '
                     '"sometimes": must be one of wait, create, fail'], proc.stderr
    assert attachments(world, volume) == []
    assert "spotagent:owner" not in world.volume(volume)["TagMap"]


def test_a_device_that_never_appears_times_out_clearly_and_the_volume_is_released(
        world: World, image: Path, tmp_path: Path) -> None:
    # The attach succeeds but no by-id link ever shows up where the agent looks (a missing
    # udev rule, say): a clear timeout naming the volume and the directory, then the release.
    volume, = pool_volumes(world, image)
    nowhere = tmp_path / "empty-by-id"
    nowhere.mkdir()
    inst = world.launch(pool="dl", settings=settings(
        devices={"by_id_dir": str(nowhere), "timeout": 2}))
    with running(inst) as agent:
        error = fails_cleanly(world, inst, volume, agent, volume)
        assert str(nowhere) in error
    assert precious(world, volume) == PRECIOUS_TEXT
