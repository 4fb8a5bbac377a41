"""Checkpoint format and store: round trip, verification, fallback, cleanup, retention, CLI."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spottrainer import cli, codec
from spottrainer.errors import CheckpointError, CorruptCheckpointError
from spottrainer.manifest import MANIFEST_NAME, STATE_NAME, TENSORS_NAME
from spottrainer.snapshot import HostBuffer, copy_into
from spottrainer.store import LATEST_NAME, CheckpointStore

from .conftest import assert_same_tree


def save(store: CheckpointStore, step: int, tree: Any) -> Path:
    enc = codec.encode(tree)
    data = copy_into(enc, HostBuffer(pinned=False).reserve(enc.total_bytes))
    return store.write(step, enc.skeleton, enc.records, data)


def small_tree(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((1000,), float(step)), "note": f"s{step}"}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    # Small chunks so that files span several checksum chunks.
    return CheckpointStore(tmp_path / "ckpt", keep=3, chunk_bytes=1024)


def test_round_trip_keeps_every_type_bitwise(store: CheckpointStore) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tree = {
        "f32": torch.randn(3, 5), "f16": torch.randn(7).half(), "bf16": torch.randn(9).bfloat16(),
        "i64": torch.arange(-5, 5), "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(256, dtype=torch.uint8), "c64": torch.randn(4, dtype=torch.complex64),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 3), "strided": base.t()[1:, ::2],
        "np": np.arange(10, dtype=np.uint32).reshape(2, 5), "npscalar": np.float64(2.5),
        "py": (1, 2.5, None, True, "x", b"\x00\xff", [1, (2, 3)]),
        "int_keys": {0: "a", 7: {"nested": (math.inf, -math.inf)}},
        "nan": math.nan, "dtype": torch.float16, "size": torch.Size([2, 3]),
    }
    save(store, 5, tree)
    loaded = store.load_newest()
    assert loaded is not None and loaded.step == 5
    got = loaded.tree
    assert_same_tree({k: v for k, v in got.items() if k != "strided"},
                     {k: v for k, v in tree.items() if k != "strided"})
    assert torch.equal(got["strided"], tree["strided"])
    assert isinstance(got["npscalar"], np.float64)
    assert got["size"] == torch.Size([2, 3]) and got["dtype"] is torch.float16


def test_unsupported_type_names_the_entry() -> None:
    with pytest.raises(CheckpointError, match=r"state\['opt'\]\['fn'\].*function"):
        codec.encode({"opt": {"fn": lambda: 0}})


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        data[len(data) // 3] ^= 0x40
        path.write_bytes(data)


@pytest.mark.parametrize(("name", "how", "problem"), [
    (TENSORS_NAME, "truncate", "size is"),
    (TENSORS_NAME, "flip", "checksum mismatch"),
    (STATE_NAME, "flip", "checksum mismatch"),
    (MANIFEST_NAME, "flip", "manifest"),
    (MANIFEST_NAME, "truncate", "manifest"),
])
def test_damaged_newest_falls_back_with_warning(store: CheckpointStore, name: str, how: str,
                                                problem: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    save(store, 1, small_tree(1))
    newest = save(store, 2, small_tree(2))
    _corrupt(newest / name, how)
    with pytest.raises(CorruptCheckpointError, match=problem):
        store.load(newest)
    with caplog.at_level(logging.WARNING, logger="spottrainer"):
        loaded = store.load_newest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.tree["w"], torch.full((1000,), 1.0))
    assert any("checkpoint_invalid_fallback" in r.getMessage() and "step=2" in r.getMessage()
               for r in caplog.records)
    assert not store.verify(newest).ok


def test_repair_moves_bad_checkpoint_aside_and_repoints_latest(store: CheckpointStore) -> None:
    save(store, 1, small_tree(1))
    newest = save(store, 2, small_tree(2))
    _corrupt(newest / TENSORS_NAME, "flip")
    loaded = store.load_newest(repair=True)
    assert loaded is not None and loaded.step == 1
    assert [r.step for r in store.committed()] == [1]
    assert any(p.name.startswith("corrupt-step-000000000002") for p in store.root.iterdir())
    pointer = store.read_latest_pointer()
    assert pointer is not None and pointer.step == 1
    save(store, 2, small_tree(2))  # the step can be saved again afterwards
    assert store.load_newest().step == 2  # type: ignore[union-attr]


def test_directory_without_manifest_is_never_loaded_and_cleaned(
        store: CheckpointStore, caplog: pytest.LogCaptureFixture) -> None:
    save(store, 1, small_tree(1))
    newest = save(store, 2, small_tree(2))
    (newest / MANIFEST_NAME).unlink()
    tmp = store.root / ".tmp-step-000000000003-123-abc"
    tmp.mkdir()
    (tmp / TENSORS_NAME).write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="spottrainer"):
        assert store.load_newest().step == 1  # type: ignore[union-attr]
    assert any("manifest is missing" in r.getMessage() for r in caplog.records)
    removed = store.cleanup()
    assert set(removed) == {newest, tmp}
    assert [r.step for r in store.committed()] == [1]


@pytest.mark.parametrize("pointer", [b"{not json", b'{"step": 9, "dir": "step-000000000009"}',
                                     b'{"step": 1, "dir": "../../etc"}'])
def test_bad_latest_pointer_falls_back_with_warning(store: CheckpointStore, pointer: bytes,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    save(store, 1, small_tree(1))
    save(store, 2, small_tree(2))
    (store.root / LATEST_NAME).write_bytes(pointer)
    with caplog.at_level(logging.WARNING, logger="spottrainer"):
        loaded = store.load_newest()
    assert loaded is not None and loaded.step == 2
    assert any("latest_pointer" in r.getMessage() for r in caplog.records)


def test_latest_pointer_written_atomically_and_names_newest(store: CheckpointStore) -> None:
    save(store, 3, small_tree(3))
    doc = json.loads((store.root / LATEST_NAME).read_text())
    assert doc["step"] == 3 and doc["dir"] == "step-000000000003"
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".")] == []


def test_retention_keeps_last_k(store: CheckpointStore) -> None:
    for step in range(1, 8):
        save(store, step, small_tree(step))
    assert [r.step for r in store.committed()] == [5, 6, 7]
    assert store.read_latest_pointer().step == 7  # type: ignore[union-attr]
    assert not [p for p in store.root.iterdir() if p.name.startswith(".trash-")]


def test_cli_latest_and_verify(store: CheckpointStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["latest", str(store.root)]) == 1
    save(store, 1, small_tree(1))
    newest = save(store, 2, small_tree(2))
    assert cli.main(["latest", str(store.root)]) == 0
    assert f"step=2 path={newest}" in capsys.readouterr().out
    assert cli.main(["verify", str(store.root)]) == 0
    _corrupt(newest / TENSORS_NAME, "flip")
    assert cli.main(["verify", str(store.root)]) == 2
    out = capsys.readouterr().out
    assert "ok step=1" in out and "INVALID step=2" in out and "checksum mismatch" in out
    assert cli.main(["latest", "--json", str(store.root)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
