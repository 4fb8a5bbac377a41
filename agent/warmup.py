"""Warm-up: read a volume end to end in the background so EBS fetches every block once.

A volume restored from a snapshot is loaded lazily: the first read of each block is slow.
`Warmup` reads the whole device in one background thread, gently:

- idle I/O priority for the reading thread (ioprio_set IOPRIO_CLASS_IDLE through psutil on the
  thread id) — honoured by the bfq scheduler; with `none` (NVMe's usual default) it is not,
  which is why the bandwidth cap below is the guard that always holds;
- a token-bucket cap of `max_bytes_per_s` (burst: one block);
- large aligned reads (1 MiB) with O_DIRECT, so the page cache that holds training data is not
  evicted; where O_DIRECT is refused it falls back to buffered reads followed by
  posix_fadvise(DONTNEED) on what was read.

Progress is a thread-safe snapshot (`progress`) for the status line. `on_done` runs once, in the
warm-up thread, after the last byte was read; the caller tags the volume warm there.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from spotagent.log import get_logger

log = get_logger("warmup")

MIB = 1 << 20
_ALIGN = 4096
_RATE_WINDOW_S = 3.0


@dataclass(frozen=True)
class WarmupProgress:
    """A snapshot of a warm-up. `rate` is bytes/s over the last few seconds."""

    bytes_read: int = 0
    total_bytes: int = 0
    rate: float = 0.0
    done: bool = False
    error: str | None = None
    running: bool = False
    stopped: bool = False
    elapsed: float = 0.0

    @property
    def fraction(self) -> float:
        return self.bytes_read / self.total_bytes if self.total_bytes else 0.0

    def summary(self) -> str:
        """One status-line fragment, e.g. `warm-up 45% (29/64 MiB, 31.8 MiB/s)`."""
        state = ("done" if self.done else f"failed: {self.error}" if self.error
                 else "stopped" if self.stopped else f"{self.fraction:.0%}")
        return (f"warm-up {state} ({self.bytes_read // MIB}/{self.total_bytes // MIB} MiB, "
                f"{self.rate / MIB:.1f} MiB/s)")


class TokenBucket:
    """Rate limiter: `take(n)` returns how long to wait before using n bytes.

    Tokens refill at `rate` per second up to `capacity`; a take may drive the balance negative,
    and the wait is the time to pay that debt back. `rate=inf` never waits.
    """

    def __init__(self, rate: float, capacity: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._last = clock()

    def take(self, n: float) -> float:
        if math.isinf(self.rate):
            return 0.0
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= n
        return max(0.0, -self._tokens / self.rate)


def _set_thread_idle_ioprio() -> bool:
    """Put the calling thread (not the whole agent) in the idle I/O class."""
    try:
        psutil.Process(threading.get_native_id()).ionice(psutil.IOPRIO_CLASS_IDLE)
    except (psutil.Error, OSError) as exc:
        log.warning("warmup_ioprio_failed", error=str(exc))
        return False
    return True


class Warmup:
    """Read `device` end to end in a background thread at idle I/O priority, capped."""

    def __init__(
        self,
        device: Path,
        *,
        max_bytes_per_s: float,
        block_size: int = MIB,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        if not max_bytes_per_s > 0:
            raise ValueError(f"max_bytes_per_s must be > 0 (inf = no cap), got {max_bytes_per_s}")
        if block_size <= 0 or block_size % _ALIGN:
            raise ValueError(
                f"block_size must be a positive multiple of {_ALIGN}, got {block_size}")
        self.device = device
        self.max_bytes_per_s = max_bytes_per_s
        self.block_size = block_size
        self._on_done = on_done
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = WarmupProgress()
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._started_at = 0.0
        self.native_id: int | None = None  # the reading thread's id, for tests and ps
        self.direct: bool | None = None  # whether reads bypass the page cache (O_DIRECT)

    @property
    def progress(self) -> WarmupProgress:
        with self._lock:
            return self._progress

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("warm-up already started")
        self._thread = threading.Thread(target=self._run, name=f"warmup-{self.device.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the reader to stop and wait up to `timeout` for it (at most one read away)."""
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the reader; True when it has finished (or never started)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- the reading thread ---------------------------------------------------------------

    def _update(self, **changes: Any) -> None:
        with self._lock:
            now = time.monotonic()
            new = dataclasses.replace(self._progress, **changes)
            self._samples.append((now, new.bytes_read))
            while len(self._samples) > 2 and now - self._samples[0][0] > _RATE_WINDOW_S:
                self._samples.popleft()
            t0, b0 = self._samples[0]
            rate = (new.bytes_read - b0) / (now - t0) if now > t0 else new.rate
            self._progress = dataclasses.replace(new, rate=rate, elapsed=now - self._started_at)

    def _open(self) -> tuple[int, bool]:
        """(fd, direct): O_DIRECT where the device allows it, else buffered."""
        flags = os.O_RDONLY | os.O_CLOEXEC
        try:
            return os.open(self.device, flags | os.O_DIRECT), True
        except OSError as exc:
            log.info("warmup_buffered_fallback", device=str(self.device), error=str(exc))
            return os.open(self.device, flags), False

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        self._started_at = time.monotonic()
        self._update(running=True)
        try:
            finished = self._read_all()
        except OSError as exc:
            self._update(running=False, error=f"{exc.strerror or exc} (errno {exc.errno})")
            log.error("warmup_failed", device=str(self.device), error=str(exc),
                      bytes_read=self.progress.bytes_read)
            return
        except BaseException as exc:
            self._update(running=False, error=repr(exc))
            raise
        if not finished:
            self._update(running=False, stopped=True)
            log.info("warmup_stopped", device=str(self.device),
                     bytes_read=self.progress.bytes_read)
            return
        self._update(running=False, done=True)
        p = self.progress
        log.info("warmup_done", device=str(self.device), bytes_read=p.bytes_read,
                 elapsed_s=round(p.elapsed, 3))
        if self._on_done is not None:
            self._on_done()

    def _read_all(self) -> bool:
        """Read the device once; True when every byte was read, False when stopped."""
        idle = _set_thread_idle_ioprio()
        fd, direct = self._open()
        self.direct = direct
        try:
            total = os.lseek(fd, 0, os.SEEK_END)
            self._update(total_bytes=total)
            log.info("warmup_started", device=str(self.device), total_bytes=total,
                     max_bytes_per_s=self.max_bytes_per_s, direct=direct, idle_ioprio=idle)
            bucket = TokenBucket(self.max_bytes_per_s, capacity=self.block_size)
            with mmap.mmap(-1, self.block_size) as buf:  # page-aligned, as O_DIRECT needs
                view = memoryview(buf)
                try:
                    offset = 0
                    while offset < total:
                        n = min(self.block_size, total - offset)
                        if self._stop.wait(bucket.take(n)) or self._stop.is_set():
                            return False
                        # O_DIRECT wants aligned lengths; a short tail is read as a short read.
                        want = min(self.block_size, -(-n // _ALIGN) * _ALIGN)
                        got = os.preadv(fd, [view[:want]], offset)
                        if got == 0:
                            raise OSError(errno.EIO,
                                          f"device ended at byte {offset} of {total}")
                        if not direct:
                            os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
                        offset += got
                        self._update(bytes_read=offset)
                finally:
                    view.release()
            return True
        finally:
            os.close(fd)
