"""Spot interruption notice: `meta-data/spot/instance-action`.

404 until AWS decides to take the instance back, then
`{"action": "terminate"|"stop"|"hibernate", "time": "2017-09-18T08:22:00Z"}`. The `time` may
change between polls, so a notice is identified by its action, never by its payload
(aws-node-termination-handler #146).
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
    parse_iso_time,
)

PATH = "meta-data/spot/instance-action"
KNOWN_ACTIONS = frozenset({"terminate", "stop", "hibernate"})


class SpotActionMonitor(ImdsJsonMonitor):
    name = "spot"
    source = "spot"
    path = PATH

    def events_from(self, data: Any, now: datetime) -> list[InterruptionEvent]:
        if not isinstance(data, dict):
            raise MalformedNotice("instance-action is not a JSON object")
        action = data.get("action")
        if not isinstance(action, str) or not action:
            raise MalformedNotice("instance-action has no action")
        if action not in KNOWN_ACTIONS:
            # Still a notice that the instance is going away: report it under its own kind.
            log.warning("spot_action_unknown", action=action[:32])
        raw = data.get("time")
        return [InterruptionEvent(
            source=self.source,
            kind=action,
            key=f"spot:{action}",
            notice_time=self._notice_time(parse_iso_time(raw), raw, now),
            detected_at=now,
            payload=MappingProxyType(dict(data)),
        )]
