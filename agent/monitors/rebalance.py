"""Rebalance recommendation: `meta-data/events/recommendations/rebalance`.

404 until EC2 judges the instance at elevated risk of interruption, then
`{"noticeTime": "2020-10-27T08:22:00Z"}`. It may come before the spot notice, with it, or not
at all; the lifecycle answers it with a cheap early checkpoint.
"""

from __future__ import annotations

from datetime import datetime
from types import MappingProxyType
from typing import Any

from spotagent.monitors.base import (
    ImdsJsonMonitor,
    InterruptionEvent,
    MalformedNotice,
    parse_iso_time,
)

PATH = "meta-data/events/recommendations/rebalance"


class RebalanceMonitor(ImdsJsonMonitor):
    name = "rebalance"
    source = "rebalance"
    path = PATH

    def events_from(self, data: Any, now: datetime) -> list[InterruptionEvent]:
        if not isinstance(data, dict):
            raise MalformedNotice("rebalance recommendation is not a JSON object")
        raw = data.get("noticeTime")
        return [InterruptionEvent(
            source=self.source,
            kind="rebalance",
            key="rebalance",
            notice_time=self._notice_time(parse_iso_time(raw), raw, now),
            detected_at=now,
            payload=MappingProxyType(dict(data)),
        )]
