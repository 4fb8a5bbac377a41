"""Logging set-up: structlog events with stable names; JSON lines off a terminal, text on one."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

_SECRET_KEYS = frozenset({"token", "x-aws-ec2-metadata-token", "aws_secret_access_key"})


def _redact(_logger: Any, _name: str,
            event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Never let a secret reach the journal, whatever a caller passed."""
    for key in list(event):
        if key.lower() in _SECRET_KEYS:
            event[key] = "[redacted]"
    return event


class _StderrLogger:
    """Writes each line to the current `sys.stderr` (looked up per line, so a redirected or
    replaced stream is honoured)."""

    def msg(self, message: str) -> None:
        stream = sys.stderr
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _stderr_factory(*_args: Any) -> _StderrLogger:
    return _StderrLogger()


def configure(*, json: bool | None = None, level: str | None = None,
              stream: TextIO | None = None) -> None:
    """Configure structlog once per process.

    `json=None` picks JSON lines when `stream` is not a terminal (the journal), readable
    key=value output on a terminal. `SPOTAGENT_LOG_LEVEL` sets the level (default info).
    """
    out = stream if stream is not None else sys.stderr
    if json is None:
        json = not out.isatty()
    lvl = (level or os.environ.get("SPOTAGENT_LOG_LEVEL", "info")).upper()
    renderer: Any = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(lvl)),
        logger_factory=(_stderr_factory if stream is None
                        else structlog.PrintLoggerFactory(file=stream)),
        cache_logger_on_first_use=False,
    )


def get_logger(component: str) -> Any:
    """A logger whose events carry `component`.

    Lazy: module-level loggers made at import time still follow a later `configure()`
    (`.bind()` on structlog's proxy would freeze the configuration of the moment)."""
    return structlog.get_logger(component=component)
