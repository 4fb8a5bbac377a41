"""Asynchronous checkpoint saves: snapshot on the training thread, write on a writer thread.

The training thread is blocked only while the state is copied into a reusable host buffer
(pinned when CUDA is present). A writer thread then streams the bytes to disk and commits; its
work is system calls and zlib CRCs, which release the GIL, so it does not slow Python on the
training thread (bench/checkpoint.py measures this).

Deferred copy: tensors selected by `save(..., defer=pred)` (parameters and optimizer state, which
only `optimizer.step()` mutates) are copied by the writer thread while the training thread
already runs the next forward/backward; the training thread calls `wait_snapshot()` before it
mutates them (Session does this in an optimizer step pre-hook). Everything else is copied
before `save()` returns.

One save is in flight at a time. `save(..., wait=False)` while one is in flight *coalesces*: the
request is remembered (several collapse into one) and served by `poll()` at the first step
boundary after the in-flight save has finished, with the state of that step. `save(..., wait=True)`
waits for the in-flight save to finish first (used for the final / SIGTERM save).

Background saves (`wait=False`) write at a raised nice value (`background_nice`, default +10) so
that on a machine without an idle core the writer yields CPU to the training thread.

Deadline: before every chunk the writer reads `deadline()` (unix seconds or None). If the save
cannot finish by `deadline - margin` at the bandwidth seen so far, it is abandoned: the temp
directory is removed and the previous checkpoint stays the latest. It is also abandoned if the
deadline has passed when it is ready to rename.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import codec
from ._log import event
from .errors import CheckpointError, SaveAbandonedError
from .snapshot import HostBuffer, copy_into
from .store import CheckpointStore


class SaveStatus(enum.Enum):
    COMMITTED = "committed"
    ABANDONED = "abandoned"
    FAILED = "failed"


class Request(enum.Enum):
    STARTED = "started"
    COALESCED = "coalesced"


@dataclass(frozen=True)
class SaveResult:
    step: int
    status: SaveStatus
    path: Path | None
    problem: str | None
    nbytes: int
    stall_seconds: float   # training thread blocked in save() (capture + non-deferred copy)
    write_seconds: float   # writer thread, until committed / abandoned (incl. deferred copy)
    copy_seconds: float = 0.0  # writer thread: deferred copy to host memory


DeadlineFn = Callable[[], float | None]
DeferFn = Callable[[torch.Tensor], bool]  # True: copy this source on the writer thread


def _lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value (Linux: per thread; the CRC helper inherits it), so a
    background save takes idle CPU rather than the training thread's. The deferred copy runs
    before this (the training thread may be waiting for it); SIGTERM / final saves are not
    lowered (the training thread waits for them)."""
    if nice <= 0:
        return
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


class AsyncCheckpointer:
    """Owns the host buffer and the writer thread of one checkpoint store."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        deadline: DeadlineFn | None = None,
        margin_s: float = 1.0,
        rate_limit: float | None = None,
        pinned: bool | None = None,
        run_id: str | None = None,
        restart_count: int | None = None,
        background_nice: int = 10,
    ) -> None:
        self.store = store
        self.background_nice = background_nice
        self.deadline = deadline or (lambda: None)
        self.margin_s = margin_s
        self.rate_limit = rate_limit
        self.run_id = run_id
        self.restart_count = restart_count
        self._buffer = HostBuffer(pinned)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._snapshot_done = threading.Event()
        self._snapshot_done.set()
        self.blocked_seconds = 0.0  # training thread: save() stalls + wait_snapshot() waits
        self._pending = False
        self._bandwidth: float | None = None  # bytes/s of the last completed save
        self._results: list[SaveResult] = []
        self.last_result: SaveResult | None = None
        self.last_committed: SaveResult | None = None

    # ---- state -------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    @property
    def pending(self) -> bool:
        """A coalesced request is waiting for the in-flight save to finish."""
        return self._pending

    def take_results(self) -> list[SaveResult]:
        """Results finished since the last call (oldest first)."""
        with self._lock:
            out, self._results = self._results, []
        return out

    # ---- requests ----------------------------------------------------------------------------

    def prepare(self, nbytes: int) -> None:
        """Reserve and pre-fault the host buffer for a state of `nbytes` on a helper thread."""
        if self.busy or self._buffer.capacity >= nbytes:
            return
        self._thread = threading.Thread(target=self._buffer.reserve, args=(nbytes,),
                                        name="spottrainer-prefault", daemon=True)
        self._thread.start()

    def save(self, step: int, capture: Callable[[], Any], *, wait: bool = False,
             extra: dict[str, Any] | None = None, defer: DeferFn | None = None) -> Request:
        """Request a checkpoint of `capture()` at `step` (see the module doc for the rules)."""
        if self.busy:
            if not wait:
                self._pending = True
                return Request.COALESCED
            self.wait()
        self._pending = False
        self._start(step, capture, extra, defer, background=not wait)
        return Request.STARTED

    def poll(self, step: int, capture: Callable[[], Any], extra: dict[str, Any] | None = None,
             defer: DeferFn | None = None) -> Request | None:
        """At a step boundary: start the coalesced request once the writer is idle."""
        if self._pending and not self.busy:
            self._pending = False
            self._start(step, capture, extra, defer)
            return Request.STARTED
        return None

    def wait_snapshot(self) -> float:
        """Block until the deferred tensors of the current save are copied; seconds blocked."""
        if self._snapshot_done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._snapshot_done.wait()
        blocked = time.perf_counter() - t0
        self.blocked_seconds += blocked
        return blocked

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight save (or buffer preparation); False on timeout."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return False
        return True

    def abandon(self) -> None:
        """Ask the in-flight save to stop at its next chunk (it cleans up after itself)."""
        self._cancel.set()

    def close(self, timeout: float | None = None) -> None:
        self.wait(timeout)
        self._buffer.release()

    # ---- internals ---------------------------------------------------------------------------

    def _start(self, step: int, capture: Callable[[], Any], extra: dict[str, Any] | None,
               defer: DeferFn | None, background: bool = True) -> None:
        self.wait()  # a buffer preparation may still run
        t0 = time.perf_counter()
        encoded = codec.encode(capture())
        buf = self._buffer.reserve(encoded.total_bytes)
        deferred = [i for i, src in enumerate(encoded.sources) if defer is not None and defer(src)]
        chosen = set(deferred)
        data = copy_into(encoded, buf, [i for i in range(len(encoded.sources)) if i not in chosen])
        if deferred:
            self._snapshot_done.clear()
        stall = time.perf_counter() - t0
        self.blocked_seconds += stall
        self._cancel.clear()
        self._thread = threading.Thread(
            target=self._write,
            args=(step, encoded, deferred, buf, data, stall, extra, background),
            name=f"spottrainer-save-{step}", daemon=True)
        self._thread.start()

    def _check(self, started: float) -> Callable[[int, int], None]:
        def check(done: int, total: int) -> None:
            if self._cancel.is_set():
                raise SaveAbandonedError("save cancelled")
            deadline = self.deadline()
            if deadline is None:
                return
            now = time.time()
            elapsed = time.monotonic() - started
            bw = done / elapsed if done > 0 and elapsed > 0 else self._bandwidth
            eta = now + ((total - done) / bw if bw else 0.0) + self.margin_s
            if eta > deadline:
                raise SaveAbandonedError(
                    f"cannot finish before the deadline (eta {eta - now:.1f}s, "
                    f"deadline in {deadline - now:.1f}s)")
        return check

    def _before_commit(self) -> None:
        if self._cancel.is_set():
            raise SaveAbandonedError("save cancelled")
        deadline = self.deadline()
        if deadline is not None and time.time() > deadline:
            raise SaveAbandonedError("deadline passed before commit")

    def _write(self, step: int, encoded: codec.Encoded, deferred: list[int], buf: Any,
               data: Any, stall: float, extra: dict[str, Any] | None, background: bool) -> None:
        started = time.monotonic()
        nbytes = int(data.numel())
        status, path = SaveStatus.FAILED, None
        problem: str | None = "unexpected error in the writer thread"
        copy_s = 0.0
        try:
            try:
                if deferred:
                    t0 = time.perf_counter()
                    copy_into(encoded, buf, deferred)
                    copy_s = time.perf_counter() - t0
            finally:
                self._snapshot_done.set()  # never leave the training thread waiting
            if background:
                _lower_thread_priority(self.background_nice)
            skeleton, records = encoded.skeleton, encoded.records
            del encoded  # drop references to live tensors: only the copy is written
            path = self.store.write(
                step, skeleton, records, data, check=self._check(started),
                before_commit=self._before_commit, rate_limit=self.rate_limit,
                run_id=self.run_id, restart_count=self.restart_count, extra=extra)
            status, problem = SaveStatus.COMMITTED, None
        except SaveAbandonedError as err:
            status, problem = SaveStatus.ABANDONED, str(err)
        except (CheckpointError, OSError) as err:
            problem = str(err)
        finally:  # also when an unexpected error propagates to threading.excepthook
            self._record(SaveResult(step, status, path, problem, nbytes, stall,
                                    time.monotonic() - started, copy_s))

    def _record(self, result: SaveResult) -> None:
        status, seconds = result.status, result.write_seconds
        if status is SaveStatus.COMMITTED and seconds > 0:
            self._bandwidth = result.nbytes / seconds
        step, path, problem = result.step, result.path, result.problem
        level = logging.INFO if status is SaveStatus.COMMITTED else logging.WARNING
        event(level, f"checkpoint_{status.value}", step=step, path=str(path or self.store.root),
              bytes=result.nbytes, stall_s=round(result.stall_seconds, 4),
              copy_s=round(result.copy_seconds, 4), write_s=round(seconds, 3),
              **({"problem": problem} if problem else {}))
        with self._lock:
            self._results.append(result)
            self.last_result = result
            if status is SaveStatus.COMMITTED:
                self.last_committed = result
