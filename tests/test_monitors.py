"""Interruption monitors polling the IMDS emulator over real HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from structlog.testing import capture_logs

from spotagent.imds import ImdsClient, ImdsDisabledError
from spotagent.monitors import (
    InterruptionEvent,
    Monitor,
    RebalanceMonitor,
    ScheduledEventMonitor,
    SpotActionMonitor,
    default_monitors,
    parse_event_time,
    parse_iso_time,
    poll_all,
    run_loop,
)
from spotagent.testbed.imds import ImdsEmulator

IID = "i-0123456789abcdef0"
SPOT = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
SCHEDULED = "/latest/meta-data/events/maintenance/scheduled"


@pytest.fixture
def emu() -> Iterator[ImdsEmulator]:
    e = ImdsEmulator().start()
    try:
        e.add_instance(IID, availability_zone="us-east-1a")
        yield e
    finally:
        e.stop()


@pytest.fixture
def imds(emu: ImdsEmulator) -> Iterator[ImdsClient]:
    c = ImdsClient(emu.url, retries=1, backoff=0.01)
    try:
        yield c
    finally:
        c.close()


def at(minute: int) -> datetime:
    return datetime(2024, 5, 1, 10, minute, tzinfo=UTC)


@pytest.mark.parametrize("cls,path", [
    (SpotActionMonitor, SPOT), (RebalanceMonitor, REBALANCE), (ScheduledEventMonitor, SCHEDULED),
])
def test_no_notice_no_event_and_one_get_per_poll(emu: ImdsEmulator, imds: ImdsClient,
                                                 cls: type[SpotActionMonitor], path: str) -> None:
    monitor = cls(imds)
    assert monitor.poll() == []  # the first poll also fetches the token
    before = len(emu.requests(IID))
    for _ in range(5):
        assert monitor.poll() == []
    assert [(m, p) for m, p, _ in emu.requests(IID)[before:]] == [("GET", path)] * 5


def test_all_sources_quiet_is_three_gets_per_poll(emu: ImdsEmulator, imds: ImdsClient) -> None:
    monitors = default_monitors(imds)
    assert [m.name for m in monitors] == ["spot", "rebalance", "scheduled"]
    poll_all(monitors)
    before = imds.request_count
    for _ in range(4):
        assert poll_all(monitors) == []
    assert imds.request_count - before == 12


def test_terminate_notice_reported_once(emu: ImdsEmulator, imds: ImdsClient) -> None:
    monitor = SpotActionMonitor(imds)
    assert monitor.poll() == []
    emu.fire_spot_action(IID, "terminate", at=at(22))
    (event,) = monitor.poll()
    assert (event.source, event.kind, event.key) == ("spot", "terminate", "spot:terminate")
    assert event.notice_time == at(22)
    assert event.detected_at.tzinfo is not None
    assert abs((event.detected_at - datetime.now(UTC)).total_seconds()) < 60
    assert dict(event.payload) == {"action": "terminate", "time": "2024-05-01T10:22:00Z"}
    for _ in range(3):
        assert monitor.poll() == []


def test_time_changing_between_polls_is_still_one_event(emu: ImdsEmulator,
                                                         imds: ImdsClient) -> None:
    # aws-node-termination-handler #146: the time field moves; the notice is the same.
    monitor = SpotActionMonitor(imds)
    emu.fire_spot_action(IID, "terminate", at=at(22))
    assert len(monitor.poll()) == 1
    for minute in (23, 24, 25):
        emu.fire_spot_action(IID, "terminate", at=at(minute))
        assert monitor.poll() == []


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_stop_and_hibernate(emu: ImdsEmulator, imds: ImdsClient, action: str) -> None:
    monitor = SpotActionMonitor(imds)
    emu.fire_spot_action(IID, action, at=at(5))
    (event,) = monitor.poll()
    assert (event.kind, event.key, event.notice_time) == (action, f"spot:{action}", at(5))


def test_a_different_action_is_a_new_event(emu: ImdsEmulator, imds: ImdsClient) -> None:
    monitor = SpotActionMonitor(imds)
    emu.fire_spot_action(IID, "stop")
    assert [e.kind for e in monitor.poll()] == ["stop"]
    emu.fire_spot_action(IID, "terminate")
    assert [e.kind for e in monitor.poll()] == ["terminate"]


def test_withdrawn_then_reissued_notice_is_reported_again(emu: ImdsEmulator,
                                                          imds: ImdsClient) -> None:
    monitor = SpotActionMonitor(imds)
    emu.fire_spot_action(IID)
    assert len(monitor.poll()) == 1
    emu.clear_events(IID)
    assert monitor.poll() == []
    emu.fire_spot_action(IID)
    assert len(monitor.poll()) == 1


def test_notice_from_before_the_first_poll_keeps_its_original_time(
        emu: ImdsEmulator, imds: ImdsClient) -> None:
    old = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)
    emu.fire_spot_action(IID, "stop", at=old)
    emu.fire_rebalance(IID, old - timedelta(minutes=1))
    events = poll_all(default_monitors(imds))  # a monitor born at this boot
    assert [(e.key, e.notice_time) for e in events] == [
        ("spot:stop", old), ("rebalance", old - timedelta(minutes=1))]
    assert all(e.detected_at > e.notice_time for e in events)


def test_rebalance_reported_once(emu: ImdsEmulator, imds: ImdsClient) -> None:
    monitor = RebalanceMonitor(imds)
    assert monitor.poll() == []
    emu.fire_rebalance(IID, at(8))
    (event,) = monitor.poll()
    assert (event.source, event.kind, event.key, event.notice_time) == (
        "rebalance", "rebalance", "rebalance", at(8))
    assert monitor.poll() == []


def test_scheduled_events_each_once_and_finished_ones_ignored(emu: ImdsEmulator,
                                                               imds: ImdsClient) -> None:
    monitor = ScheduledEventMonitor(imds)
    nb = datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)
    reboot = emu.add_scheduled_event(IID, "system-reboot", not_before=nb)
    stop = emu.add_scheduled_event(IID, "instance-stop", not_before=nb + timedelta(days=1))
    emu.add_scheduled_event(IID, "instance-retirement", state="completed")
    emu.add_scheduled_event(IID, "system-maintenance", state="canceled")
    events = monitor.poll()
    assert [(e.source, e.kind, e.key) for e in events] == [
        ("scheduled", "system-reboot", f"scheduled:{reboot}"),
        ("scheduled", "instance-stop", f"scheduled:{stop}")]
    assert [e.notice_time for e in events] == [nb, nb + timedelta(days=1)]
    assert monitor.poll() == []
    later = emu.add_scheduled_event(IID, "instance-reboot")
    assert [e.key for e in monitor.poll()] == [f"scheduled:{later}"]
    # an event that completes is history: nothing new, no crash
    emu.add_scheduled_event(IID, "system-reboot", not_before=nb, event_id=reboot,
                            state="completed")
    assert monitor.poll() == []


@pytest.mark.parametrize("source,body", [
    ("spot", "{not json"), ("spot", "[]"), ("spot", '{"time": "2024-05-01T10:00:00Z"}'),
    ("rebalance", '"soon"'), ("scheduled", "{}"), ("scheduled", "<html>oops</html>"),
])
def test_malformed_json_is_tolerated_and_warned_once(emu: ImdsEmulator, imds: ImdsClient,
                                                     source: str, body: str) -> None:
    monitors = default_monitors(imds)
    emu.set_raw(IID, source, body)
    with capture_logs() as logs:
        for _ in range(3):
            assert poll_all(monitors) == []
    warnings = [e for e in logs if e["event"] == "monitor_malformed_notice"]
    assert len(warnings) == 1 and warnings[0]["monitor"] == source
    emu.set_raw(IID, source, None)  # healthy again: notices get through
    emu.fire_spot_action(IID)
    emu.fire_rebalance(IID)
    emu.add_scheduled_event(IID)
    assert sorted(e.source for e in poll_all(monitors)) == ["rebalance", "scheduled", "spot"]


def test_malformed_scheduled_item_skipped_others_reported(emu: ImdsEmulator,
                                                          imds: ImdsClient) -> None:
    emu.set_raw(IID, "scheduled", '[{"Code": "system-reboot"}, 7, {"EventId": "instance-event-1",'
                ' "Code": "instance-stop", "State": "active",'
                ' "NotBefore": "1 Feb 2024 00:00:00 GMT"}]')
    (event,) = ScheduledEventMonitor(imds).poll()
    assert (event.kind, event.key) == ("instance-stop", "scheduled:instance-event-1")
    assert event.notice_time == datetime(2024, 2, 1, tzinfo=UTC)


def test_unreadable_notice_time_still_reports_the_notice(emu: ImdsEmulator,
                                                         imds: ImdsClient) -> None:
    emu.set_raw(IID, "spot", '{"action": "terminate", "time": "in two minutes"}')
    (event,) = SpotActionMonitor(imds).poll()
    assert event.kind == "terminate" and event.notice_time == event.detected_at


def test_poll_all_keeps_going_when_one_source_fails(emu: ImdsEmulator, imds: ImdsClient) -> None:
    monitors = default_monitors(imds)
    emu.inject_fault(IID, "status", status=500, count=1000, path="recommendations")
    emu.fire_spot_action(IID)
    with capture_logs() as logs:
        events = poll_all(monitors)
    assert [e.key for e in events] == ["spot:terminate"]
    assert any(e["event"] == "monitor_poll_failed" and e["monitor"] == "rebalance"
               for e in logs)


def test_poll_all_raises_when_imds_is_disabled(emu: ImdsEmulator, imds: ImdsClient) -> None:
    emu.inject_fault(None, "forbidden")
    with pytest.raises(ImdsDisabledError):
        poll_all(default_monitors(imds))


def test_run_loop_delivers_each_notice_once_and_stops(emu: ImdsEmulator,
                                                      imds: ImdsClient) -> None:
    got: list[InterruptionEvent] = []
    seen = threading.Event()
    stop = threading.Event()

    def on_events(events: list[InterruptionEvent]) -> None:
        got.extend(events)
        seen.set()

    monitors: list[Monitor] = default_monitors(imds)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(
        run_loop(monitors, stop=stop, on_events=on_events, interval=0.02)))
    t.start()
    try:
        emu.fire_spot_action(IID)
        assert seen.wait(10)
        for minute in (1, 2):  # the time moves; still one notice
            emu.fire_spot_action(IID, at=at(minute))
        n = len(emu.requests(IID))
        while len(emu.requests(IID)) < n + 15:  # five more polls of three sources
            stop.wait(0.02)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert [e.key for e in got] == ["spot:terminate"]
    assert result[0] > 5


def test_time_parsers() -> None:
    assert parse_iso_time("2017-09-18T08:22:00Z") == datetime(2017, 9, 18, 8, 22, tzinfo=UTC)
    assert parse_iso_time("2017-09-18T08:22:00") == datetime(2017, 9, 18, 8, 22, tzinfo=UTC)
    assert parse_event_time("21 Jan 2019 09:00:43 GMT") == datetime(2019, 1, 21, 9, 0, 43,
                                                                    tzinfo=UTC)
    assert parse_event_time("1 Dec 2020 01:03:47 GMT") == datetime(2020, 12, 1, 1, 3, 47,
                                                                   tzinfo=UTC)
    for bad in ("", "soon", "32 Jan 2019 09:00:43 GMT", "21 Foo 2019 09:00:43 GMT", None, 5):
        assert parse_event_time(bad) is None
        assert parse_iso_time(bad) is None
