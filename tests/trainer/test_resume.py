"""Exact resume of the reference script across real SIGTERM / SIGKILL interruptions."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from spottrainer.store import CheckpointStore

from .conftest import assert_same_tree, final_tree, start_train

STEPS = 150
EVERY = 4
COMMON = ["--steps", str(STEPS), "--checkpoint-every-steps", str(EVERY), "--keep", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run's final state (workers do not change the result)."""
    ckpt = tmp_path_factory.mktemp("reference")
    run = start_train(ckpt, COMMON)
    assert run.finish(timeout=120) == 0
    assert run.steps == list(range(1, STEPS + 1))
    return final_tree(ckpt)


def _committed_step(ckpt: Path) -> int:
    loaded = CheckpointStore(ckpt).load_newest()
    return 0 if loaded is None else loaded.step


def _interrupt_chain(running: Any, ckpt: Path, plan: list[signal.Signals], args: list[str],
                     *, seed: int, group: bool = False) -> int:
    """Interrupt a run per `plan`, resume each time, finish; return interruptions done."""
    rng = random.Random(seed)
    resume = 0
    done = 0
    for i, sig in enumerate(plan):
        run = running(ckpt, COMMON + args, new_session=group, restart_count=i)
        target = min(resume + rng.randint(1, 8), STEPS - 2)
        if run.wait_step(target) is None:
            break
        if group:
            os.killpg(run.proc.pid, sig)
        else:
            run.proc.send_signal(sig)
        rc = run.finish()
        assert run.start_step() == resume, "did not resume from the newest checkpoint"
        steps = run.steps
        assert steps == list(range(resume + 1, steps[-1] + 1)), "steps skipped or repeated"
        if sig == signal.SIGTERM:
            assert rc == 0, f"SIGTERM exit code {rc}"
            assert _committed_step(ckpt) == steps[-1], "SIGTERM did not commit the last step"
            resume = steps[-1]  # the next run must continue at exactly the next step
        else:
            assert rc == -signal.SIGKILL
            resume = _committed_step(ckpt)
            assert resume <= steps[-1] + 1
        done += 1
        if steps[-1] >= STEPS:
            break
    run = running(ckpt, COMMON + args, restart_count=len(plan))
    assert run.finish(timeout=120) == 0
    assert run.start_step() == resume
    if run.steps:
        assert run.steps == list(range(resume + 1, STEPS + 1))
    return done


def test_sigterm_and_sigkill_resume_bitwise_equal(tmp_path: Path, running: Any,
                                                  reference: Any) -> None:
    plan = [signal.SIGTERM] * 10 + [signal.SIGKILL] * 10
    random.Random(1).shuffle(plan)
    done = _interrupt_chain(running, tmp_path, plan, [], seed=11)
    assert done >= 20
    final = final_tree(tmp_path)
    assert final["step"] == STEPS
    assert_same_tree(final["model"], reference["model"], "model")
    assert_same_tree(final["optimizer"], reference["optimizer"], "optimizer")
    assert_same_tree(final["scheduler"], reference["scheduler"], "scheduler")
    assert_same_tree(final["ranks"], reference["ranks"], "rng+sampler")


def test_workers_ignore_group_sigterm_and_resume_exactly(tmp_path: Path, running: Any,
                                                          reference: Any) -> None:
    """SIGTERM to the whole process group: workers ignore it, main commits and exits 0."""
    done = _interrupt_chain(running, tmp_path, [signal.SIGTERM] * 3, ["--workers", "2"],
                            seed=5, group=True)
    assert done == 3
    final = final_tree(tmp_path)
    assert_same_tree(final["model"], reference["model"], "model")
    assert_same_tree(final["optimizer"], reference["optimizer"], "optimizer")


def test_sigusr1_commits_and_continues(tmp_path: Path, running: Any) -> None:
    control = tmp_path / "control"
    control.mkdir()
    run = running(tmp_path / "ckpt", ["--steps", "60", "--checkpoint-every-steps", "1000"],
                  control=control)
    at = run.wait_step(10)
    assert at is not None
    run.proc.send_signal(signal.SIGUSR1)
    assert run.finish() == 0
    commits = [e["step"] for e in run.lines if e.get("event") == "checkpoint_committed"]
    assert commits[0] >= at and commits[0] < 60, commits  # the SIGUSR1 save, mid-run
    assert commits[-1] == 60                             # the final save
    assert run.steps == list(range(1, 61))               # training went on after it
    progress = json.loads((control / "progress.json").read_text())
    assert progress["state"] == "exiting" and progress["step"] == 60
    assert progress["last_committed_step"] == 60 and progress["pid"] == run.proc.pid


def test_sigterm_past_deadline_abandons_and_keeps_previous(tmp_path: Path,
                                                           running: Any) -> None:
    """A save that cannot meet the deadline is abandoned: exit 3, previous stays latest."""
    control = tmp_path / "control"
    control.mkdir()
    ckpt = tmp_path / "ckpt"
    run = running(ckpt, ["--steps", "400", "--checkpoint-every-steps", "5"], control=control)
    assert run.wait_step(12) is not None
    run.wait_event("checkpoint_committed")  # a previous checkpoint exists (slow disks too)
    (control / "deadline.tmp").write_text(json.dumps(
        {"deadline": time.time() - 1, "reason": "spot-terminate"}))
    os.replace(control / "deadline.tmp", control / "deadline")
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 3
    last = run.steps[-1]
    store = CheckpointStore(ckpt)
    loaded = store.load_newest()
    assert loaded is not None and loaded.step < last
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    assert store.read_latest_pointer() is not None
    assert store.read_latest_pointer().step == loaded.step  # type: ignore[union-attr]
    progress = json.loads((control / "progress.json").read_text())
    assert progress["state"] == "exiting"
    assert progress["last_committed_step"] == loaded.step
