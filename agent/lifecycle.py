"""The lifecycle: one state enum and one pure transition function, the only place that decides.

`next_state(state, event, ctx)` returns the new state and the actions the runner must carry
out; it does no I/O and reads no clock (times arrive inside events and the context), so every
decision is a unit test. The runner (`spotagent.runner`) turns the world into events and
actions into effects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta


class State(enum.StrEnum):
    STARTING = "starting"
    CLAIMING = "claiming"
    WAITING = "waiting"
    MOUNTING = "mounting"
    TRAINING = "training"
    DRAINING = "draining"
    RELEASED = "released"
    COMPLETED = "completed"
    FAILED = "failed"


TERMINAL = frozenset({State.RELEASED, State.COMPLETED, State.FAILED})
# States in which a volume may be attached to this instance (release must run before leaving).
HOLDS_VOLUME = frozenset({State.MOUNTING, State.TRAINING, State.DRAINING})


class Act(enum.StrEnum):
    CLAIM = "claim"                    # one pass over the pool's candidates (keeps a volume
                                       # already attached to us, finishing its tags)
    WAIT = "wait"                      # back off, then claim again (on_empty = wait)
    CREATE = "create"                  # create a volume in this AZ and claim it (on_empty = create)
    MOUNT = "mount"                    # device, probe, fsck, mount, chroot, start trainer
    CHECKPOINT = "checkpoint"          # SIGUSR1 to the trainer: checkpoint and continue
    DRAIN = "drain"                    # write deadline, SIGTERM the trainer
    KILL = "kill"                      # SIGKILL the trainer's tree
    RELEASE = "release"                # sync, unmount in reverse, detach, untag
    RELEASE_DONE = "release_done"      # as RELEASE, and tag the volume done (job complete)
    POWEROFF = "poweroff"
    NOTIFY_READY = "notify_ready"      # sd_notify READY=1
    NOTIFY_STOPPING = "notify_stopping"
    EXIT = "exit"                      # the agent's main loop ends


@dataclass(frozen=True)
class Action:
    act: Act
    deadline: datetime | None = None   # for DRAIN: when the trainer must have committed
    reason: str = ""


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """Base: every event says why (for the one log line per transition)."""

    @property
    def cause(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Boot(Event):
    """The agent knows who it is. Notices seen at the first poll come before it."""

    attached_volume: str | None = None   # a volume of the pool already attached to us (restart)


@dataclass(frozen=True)
class Claimed(Event):
    volume_id: str


@dataclass(frozen=True)
class PoolEmpty(Event):
    pass


@dataclass(frozen=True)
class RetryClaim(Event):
    pass


@dataclass(frozen=True)
class TrainerStarted(Event):
    pid: int


@dataclass(frozen=True)
class Notice(Event):
    """An interruption notice from a monitor (spot instance-action, rebalance, scheduled)."""

    source: str        # spot | rebalance | scheduled
    kind: str          # terminate | stop | hibernate | rebalance | <scheduled code>
    notice_time: datetime
    detected_at: datetime

    @property
    def cause(self) -> str:
        return f"notice:{self.source}:{self.kind}"


@dataclass(frozen=True)
class StopRequested(Event):
    """systemd stop (SIGTERM to the agent) or `spotagent drain`."""

    requested_at: datetime
    origin: str = "systemd"

    @property
    def cause(self) -> str:
        return f"stop:{self.origin}"


@dataclass(frozen=True)
class TrainerExited(Event):
    code: int


@dataclass(frozen=True)
class TrainerGaveUp(Event):
    """The supervisor's restart budget is exhausted."""

    reason: str


@dataclass(frozen=True)
class CheckpointCommitted(Event):
    step: int


@dataclass(frozen=True)
class DeadlinePassed(Event):
    pass


@dataclass(frozen=True)
class Released(Event):
    pass


@dataclass(frozen=True)
class Failed(Event):
    """An effect failed in a way the runner cannot retry (bad volume, bad trainer, ...)."""

    reason: str

    @property
    def cause(self) -> str:
        return f"error: {self.reason}"


# --- context and transition --------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    boot_time: datetime
    on_empty: str = "wait"               # wait | create | fail
    on_rebalance: str = "checkpoint"     # checkpoint | drain | ignore
    on_complete: str = "stay"            # stay | poweroff
    release_margin: float = 20.0         # seconds kept back from the notice's time
    stop_deadline: float = 90.0          # seconds granted on a systemd stop / spotagent drain
    # Set by the runner while draining so a second stop or notice cannot move the deadline.
    drain_deadline: datetime | None = None
    completed: bool = False              # the trainer exited 0 (job done)
    failure: str | None = None
    release_error: str | None = None     # a release attempt failed and is being retried


@dataclass(frozen=True)
class Transition:
    state: State
    actions: tuple[Action, ...] = ()
    cause: str = ""
    ignored: bool = False                # the event changed nothing (logged at debug)
    context: Context | None = None       # a new context when the decision changes it
    notes: tuple[str, ...] = field(default_factory=tuple)


# Scheduled-event codes that end the instance (system-maintenance does not).
_SCHEDULED_ENDING = frozenset({"instance-stop", "instance-retirement", "instance-reboot",
                               "system-reboot"})


def is_stale(notice: Notice, ctx: Context) -> bool:
    """A notice is stale when it belongs to an earlier boot (left over across a reboot or a
    stop/start) and must not drain this one. `ctx.boot_time` is the kernel's boot time, not the
    agent's start, so an agent restarted mid-notice still drains. A rebalance's notice_time is
    when it was issued; an instance-action's is when the interruption happens (~2 minutes after
    issue): either lying before this boot means it was meant for an earlier one."""
    if notice.source == "scheduled":
        return False  # scheduled events stay relevant until they complete
    return notice.notice_time < ctx.boot_time


def _deadline_for(notice: Notice, ctx: Context) -> datetime:
    if notice.kind == "hibernate":
        # No two-minute guarantee: the drain starts at once (SIGTERM now) with a best-effort
        # deadline. Killing the trainer at detection would lose the very checkpoint the notice
        # asks for; if the instance hibernates first, memory is kept and the drain finishes when
        # the instance resumes.
        return notice.detected_at + timedelta(seconds=ctx.stop_deadline)
    return notice.notice_time - timedelta(seconds=ctx.release_margin)


def _drain(state: State, ctx: Context, deadline: datetime, cause: str) -> Transition:
    if state is State.TRAINING:
        new = _ctx(ctx, drain_deadline=deadline)
        return Transition(State.DRAINING,
                          (Action(Act.NOTIFY_STOPPING), Action(Act.DRAIN, deadline, cause)),
                          cause, context=new)
    if state is State.MOUNTING:
        # Nothing to checkpoint yet: release straight away.
        return Transition(State.DRAINING, (Action(Act.NOTIFY_STOPPING),
                                           Action(Act.RELEASE, deadline, cause)), cause,
                          context=_ctx(ctx, drain_deadline=deadline))
    if state is State.STARTING:
        # Before Boot the runner has not said whether a volume is attached to us (an agent
        # restarted mid-drain): remember the deadline; Boot releases or ends.
        if ctx.drain_deadline is not None:
            return Transition(state, (), cause, ignored=True)
        return Transition(State.STARTING, (Action(Act.NOTIFY_STOPPING),), cause,
                          context=_ctx(ctx, drain_deadline=deadline))
    if state in (State.CLAIMING, State.WAITING):
        # No volume held: stop claiming and end.
        return Transition(State.RELEASED, (Action(Act.NOTIFY_STOPPING), Action(Act.EXIT)), cause)
    return Transition(state, (), cause, ignored=True)


def _ctx(ctx: Context, **changes: object) -> Context:
    from dataclasses import replace

    return replace(ctx, **changes)  # type: ignore[arg-type]


def next_state(state: State, event: Event, ctx: Context) -> Transition:
    """Decide. Pure: the same (state, event, ctx) always gives the same Transition."""
    cause = event.cause
    if state in TERMINAL:
        return Transition(state, (), cause, ignored=True)

    match event:
        case Boot(attached_volume=vol) if state is State.STARTING:
            if ctx.drain_deadline is not None:
                # Interrupted before we even started: nothing to train, only to give back.
                if vol:
                    return Transition(State.DRAINING,
                                      (Action(Act.RELEASE, ctx.drain_deadline, "interrupted"),),
                                      f"boot: interrupted; releasing volume {vol}")
                return Transition(State.RELEASED, (Action(Act.EXIT),),
                                  "boot: interrupted before claiming")
            if vol:
                # Claim keeps a volume already attached to us (never a second one) and finishes
                # its owner tag and generation if the last agent died before writing them.
                return Transition(State.CLAIMING, (Action(Act.CLAIM, reason="re-use"),),
                                  f"boot: volume {vol} already attached to this instance")
            return Transition(State.CLAIMING, (Action(Act.CLAIM),), "boot")

        case Claimed() if state in (State.CLAIMING, State.WAITING):
            return Transition(State.MOUNTING, (Action(Act.MOUNT),), cause)

        case PoolEmpty() if state in (State.CLAIMING, State.WAITING):
            if ctx.on_empty == "wait":
                acts: tuple[Action, ...] = (Action(Act.WAIT),)
                if state is State.CLAIMING:
                    # Ready for systemd: the agent is up and waiting for a volume.
                    acts = (Action(Act.NOTIFY_READY), Action(Act.WAIT))
                return Transition(State.WAITING, acts, "pool empty: waiting")
            if ctx.on_empty == "create" and state is State.CLAIMING:
                return Transition(State.CLAIMING, (Action(Act.CREATE),), "pool empty: creating")
            return Transition(State.FAILED, (Action(Act.EXIT),), "pool empty: on_empty=fail",
                              context=_ctx(ctx, failure="no free volume in the pool"))

        case RetryClaim() if state is State.WAITING:
            return Transition(State.WAITING, (Action(Act.CLAIM),), cause)

        case TrainerStarted() if state is State.MOUNTING:
            return Transition(State.TRAINING, (Action(Act.NOTIFY_READY),), cause)

        case Notice() as n:
            return _on_notice(state, n, ctx)

        case StopRequested(requested_at=at):
            if state is State.DRAINING:
                # A second stop does not interrupt or move the drain in progress.
                return Transition(state, (), cause, ignored=True)
            return _drain(state, ctx, at + timedelta(seconds=ctx.stop_deadline), cause)

        case TrainerExited(code=0) if state is State.TRAINING:
            return Transition(State.DRAINING, (Action(Act.NOTIFY_STOPPING),
                                               Action(Act.RELEASE_DONE, reason="job complete")),
                              "trainer exited 0: job complete",
                              context=_ctx(ctx, completed=True))

        case TrainerExited(code=code) if state is State.DRAINING:
            # Exit during a drain: 0 means the checkpoint is committed; anything else still
            # leaves the newest committed checkpoint on the volume, which is what we keep.
            return Transition(State.DRAINING, (Action(Act.RELEASE),),
                              f"trainer exited {code} during drain")

        case CheckpointCommitted() if state is State.DRAINING:
            # The trainer exits by itself after its SIGTERM checkpoint; nothing to do yet.
            return Transition(state, (), cause, ignored=True)

        case DeadlinePassed() if state is State.DRAINING:
            return Transition(State.DRAINING, (Action(Act.KILL), Action(Act.RELEASE)),
                              "drain deadline passed: killing the trainer")

        case TrainerGaveUp(reason=reason) if state is State.TRAINING:
            return Transition(State.DRAINING, (Action(Act.RELEASE),),
                              f"trainer failed: {reason}", context=_ctx(ctx, failure=reason))

        case Released() if state is State.DRAINING:
            if ctx.failure:
                return Transition(State.FAILED, (Action(Act.EXIT),),
                                  f"volume released after failure: {ctx.failure}")
            if ctx.completed:
                acts = ((Action(Act.POWEROFF),) if ctx.on_complete == "poweroff" else ())
                return Transition(State.COMPLETED, (*acts, Action(Act.EXIT)), "volume released")
            return Transition(State.RELEASED, (Action(Act.EXIT),), "volume released")

        case Failed(reason=reason):
            # The first failure is the cause the operator needs; a later one (a release that
            # fails after it) is added, not swapped in.
            new = _ctx(ctx, failure=f"{ctx.failure}; then {reason}" if ctx.failure else reason)
            if state is State.DRAINING and not (ctx.failure or ctx.release_error):
                # The drain's own release (or drain) failed, say a device still busy for a
                # moment: one more try. If that one succeeds the drain ends as it would have.
                return Transition(State.DRAINING, (Action(Act.KILL), Action(Act.RELEASE)),
                                  cause, context=_ctx(ctx, release_error=reason))
            if state is State.DRAINING:
                # Release failed after a failure, or twice: nothing more this process can do
                # safely (systemd restarts the agent, which re-uses the attached volume).
                if not ctx.failure and ctx.release_error:
                    new = _ctx(ctx, failure=f"{ctx.release_error}; then {reason}")
                return Transition(State.FAILED, (Action(Act.EXIT),), cause, context=new)
            if state in HOLDS_VOLUME:
                acts = (Action(Act.KILL), Action(Act.RELEASE))
                return Transition(State.DRAINING, acts, cause, context=new)
            return Transition(State.FAILED, (Action(Act.EXIT),), cause, context=new)

    return Transition(state, (), cause, ignored=True)


def _on_notice(state: State, n: Notice, ctx: Context) -> Transition:
    cause = n.cause
    if is_stale(n, ctx):
        return Transition(state, (), f"{cause}: predates this boot, ignored", ignored=True)
    if n.source == "spot" and n.kind in ("terminate", "stop", "hibernate"):
        if state is State.DRAINING:
            return Transition(state, (), cause, ignored=True)
        return _drain(state, ctx, _deadline_for(n, ctx), cause)
    if n.source == "rebalance" or (n.source == "scheduled" and n.kind in _SCHEDULED_ENDING):
        if n.source == "rebalance" and ctx.on_rebalance == "ignore":
            return Transition(state, (), f"{cause}: on_rebalance=ignore", ignored=True)
        if n.source == "rebalance" and ctx.on_rebalance == "drain":
            return _drain(state, ctx, n.detected_at + timedelta(seconds=ctx.stop_deadline),
                          cause)
        if state is State.TRAINING:
            # A cheap early checkpoint; training continues.
            return Transition(state, (Action(Act.CHECKPOINT, reason=cause),), cause)
    return Transition(state, (), cause, ignored=True)
