"""Typed errors: each carries the context an operator needs in one line."""

from __future__ import annotations

from typing import Any


class SpotagentError(Exception):
    """Base of every error the agent raises on purpose.

    `str(err)` is the one line shown to an operator: the message followed by key=value context.
    `exit_code` is what the CLI exits with when the error ends the process.
    """

    exit_code = 1

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context

    def __str__(self) -> str:
        if not self.context:
            return self.message
        ctx = " ".join(f"{k}={v}" for k, v in self.context.items())
        return f"{self.message} ({ctx})"


class ConfigError(SpotagentError):
    """Bad configuration: names the key, the value and where it came from. Exit code 2."""

    exit_code = 2


class SubprocessError(SpotagentError):
    """A command failed, timed out or could not be started."""
