"""DDP under torchrun (gloo, 2 CPU workers): agreed SIGTERM step, rank-0 writes, exact resume."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from .conftest import assert_same_tree, final_tree

ARGS = ["--steps", "30", "--checkpoint-every-steps", "4"]


def test_torchrun_sigterm_commits_agreed_step_and_resumes_exactly(tmp_path: Path,
                                                                  running: Any) -> None:
    ref = running(tmp_path / "ref", ARGS, nproc=2)
    assert ref.finish(timeout=180) == 0
    reference = final_tree(tmp_path / "ref")
    assert len(reference["ranks"]) == 2  # every rank's RNG and data position

    ckpt = tmp_path / "run"
    run = running(ckpt, ARGS, nproc=2)
    assert run.wait_step(10, timeout=120) is not None
    run.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    run.finish(timeout=120)  # torchrun itself exits non-zero after a signal
    exits = [e for e in run.lines if e.get("event") == "exiting"]
    assert len(exits) == 2 and all(e["committed"] and e["exit_code"] == 0 for e in exits)
    assert exits[0]["step"] == exits[1]["step"] == run.steps[-1]  # same step on both ranks
    assert final_tree(ckpt)["step"] == run.steps[-1]

    resumed = running(ckpt, ARGS, nproc=2)
    assert resumed.finish(timeout=180) == 0
    assert resumed.steps[0] == run.steps[-1] + 1
    final = final_tree(ckpt)
    assert_same_tree(final["model"], reference["model"], "model")
    assert_same_tree(final["optimizer"], reference["optimizer"], "optimizer")
    assert_same_tree(final["ranks"], reference["ranks"], "ranks")
