"""Warm-up: reads every byte, respects the cap, stops promptly, idle I/O class, errors surface."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from loopdev import MIB, attach, detach, loop_device, mkfs, mounted, needs_root, sh

from spotagent.warmup import TokenBucket, Warmup, WarmupProgress

# --- pure ------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_one_burst_then_paces() -> None:
    clock = FakeClock()
    bucket = TokenBucket(10.0, capacity=5.0, clock=clock)
    assert bucket.take(5) == 0.0          # the burst
    assert bucket.take(5) == pytest.approx(0.5)  # 5 tokens owed at 10/s
    clock.now += 0.5
    assert bucket.take(5) == pytest.approx(0.5)
    clock.now += 100                      # idle time refills only up to capacity
    assert bucket.take(5) == 0.0
    assert bucket.take(1) == pytest.approx(0.1)


def test_token_bucket_uncapped_never_waits() -> None:
    bucket = TokenBucket(math.inf, capacity=1.0)
    assert all(bucket.take(1 << 30) == 0.0 for _ in range(3))


@pytest.mark.parametrize("kwargs", [{"max_bytes_per_s": 0}, {"max_bytes_per_s": -1},
                                    {"max_bytes_per_s": 1e6, "block_size": 1000}])
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Warmup(Path("/dev/null"), **kwargs)  # type: ignore[arg-type]


def test_progress_summary() -> None:
    p = WarmupProgress(bytes_read=29 * MIB, total_bytes=64 * MIB, rate=31.8 * MIB)
    assert p.summary() == "warm-up 45% (29/64 MiB, 31.8 MiB/s)"
    assert WarmupProgress(done=True).summary().startswith("warm-up done")


# --- on a loop device ----------------------------------------------------------------------


@pytest.fixture
def dev64(tmp_path: Path) -> Iterator[Path]:
    with loop_device(tmp_path / "w.img", 64 * MIB) as dev:
        yield dev


class Counter:
    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.calls += 1


@needs_root
def test_reads_every_byte_and_calls_on_done_once(dev64: Path) -> None:
    done = Counter()
    w = Warmup(dev64, max_bytes_per_s=math.inf, on_done=done)
    w.start()
    assert w.join(timeout=60)
    p = w.progress
    assert p.total_bytes == 64 * MIB
    assert p.bytes_read == p.total_bytes
    assert p.done and p.error is None and not p.running and not p.stopped
    assert done.calls == 1
    assert w.direct  # O_DIRECT: the warm-up does not fill the page cache
    w.stop()  # after the end: harmless
    assert done.calls == 1


@needs_root
def test_cap_paces_the_reads(dev64: Path) -> None:
    w = Warmup(dev64, max_bytes_per_s=32 * MIB)
    start = time.monotonic()
    w.start()
    assert w.join(timeout=60)
    elapsed = time.monotonic() - start
    # 64 MiB at 32 MiB/s with a one-block burst is ~2 s; bounds are generous on purpose.
    assert 1.5 <= elapsed < 30
    assert w.progress.done
    assert w.progress.rate <= 48 * MIB


@needs_root
def test_stop_is_prompt_and_not_done(dev64: Path) -> None:
    done = Counter()
    w = Warmup(dev64, max_bytes_per_s=4 * MIB, on_done=done)
    w.start()
    time.sleep(0.5)
    p = w.progress
    assert p.running and 0 < p.bytes_read < p.total_bytes
    start = time.monotonic()
    w.stop()
    assert w.join(timeout=0)  # stop() waited for the reader
    assert time.monotonic() - start < 2
    p = w.progress
    assert p.stopped and not p.done and not p.running and p.error is None
    assert p.bytes_read < p.total_bytes
    assert done.calls == 0
    assert "stopped" in p.summary()


@needs_root
def test_reader_thread_runs_in_the_idle_io_class(dev64: Path) -> None:
    w = Warmup(dev64, max_bytes_per_s=8 * MIB)
    w.start()
    try:
        deadline = time.monotonic() + 10
        while w.progress.bytes_read == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.native_id is not None
        assert psutil.Process(w.native_id).ionice().ioclass == psutil.IOPRIO_CLASS_IDLE
        # Only the reading thread, not the agent's main thread.
        assert psutil.Process().ionice().ioclass != psutil.IOPRIO_CLASS_IDLE
    finally:
        w.stop()


@needs_root
def test_io_error_surfaces_in_progress(tmp_path: Path) -> None:
    # A loop device over a file on an ext4 that is then shut down: every read of the
    # inner device fails with EIO, as a failing EBS volume would.
    done = Counter()
    outer_img = tmp_path / "outer.img"
    with loop_device(outer_img, 96 * MIB, lambda img: mkfs("ext4", img)) as outer, \
            mounted(outer, tmp_path / "outer") as mp:
        inner_img = mp / "inner.img"
        with open(inner_img, "wb") as f:
            f.write(b"\1" * (8 * MIB))
        inner = attach(inner_img)
        try:
            sh("xfs_io", "-x", "-c", "shutdown", mp)
            w = Warmup(inner, max_bytes_per_s=math.inf, on_done=done)
            w.start()
            assert w.join(timeout=30)
        finally:
            detach(inner)
    p = w.progress
    assert p.error is not None and "errno 5" in p.error
    assert not p.done and not p.running
    assert done.calls == 0
    assert p.summary().startswith("warm-up failed")
