"""The state file round-trips atomically and renders the line people read."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spotagent import status


def test_round_trip_and_timeline(tmp_path: Path) -> None:
    s = status.AgentStatus(state="training", volume_id="vol-1", step=12, samples_per_s=3.5,
                           last_committed_step=10, last_commit_time=time.time() - 5)
    s.mark("start", 100.0)
    s.mark("claimed", 101.5)
    s.mark("claimed", 999.0)  # recorded once
    status.write(tmp_path, s)
    back = status.read(tmp_path)
    assert back is not None
    assert back.timeline == {"start": 100.0, "claimed": 101.5}
    assert back.volume_id == "vol-1"
    line = back.summary()
    assert line.startswith("training, volume vol-1, step 12, 3.5 samples/s, checkpoint 10 ")
    text = status.render(back)
    assert "+   1.500s  claimed" in text
    assert list(tmp_path.iterdir()) == [tmp_path / "state.json"]  # no temp files left


def test_missing_and_corrupt_state_files(tmp_path: Path) -> None:
    assert status.read(tmp_path) is None
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(status.StatusError, match="cannot read the state file"):
        status.read(tmp_path)
    (tmp_path / "state.json").write_text('{"format": 99}')
    with pytest.raises(status.StatusError, match="unknown format"):
        status.read(tmp_path)


def test_unknown_phase_is_a_bug() -> None:
    with pytest.raises(ValueError):
        status.AgentStatus().mark("lunch")
