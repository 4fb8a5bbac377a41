"""spottrainer: crash-safe, asynchronous checkpoints and the agent protocol for training jobs.

Runs inside the training environment and needs only torch. Typical use::

    state = TrainState(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    session = Session.from_env(state, every_seconds=60)
    session.restore()
    for batch in iterate(loader, sampler):
        ...  # forward, backward, optimizer step
        if session.step_done(loss=loss.item(), samples=len(batch)) or state.step >= steps:
            break
    sys.exit(session.finish() if session.exit_code is None else session.exit_code)

See docs/trainer.md for the checkpoint format and the agent <-> trainer protocol.
"""

from .asyncsave import AsyncCheckpointer, Request, SaveResult, SaveStatus
from .data import ResumableSampler, iterate, worker_init_fn
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    ProtocolError,
    SaveAbandonedError,
    SpottrainerError,
)
from .protocol import (
    EXIT_FAILURE,
    EXIT_NOT_COMMITTED,
    EXIT_OK,
    AgentEnv,
    DeadlineWatcher,
    Progress,
    ProgressWriter,
    SignalFlags,
    ignore_agent_signals,
)
from .session import Session
from .state import Stateful, TrainState
from .store import CheckpointRef, CheckpointStore, Loaded, VerifyResult

__all__ = [
    "EXIT_FAILURE",
    "EXIT_NOT_COMMITTED",
    "EXIT_OK",
    "AgentEnv",
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointRef",
    "CheckpointStore",
    "CorruptCheckpointError",
    "DeadlineWatcher",
    "Loaded",
    "NoCheckpointError",
    "Progress",
    "ProgressWriter",
    "ProtocolError",
    "Request",
    "ResumableSampler",
    "SaveAbandonedError",
    "SaveResult",
    "SaveStatus",
    "Session",
    "SignalFlags",
    "SpottrainerError",
    "Stateful",
    "TrainState",
    "VerifyResult",
    "ignore_agent_signals",
    "iterate",
    "worker_init_fn",
]
