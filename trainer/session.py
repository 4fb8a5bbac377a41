"""Session: the step-boundary logic that ties state, saver, signals, deadline and progress.

Call `restore()` once, `step_done()` after every optimizer step and `finish()` when the job is
complete; exit with the returned code. At each step boundary the session decides (identically on
every rank under torch.distributed, through one tiny all-reduce) whether to start a checkpoint
(periodic, SIGUSR1) or to commit and exit (SIGTERM). Requests arriving while a save is in flight
coalesce into one save at the first boundary after it finishes.

When the state has a torch optimizer, parameters and optimizer state are copied to host memory
by the writer thread while the next forward/backward runs; an optimizer step pre-hook waits for
that copy before `optimizer.step()` changes them (`defer_copy=False` copies everything at the
boundary instead: use it if your loop changes parameters in place outside `optimizer.step()`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from . import codec, fsio
from ._log import event
from .asyncsave import AsyncCheckpointer, SaveStatus
from .dist import Dist
from .errors import CheckpointError, NoCheckpointError
from .protocol import (
    EXIT_FAILURE,
    EXIT_NOT_COMMITTED,
    EXIT_OK,
    PROGRESS_NAME,
    AgentEnv,
    DeadlineWatcher,
    Progress,
    ProgressWriter,
    SignalFlags,
)
from .state import TrainState
from .store import CheckpointStore


class Session:
    """One training process's view of checkpointing and of the agent protocol."""

    def __init__(
        self,
        state: TrainState,
        checkpoint_dir: Path | str,
        *,
        keep: int = 3,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        control_dir: Path | str | None = None,
        run_id: str | None = None,
        restart_count: int = 0,
        install_signal_handlers: bool = True,
        deadline_margin_s: float = 1.0,
        write_rate_limit: float | None = None,
        chunk_bytes: int = fsio.DEFAULT_CHUNK_BYTES,
        progress_interval_s: float = 1.0,
        pinned: bool | None = None,
        defer_copy: bool = True,
        flags: SignalFlags | None = None,
        dist: Dist | None = None,
    ) -> None:
        self.state = state
        self.dist = dist or Dist.detect()
        self.store = CheckpointStore(checkpoint_dir, keep=keep, chunk_bytes=chunk_bytes)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.run_id = run_id
        self.restart_count = restart_count
        self.margin_s = deadline_margin_s
        if flags is not None:  # handlers installed by the caller (e.g. before a slow start-up)
            self.flags = flags
        else:
            self.flags = SignalFlags()
            if install_signal_handlers:
                self.flags.install()
        self.deadline = DeadlineWatcher(Path(control_dir) if control_dir else None)
        self.saver: AsyncCheckpointer | None = None
        self.progress: ProgressWriter | None = None
        if self.dist.is_writer:
            self.saver = AsyncCheckpointer(
                self.store, deadline=self.deadline.seconds, margin_s=deadline_margin_s,
                rate_limit=write_rate_limit, pinned=pinned, run_id=run_id,
                restart_count=restart_count)
            progress_dir = Path(control_dir) if control_dir else self.store.root
            self.progress = ProgressWriter(progress_dir / PROGRESS_NAME, progress_interval_s)
        self.last_committed_step: int | None = None
        self.last_commit_time: float | None = None
        self.exit_code: int | None = None
        self._pending = False
        self._last_save_mark = time.monotonic()
        self._loss = float("nan")
        self._samples = 0
        self._window: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])
        self._defer = bool(defer_copy and self.saver is not None
                           and isinstance(state.optimizer, torch.optim.Optimizer))
        if self._defer:
            assert isinstance(state.optimizer, torch.optim.Optimizer)
            self._hook = state.optimizer.register_step_pre_hook(self._before_optimizer_step)

    @property
    def blocked_seconds(self) -> float:
        """Time the training thread spent blocked by checkpoint snapshots so far."""
        return 0.0 if self.saver is None else self.saver.blocked_seconds

    def request_checkpoint(self) -> None:
        """Checkpoint at the next step boundary and continue (what SIGUSR1 does)."""
        self.flags.checkpoint_requested = True

    @classmethod
    def from_env(cls, state: TrainState, *, checkpoint_dir: Path | str | None = None,
                 environ: Mapping[str, str] | None = None, **kwargs: Any) -> Session:
        """Build from SPOTAGENT_* variables; `checkpoint_dir` is the fallback when unset."""
        env = AgentEnv.from_environ(environ)
        root = env.checkpoint_dir or (Path(checkpoint_dir) if checkpoint_dir else None)
        if root is None:
            raise CheckpointError("no checkpoint directory: set SPOTAGENT_CHECKPOINT_DIR")
        return cls(state, root, control_dir=env.control_dir, run_id=env.run_id,
                   restart_count=env.restart_count, **kwargs)

    # ---- start -------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest valid checkpoint into the state (all ranks); return the step."""
        loaded = None
        if self.dist.is_writer:
            self.store.cleanup()
            loaded = self.store.load_newest(repair=True)
        step = int(self.dist.broadcast(loaded.step if loaded else -1))
        if not self.dist.is_writer and step >= 0:
            loaded = self.store.load_newest(accept=lambda ref: ref.step == step)
            if loaded is None:
                raise NoCheckpointError(f"rank {self.dist.rank} cannot load step {step}",
                                        self.store.root)
        if loaded is not None:
            self.state.apply(loaded.tree, self.dist.rank)
            self.last_committed_step = loaded.step
            self.last_commit_time = loaded.manifest.wall_time
            event(logging.INFO, "checkpoint_restored", step=loaded.step, path=str(loaded.path),
                  restart_count=self.restart_count, rank=self.dist.rank)
        else:
            event(logging.INFO, "no_checkpoint", path=str(self.store.root), rank=self.dist.rank)
        if self.saver is not None:
            self.saver.prepare(codec.encode(self.state.capture()).total_bytes)
        self._last_save_mark = time.monotonic()
        self._write_progress("training", force=True)
        return self.state.step

    # ---- the step boundary -------------------------------------------------------------------

    def step_done(self, *, loss: float | None = None, samples: int = 0) -> bool:
        """Record a completed step; act on periodic saves and signals. True = stop training."""
        self.state.step += 1
        if loss is not None:
            self._loss = float(loss)
        self._samples += samples
        if self.exit_code is not None:
            return True
        due = bool(self.every_steps and self.state.step % self.every_steps == 0)
        if self.every_seconds and time.monotonic() - self._last_save_mark >= self.every_seconds:
            due = True
        save_req, exit_req, busy = self.dist.max_flags([
            int(self.flags.take_checkpoint_request() or due),
            int(self.flags.exit_requested),
            int(self.saver is not None and self.saver.busy),
        ])
        self._collect_results()
        if exit_req:
            self._commit_and_exit()
            return True
        self._pending = self._pending or bool(save_req)
        if self._pending and not busy:
            self._pending = False
            self._start_save(wait=False)
        self._write_progress("saving" if busy or self._pending else "training")
        return False

    def finish(self) -> int:
        """The job is complete: commit the final step, wait, and return the exit code (0)."""
        if self.exit_code is not None:
            return self.exit_code
        committed = self._save_now()
        self.exit_code = EXIT_OK if committed else EXIT_FAILURE
        self._write_progress("exiting", force=True)
        self.close()
        return self.exit_code

    def close(self) -> None:
        """Wait for an in-flight save (bounded by the deadline) and free the host buffer."""
        if self.saver is not None:
            self._wait_in_flight()
            self.saver.close()
            self._collect_results()

    # ---- internals ---------------------------------------------------------------------------

    def _commit_and_exit(self) -> None:
        event(logging.WARNING, "exit_requested", step=self.state.step, rank=self.dist.rank)
        self._write_progress("saving", force=True)
        committed = self._save_now()
        self.exit_code = EXIT_OK if committed else EXIT_NOT_COMMITTED
        self._write_progress("exiting", force=True)
        self.close()
        event(logging.WARNING if committed else logging.ERROR, "exiting", step=self.state.step,
              committed=committed, exit_code=self.exit_code)

    def _save_now(self) -> bool:
        """Commit the current step synchronously (all ranks agree on the outcome)."""
        if self.saver is not None:
            self._wait_in_flight()
            self._collect_results()
        need = self.dist.broadcast(self.last_committed_step != self.state.step)
        if need:
            self._start_save(wait=True)
            if self.saver is not None:
                self.saver.wait()
                self._collect_results()
        return bool(self.dist.broadcast(self.last_committed_step == self.state.step))

    def _wait_in_flight(self) -> None:
        assert self.saver is not None
        deadline = self.deadline.seconds()
        if deadline is None:
            self.saver.wait()
            return
        if not self.saver.wait(max(0.0, deadline - time.time() - self.margin_s)):
            self.saver.abandon()
            self.saver.wait()

    def _start_save(self, *, wait: bool) -> None:
        ranks = self.dist.gather(self.state.capture_local())
        self._last_save_mark = time.monotonic()
        if self.saver is None:
            return
        assert ranks is not None
        self._write_progress("saving", force=True)
        self.saver.save(self.state.step, lambda: self.state.capture(ranks), wait=wait,
                        extra={"world_size": self.dist.world},
                        defer=None if wait else self._defer_predicate())

    def _before_optimizer_step(self, *_args: Any) -> None:
        assert self.saver is not None
        self.saver.wait_snapshot()

    def _defer_predicate(self) -> Callable[[torch.Tensor], bool] | None:
        """Sources living in parameter or optimizer-state storage: only step() mutates them."""
        if not self._defer:
            return None
        opt = self.state.optimizer
        assert isinstance(opt, torch.optim.Optimizer)
        storages = {p.untyped_storage().data_ptr()
                    for group in opt.param_groups for p in group["params"]}
        for per_param in opt.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    storages.add(value.untyped_storage().data_ptr())
        return lambda t: t.untyped_storage().data_ptr() in storages

    def _collect_results(self) -> None:
        if self.saver is None:
            return
        for result in self.saver.take_results():
            if result.status is SaveStatus.COMMITTED:
                self.last_committed_step = result.step
                self.last_commit_time = time.time()

    def _samples_per_s(self) -> float:
        now = time.monotonic()
        self._window.append((now, self._samples))
        while len(self._window) > 2 and now - self._window[1][0] >= 5.0:
            self._window.popleft()
        t0, s0 = self._window[0]
        return (self._samples - s0) / (now - t0) if now > t0 else 0.0

    def _write_progress(self, state: str, *, force: bool = False) -> None:
        if self.progress is None:
            return
        self.progress.write(Progress(
            step=self.state.step, samples_per_s=round(self._samples_per_s(), 3),
            loss=self._loss, last_committed_step=self.last_committed_step,
            last_commit_time=self.last_commit_time, pid=os.getpid(), state=state,
            time=time.time()), force=force)
