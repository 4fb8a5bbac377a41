"""A directory of checkpoints: commit protocol, `latest` pointer, retention, verified loading.

Layout of the checkpoint root:

    step-000000001200/      committed checkpoint (MANIFEST.json, state.json, tensors.bin)
    latest                  JSON {"step": 1200, "dir": "step-000000001200", "time": ...}
    .tmp-step-...           a save in progress (or killed): never loaded, removed by cleanup()
    .trash-...              being deleted by retention: removed by cleanup()
    corrupt-step-...        a committed checkpoint that failed verification, moved aside
    progress.json           the trainer's progress file when no control directory is set

Commit: files are written into `.tmp-step-N-...` and each fsynced, MANIFEST.json is written and
fsynced last, the temp directory is fsynced, renamed to `step-N` and the root fsynced; then
`latest` is replaced atomically and retention removes the oldest beyond `keep`. The newest
committed directory that verifies is the truth; `latest` is a hint that is checked against it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import codec, fsio
from ._log import event
from .errors import CheckpointError, CorruptCheckpointError
from .manifest import MANIFEST_NAME, STATE_NAME, TENSORS_NAME, FileEntry, Manifest
from .snapshot import byte_view

STEP_RE = re.compile(r"^step-(\d{12})$")
LATEST_NAME = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
CORRUPT_PREFIX = "corrupt-"


SMALL_TENSOR_BYTES = 1 << 20


def _own_if_small(raw: torch.Tensor) -> torch.Tensor:
    """Small tensors (RNG states, step counters, biases) get their own storage: some torch
    functions (e.g. set_rng_state) mishandle views into a foreign buffer."""
    return raw.clone() if raw.numel() < SMALL_TENSOR_BYTES else raw


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint directory (not yet verified)."""

    step: int
    path: Path


@dataclass(frozen=True)
class Loaded:
    """A verified checkpoint read into memory."""

    step: int
    path: Path
    manifest: Manifest
    tree: Any


@dataclass(frozen=True)
class VerifyResult:
    step: int
    path: Path
    ok: bool
    problem: str | None
    bytes: int


class CheckpointStore:
    """The checkpoint root directory; rank 0 of a job is its only writer."""

    def __init__(self, root: Path | str, *, keep: int = 3,
                 chunk_bytes: int = fsio.DEFAULT_CHUNK_BYTES) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}", root)
        self.root = Path(root)
        self.keep = keep
        self.chunk_bytes = chunk_bytes

    # ---- listing ---------------------------------------------------------------------------

    def committed(self) -> list[CheckpointRef]:
        """Committed checkpoint directories (by name), oldest first."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        refs = []
        for entry in entries:
            m = STEP_RE.match(entry.name)
            if m and entry.is_dir(follow_symlinks=False):
                refs.append(CheckpointRef(int(m.group(1)), Path(entry.path)))
        return sorted(refs, key=lambda r: r.step)

    def read_latest_pointer(self) -> CheckpointRef | None:
        """The `latest` pointer, or None when absent; CorruptCheckpointError when unreadable."""
        path = self.root / LATEST_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            obj = json.loads(data)
            name = str(obj["dir"])
            step = int(obj["step"])
        except (ValueError, KeyError, TypeError) as err:
            raise CorruptCheckpointError("latest pointer is not valid JSON", path) from err
        m = STEP_RE.match(name)
        if not m or int(m.group(1)) != step:
            raise CorruptCheckpointError(f"latest pointer names {name!r} for step {step}", path)
        return CheckpointRef(step, self.root / name)

    # ---- reading ---------------------------------------------------------------------------

    def read_manifest(self, path: Path) -> Manifest:
        mpath = path / MANIFEST_NAME
        try:
            data = mpath.read_bytes()
        except FileNotFoundError as err:
            raise CorruptCheckpointError("manifest is missing", mpath) from err
        except OSError as err:
            raise CheckpointError(f"cannot read manifest: {err.strerror}", mpath) from err
        manifest = Manifest.parse(data, mpath)
        m = STEP_RE.match(path.name)
        if m and int(m.group(1)) != manifest.step:
            raise CorruptCheckpointError(
                f"manifest step {manifest.step} does not match directory", mpath)
        for name in (STATE_NAME, TENSORS_NAME):
            if name not in manifest.files:
                raise CorruptCheckpointError(f"manifest does not list {name}", mpath)
        return manifest

    def _read_small(self, path: Path, entry: FileEntry, chunk_bytes: int) -> bytes:
        return fsio.read_file_verified(path, size=entry.size, chunks=entry.chunks,
                                       chunk_bytes=chunk_bytes)

    def load(self, path: Path) -> Loaded:
        """Read and verify the checkpoint at `path`.

        Tensors are views of tensors.bin mapped copy-on-write (like `torch.load(mmap=True)`):
        every byte has been read and checksummed when this returns; writing to a tensor copies
        the touched pages privately and never changes the file.
        """
        manifest = self.read_manifest(path)
        state_path = path / STATE_NAME
        raw = self._read_small(state_path, manifest.files[STATE_NAME], manifest.chunk_bytes)
        try:
            doc = json.loads(raw)
            records = [codec.TensorRecord.from_json(r) for r in doc["tensors"]]
            skeleton = doc["skeleton"]
        except (ValueError, KeyError, TypeError, CheckpointError) as err:
            raise CorruptCheckpointError("state.json is malformed", state_path) from err
        entry = manifest.files[TENSORS_NAME]
        mapped = fsio.map_file_verified(path / TENSORS_NAME, size=entry.size,
                                        chunks=entry.chunks, chunk_bytes=manifest.chunk_bytes)
        whole = (torch.frombuffer(mapped, dtype=torch.uint8) if len(mapped)
                 else torch.empty(0, dtype=torch.uint8))
        for rec in records:
            if rec.offset + rec.nbytes > entry.size:
                raise CorruptCheckpointError(f"tensor at {rec.offset} runs past the end",
                                             path / TENSORS_NAME)
        try:
            tensors = [codec.view_tensor(rec, _own_if_small(whole[rec.offset:rec.offset
                                                                    + rec.nbytes]))
                       for rec in records]
            tree = codec.decode(skeleton, tensors)
        except (CheckpointError, RuntimeError, ValueError) as err:
            raise CorruptCheckpointError(f"cannot rebuild state: {err}", state_path) from err
        return Loaded(manifest.step, path, manifest, tree)

    def verify(self, path: Path) -> VerifyResult:
        """Check manifest, sizes and every checksum of `path` without keeping the data."""
        m = STEP_RE.match(path.name)
        step = int(m.group(1)) if m else -1
        try:
            manifest = self.read_manifest(path)
            total = 0
            for name, entry in manifest.files.items():
                mapped = fsio.map_file_verified(path / name, size=entry.size,
                                                chunks=entry.chunks,
                                                chunk_bytes=manifest.chunk_bytes)
                if isinstance(mapped, mmap.mmap):
                    mapped.close()
                total += entry.size
        except CheckpointError as err:
            return VerifyResult(step, path, False, str(err), 0)
        return VerifyResult(manifest.step, path, True, None, total)

    def load_newest(self, *, repair: bool = False,
                    accept: Callable[[CheckpointRef], bool] | None = None) -> Loaded | None:
        """Load the newest checkpoint that verifies, falling back with a warning per bad one.

        `repair` (the writer only) moves bad checkpoints aside as `corrupt-step-...` and points
        `latest` at the one loaded. `accept` can restrict candidates (e.g. a given step).
        """
        self._check_latest_pointer()
        for ref in reversed(self.committed()):
            if accept is not None and not accept(ref):
                continue
            try:
                loaded = self.load(ref.path)
            except CorruptCheckpointError as err:
                event(logging.WARNING, "checkpoint_invalid_fallback", step=ref.step,
                      path=str(ref.path), problem=str(err))
                if repair:
                    self._quarantine(ref)
                continue
            if repair:
                self._repair_latest(loaded)
            return loaded
        return None

    def _check_latest_pointer(self) -> None:
        refs = self.committed()
        try:
            pointer = self.read_latest_pointer()
        except CorruptCheckpointError as err:
            event(logging.WARNING, "latest_pointer_invalid", path=str(self.root / LATEST_NAME),
                  problem=str(err), action="falling back to the newest valid checkpoint")
            return
        if pointer is None:
            if refs:
                event(logging.WARNING, "latest_pointer_missing", path=str(self.root),
                      action="falling back to the newest valid checkpoint")
            return
        if not (pointer.path / MANIFEST_NAME).is_file():
            event(logging.WARNING, "latest_pointer_dangling", path=str(pointer.path),
                  step=pointer.step, action="falling back to the newest valid checkpoint")
        elif refs and refs[-1].step != pointer.step:
            event(logging.INFO, "latest_pointer_stale", pointer_step=pointer.step,
                  newest_step=refs[-1].step)

    def _repair_latest(self, loaded: Loaded) -> None:
        try:
            pointer = self.read_latest_pointer()
        except CorruptCheckpointError:
            pointer = None
        if pointer is None or pointer.step != loaded.step:
            self._write_latest(loaded.step)
            event(logging.INFO, "latest_pointer_repaired", step=loaded.step)

    def _quarantine(self, ref: CheckpointRef) -> None:
        dest = self.root / f"{CORRUPT_PREFIX}{ref.path.name}-{int(time.time())}"
        try:
            os.rename(ref.path, dest)
            fsio.fsync_dir(self.root)
        except OSError as err:
            raise CheckpointError(f"cannot move bad checkpoint aside: {err.strerror}",
                                  ref.path) from err
        event(logging.WARNING, "checkpoint_quarantined", step=ref.step, path=str(dest))

    # ---- writing ---------------------------------------------------------------------------

    def cleanup(self) -> list[Path]:
        """Remove temp/trash directories and step directories without a manifest (writer only)."""
        removed = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for entry in entries:
            path = Path(entry.path)
            if not entry.is_dir(follow_symlinks=False):
                continue
            stale = entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) or (
                STEP_RE.match(entry.name) is not None and not (path / MANIFEST_NAME).exists())
            if stale:
                fsio.remove_tree(path)
                removed.append(path)
                event(logging.INFO, "checkpoint_dir_removed", path=str(path),
                      reason="no manifest (incomplete save)")
        if removed:
            fsio.fsync_dir(self.root)
        return removed

    def write(
        self,
        step: int,
        skeleton: Any,
        records: list[codec.TensorRecord],
        data: torch.Tensor,
        *,
        check: fsio.ProgressCheck | None = None,
        before_commit: Callable[[], None] | None = None,
        rate_limit: float | None = None,
        run_id: str | None = None,
        restart_count: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write and commit checkpoint `step` from host bytes `data` (1-D uint8, CPU).

        `check(done, total)` runs before each data chunk and `before_commit()` right before the
        rename; either may raise SaveAbandonedError, in which case the temp directory is removed
        and nothing changes. Returns the committed directory.
        """
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            tmp.mkdir()
            tensor_crcs = fsio.write_file_streamed(
                tmp / TENSORS_NAME, byte_view(data), chunk_bytes=self.chunk_bytes,
                check=check, rate_limit=rate_limit)
            state_bytes = json.dumps(
                {"skeleton": skeleton, "tensors": [r.to_json() for r in records]},
                separators=(",", ":")).encode()
            fsio.write_file(tmp / STATE_NAME, state_bytes)
            manifest = Manifest(
                step=step, wall_time=time.time(), chunk_bytes=self.chunk_bytes,
                files={
                    TENSORS_NAME: FileEntry(int(data.numel()), tuple(tensor_crcs)),
                    STATE_NAME: FileEntry(len(state_bytes),
                                          tuple(fsio.checksum_bytes(state_bytes,
                                                                    self.chunk_bytes))),
                },
                save_seconds=round(time.monotonic() - t0, 6), run_id=run_id,
                restart_count=restart_count, extra=extra or {})
            fsio.write_file(tmp / MANIFEST_NAME, manifest.to_bytes())
            fsio.fsync_dir(tmp)
            if before_commit is not None:
                before_commit()
            final = self.root / step_dir_name(step)
            if final.exists():  # re-saving a step (e.g. after resuming from an older one)
                os.rename(final, self.root / f"{TRASH_PREFIX}{final.name}-{secrets.token_hex(3)}")
            os.rename(tmp, final)
            fsio.fsync_dir(self.root)
        except BaseException:
            fsio.remove_tree(tmp)
            raise
        self._write_latest(step)
        self._retain()
        return final

    def _write_latest(self, step: int) -> None:
        doc = {"step": step, "dir": step_dir_name(step), "time": time.time()}
        fsio.atomic_replace(self.root / LATEST_NAME, (json.dumps(doc) + "\n").encode())

    def _retain(self) -> None:
        refs = self.committed()
        for ref in refs[:-self.keep]:
            trash = self.root / f"{TRASH_PREFIX}{ref.path.name}-{secrets.token_hex(3)}"
            try:
                os.rename(ref.path, trash)
            except FileNotFoundError:
                continue
            fsio.remove_tree(trash)
            event(logging.INFO, "checkpoint_retired", step=ref.step)
        with contextlib.suppress(OSError):
            self._remove_trash()

    def _remove_trash(self) -> None:
        for entry in os.scandir(self.root):
            if entry.name.startswith(TRASH_PREFIX):
                fsio.remove_tree(Path(entry.path))
