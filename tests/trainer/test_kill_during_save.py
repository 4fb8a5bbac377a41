"""SIGKILL at 100 random moments of a saving process never yields a corrupt checkpoint."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

from spottrainer.asyncsave import AsyncCheckpointer
from spottrainer.store import CheckpointStore

KILLS = 100


def _tree(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "a": torch.full((1 << 20,), float(step)),
        "b": torch.arange(1 << 19, dtype=torch.int64) + step,
        "meta": {"step": step, "pair": (step, "x")},
    }


def _check(tree: Any, step: int) -> None:
    assert tree["step"] == step and tree["meta"] == {"step": step, "pair": (step, "x")}
    assert torch.equal(tree["a"], torch.full((1 << 20,), float(step)))
    assert torch.equal(tree["b"], torch.arange(1 << 19, dtype=torch.int64) + step)


def _saver_child(root: Path, ready: int) -> NoReturn:
    """Resume like a trainer (cleanup, newest valid), then save step after step forever."""
    code = 1
    try:
        torch.set_num_threads(1)
        store = CheckpointStore(root, keep=3, chunk_bytes=256 << 10)
        store.cleanup()
        loaded = store.load_newest(repair=True)
        step = 0
        if loaded is not None:
            _check(loaded.tree, loaded.step)
            step = loaded.step
        # ~8 MiB at 160 MiB/s: each save writes for ~50 ms, then fsyncs and commits.
        saver = AsyncCheckpointer(store, pinned=False, rate_limit=160 << 20)
        os.write(ready, b"r")
        while True:
            step += 1
            tree = _tree(step)
            os.write(ready, b"s")  # a save starts now
            saver.save(step, lambda t=tree: t, wait=True)
            saver.wait()
    finally:
        os._exit(code)


def test_sigkill_during_saves_never_loads_corrupt(tmp_path: Path) -> None:
    rng = random.Random(3)
    newest = 0
    mid_save = 0
    for _ in range(KILLS):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.close(r)
            _saver_child(tmp_path, w)
        os.close(w)
        try:
            assert os.read(r, 1) == b"r", "saver child failed to resume"
            assert os.read(r, 1) == b"s"
            time.sleep(rng.uniform(0.0, 0.06))  # a random moment inside that save
            os.kill(pid, signal.SIGKILL)
        finally:
            os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

        if any(p.name.startswith(".tmp-") for p in tmp_path.iterdir()):
            mid_save += 1
        store = CheckpointStore(tmp_path)
        refs = store.committed()
        results = [store.verify(ref.path) for ref in refs]
        assert all(r.ok for r in results), [r.problem for r in results if not r.ok]
        loaded = store.load_newest()
        if not refs:  # killed before the first commit ever
            assert loaded is None and newest == 0
            continue
        assert loaded is not None
        assert loaded.step == refs[-1].step >= newest  # newest valid, never going back
        _check(loaded.tree, loaded.step)
        newest = loaded.step
    # The rest landed while committing (rename, `latest`, retention) or just after.
    assert mid_save >= KILLS // 2, f"only {mid_save} kills landed while writing"
