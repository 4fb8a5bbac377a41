"""The IMDS emulator speaks IMDSv2 like AWS: raw HTTP against it, no client library."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.message import Message
from typing import Any
from urllib.parse import urlsplit

import pytest

from spotagent.testbed.imds import ImdsEmulator

IID = "i-0123456789abcdef0"
OTHER = "i-0fedcba9876543210"


@dataclass
class Resp:
    status: int
    headers: Message
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(url: str, method: str, path: str, headers: dict[str, str] | None = None,
         body: bytes | None = None) -> Resp:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    try:
        conn.request(method, parts.path.rstrip("/") + path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Resp(resp.status, resp.msg, resp.read())
    finally:
        conn.close()


def token(url: str, ttl: int = 60) -> str:
    r = call(url, "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
    assert r.status == 200
    return r.body.decode()


def get(url: str, path: str, tok: str | None = None) -> Resp:
    return call(url, "GET", "/latest/" + path,
                {"X-aws-ec2-metadata-token": tok} if tok is not None else {})


@pytest.fixture
def emu() -> Iterator[ImdsEmulator]:
    e = ImdsEmulator().start()
    try:
        e.add_instance(IID, availability_zone="us-east-1a")
        yield e
    finally:
        e.stop()


@pytest.mark.parametrize("ttl", [None, "0", "21601", "abc", "-5"])
def test_token_put_with_bad_ttl_is_400(emu: ImdsEmulator, ttl: str | None) -> None:
    headers = {"X-aws-ec2-metadata-token-ttl-seconds": ttl} if ttl is not None else {}
    assert call(emu.url, "PUT", "/latest/api/token", headers).status == 400


def test_token_put_echoes_ttl_and_rejects_forwarded_requests(emu: ImdsEmulator) -> None:
    r = call(emu.url, "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
    assert r.status == 200 and len(r.body) >= 40
    assert r.headers["X-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    relayed = call(emu.url, "PUT", "/latest/api/token",
                   {"X-aws-ec2-metadata-token-ttl-seconds": "60", "X-Forwarded-For": "10.0.0.1"})
    assert relayed.status == 400
    assert call(emu.url, "GET", "/latest/api/token").status == 405


def test_get_needs_a_valid_token_when_v2_is_required(emu: ImdsEmulator) -> None:
    assert get(emu.url, "meta-data/instance-id").status == 401
    assert get(emu.url, "meta-data/instance-id", "not-a-token").status == 401
    r = get(emu.url, "meta-data/instance-id", token(emu.url))
    assert (r.status, r.body) == (200, IID.encode())


def test_v1_allowed_when_not_required_but_a_bad_token_is_still_401() -> None:
    with ImdsEmulator(require_v2=False) as e:
        e.add_instance(IID, availability_zone="us-east-1a")
        assert get(e.url, "meta-data/instance-id").body == IID.encode()
        assert get(e.url, "meta-data/instance-id", "bogus").status == 401


def test_token_ttl_is_enforced(emu: ImdsEmulator) -> None:
    tok = token(emu.url, ttl=1)
    assert get(emu.url, "meta-data/instance-id", tok).status == 200
    time.sleep(1.1)
    assert get(emu.url, "meta-data/instance-id", tok).status == 401


def test_instances_by_path_prefix_have_their_own_tokens(emu: ImdsEmulator) -> None:
    other_url = emu.add_instance(OTHER, availability_zone="eu-west-1b", instance_type="p3.2xlarge")
    assert other_url == f"{emu.url}/{OTHER}"
    tok_other = token(other_url)
    r = get(other_url, "meta-data/placement/region", tok_other)
    assert r.body == b"eu-west-1"
    assert get(other_url, "meta-data/instance-type", tok_other).body == b"p3.2xlarge"
    # the root serves the first instance added, and it does not accept the other's token
    assert get(emu.url, "meta-data/instance-id", tok_other).status == 401
    assert get(f"{emu.url}/{IID}", "meta-data/instance-id", token(emu.url)).body == IID.encode()
    assert get(f"{emu.url}/i-nosuch", "meta-data/instance-id", tok_other).status == 404


@pytest.mark.parametrize("path", [
    "meta-data/spot/instance-action", "meta-data/spot/termination-time",
    "meta-data/events/recommendations/rebalance", "user-data", "meta-data/tags/instance",
    "meta-data/no-such-thing",
])
def test_absent_paths_are_404(emu: ImdsEmulator, path: str) -> None:
    assert get(emu.url, path, token(emu.url)).status == 404


def test_identity_paths_and_document(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    expect = {
        "meta-data/instance-id": IID, "meta-data/placement/availability-zone": "us-east-1a",
        "meta-data/placement/region": "us-east-1", "meta-data/instance-type": "g5.xlarge",
        "meta-data/instance-life-cycle": "spot", "meta-data/ami-id": "ami-00000000000000000",
    }
    for path, value in expect.items():
        assert get(emu.url, path, tok).body.decode() == value, path
    doc = get(emu.url, "dynamic/instance-identity/document", tok).json()
    assert isinstance(doc, dict)
    assert (doc["instanceId"], doc["availabilityZone"], doc["region"], doc["instanceType"]) == (
        IID, "us-east-1a", "us-east-1", "g5.xlarge")


def test_listing_shows_what_exists(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    listing = get(emu.url, "meta-data/", tok).body.decode().splitlines()
    assert {"instance-id", "placement/", "events/", "ami-id"} <= set(listing)
    assert "spot/" not in listing
    emu.fire_spot_action(IID)
    assert "spot/" in get(emu.url, "meta-data", tok).body.decode().splitlines()
    assert get(emu.url, "", tok).body.decode().splitlines() == ["dynamic/", "meta-data/"]


def test_spot_action_shape(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    emu.fire_spot_action(IID, "stop", at=datetime(2017, 9, 18, 8, 22, tzinfo=UTC))
    assert get(emu.url, "meta-data/spot/instance-action", tok).json() == {
        "action": "stop", "time": "2017-09-18T08:22:00Z"}
    assert get(emu.url, "meta-data/spot/termination-time", tok).status == 404
    emu.fire_spot_action(IID)  # default: terminate, two minutes from now
    body = get(emu.url, "meta-data/spot/instance-action", tok).json()
    assert isinstance(body, dict) and body["action"] == "terminate"
    when = datetime.fromisoformat(body["time"])
    assert 100 < (when - datetime.now(UTC)).total_seconds() <= 121
    assert get(emu.url, "meta-data/spot/termination-time", tok).body.decode() == body["time"]


def test_rebalance_shape(emu: ImdsEmulator) -> None:
    emu.fire_rebalance(IID, datetime(2020, 10, 27, 8, 22, tzinfo=UTC))
    r = get(emu.url, "meta-data/events/recommendations/rebalance", token(emu.url))
    assert r.json() == {"noticeTime": "2020-10-27T08:22:00Z"}


def test_scheduled_events_shape(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    assert get(emu.url, "meta-data/events/maintenance/scheduled", tok).json() == []
    eid = emu.add_scheduled_event(IID, "instance-stop",
                                  not_before=datetime(2019, 1, 1, 9, 0, 43, tzinfo=UTC),
                                  not_after=datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC))
    done = emu.add_scheduled_event(IID, state="completed")
    events = get(emu.url, "meta-data/events/maintenance/scheduled", tok).json()
    assert isinstance(events, list) and len(events) == 2
    first, second = events
    assert set(first) == {"Code", "Description", "EventId", "NotAfter", "NotBefore",
                          "NotBeforeDeadline", "State"}
    assert re.fullmatch(r"instance-event-[0-9a-f]{17}", eid)
    assert (first["EventId"], first["Code"], first["State"]) == (eid, "instance-stop", "active")
    assert first["NotBefore"] == "1 Jan 2019 09:00:43 GMT"  # day not zero-padded, like AWS
    assert first["NotAfter"] == "21 Jan 2019 09:00:43 GMT"
    assert re.fullmatch(r"\d{1,2} [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT",
                        first["NotBeforeDeadline"])
    assert second["EventId"] == done and second["Description"].startswith("[Completed]")
    emu.clear_events(IID)
    assert get(emu.url, "meta-data/events/maintenance/scheduled", tok).json() == []


def test_user_data_and_tags(emu: ImdsEmulator) -> None:
    url = emu.add_instance(OTHER, availability_zone="us-west-2c", user_data=b"\x1f\x8b\x00bin",
                           tags={"Name": "trainer", "spotagent:pool.name": "p1"})
    tok = token(url)
    assert get(url, "user-data", tok).body == b"\x1f\x8b\x00bin"
    assert get(url, "meta-data/tags/instance", tok).body == b"Name\nspotagent:pool.name"
    assert get(url, "meta-data/tags/instance/spotagent:pool.name", tok).body == b"p1"
    emu.set_tags(OTHER, None)
    emu.set_user_data(OTHER, None)
    assert get(url, "meta-data/tags/instance", tok).status == 404
    assert get(url, "user-data", tok).status == 404


def test_status_fault_with_retry_after_is_consumed(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    emu.inject_fault(IID, "status", status=503, delay=2, count=1)
    r = get(emu.url, "meta-data/instance-id", tok)
    assert (r.status, r.headers["Retry-After"]) == (503, "2")
    assert get(emu.url, "meta-data/instance-id", tok).status == 200


def test_fault_scoped_to_instance_and_path(emu: ImdsEmulator) -> None:
    url = emu.add_instance(OTHER, availability_zone="us-east-1b")
    tok, tok_other = token(emu.url), token(url)
    emu.inject_fault(OTHER, "status", status=500, count=5, path="instance-type")
    assert get(emu.url, "meta-data/instance-type", tok).status == 200
    assert get(url, "meta-data/instance-id", tok_other).status == 200
    assert get(url, "meta-data/instance-type", tok_other).status == 500
    emu.clear_faults(OTHER)
    assert get(url, "meta-data/instance-type", tok_other).status == 200


def test_slow_fault_delays_the_answer(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    emu.inject_fault(IID, "slow", delay=0.3)
    t0 = time.monotonic()
    assert get(emu.url, "meta-data/instance-id", tok).status == 200
    assert time.monotonic() - t0 >= 0.3


def test_drop_fault_closes_without_answer(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    emu.inject_fault(IID, "drop")
    with pytest.raises(http.client.RemoteDisconnected):
        get(emu.url, "meta-data/instance-id", tok)
    assert get(emu.url, "meta-data/instance-id", tok).status == 200


def test_forbidden_until_cleared_and_expire_tokens(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    emu.inject_fault(None, "forbidden")
    for _ in range(3):
        assert get(emu.url, "meta-data/instance-id", tok).status == 403
    emu.clear_faults()
    assert get(emu.url, "meta-data/instance-id", tok).status == 200
    emu.inject_fault(IID, "expire_tokens")
    assert emu.issued_tokens() == []
    assert get(emu.url, "meta-data/instance-id", tok).status == 401
    with pytest.raises(ValueError, match="unknown fault"):
        emu.inject_fault(IID, "explode")


def test_request_log_records_metadata_calls_only(emu: ImdsEmulator) -> None:
    tok = token(emu.url)
    get(emu.url, "meta-data/instance-id", tok)
    call(emu.url, "GET", f"/_control/{IID}/requests")
    log = emu.requests(IID)
    assert [(m, p) for m, p, _ in log] == [("PUT", "/latest/api/token"),
                                           ("GET", "/latest/meta-data/instance-id")]
    assert log[0][2] <= log[1][2] <= time.monotonic()


def test_control_api_over_http(emu: ImdsEmulator) -> None:
    ctl = f"{emu.url}/_control"
    tok = token(emu.url)

    def post(path: str, body: object) -> Resp:
        return call(ctl, "POST", path, {"Content-Type": "application/json"},
                    json.dumps(body).encode())

    assert post(f"/{IID}/spot-action", {"action": "hibernate",
                                        "time": "2024-05-01T10:00:00Z"}).status == 200
    assert get(emu.url, "meta-data/spot/instance-action", tok).json() == {
        "action": "hibernate", "time": "2024-05-01T10:00:00Z"}
    assert post(f"/{IID}/rebalance", {}).status == 200
    assert get(emu.url, "meta-data/events/recommendations/rebalance", tok).status == 200
    r = post(f"/{IID}/scheduled", {"code": "system-maintenance"})
    eid = r.json()["event_id"]
    events = get(emu.url, "meta-data/events/maintenance/scheduled", tok).json()
    assert [e["EventId"] for e in events] == [eid]
    assert post(f"/{IID}/clear", {}).status == 200
    assert get(emu.url, "meta-data/spot/instance-action", tok).status == 404
    assert post("/_all/fault", {"kind": "status", "status": 500, "count": 1}).status == 200
    assert get(emu.url, "meta-data/instance-id", tok).status == 500
    added = post("/instances", {"instance_id": OTHER, "availability_zone": "us-east-1c"})
    assert added.json() == {"url": f"{emu.url}/{OTHER}"}
    log = call(ctl, "GET", f"/{IID}/requests").json()
    assert isinstance(log, list) and log[-1][:2] == ["GET", "/latest/meta-data/instance-id"]
    assert post(f"/{IID}/nonsense", {}).status == 400
    assert post("/i-nosuch/clear", {}).status == 400


def test_control_api_sets_user_data_tags_and_raw_bodies(emu: ImdsEmulator) -> None:
    ctl = f"{emu.url}/_control/{IID}"
    tok = token(emu.url)
    assert call(ctl, "POST", "/user-data", body=b"#!/bin/sh\n\x00").status == 200
    assert get(emu.url, "user-data", tok).body == b"#!/bin/sh\n\x00"
    assert call(ctl, "POST", "/tags", body=json.dumps({"Name": "n"}).encode()).status == 200
    assert get(emu.url, "meta-data/tags/instance/Name", tok).body == b"n"
    raw = json.dumps({"source": "spot", "body": "{broken"}).encode()
    assert call(ctl, "POST", "/raw", body=raw).status == 200
    assert get(emu.url, "meta-data/spot/instance-action", tok).body == b"{broken"
    assert call(ctl, "POST", "/raw", body=json.dumps({"source": "spot"}).encode()).status == 200
    assert get(emu.url, "meta-data/spot/instance-action", tok).status == 404


def test_stop_returns_with_a_kept_alive_connection_open() -> None:
    e = ImdsEmulator().start()
    e.add_instance(IID, availability_zone="us-east-1a")
    parts = urlsplit(e.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
    try:
        conn.request("PUT", "/latest/api/token", headers={
            "X-aws-ec2-metadata-token-ttl-seconds": "60"})
        assert conn.getresponse().read()
        t0 = time.monotonic()
        e.stop()
        assert time.monotonic() - t0 < 5
        with pytest.raises((OSError, http.client.HTTPException)):
            conn.request("GET", "/latest/meta-data/instance-id")
            conn.getresponse()
    finally:
        conn.close()


def test_command_line_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotagent.testbed.imds", "--port", "0", "--instance", IID,
         "--az", "ap-south-1b", "--tag", "Name=x"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        tok = token(url)
        assert get(url, "meta-data/placement/region", tok).body == b"ap-south-1"
        assert get(url, "meta-data/tags/instance/Name", tok).body == b"x"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
