"""The agent <-> trainer protocol: environment, signal flags, deadline file, progress file.

Environment (set by the agent):
    SPOTAGENT_CHECKPOINT_DIR  checkpoint root (required unless the script gives a default)
    SPOTAGENT_RUN_ID          opaque id of the training run (recorded in every manifest)
    SPOTAGENT_RESTART_COUNT   how many times the agent restarted the trainer (int, default 0)
    SPOTAGENT_CONTROL_DIR     control directory; unset means no deadline is ever read

Signals (handlers only set flags; the training loop acts at the next step boundary):
    SIGUSR1  commit a checkpoint and continue
    SIGTERM  commit a checkpoint and exit 0 (EXIT_NOT_COMMITTED if it could not be committed)

Files in the control directory:
    deadline       written atomically by the agent: {"deadline": <unix s>, "reason": "..."}
    progress.json  written atomically by the trainer (see Progress); without a control
                   directory it lives at <checkpoint_dir>/progress.json
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

from . import fsio
from ._log import event
from .errors import CheckpointError, ProtocolError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_NOT_COMMITTED = 3  # SIGTERM honoured, but no checkpoint could be committed (deadline)

ENV_CHECKPOINT_DIR = "SPOTAGENT_CHECKPOINT_DIR"
ENV_RUN_ID = "SPOTAGENT_RUN_ID"
ENV_RESTART_COUNT = "SPOTAGENT_RESTART_COUNT"
ENV_CONTROL_DIR = "SPOTAGENT_CONTROL_DIR"
DEADLINE_NAME = "deadline"
PROGRESS_NAME = "progress.json"


@dataclass(frozen=True)
class AgentEnv:
    checkpoint_dir: Path | None
    run_id: str | None
    restart_count: int
    control_dir: Path | None

    @staticmethod
    def from_environ(environ: Mapping[str, str] | None = None) -> AgentEnv:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_RESTART_COUNT, "0") or "0"
        try:
            restarts = int(raw)
        except ValueError as err:
            raise ProtocolError(f"{ENV_RESTART_COUNT}={raw!r} is not an integer") from err
        if restarts < 0:
            raise ProtocolError(f"{ENV_RESTART_COUNT}={raw!r} is negative")
        ckpt = env.get(ENV_CHECKPOINT_DIR) or None
        ctl = env.get(ENV_CONTROL_DIR) or None
        return AgentEnv(
            checkpoint_dir=Path(ckpt) if ckpt else None,
            run_id=env.get(ENV_RUN_ID) or None,
            restart_count=restarts,
            control_dir=Path(ctl) if ctl else None,
        )


class SignalFlags:
    """SIGUSR1 / SIGTERM handlers that only record; the loop reads and clears the flags."""

    def __init__(self) -> None:
        self.checkpoint_requested = False
        self.exit_requested = False

    def _on_usr1(self, _signum: int, _frame: FrameType | None) -> None:
        self.checkpoint_requested = True

    def _on_term(self, _signum: int, _frame: FrameType | None) -> None:
        self.exit_requested = True

    def install(self) -> None:
        """Install the handlers (main thread only)."""
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)

    def take_checkpoint_request(self) -> bool:
        requested, self.checkpoint_requested = self.checkpoint_requested, False
        return requested


def ignore_agent_signals() -> None:
    """For data-loader workers: ignore SIGTERM/SIGUSR1/SIGINT so a signal sent to the whole
    process group cannot kill a worker while the main process commits its emergency save."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


@dataclass(frozen=True)
class Deadline:
    deadline: float
    reason: str


class DeadlineWatcher:
    """Reads `<control>/deadline` when it changes (one stat per call otherwise)."""

    def __init__(self, control_dir: Path | None) -> None:
        self.path = None if control_dir is None else control_dir / DEADLINE_NAME
        self._key: tuple[int, int, int] | None = None
        self._value: Deadline | None = None

    def read(self) -> Deadline | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._key, self._value = None, None
            return None
        except OSError:
            return self._value
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._key = key
            self._value = self._parse()
        return self._value

    def seconds(self) -> float | None:
        """The deadline as unix seconds (or None): the shape AsyncCheckpointer wants."""
        value = self.read()
        return None if value is None else value.deadline

    def _parse(self) -> Deadline | None:
        assert self.path is not None
        try:
            obj = json.loads(self.path.read_bytes())
            value = Deadline(float(obj["deadline"]), str(obj.get("reason", "")))
        except (OSError, ValueError, KeyError, TypeError) as err:
            event(logging.WARNING, "deadline_file_invalid", path=str(self.path), problem=str(err))
            return None
        event(logging.WARNING, "deadline_seen", deadline=value.deadline, reason=value.reason,
              seconds_left=round(value.deadline - time.time(), 3))
        return value


@dataclass
class Progress:
    step: int
    samples_per_s: float
    loss: float
    last_committed_step: int | None
    last_commit_time: float | None
    pid: int
    state: str  # "training" | "saving" | "exiting"
    time: float


class ProgressWriter:
    """Atomically replaces the progress file, at most every `interval_s` unless forced."""

    def __init__(self, path: Path, interval_s: float = 1.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self._last = 0.0
        self._last_state = ""

    def write(self, progress: Progress, *, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and progress.state == self._last_state and now - self._last < self.interval_s:
            return False
        self._last, self._last_state = now, progress.state
        doc = asdict(progress)
        if doc["loss"] != doc["loss"] or doc["loss"] in (float("inf"), float("-inf")):
            doc["loss"] = None  # keep the file strict JSON
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fsio.atomic_replace(self.path, (json.dumps(doc) + "\n").encode(), durable=False)
        except (CheckpointError, OSError) as err:
            event(logging.WARNING, "progress_write_failed", path=str(self.path), problem=str(err))
            return False
        return True
