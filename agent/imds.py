"""IMDSv2 client: the only code in the agent that talks to the instance metadata address.

A session token is fetched with PUT, cached for its TTL, refreshed a little before it expires
and again when IMDS answers 401 (then the request is retried once). Every request has a timeout.
5xx answers, timeouts and connection errors are retried a bounded number of times with jittered
backoff (a 503's Retry-After is honoured up to a bound); a 403 means IMDS is disabled for this
instance and stops at once. The token never reaches a log line or an error message.

One persistent HTTP/1.1 connection per client keeps sub-second polling cheap; it is re-opened
after any failure.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import TypeVar
from urllib.parse import quote, urlsplit

from spotagent.errors import SpotagentError
from spotagent.log import get_logger

log = get_logger("imds")

DEFAULT_URL = "http://169.254.169.254"
TOKEN_PATH = "api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TOKEN_TTL = 21600
# No single wait between two attempts is longer than this, a server's Retry-After included:
# the monitors poll twice a second and a spot notice gives two minutes.
MAX_RETRY_WAIT = 1.0
# The token is renewed this long before it expires (a quarter of short TTLs).
MAX_REFRESH_MARGIN = 60.0

_T = TypeVar("_T")


class ImdsError(SpotagentError):
    """The instance metadata service gave an answer the agent cannot use."""


class ImdsDisabledError(ImdsError):
    """IMDS answered 403: it is disabled or forbidden for this instance. Not retried."""


class ImdsUnavailableError(ImdsError):
    """IMDS did not answer usefully within the retry budget (5xx, timeouts, connection errors)."""


@dataclass(frozen=True)
class Identity:
    """Who and where this instance is."""

    instance_id: str
    availability_zone: str
    region: str
    instance_type: str
    life_cycle: str  # "spot" | "on-demand"


class _Transient(Exception):
    """One attempt failed in a way worth retrying (internal to this module)."""

    def __init__(self, reason: str, *, retry_after: float | None = None,
                 cause: BaseException | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.cause = cause


class ImdsClient:
    """IMDSv2 over one keep-alive connection. Thread-safe (one request at a time).

    `url` may carry a path prefix (the emulator serves several instances as
    `http://127.0.0.1:PORT/<instance-id>`); requests go to `{url}/latest/...`.
    `retries` is the number of extra attempts after the first; `backoff` the base wait.
    """

    def __init__(self, url: str = DEFAULT_URL, *, timeout: float = 1.0,
                 token_ttl: int = MAX_TOKEN_TTL, retries: int = 3, backoff: float = 0.1,
                 max_wait: float = MAX_RETRY_WAIT) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ImdsError("IMDS url must be http://host[:port][/prefix]", url=url)
        if not 1 <= token_ttl <= MAX_TOKEN_TTL:
            raise ImdsError(f"token_ttl must be 1..{MAX_TOKEN_TTL} seconds", token_ttl=token_ttl)
        if timeout <= 0 or retries < 0 or backoff < 0 or max_wait < 0:
            raise ImdsError("timeout must be > 0; retries, backoff and max_wait >= 0",
                            timeout=timeout, retries=retries, backoff=backoff)
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.token_ttl = token_ttl
        self.retries = retries
        self.backoff = backoff
        self.max_wait = max_wait
        self.request_count = 0
        self._host = parts.hostname
        self._port = parts.port or 80
        self._base = parts.path.rstrip("/") + "/latest/"
        self._margin = min(MAX_REFRESH_MARGIN, token_ttl / 4)
        self._conn: http.client.HTTPConnection | None = None
        self._token: str | None = None
        self._token_renew_at = 0.0
        self._lock = threading.Lock()

    # -- public API ------------------------------------------------------------------------

    def get(self, path: str) -> str | None:
        """Text at `latest/<path>` (e.g. "meta-data/instance-id"), or None on 404."""
        body = self.get_bytes(path)
        if body is None:
            return None
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ImdsError("IMDS answer is not UTF-8 text", path=path) from exc

    def get_bytes(self, path: str) -> bytes | None:
        """Raw bytes at `latest/<path>`, or None on 404."""
        path = path.lstrip("/")
        with self._lock:
            return self._with_retries(path, lambda: self._get_once(path))

    def identity(self) -> Identity:
        """Instance id, zone, region, type and life cycle (spot | on-demand)."""
        instance_id = self._require("meta-data/instance-id")
        zone = self._require("meta-data/placement/availability-zone")
        region = self.get("meta-data/placement/region")
        if not region:
            region = self._region_from_document()
        return Identity(
            instance_id=instance_id,
            availability_zone=zone,
            region=region.strip(),
            instance_type=self._require("meta-data/instance-type"),
            life_cycle=self._require("meta-data/instance-life-cycle"),
        )

    def user_data(self) -> bytes | None:
        """The instance's user data, or None when it has none."""
        return self.get_bytes("user-data")

    def instance_tags(self) -> dict[str, str]:
        """Instance tags; {} when tags in instance metadata are off (404)."""
        listing = self.get("meta-data/tags/instance")
        if listing is None:
            return {}
        tags: dict[str, str] = {}
        for key in filter(None, (line.strip() for line in listing.splitlines())):
            value = self.get("meta-data/tags/instance/" + quote(key, safe=""))
            if value is not None:  # a tag removed between the listing and the read is gone
                tags[key] = value
        return tags

    def close(self) -> None:
        with self._lock:
            self._close()

    def __enter__(self) -> ImdsClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- helpers for identity ----------------------------------------------------------------

    def _require(self, path: str) -> str:
        value = self.get(path)
        if value is None or not value.strip():
            raise ImdsError("IMDS has no value for a required path", path=path)
        return value.strip()

    def _region_from_document(self) -> str:
        path = "dynamic/instance-identity/document"
        doc = self.get(path)
        try:
            region = json.loads(doc)["region"] if doc else None
        except (ValueError, KeyError, TypeError) as exc:
            raise ImdsError("instance identity document has no region", path=path) from exc
        if not isinstance(region, str) or not region:
            raise ImdsError("IMDS gives no region", path=path)
        return region

    # -- one request, its retries, its token -----------------------------------------------

    def _with_retries(self, path: str, attempt: Callable[[], _T]) -> _T:
        last: _Transient | None = None
        for n in range(self.retries + 1):
            if last is not None:
                wait = self._wait(n, last)
                log.info("imds_retry", path=path, attempt=n + 1, reason=last.reason,
                         wait_s=round(wait, 3))
                time.sleep(wait)
            try:
                return attempt()
            except _Transient as exc:
                last = exc
        assert last is not None
        log.warning("imds_unavailable", path=path, attempts=self.retries + 1, reason=last.reason)
        raise ImdsUnavailableError("instance metadata service unavailable", path=path,
                                   attempts=self.retries + 1, reason=last.reason) from last.cause

    def _wait(self, attempt: int, last: _Transient) -> float:
        if last.retry_after is not None:
            return min(max(last.retry_after, 0.0), self.max_wait)
        base: float = self.backoff * 2.0 ** (attempt - 1)
        return min(base * random.uniform(0.5, 1.5), self.max_wait)

    def _get_once(self, path: str) -> bytes | None:
        status, retry_after, body = self._exchange("GET", path, {TOKEN_HEADER: self._token_now()})
        if status == 401:
            # The token expired or was revoked under us: fetch a new one and try once more.
            log.info("imds_token_rejected", path=path)
            self._token = None
            status, retry_after, body = self._exchange(
                "GET", path, {TOKEN_HEADER: self._token_now()})
            if status == 401:
                raise ImdsError("IMDS rejected a freshly issued token", path=path, status=401)
        if status == 200:
            return body
        if status == 404:
            return None
        raise self._failure(path, status, retry_after)

    def _token_now(self) -> str:
        now = time.monotonic()
        if self._token is not None and now < self._token_renew_at:
            return self._token
        status, retry_after, body = self._exchange("PUT", TOKEN_PATH,
                                                   {TTL_HEADER: str(self.token_ttl)})
        if status != 200:
            raise self._failure(TOKEN_PATH, status, retry_after)
        try:
            token = body.decode("ascii").strip()
        except UnicodeDecodeError as exc:
            raise ImdsError("IMDS issued a token that is not ASCII", path=TOKEN_PATH) from exc
        if not token or not token.isprintable() or " " in token:
            # (a header value with control characters would make http.client raise an error
            # that quotes the value: refuse it here, without echoing it)
            raise ImdsError("IMDS issued a malformed token", path=TOKEN_PATH)
        self._token = token
        self._token_renew_at = now + self.token_ttl - self._margin
        log.debug("imds_token_issued", ttl_s=self.token_ttl)
        return token

    def _failure(self, path: str, status: int, retry_after: str | None) -> Exception:
        """The exception for a non-success answer: transient ones are retried by the caller."""
        if status == 403:
            log.error("imds_disabled", path=path, status=status)
            return ImdsDisabledError(
                "instance metadata service is disabled or forbidden for this instance "
                "(HTTP 403); enable it (http-endpoint=enabled) or check the hop limit",
                path=path, status=status)
        if status >= 500 or status == 429:
            wait = _parse_retry_after(retry_after) if status in (429, 503) else None
            return _Transient(f"http {status}", retry_after=wait)
        if status == 401:
            return ImdsError("IMDS rejected the token", path=path, status=status)
        return ImdsError("unexpected answer from IMDS", path=path, status=status)

    def _exchange(self, method: str, path: str,
                  headers: dict[str, str]) -> tuple[int, str | None, bytes]:
        """One HTTP request on the persistent connection: (status, Retry-After, body)."""
        reused = self._conn is not None
        conn = self._conn
        if conn is None:
            conn = self._conn = http.client.HTTPConnection(self._host, self._port,
                                                           timeout=self.timeout)
        self.request_count += 1
        try:
            conn.request(method, self._base + path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._close()
            if reused and isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                # The server closed an idle keep-alive connection: resend at once on a new one.
                return self._exchange(method, path, headers)
            reason = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
            raise _Transient(reason, cause=exc) from exc
        return resp.status, resp.getheader("Retry-After"), body

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP-date); None when absent/bad."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)
