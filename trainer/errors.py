"""Typed errors of the trainer library: each message is one line naming the path and the problem."""

from __future__ import annotations

from pathlib import Path


class SpottrainerError(Exception):
    """Base of every error `spottrainer` raises on purpose.

    `str(err)` is one line: the problem, then `path=...` when a file or directory is involved.
    """

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = None if path is None else Path(path)

    def __str__(self) -> str:
        if self.path is None:
            return self.message
        return f"{self.message} (path={self.path})"


class CheckpointError(SpottrainerError):
    """A checkpoint could not be written or read (I/O, unsupported state, bad directory)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint failed verification (manifest, size or checksum)."""


class NoCheckpointError(CheckpointError):
    """No valid checkpoint exists where one was required."""


class SaveAbandonedError(CheckpointError):
    """An in-flight save was abandoned (deadline or shutdown); nothing was committed."""


class ProtocolError(SpottrainerError):
    """The agent's environment or control files are malformed."""
