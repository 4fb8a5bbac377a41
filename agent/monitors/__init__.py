"""Interruption monitors, one per source, and the loop that polls them.

`default_monitors(imds)` gives the spot, rebalance and scheduled-event monitors; `poll_all`
polls each once and keeps going when one source fails; `run_loop` polls on a fixed schedule
until told to stop and hands new events to a callback (the lifecycle decides what they mean).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from spotagent.imds import ImdsClient, ImdsDisabledError, ImdsError
from spotagent.monitors.base import (
    InterruptionEvent,
    Monitor,
    log,
    parse_event_time,
    parse_iso_time,
)
from spotagent.monitors.rebalance import RebalanceMonitor
from spotagent.monitors.scheduled import ScheduledEventMonitor
from spotagent.monitors.spot import SpotActionMonitor

DEFAULT_POLL_INTERVAL = 0.5  # seconds; the config default imds.poll_interval

__all__ = [
    "DEFAULT_POLL_INTERVAL",
    "InterruptionEvent",
    "Monitor",
    "RebalanceMonitor",
    "ScheduledEventMonitor",
    "SpotActionMonitor",
    "default_monitors",
    "parse_event_time",
    "parse_iso_time",
    "poll_all",
    "run_loop",
]


def default_monitors(imds: ImdsClient) -> list[Monitor]:
    """One monitor per interruption source, all reading through `imds`."""
    return [SpotActionMonitor(imds), RebalanceMonitor(imds), ScheduledEventMonitor(imds)]


def poll_all(monitors: Sequence[Monitor]) -> list[InterruptionEvent]:
    """Poll each monitor once. A source IMDS cannot serve right now is logged and skipped (the
    next poll tries again); IMDS being disabled (403) is raised: polling cannot work."""
    events: list[InterruptionEvent] = []
    for monitor in monitors:
        try:
            events.extend(monitor.poll())
        except ImdsDisabledError:
            raise
        except ImdsError as exc:
            log.warning("monitor_poll_failed", monitor=monitor.name, error=str(exc))
    return events


def run_loop(monitors: Sequence[Monitor], *, stop: threading.Event,
             on_events: Callable[[list[InterruptionEvent]], None],
             interval: float = DEFAULT_POLL_INTERVAL) -> int:
    """Poll every `interval` seconds on a fixed schedule until `stop` is set; return the
    number of polls. A poll that overruns its slot (IMDS retrying) is followed at once by the
    next one rather than by a burst of missed ones."""
    polls = 0
    next_at = time.monotonic()
    while not stop.is_set():
        events = poll_all(monitors)
        polls += 1
        if events:
            on_events(events)
        next_at += interval
        now = time.monotonic()
        if next_at < now:
            next_at = now
        stop.wait(next_at - now)
    return polls
