"""The checkpoint manifest: what a committed checkpoint promises (pure, no I/O).

MANIFEST.json is written last inside the temporary directory; the directory is then renamed into
place, so a checkpoint directory that has a valid manifest is complete. The manifest names the
step, the format version, every file's size and per-chunk CRC-32s, and carries a CRC of its own
body so a damaged manifest is detected too.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError

FORMAT = "spottrainer-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
TENSORS_NAME = "tensors.bin"
STATE_NAME = "state.json"


@dataclass(frozen=True)
class FileEntry:
    size: int
    chunks: tuple[int, ...]  # CRC-32 of each `chunk_bytes` slice, in order

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "crc32_chunks": list(self.chunks)}


@dataclass(frozen=True)
class Manifest:
    step: int
    wall_time: float        # unix time of the commit
    chunk_bytes: int
    files: dict[str, FileEntry]
    save_seconds: float = 0.0
    run_id: str | None = None
    restart_count: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "wall_time": self.wall_time,
            "save_seconds": self.save_seconds,
            "run_id": self.run_id,
            "restart_count": self.restart_count,
            "checksum": "crc32",
            "chunk_bytes": self.chunk_bytes,
            "files": {name: entry.to_json() for name, entry in sorted(self.files.items())},
            "extra": self.extra,
        }

    def to_bytes(self) -> bytes:
        body = self._body()
        body["manifest_crc32"] = _body_crc(body)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @staticmethod
    def parse(data: bytes, path: Path) -> Manifest:
        """Parse and self-check manifest bytes; CorruptCheckpointError naming `path` if bad."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptCheckpointError("manifest is not valid JSON", path) from err
        if not isinstance(body, dict):
            raise CorruptCheckpointError("manifest is not a JSON object", path)
        if body.get("format") != FORMAT:
            raise CorruptCheckpointError(f"not a {FORMAT} manifest", path)
        if body.get("format_version") != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"unsupported format_version {body.get('format_version')!r}", path)
        stored = body.pop("manifest_crc32", None)
        if stored != _body_crc(body):
            raise CorruptCheckpointError("manifest checksum mismatch", path)
        try:
            files = {
                str(name): FileEntry(int(e["size"]), tuple(int(c) for c in e["crc32_chunks"]))
                for name, e in body["files"].items()
            }
            return Manifest(
                step=int(body["step"]), wall_time=float(body["wall_time"]),
                chunk_bytes=int(body["chunk_bytes"]), files=files,
                save_seconds=float(body.get("save_seconds", 0.0)), run_id=body.get("run_id"),
                restart_count=body.get("restart_count"), extra=dict(body.get("extra") or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptCheckpointError(f"manifest field missing or malformed: {err}",
                                         path) from err


def _body_crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
