"""Scheduled maintenance events: `meta-data/events/maintenance/scheduled`.

A JSON array of `{"Code", "Description", "EventId", "NotAfter", "NotBefore",
"NotBeforeDeadline", "State"}` with times like "21 Jan 2019 09:00:43 GMT". Each EventId is
reported once; events whose State is completed or canceled are history, not notices.
"""

from __future__ import annotations

from datetime import datetime
from types import MappingProxyType
from typing import Any

from spotagent.monitors.base import (
    ImdsJsonMonitor,
    InterruptionEvent,
    MalformedNotice,
    log,
    parse_event_time,
)

PATH = "meta-data/events/maintenance/scheduled"
FINISHED_STATES = frozenset({"completed", "canceled", "cancelled"})


class ScheduledEventMonitor(ImdsJsonMonitor):
    name = "scheduled"
    source = "scheduled"
    path = PATH

    def events_from(self, data: Any, now: datetime) -> list[InterruptionEvent]:
        if not isinstance(data, list):
            raise MalformedNotice("scheduled events are not a JSON array")
        events: list[InterruptionEvent] = []
        for item in data:
            event_id = item.get("EventId") if isinstance(item, dict) else None
            if not isinstance(event_id, str) or not event_id:
                log.warning("scheduled_event_malformed", path=self.path, item=str(item)[:200])
                continue
            if str(item.get("State", "")).strip().lower() in FINISHED_STATES:
                continue
            code = item.get("Code")
            raw = item.get("NotBefore")
            events.append(InterruptionEvent(
                source=self.source,
                kind=code if isinstance(code, str) and code else "unknown",
                key=f"scheduled:{event_id}",
                notice_time=self._notice_time(parse_event_time(raw), raw, now),
                detected_at=now,
                payload=MappingProxyType(dict(item)),
            ))
        return events
