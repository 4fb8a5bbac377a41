"""Agent protocol pieces: environment, signal flags, deadline file, progress file."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spottrainer.errors import ProtocolError
from spottrainer.protocol import (
    AgentEnv,
    DeadlineWatcher,
    Progress,
    ProgressWriter,
    SignalFlags,
)


def test_env_is_parsed() -> None:
    env = AgentEnv.from_environ({
        "SPOTAGENT_CHECKPOINT_DIR": "/ckpt", "SPOTAGENT_RUN_ID": "r1",
        "SPOTAGENT_RESTART_COUNT": "4", "SPOTAGENT_CONTROL_DIR": "/ctl"})
    assert env == AgentEnv(Path("/ckpt"), "r1", 4, Path("/ctl"))
    assert AgentEnv.from_environ({}) == AgentEnv(None, None, 0, None)


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_bad_restart_count_is_one_line_error(value: str) -> None:
    with pytest.raises(ProtocolError, match="SPOTAGENT_RESTART_COUNT"):
        AgentEnv.from_environ({"SPOTAGENT_RESTART_COUNT": value})


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_signal_handlers_only_set_flags(restore_handlers: None) -> None:
    flags = SignalFlags()
    flags.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    assert flags.checkpoint_requested and not flags.exit_requested
    assert flags.take_checkpoint_request() and not flags.take_checkpoint_request()
    os.kill(os.getpid(), signal.SIGTERM)  # would end the test process without the handler
    time.sleep(0.01)
    assert flags.exit_requested


def test_deadline_watcher_follows_the_file(tmp_path: Path) -> None:
    watcher = DeadlineWatcher(tmp_path)
    assert watcher.read() is None
    (tmp_path / "d.tmp").write_text(json.dumps({"deadline": 1234.5, "reason": "spot-terminate"}))
    os.replace(tmp_path / "d.tmp", tmp_path / "deadline")
    value = watcher.read()
    assert value is not None and value.deadline == 1234.5 and value.reason == "spot-terminate"
    (tmp_path / "d.tmp").write_text(json.dumps({"deadline": 99.0, "reason": "x"}))
    os.replace(tmp_path / "d.tmp", tmp_path / "deadline")
    assert watcher.seconds() == 99.0
    (tmp_path / "deadline").unlink()
    assert watcher.seconds() is None
    (tmp_path / "deadline").write_text("{garbage")
    assert watcher.read() is None
    assert DeadlineWatcher(None).read() is None


def test_progress_file_is_strict_json_and_rate_limited(tmp_path: Path) -> None:
    writer = ProgressWriter(tmp_path / "progress.json", interval_s=60)
    p = Progress(step=3, samples_per_s=12.5, loss=float("nan"), last_committed_step=None,
                 last_commit_time=None, pid=os.getpid(), state="training", time=time.time())
    assert writer.write(p)
    doc = json.loads((tmp_path / "progress.json").read_text())
    assert doc["step"] == 3 and doc["loss"] is None and doc["state"] == "training"
    assert set(doc) == {"step", "samples_per_s", "loss", "last_committed_step",
                        "last_commit_time", "pid", "state", "time"}
    p.step = 4
    assert not writer.write(p)             # within the interval, same state
    p.state = "saving"
    assert writer.write(p)                 # a state change is written at once
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 4
    assert [x.name for x in tmp_path.iterdir()] == ["progress.json"]
