"""Interruption events, the monitor protocol, and the IMDS polling every monitor shares.

A monitor reads one IMDS path per poll and returns the notices it has not reported yet; a 404
means "no notice". It never sleeps and never decides anything: the caller drives polling and
the lifecycle decides what a notice means (including whether one from before this boot is
stale, from its `notice_time`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from spotagent.imds import ImdsClient
from spotagent.log import get_logger

log = get_logger("monitors")

_MONTHS = {m: i for i, m in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}


@dataclass(frozen=True)
class InterruptionEvent:
    """One notice, reported once by the monitor of its source."""

    source: str  # "spot" | "rebalance" | "scheduled"
    kind: str  # "terminate" | "stop" | "hibernate" | "rebalance" | a scheduled event Code
    key: str  # stable identity for de-duplication: "spot:terminate", "rebalance", "scheduled:<id>"
    notice_time: datetime  # the notice's own time (UTC): action time, noticeTime, NotBefore
    detected_at: datetime  # wall clock when this monitor first saw it (UTC)
    payload: Mapping[str, Any]


class Monitor(Protocol):
    name: str

    def poll(self) -> list[InterruptionEvent]:
        """New events only; one HTTP GET per poll (plus a token PUT when it needs renewing)."""
        ...


class MalformedNotice(ValueError):
    """The body at a monitor's path is not the shape AWS documents."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def parse_iso_time(value: object) -> datetime | None:
    """'2017-09-18T08:22:00Z' (the spot and rebalance format) → aware UTC; None when not one."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def parse_event_time(value: object) -> datetime | None:
    """'21 Jan 2019 09:00:43 GMT' (the scheduled-events format) → aware UTC; None when not one.

    Parsed by hand: strptime's %b follows the process locale.
    """
    if not isinstance(value, str):
        return None
    parts = value.split()
    if len(parts) != 5 or parts[4] not in ("GMT", "UTC") or parts[1] not in _MONTHS:
        return parse_iso_time(value)
    try:
        hh, mm, ss = (int(x) for x in parts[3].split(":"))
        return datetime(int(parts[2]), _MONTHS[parts[1]], int(parts[0]), hh, mm, ss, tzinfo=UTC)
    except ValueError:
        return None


class ImdsJsonMonitor:
    """One IMDS path holding a JSON notice; subclasses turn the JSON into current events.

    Each poll computes the events present now; those whose key was not present at the
    previous successful poll are new. A key that disappears (404, or gone from the list) is
    forgotten, so a notice withdrawn and issued again is reported again. A body identical to
    the previous one is skipped without parsing, which also keeps a malformed body to one
    warning.
    """

    name = "imds-json"
    source = "imds"
    path = ""

    def __init__(self, imds: ImdsClient) -> None:
        self._imds = imds
        self._present: frozenset[str] = frozenset()
        self._last_body: str | None = None
        self._polled = False

    def poll(self) -> list[InterruptionEvent]:
        body = self._imds.get(self.path)
        first_poll = not self._polled
        self._polled = True
        if body is None:
            self._present = frozenset()
            self._last_body = None
            return []
        if body == self._last_body:
            return []
        self._last_body = body
        now = utcnow()
        try:
            current = self.events_from(json.loads(body), now)
        except ValueError as exc:  # JSONDecodeError and MalformedNotice
            log.warning("monitor_malformed_notice", monitor=self.name, path=self.path,
                        reason=str(exc)[:200], body=body[:200])
            return []
        new = [ev for ev in current if ev.key not in self._present]
        self._present = frozenset(ev.key for ev in current)
        for ev in new:
            log.info("interruption_notice", source=ev.source, kind=ev.kind, key=ev.key,
                     notice_time=ev.notice_time.isoformat(), first_poll=first_poll)
        return new

    def events_from(self, data: Any, now: datetime) -> list[InterruptionEvent]:
        """The events `data` (parsed JSON) describes; raise MalformedNotice when it is not
        the documented shape."""
        raise NotImplementedError

    def _notice_time(self, parsed: datetime | None, raw: object, now: datetime) -> datetime:
        if parsed is not None:
            return parsed
        # A notice with an unreadable time is still a notice: date it now rather than drop it.
        log.warning("monitor_bad_notice_time", monitor=self.name, path=self.path,
                    value=str(raw)[:64])
        return now
