"""Helpers for the spottrainer tests: run the reference script as a real subprocess."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spottrainer.store import CheckpointStore

TINY = [
    "--image-size", "16", "--width", "4", "--depth", "1", "--num-classes", "10",
    "--batch-size", "8", "--dataset-size", "200", "--dropout", "0.2", "--lr", "0.05",
    "--threads", "1", "--log-every", "1", "--seed", "7",
]


@dataclass
class Run:
    """A running `python -m spottrainer.train` whose JSON stdout is parsed on a thread."""

    proc: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    lines: list[dict[str, Any]] = field(default_factory=list)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            self.lines.append(ev)
            self.events.put(ev)

    def wait_step(self, target: int, timeout: float = 60.0) -> int | None:
        """Block until a step >= target is logged; the logged step, or None if it exited."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                ev = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    return None
                continue
            if ev.get("event") == "step" and ev["step"] >= target:
                return int(ev["step"])
        raise TimeoutError(f"step {target} not reached in {timeout}s")

    def wait_event(self, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Block until an event called `name` has been logged (at any time); return it."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for ev in list(self.lines):
                if ev.get("event") == name:
                    return ev
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise TimeoutError(f"no {name} event")

    def finish(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._thread.join(timeout=10)
        return rc

    @property
    def steps(self) -> list[int]:
        return [int(e["step"]) for e in self.lines if e.get("event") == "step"]

    def start_step(self) -> int:
        for e in self.lines:
            if e.get("event") == "train_start":
                return int(e["step"])
        raise AssertionError("no train_start event")

    _thread: threading.Thread = field(init=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_train(ckpt: Path, args: list[str], *, control: Path | None = None,
                new_session: bool = False, restart_count: int = 0, nproc: int = 1) -> Run:
    """`python -m spottrainer.train` (or under torchrun with `nproc` > 1 workers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTAGENT_")}
    env["SPOTAGENT_CHECKPOINT_DIR"] = str(ckpt)
    env["SPOTAGENT_RUN_ID"] = "test-run"
    env["SPOTAGENT_RESTART_COUNT"] = str(restart_count)
    if control is not None:
        env["SPOTAGENT_CONTROL_DIR"] = str(control)
    launcher = [sys.executable, "-m"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                    str(nproc), "--master-addr", "127.0.0.1", "--master-port",
                    str(free_port()), "-m"]
    proc = subprocess.Popen(
        [*launcher, "spottrainer.train", *TINY, *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        start_new_session=new_session or nproc > 1)  # fixture cleanup kills the group
    run = Run(proc)
    run._thread = threading.Thread(target=run._pump, daemon=True)
    run._thread.start()
    return run


@pytest.fixture
def running() -> Any:
    """Tracks started runs and kills any still alive when the test ends."""
    started: list[Run] = []

    def start(*a: Any, **kw: Any) -> Run:
        run = start_train(*a, **kw)
        started.append(run)
        return run

    yield start
    for run in started:
        if run.proc.poll() is None:
            try:
                os.killpg(run.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                run.proc.kill()
            run.proc.wait()


def assert_same_tree(a: Any, b: Any, where: str = "state") -> None:
    """Bitwise equality of two state trees (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
            f"{where} differs"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def final_tree(ckpt: Path) -> Any:
    loaded = CheckpointStore(ckpt).load_newest()
    assert loaded is not None, f"no checkpoint in {ckpt}"
    return loaded.tree
