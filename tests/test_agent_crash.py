"""Agents that die: SIGKILL while training, at each step of claim, mount and release (driven by
the SPOTAGENT_TEST_CRASH_AT hook, see spotagent.crashpoints), and an exception nobody expected.
Each is restarted (or `spotagent release` is run) and must converge: one attachment at most, no
leaked claim, nothing mounted while detached, the checkpoint kept, and a later notice still
drains cleanly. Real processes, emulators over HTTP, loop devices, mounts and chroots."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from agent_world import (
    TRAINER_LOG,
    Agent,
    assert_released,
    attachments,
    mounts_under,
    run_cli,
    settings,
    volume_files,
)

from spotagent.crashpoints import ENV as CRASH_AT
from spotagent.testbed.world import Instance, World

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("needs root (loop devices, mounts, chroot)", allow_module_level=True)

CKPT = "home/trainer/ckpt/step"


def owner(world: World, volume_id: str) -> str | None:
    return world.volume(volume_id)["TagMap"].get("spotagent:owner")


def generation(world: World, volume_id: str) -> int:
    return int(world.volume(volume_id)["TagMap"].get("spotagent:generation", "0"))


def notice_drains(world: World, inst: Instance, agent: Agent) -> int:
    """Fire a spot notice and wait for the clean end; return the committed step."""
    world.imds.fire_spot_action(inst.instance_id, "terminate")
    assert agent.wait_exit(60) == 0, agent.output()
    st = agent.status()
    assert st is not None and st.state == "released", st
    assert st.last_committed_step is not None
    return st.last_committed_step


def progress_step(inst: Instance) -> int:
    doc = json.loads((inst.state_dir / "control" / "progress.json").read_text())
    return int(doc["step"])


def test_agent_killed_while_training_restarts_reuses_the_volume_and_adopts_the_trainer(
        world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    first = Agent(inst).start()
    st = first.training_past(5)
    stray = st.trainer_pid
    assert stray is not None
    first.crash()
    # The trainer outlives its agent (its output pipe has no reader now) and keeps training.
    before = progress_step(inst)
    time.sleep(0.5)
    assert psutil.pid_exists(stray) and progress_step(inst) > before

    second = Agent(inst).start()
    st = second.training_past(1)
    found = second.events("stray_trainer_found")
    assert found and stray in found[0]["pids"]
    assert not psutil.pid_exists(stray) or psutil.Process(stray).status() == "zombie"
    # Kept, not claimed again: one attachment, generation unchanged.
    assert second.events("claim_reused") and not second.events("volume_claimed")
    assert st.volume_id == volume and st.generation == 1
    assert len(attachments(world, volume)) == 1 and generation(world, volume) == 1
    assert owner(world, volume) == inst.instance_id
    # The stray checkpointed on SIGTERM (it was never asked for any other checkpoint, and its
    # output since the crash went nowhere: the pipe's reader was the dead agent); the new
    # trainer resumed exactly there.
    committed = int((inst.mount_point / CKPT).read_text())
    assert committed >= before
    new_part = (inst.mount_point / TRAINER_LOG).read_text().rpartition(
        "--- spotagent: trainer start")[2]
    assert f"resumed from {committed} restart=0" in new_part
    second.training_past(committed + 2)

    final = notice_drains(world, inst, second)
    tags = assert_released(world, inst, volume, generation=1)
    assert tags["spotagent:checkpoint-step"] == str(final) and final > committed


def test_spotagent_release_after_the_agent_was_killed_releases_cleanly(
        world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    agent = Agent(inst).start()
    agent.training_past(5)
    agent.crash()
    before = progress_step(inst)
    proc = run_cli(inst, "release")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"released {volume}"
    tags = assert_released(world, inst, volume, generation=1)
    files = volume_files(world, volume, CKPT, TRAINER_LOG)
    assert files[CKPT] is not None and int(files[CKPT]) >= before   # the stray's SIGTERM commit
    assert tags["spotagent:checkpoint-step"] == files[CKPT].strip()
    st = agent.status()
    assert st is not None and st.state == "released" and st.trainer_pid is None
    # Nothing more to do the second time.
    again = run_cli(inst, "release")
    assert again.returncode == 0 and again.stdout.strip() == "nothing to release"


@pytest.mark.parametrize("point", ["after_attach", "after_tag", "after_mount", "after_chroot"])
def test_killed_on_the_way_up_then_restarted_converges(
        world: World, volume: str, point: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    doomed = Agent(inst, env={CRASH_AT: point}).start()
    assert doomed.wait_exit(60) == -signal.SIGKILL, doomed.output()
    # Dead half-way: the volume is attached to us (the lock) and to nobody else.
    att = attachments(world, volume)
    assert [a["InstanceId"] for a in att] == [inst.instance_id]
    if point == "after_attach":
        assert owner(world, volume) is None and generation(world, volume) == 0
    else:
        assert owner(world, volume) == inst.instance_id and generation(world, volume) == 1

    agent = Agent(inst).start()
    st = agent.training_past(3)
    # Converged: the same volume, attached once, our owner tag, generation bumped exactly once.
    assert st.volume_id == volume and st.generation == 1
    assert len(attachments(world, volume)) == 1
    assert owner(world, volume) == inst.instance_id and generation(world, volume) == 1
    assert agent.events("claim_reused") and not agent.events("volume_claimed")
    notice_drains(world, inst, agent)
    assert_released(world, inst, volume, generation=1)


@pytest.mark.parametrize("point", ["after_unmount", "after_detach"])
def test_killed_during_the_release_then_restarted_finishes_it(
        world: World, volume: str, point: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    doomed = Agent(inst, env={CRASH_AT: point}).start()
    doomed.training_past(3)
    world.imds.fire_spot_action(inst.instance_id, "terminate")
    assert doomed.wait_exit(60) == -signal.SIGKILL, doomed.output()
    committed = doomed.status().last_committed_step  # type: ignore[union-attr]
    # Dead half-way through the release: never a volume detached while mounted.
    assert mounts_under(inst.home) == [] and world.plane.violations == []
    assert owner(world, volume) == inst.instance_id   # the claim is not given up yet
    if point == "after_unmount":
        assert len(attachments(world, volume)) == 1

    # Restarted (systemd would): the notice is still there, so it only finishes the release.
    agent = Agent(inst).start()
    assert agent.wait_exit(60) == 0, agent.output()
    st = agent.status()
    assert st is not None and st.state == "released", st
    assert not agent.events("trainer_started") and not agent.events("volume_claimed")
    tags = assert_released(world, inst, volume, generation=1)
    assert tags["spotagent:checkpoint-step"] == str(committed)
    assert volume_files(world, volume, CKPT)[CKPT] == f"{committed}\n"


def test_unexpected_exception_releases_the_volume_and_exits_non_zero(
        world: World, volume: str) -> None:
    inst = world.launch(pool="dl", settings=settings())
    buggy = Agent(inst, env={CRASH_AT: "after_chroot:raise"}).start()
    code = buggy.wait_exit(60)
    assert code not in (0, -signal.SIGKILL), buggy.output()
    assert "InjectedCrash" in buggy.output()   # the traceback reaches the journal
    st = buggy.status()
    assert st is not None and st.state == "failed"
    assert st.error is not None and st.error.startswith("unexpected error: InjectedCrash")
    assert buggy.events("agent_crashed")
    assert_released(world, inst, volume, generation=1)

    # systemd restarts the agent: it claims the volume again and trains.
    agent = Agent(inst).start()
    agent.training_past(3)
    notice_drains(world, inst, agent)
    assert_released(world, inst, volume, generation=2)
