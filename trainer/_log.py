"""Event logging for the library: stable snake_case event names with key=value fields.

Records go through the stdlib logger `spottrainer`; the event name and fields ride along in
`record.event` / `record.fields` so a JSON formatter (see `spottrainer.train`) can render them.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

logger = logging.getLogger("spottrainer")


def event(level: int, name: str, **fields: Any) -> None:
    """Log `name` with `fields` at `level` (message text is `name k=v ...`)."""
    text = " ".join([name, *(f"{k}={v}" for k, v in fields.items())])
    logger.log(level, text, extra={"event": name, "fields": fields})


class JsonLineFormatter(logging.Formatter):
    """One JSON object per line: time, level, event and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": round(record.created if record.created else time.time(), 3),
            "level": record.levelname.lower(),
            "event": getattr(record, "event", record.getMessage()),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        return json.dumps(out, default=str)
