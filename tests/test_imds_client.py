"""ImdsClient against the IMDS emulator over real HTTP: token handling, retries, errors."""

from __future__ import annotations

import io
import socket
import time
from collections.abc import Iterator

import pytest
import structlog

from spotagent import log as splog
from spotagent.imds import (
    Identity,
    ImdsClient,
    ImdsDisabledError,
    ImdsError,
    ImdsUnavailableError,
)
from spotagent.testbed.imds import ImdsEmulator

IID = "i-0123456789abcdef0"
OTHER = "i-0fedcba9876543210"
ID_PATH = "/latest/meta-data/instance-id"


@pytest.fixture
def emu() -> Iterator[ImdsEmulator]:
    e = ImdsEmulator().start()
    try:
        e.add_instance(IID, availability_zone="us-east-1a", region="us-east-1",
                       instance_type="g5.xlarge", life_cycle="spot", user_data=b"#spotagent\n",
                       tags={"Name": "trainer", "spotagent:pool.name": "p1"})
        yield e
    finally:
        e.stop()


@pytest.fixture
def client(emu: ImdsEmulator) -> Iterator[ImdsClient]:
    c = ImdsClient(emu.url, timeout=1.0, retries=2, backoff=0.01)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def captured_log() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    splog.configure(json=True, level="debug", stream=buf)
    try:
        yield buf
    finally:
        structlog.reset_defaults()


def methods(emu: ImdsEmulator, path: str | None = None) -> list[str]:
    return [m for m, p, _ in emu.requests(IID) if path is None or p == path]


def test_one_token_put_serves_many_gets(emu: ImdsEmulator, client: ImdsClient) -> None:
    for _ in range(10):
        assert client.get("meta-data/instance-id") == IID
    assert methods(emu).count("PUT") == 1
    assert methods(emu).count("GET") == 10
    assert client.request_count == 11


def test_token_renewed_before_its_ttl_ends(emu: ImdsEmulator) -> None:
    with ImdsClient(emu.url, token_ttl=2) as c:  # renewed when a quarter of the TTL is left
        assert c.get("meta-data/instance-id") == IID
        time.sleep(1.6)
        assert c.get("meta-data/instance-id") == IID
    # renewed early: a second PUT, and the GET was never refused with 401 (no extra GET)
    assert methods(emu) == ["PUT", "GET", "PUT", "GET"]


def test_401_renews_the_token_and_retries_once(emu: ImdsEmulator, client: ImdsClient) -> None:
    client.get("meta-data/instance-id")
    emu.inject_fault(IID, "expire_tokens")
    before = len(emu.requests(IID))
    assert client.get("meta-data/instance-id") == IID
    assert methods(emu)[before:] == ["GET", "PUT", "GET"]


def test_401_with_a_fresh_token_is_an_error_not_a_loop(emu: ImdsEmulator,
                                                         client: ImdsClient) -> None:
    client.get("meta-data/ami-id")
    emu.inject_fault(IID, "status", status=401, count=10, path="instance-id")
    with pytest.raises(ImdsError, match="rejected") as err:
        client.get("meta-data/instance-id")
    assert not isinstance(err.value, ImdsUnavailableError)
    assert methods(emu, ID_PATH) == ["GET", "GET"]


def test_403_is_disabled_at_once_without_retries(emu: ImdsEmulator, client: ImdsClient) -> None:
    client.get("meta-data/ami-id")
    emu.inject_fault(None, "forbidden")
    before = client.request_count
    with pytest.raises(ImdsDisabledError, match="403"):
        client.get("meta-data/instance-id")
    assert client.request_count - before == 1
    # without a cached token the PUT itself is refused: still one request
    fresh = ImdsClient(emu.url, retries=5, backoff=0.01)
    with pytest.raises(ImdsDisabledError):
        fresh.identity()
    assert fresh.request_count == 1


def test_5xx_retried_a_bounded_number_of_times(emu: ImdsEmulator, client: ImdsClient) -> None:
    client.get("meta-data/ami-id")
    emu.inject_fault(IID, "status", status=500, count=100, path="instance-id")
    with pytest.raises(ImdsUnavailableError, match="http 500"):
        client.get("meta-data/instance-id")
    assert len(methods(emu, ID_PATH)) == 3  # the first attempt and retries=2


def test_5xx_then_success(emu: ImdsEmulator, client: ImdsClient) -> None:
    emu.inject_fault(IID, "status", status=502, count=2, path="instance-id")
    assert client.get("meta-data/instance-id") == IID
    assert len(methods(emu, ID_PATH)) == 3


def test_503_retry_after_is_honoured(emu: ImdsEmulator) -> None:
    c = ImdsClient(emu.url, backoff=0.0)
    c.get("meta-data/ami-id")
    emu.inject_fault(IID, "status", status=503, delay=0.3, path="instance-id")
    t0 = time.monotonic()
    assert c.get("meta-data/instance-id") == IID
    assert time.monotonic() - t0 >= 0.3  # waited as told, although backoff is 0


def test_retry_after_is_bounded(emu: ImdsEmulator) -> None:
    c = ImdsClient(emu.url, backoff=0.0, max_wait=0.05)
    c.get("meta-data/ami-id")
    emu.inject_fault(IID, "status", status=503, delay=3600, path="instance-id")
    t0 = time.monotonic()
    assert c.get("meta-data/instance-id") == IID
    assert time.monotonic() - t0 < 5  # not an hour


def test_slow_answer_times_out_then_unavailable(emu: ImdsEmulator) -> None:
    c = ImdsClient(emu.url, timeout=0.2, retries=1, backoff=0.01)
    c.get("meta-data/ami-id")
    emu.inject_fault(IID, "slow", delay=1.0, count=5, path="instance-id")
    t0 = time.monotonic()
    with pytest.raises(ImdsUnavailableError, match="timeout"):
        c.get("meta-data/instance-id")
    assert time.monotonic() - t0 < 3
    assert len(methods(emu, ID_PATH)) == 2


def test_one_slow_answer_is_retried(emu: ImdsEmulator) -> None:
    c = ImdsClient(emu.url, timeout=0.5, retries=1, backoff=0.01)
    emu.inject_fault(IID, "slow", delay=1.5, count=1, path="instance-id")
    assert c.get("meta-data/instance-id") == IID
    assert len(methods(emu, ID_PATH)) == 2


def test_dropped_connection_is_retried(emu: ImdsEmulator, client: ImdsClient) -> None:
    client.get("meta-data/ami-id")  # the kept-alive connection is now in use
    emu.inject_fault(IID, "drop", path="instance-id")
    assert client.get("meta-data/instance-id") == IID
    assert len(methods(emu, ID_PATH)) == 2
    fresh = ImdsClient(emu.url, retries=1, backoff=0.01)  # a drop on a new connection too
    emu.inject_fault(IID, "drop", path="api/token")
    assert fresh.get("meta-data/instance-id") == IID
    assert fresh.request_count == 3


def test_nothing_listening_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = ImdsClient(f"http://127.0.0.1:{port}", retries=2, backoff=0.01)
    with pytest.raises(ImdsUnavailableError, match="ConnectionRefusedError"):
        c.get("meta-data/instance-id")
    assert c.request_count == 3


def test_token_never_in_logs_or_errors(emu: ImdsEmulator, captured_log: io.StringIO) -> None:
    seen: set[str] = set()
    texts: list[str] = []
    c = ImdsClient(emu.url, retries=1, backoff=0.01)
    c.get("meta-data/instance-id")
    seen.update(emu.issued_tokens())
    emu.inject_fault(IID, "expire_tokens")  # 401 path: token rejected, renewed
    c.get("meta-data/instance-id")
    seen.update(emu.issued_tokens())
    emu.inject_fault(IID, "status", status=503, count=5, path="instance-id")  # retries, give up
    emu.inject_fault(IID, "status", status=401, count=5, path="ami-id")  # fresh token refused
    for path in ("meta-data/instance-id", "meta-data/ami-id"):
        with pytest.raises(ImdsError) as err:
            c.get(path)
        texts += [str(err.value), repr(err.value), repr(err.value.__cause__)]
    seen.update(emu.issued_tokens())
    emu.inject_fault(None, "forbidden")
    with pytest.raises(ImdsDisabledError) as err403:
        c.get("meta-data/instance-id")
    texts += [str(err403.value), repr(err403.value)]
    out = captured_log.getvalue()
    for event in ("imds_token_rejected", "imds_retry", "imds_unavailable", "imds_disabled"):
        assert event in out  # the log was captured, so the check below means something
    assert len(seen) >= 2
    for tok in seen:
        assert tok not in out
        for text in texts:
            assert tok not in text


def test_identity_user_data_and_tags(client: ImdsClient) -> None:
    assert client.identity() == Identity(IID, "us-east-1a", "us-east-1", "g5.xlarge", "spot")
    assert client.user_data() == b"#spotagent\n"
    assert client.instance_tags() == {"Name": "trainer", "spotagent:pool.name": "p1"}
    assert client.get("meta-data/spot/instance-action") is None


def test_no_user_data_and_tags_off(emu: ImdsEmulator) -> None:
    url = emu.add_instance(OTHER, availability_zone="eu-central-1b", life_cycle="on-demand")
    c = ImdsClient(url)
    assert c.user_data() is None
    assert c.instance_tags() == {}
    emu.set_tags(OTHER, {})
    assert c.instance_tags() == {}


def test_two_instances_on_one_emulator_by_path_prefix(emu: ImdsEmulator) -> None:
    url = emu.add_instance(OTHER, availability_zone="eu-west-1b", instance_type="p3.2xlarge",
                           life_cycle="on-demand")
    a, b = ImdsClient(emu.url + "/" + IID), ImdsClient(url + "/")
    assert a.identity().instance_id == IID
    assert b.identity() == Identity(OTHER, "eu-west-1b", "eu-west-1", "p3.2xlarge", "on-demand")
    assert [m for m, _, _ in emu.requests(OTHER)].count("PUT") == 1


@pytest.mark.parametrize("kwargs", [
    {"url": "https://169.254.169.254"}, {"url": "169.254.169.254"}, {"token_ttl": 0},
    {"token_ttl": 21601}, {"timeout": 0}, {"retries": -1},
])
def test_bad_settings_rejected(kwargs: dict[str, object]) -> None:
    url = str(kwargs.pop("url", "http://169.254.169.254"))
    with pytest.raises(ImdsError):
        ImdsClient(url, **kwargs)  # type: ignore[arg-type]
