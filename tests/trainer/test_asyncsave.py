"""Async saver: snapshot semantics, one save in flight, coalescing, deadline, cancellation."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from spottrainer.asyncsave import AsyncCheckpointer, Request, SaveStatus
from spottrainer.protocol import DeadlineWatcher
from spottrainer.store import CheckpointStore

MiB = 1 << 20


def tree(step: int, mib: int = 1) -> dict[str, Any]:
    return {"step": step, "w": torch.full((mib * MiB // 4,), float(step))}


def slow_saver(root: Path, **kw: Any) -> AsyncCheckpointer:
    """A saver throttled to 4 MiB/s with 256 KiB chunks: a 2 MiB save takes ~0.5 s."""
    store = CheckpointStore(root, keep=10, chunk_bytes=256 << 10)
    return AsyncCheckpointer(store, rate_limit=4 * MiB, pinned=False, **kw)


def test_snapshot_is_taken_before_save_returns(tmp_path: Path) -> None:
    saver = slow_saver(tmp_path)
    live = {"w": torch.zeros(MiB // 4)}
    assert saver.save(1, lambda: live) is Request.STARTED
    live["w"].fill_(7.0)  # training goes on mutating the state while the writer runs
    saver.wait()
    loaded = saver.store.load_newest()
    assert loaded is not None and torch.equal(loaded.tree["w"], torch.zeros(MiB // 4))
    assert saver.last_committed is not None
    assert saver.last_committed.stall_seconds < saver.last_committed.write_seconds


def test_requests_while_in_flight_coalesce_into_one(tmp_path: Path) -> None:
    saver = slow_saver(tmp_path)
    assert saver.save(1, lambda: tree(1, 2)) is Request.STARTED
    assert saver.busy
    for step in (2, 3, 4):
        assert saver.save(step, lambda s=step: tree(s, 2)) is Request.COALESCED  # type: ignore[misc]
    assert saver.pending
    assert saver.poll(5, lambda: tree(5, 2)) is None  # still writing step 1
    saver.wait()
    assert saver.poll(6, lambda: tree(6, 2)) is Request.STARTED  # first boundary after it
    assert not saver.pending
    assert saver.poll(7, lambda: tree(7, 2)) is None  # served once, not once per request
    saver.wait()
    results = saver.take_results()
    assert [(r.step, r.status) for r in results] == [(1, SaveStatus.COMMITTED),
                                                      (6, SaveStatus.COMMITTED)]
    assert [r.step for r in saver.store.committed()] == [1, 6]


def test_save_with_wait_waits_for_in_flight_first(tmp_path: Path) -> None:
    saver = slow_saver(tmp_path)
    saver.save(1, lambda: tree(1, 2))
    assert saver.save(2, lambda: tree(2, 2), wait=True) is Request.STARTED
    saver.wait()
    assert [r.step for r in saver.take_results()] == [1, 2]


def _write_deadline(control: Path, seconds_from_now: float) -> None:
    tmp = control / "deadline.tmp"
    tmp.write_text(json.dumps({"deadline": time.time() + seconds_from_now,
                               "reason": "spot-terminate"}))
    os.replace(tmp, control / "deadline")


def test_save_that_cannot_meet_deadline_is_abandoned_cleanly(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    watcher = DeadlineWatcher(control)
    saver = slow_saver(tmp_path / "ckpt", deadline=watcher.seconds, margin_s=0.2)
    saver.save(1, lambda: tree(1, 1))
    saver.wait()
    _write_deadline(control, 1.0)
    t0 = time.monotonic()
    saver.save(2, lambda: tree(2, 16))  # 16 MiB at 4 MiB/s: 4 s, deadline in 1 s
    saver.wait(timeout=10)
    assert time.monotonic() - t0 < 1.0, "abandoned only after the deadline"
    result = saver.last_result
    assert result is not None and result.status is SaveStatus.ABANDONED
    assert "deadline" in (result.problem or "")
    store = saver.store
    assert [r.step for r in store.committed()] == [1]
    assert store.read_latest_pointer().step == 1  # type: ignore[union-attr]
    assert not [p for p in store.root.iterdir() if p.name.startswith(".tmp-")]


def test_deadline_appearing_mid_save_abandons_it(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    watcher = DeadlineWatcher(control)
    saver = slow_saver(tmp_path / "ckpt", deadline=watcher.seconds, margin_s=0.2)
    saver.save(1, lambda: tree(1, 16))
    time.sleep(0.5)
    _write_deadline(control, 0.5)
    saver.wait(timeout=10)
    assert saver.last_result is not None
    assert saver.last_result.status is SaveStatus.ABANDONED
    assert list(saver.store.root.iterdir()) == []


def test_save_that_fits_before_deadline_commits(tmp_path: Path) -> None:
    control = tmp_path / "control"
    control.mkdir()
    _write_deadline(control, 30.0)
    saver = slow_saver(tmp_path / "ckpt", deadline=DeadlineWatcher(control).seconds)
    saver.save(1, lambda: tree(1, 2))
    saver.wait()
    assert saver.last_result is not None and saver.last_result.status is SaveStatus.COMMITTED


def test_abandon_cancels_in_flight_save(tmp_path: Path) -> None:
    saver = slow_saver(tmp_path)
    saver.save(1, lambda: tree(1, 16))
    time.sleep(0.2)
    saver.abandon()
    assert saver.wait(timeout=5)
    assert saver.last_result is not None
    assert saver.last_result.status is SaveStatus.ABANDONED
    assert saver.store.committed() == []


def test_unwritable_directory_fails_without_killing_the_caller(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    saver = AsyncCheckpointer(CheckpointStore(blocker / "ckpt"), pinned=False)
    assert saver.save(1, lambda: tree(1)) is Request.STARTED
    saver.wait()
    result = saver.last_result
    assert result is not None and result.status is SaveStatus.FAILED
    assert "Not a directory" in (result.problem or "")
    assert saver.last_committed is None
