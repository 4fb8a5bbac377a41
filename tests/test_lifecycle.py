"""The pure state machine: every decision the agent makes, without I/O."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from spotagent.lifecycle import (
    Act,
    Boot,
    CheckpointCommitted,
    Claimed,
    Context,
    DeadlinePassed,
    Failed,
    Notice,
    PoolEmpty,
    Released,
    RetryClaim,
    State,
    StopRequested,
    TrainerExited,
    TrainerGaveUp,
    TrainerStarted,
    next_state,
)

BOOT = datetime(2026, 11, 23, 10, 0, 0, tzinfo=UTC)
NOW = BOOT + timedelta(minutes=30)
CTX = Context(boot_time=BOOT, release_margin=20.0, stop_deadline=90.0)


def acts(t: object) -> list[Act]:
    return [a.act for a in t.actions]  # type: ignore[attr-defined]


def spot(kind: str = "terminate", *, at: datetime = NOW + timedelta(minutes=2)) -> Notice:
    return Notice(source="spot", kind=kind, notice_time=at, detected_at=NOW)


def test_boot_claims_or_reuses_an_attached_volume() -> None:
    t = next_state(State.STARTING, Boot(), CTX)
    assert (t.state, acts(t)) == (State.CLAIMING, [Act.CLAIM])
    # A volume already attached to us (agent restart) goes through the claim too: it keeps
    # the volume (never a second one) and finishes owner tag and generation if they are missing.
    t = next_state(State.STARTING, Boot(attached_volume="vol-1"), CTX)
    assert (t.state, acts(t)) == (State.CLAIMING, [Act.CLAIM])
    assert "already attached" in t.cause and t.actions[0].reason == "re-use"
    t = next_state(State.CLAIMING, Claimed("vol-1"), CTX)
    assert (t.state, acts(t)) == (State.MOUNTING, [Act.MOUNT])


def test_notice_seen_before_boot_releases_instead_of_training() -> None:
    # The runner polls the monitors once before Boot: an agent restarted mid-drain finds the
    # notice still there and must give the volume back, not start training again.
    t = next_state(State.STARTING, spot(), CTX)
    assert (t.state, acts(t)) == (State.STARTING, [Act.NOTIFY_STOPPING])
    assert t.context is not None and t.context.drain_deadline is not None
    ctx = t.context
    held = next_state(State.STARTING, Boot(attached_volume="vol-1"), ctx)
    assert (held.state, acts(held)) == (State.DRAINING, [Act.RELEASE])
    assert held.actions[0].deadline == ctx.drain_deadline
    assert next_state(State.DRAINING, Released(), ctx).state is State.RELEASED
    free = next_state(State.STARTING, Boot(), ctx)
    assert (free.state, acts(free)) == (State.RELEASED, [Act.EXIT])
    # A second notice before Boot keeps the first deadline.
    assert next_state(State.STARTING, spot("hibernate"), ctx).ignored


def test_stale_notice_before_boot_changes_nothing() -> None:
    t = next_state(State.STARTING, spot(at=BOOT - timedelta(minutes=3)), CTX)
    assert t.ignored and t.state is State.STARTING
    assert next_state(State.STARTING, Boot(), CTX).state is State.CLAIMING


def test_stop_before_boot_is_remembered() -> None:
    t = next_state(State.STARTING, StopRequested(requested_at=NOW), CTX)
    assert t.context is not None
    assert t.context.drain_deadline == NOW + timedelta(seconds=90)
    assert acts(next_state(State.STARTING, Boot(attached_volume="vol-1"), t.context)) == [
        Act.RELEASE]


@pytest.mark.parametrize(("on_empty", "state", "expected"), [
    ("wait", State.WAITING, [Act.NOTIFY_READY, Act.WAIT]),
    ("create", State.CLAIMING, [Act.CREATE]),
    ("fail", State.FAILED, [Act.EXIT]),
])
def test_pool_empty_follows_on_empty(on_empty: str, state: State, expected: list[Act]) -> None:
    t = next_state(State.CLAIMING, PoolEmpty(), replace(CTX, on_empty=on_empty))
    assert (t.state, acts(t)) == (state, expected)


def test_waiting_retries_and_claims() -> None:
    t = next_state(State.WAITING, RetryClaim(), CTX)
    assert acts(t) == [Act.CLAIM]
    t = next_state(State.WAITING, PoolEmpty(), CTX)
    assert (t.state, acts(t)) == (State.WAITING, [Act.WAIT])  # READY only once
    t = next_state(State.WAITING, Claimed("vol-1"), CTX)
    assert (t.state, acts(t)) == (State.MOUNTING, [Act.MOUNT])


def test_trainer_start_is_ready() -> None:
    t = next_state(State.MOUNTING, TrainerStarted(pid=42), CTX)
    assert (t.state, acts(t)) == (State.TRAINING, [Act.NOTIFY_READY])


def test_spot_terminate_drains_with_deadline_notice_time_minus_margin() -> None:
    n = spot("terminate")
    t = next_state(State.TRAINING, n, CTX)
    assert t.state is State.DRAINING
    assert acts(t) == [Act.NOTIFY_STOPPING, Act.DRAIN]
    assert t.actions[1].deadline == n.notice_time - timedelta(seconds=20)
    assert t.context is not None and t.context.drain_deadline == t.actions[1].deadline


def test_spot_stop_drains_too() -> None:
    assert next_state(State.TRAINING, spot("stop"), CTX).state is State.DRAINING


def test_hibernate_checkpoints_at_once() -> None:
    t = next_state(State.TRAINING, spot("hibernate"), CTX)
    assert t.state is State.DRAINING
    assert [a.act for a in t.actions] == [Act.NOTIFY_STOPPING, Act.DRAIN]  # SIGTERM now
    # Best effort, not the notice's time: stop_deadline from detection.
    assert t.actions[1].deadline == NOW + timedelta(seconds=90)


def test_notice_from_before_this_boot_is_ignored() -> None:
    old = spot("terminate", at=BOOT - timedelta(minutes=5))
    t = next_state(State.TRAINING, old, CTX)
    assert t.ignored and t.state is State.TRAINING and "predates this boot" in t.cause
    old_rebalance = Notice("rebalance", "rebalance", BOOT - timedelta(hours=1), NOW)
    assert next_state(State.TRAINING, old_rebalance, CTX).ignored


def test_agent_restarted_mid_notice_still_drains() -> None:
    # The notice is from this boot (after the kernel booted) even if the agent restarted.
    t = next_state(State.TRAINING, spot(at=BOOT + timedelta(minutes=1)), CTX)
    assert t.state is State.DRAINING


@pytest.mark.parametrize(("policy", "state", "expected"), [
    ("checkpoint", State.TRAINING, [Act.CHECKPOINT]),
    ("ignore", State.TRAINING, []),
    ("drain", State.DRAINING, [Act.NOTIFY_STOPPING, Act.DRAIN]),
])
def test_rebalance_follows_on_rebalance(policy: str, state: State, expected: list[Act]) -> None:
    n = Notice("rebalance", "rebalance", NOW, NOW)
    t = next_state(State.TRAINING, n, replace(CTX, on_rebalance=policy))
    assert (t.state, acts(t)) == (state, expected)


def test_scheduled_retirement_checkpoints_early_maintenance_does_not() -> None:
    ret = Notice("scheduled", "instance-retirement", NOW + timedelta(days=2), NOW)
    assert acts(next_state(State.TRAINING, ret, CTX)) == [Act.CHECKPOINT]
    mnt = Notice("scheduled", "system-maintenance", NOW + timedelta(days=2), NOW)
    assert next_state(State.TRAINING, mnt, CTX).ignored


def test_systemd_stop_drains_with_stop_deadline() -> None:
    t = next_state(State.TRAINING, StopRequested(requested_at=NOW), CTX)
    assert t.state is State.DRAINING
    assert t.actions[1].deadline == NOW + timedelta(seconds=90)


def test_second_stop_or_notice_during_drain_changes_nothing() -> None:
    ctx = replace(CTX, drain_deadline=NOW)
    for ev in (StopRequested(requested_at=NOW), spot("terminate"), spot("hibernate")):
        t = next_state(State.DRAINING, ev, ctx)
        assert t.ignored and t.state is State.DRAINING and not t.actions


def test_stop_before_a_volume_is_held_exits_without_release() -> None:
    for st in (State.CLAIMING, State.WAITING):
        t = next_state(st, StopRequested(requested_at=NOW), CTX)
        assert t.state is State.RELEASED and Act.RELEASE not in acts(t)


def test_stop_while_mounting_releases_at_once() -> None:
    t = next_state(State.MOUNTING, spot(), CTX)
    assert acts(t) == [Act.NOTIFY_STOPPING, Act.RELEASE]


def test_drain_ends_when_trainer_exits_or_deadline_passes() -> None:
    t = next_state(State.DRAINING, CheckpointCommitted(step=7), CTX)
    assert t.ignored
    t = next_state(State.DRAINING, TrainerExited(code=0), CTX)
    assert acts(t) == [Act.RELEASE]
    t = next_state(State.DRAINING, DeadlinePassed(), CTX)
    assert acts(t) == [Act.KILL, Act.RELEASE]
    t = next_state(State.DRAINING, Released(), CTX)
    assert (t.state, acts(t)) == (State.RELEASED, [Act.EXIT])


def test_trainer_exit_0_completes_the_job() -> None:
    t = next_state(State.TRAINING, TrainerExited(code=0), CTX)
    assert acts(t) == [Act.NOTIFY_STOPPING, Act.RELEASE_DONE]
    assert t.context is not None and t.context.completed
    done = next_state(State.DRAINING, Released(), t.context)
    assert (done.state, acts(done)) == (State.COMPLETED, [Act.EXIT])
    off = next_state(State.DRAINING, Released(), replace(t.context, on_complete="poweroff"))
    assert acts(off) == [Act.POWEROFF, Act.EXIT]


def test_trainer_budget_exhausted_releases_then_fails() -> None:
    t = next_state(State.TRAINING, TrainerGaveUp(reason="5 restarts in 600s"), CTX)
    assert (t.state, acts(t)) == (State.DRAINING, [Act.RELEASE])
    assert t.context is not None
    end = next_state(State.DRAINING, Released(), t.context)
    assert end.state is State.FAILED and "5 restarts" in end.cause


def test_failure_while_holding_a_volume_releases_it_first() -> None:
    t = next_state(State.MOUNTING, Failed("no root file system on the volume"), CTX)
    assert (t.state, acts(t)) == (State.DRAINING, [Act.KILL, Act.RELEASE])
    t2 = next_state(State.CLAIMING, Failed("ZoneMismatch"), CTX)
    assert (t2.state, acts(t2)) == (State.FAILED, [Act.EXIT])
    # A failing release does not loop.
    assert t.context is not None
    t3 = next_state(State.DRAINING, Failed("detach timed out"), t.context)
    assert (t3.state, acts(t3)) == (State.FAILED, [Act.EXIT])
    # The first failure stays the headline; the failed release is added to it.
    assert t3.context is not None
    assert t3.context.failure == "no root file system on the volume; then detach timed out"


def test_a_drain_whose_release_fails_once_retries_and_still_ends_released() -> None:
    draining = replace(CTX, drain_deadline=NOW)
    t = next_state(State.DRAINING, Failed("release: device busy"), draining)
    assert (t.state, acts(t)) == (State.DRAINING, [Act.KILL, Act.RELEASE])
    assert t.context is not None and t.context.failure is None
    ok = next_state(State.DRAINING, Released(), t.context)
    assert (ok.state, acts(ok)) == (State.RELEASED, [Act.EXIT])
    # Twice is a failure, naming both attempts.
    again = next_state(State.DRAINING, Failed("release: device busy"), t.context)
    assert (again.state, acts(again)) == (State.FAILED, [Act.EXIT])
    assert again.context is not None
    assert again.context.failure == "release: device busy; then release: device busy"


def test_terminal_states_ignore_everything() -> None:
    for st in (State.RELEASED, State.COMPLETED, State.FAILED):
        for ev in (Boot(), spot(), StopRequested(requested_at=NOW), Released()):
            t = next_state(st, ev, CTX)
            assert t.ignored and t.state is st


def test_unexpected_events_are_ignored_not_crashing() -> None:
    assert next_state(State.CLAIMING, TrainerStarted(pid=1), CTX).ignored
    assert next_state(State.TRAINING, Claimed("vol-2"), CTX).ignored
