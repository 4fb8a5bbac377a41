"""IMDS emulator: a loopback HTTP server with real IMDSv2 semantics, for tests, bench and demo.

Paths and payloads follow amazon-ec2-metadata-mock: tokens from `PUT /latest/api/token` with a
TTL of 1..21600 s that is enforced, 401 without a valid token (when `require_v2`), 404 for what
does not exist (no notice yet, no user data, tags in metadata off), JSON shaped like AWS's.
Several instances share one server: `/latest/...` serves the first one added,
`/<instance-id>/latest/...` any of them. Interruption notices and faults are set from Python
(`fire_spot_action`, `inject_fault`, ...) or over HTTP under `/_control/` for a process that
cannot share memory with the emulator (a systemd container on loopback).

Run `python -m spotagent.testbed.imds --port 8111 --instance i-0123 --az us-east-1a` to keep
one in the foreground.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import unquote, urlsplit

MAX_TTL = 21600
TOKEN_PATH = "latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
REQUEST_LOG_MAX = 200_000  # per instance, so a long-running emulator stays small
RAW_PATHS = {"spot": "meta-data/spot/instance-action",
             "rebalance": "meta-data/events/recommendations/rebalance",
             "scheduled": "meta-data/events/maintenance/scheduled"}
FAULT_KINDS = frozenset({"status", "slow", "drop", "expire_tokens", "forbidden"})
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def iso_time(when: datetime) -> str:
    """The spot/rebalance time format: 2017-09-18T08:22:00Z."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_time(when: datetime) -> str:
    """The scheduled-events time format: 21 Jan 2019 09:00:43 GMT (day not zero-padded)."""
    w = when.astimezone(UTC)
    return f"{w.day} {_MONTHS[w.month - 1]} {w.year} {w:%H:%M:%S} GMT"


def _now() -> datetime:
    return datetime.now(UTC)


def _region_of(zone: str) -> str:
    m = re.fullmatch(r"(.*\d)[a-z]+", zone)
    return m.group(1) if m else zone


@dataclass
class _Instance:
    instance_id: str
    availability_zone: str
    region: str
    instance_type: str
    life_cycle: str
    ami_id: str
    user_data: bytes | None
    tags: dict[str, str] | None
    launched: datetime = field(default_factory=_now)
    spot_action: dict[str, str] | None = None
    rebalance: dict[str, str] | None = None
    scheduled: list[dict[str, str]] = field(default_factory=list)
    tokens: dict[str, float] = field(default_factory=dict)  # token -> monotonic expiry
    requests: deque[tuple[str, str, float]] = field(
        default_factory=lambda: deque(maxlen=REQUEST_LOG_MAX))

    def documents(self) -> dict[str, bytes]:
        """Every leaf path under latest/ that exists now, with its body."""
        doc = {
            "accountId": "123456789012", "architecture": "x86_64",
            "availabilityZone": self.availability_zone, "billingProducts": None,
            "devpayProductCodes": None, "marketplaceProductCodes": None,
            "imageId": self.ami_id, "instanceId": self.instance_id,
            "instanceType": self.instance_type, "kernelId": None, "ramdiskId": None,
            "pendingTime": iso_time(self.launched), "privateIp": "10.0.0.10",
            "region": self.region, "version": "2017-09-30",
        }
        d: dict[str, bytes] = {
            "meta-data/ami-id": self.ami_id.encode(),
            "meta-data/instance-id": self.instance_id.encode(),
            "meta-data/instance-type": self.instance_type.encode(),
            "meta-data/instance-life-cycle": self.life_cycle.encode(),
            "meta-data/placement/availability-zone": self.availability_zone.encode(),
            "meta-data/placement/region": self.region.encode(),
            "meta-data/events/maintenance/scheduled": json.dumps(self.scheduled,
                                                                 indent=2).encode(),
            "dynamic/instance-identity/document": json.dumps(doc, indent=2).encode(),
        }
        if self.spot_action is not None:
            d["meta-data/spot/instance-action"] = json.dumps(self.spot_action).encode()
            if self.spot_action["action"] == "terminate":
                d["meta-data/spot/termination-time"] = self.spot_action["time"].encode()
        if self.rebalance is not None:
            d["meta-data/events/recommendations/rebalance"] = json.dumps(self.rebalance).encode()
        if self.user_data is not None:
            d["user-data"] = self.user_data
        if self.tags is not None:
            d["meta-data/tags/instance"] = "\n".join(self.tags).encode()
            for k, v in self.tags.items():
                d[f"meta-data/tags/instance/{k}"] = v.encode()
        return d


@dataclass
class _Fault:
    instance_id: str | None
    kind: str
    remaining: int
    delay: float
    status: int
    path: str | None

    def matches(self, instance_id: str, rel: str) -> bool:
        return (self.instance_id in (None, instance_id)
                and (self.path is None or self.path in rel))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, addr: tuple[str, int], emulator: ImdsEmulator) -> None:
        self.emulator = emulator
        self.open_sockets: set[socket.socket] = set()
        self.sockets_lock = threading.Lock()
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.sockets_lock:
            self.open_sockets.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.sockets_lock:
            self.open_sockets.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up on a slow answer is expected here: stay quiet.
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120  # an idle keep-alive connection is closed after this
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall
    server: _Server

    def do_GET(self) -> None:
        self.server.emulator._handle(self, "GET")

    def do_PUT(self) -> None:
        self.server.emulator._handle(self, "PUT")

    def do_POST(self) -> None:
        self.server.emulator._handle(self, "POST")

    def do_DELETE(self) -> None:
        self.server.emulator._handle(self, "DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, body: bytes = b"", *, content_type: str = "text/plain",
              headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Server", "EC2ws")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class ImdsEmulator:
    """The emulator. Bound at construction; `start()` serves in a background thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 require_v2: bool = True) -> None:
        self.require_v2 = require_v2
        self._lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}
        self._faults: list[_Fault] = []
        self._raw: dict[tuple[str, str], bytes] = {}  # (instance, path) -> verbatim body
        self._server = _Server((host, port), self)
        self._thread: threading.Thread | None = None
        bound_host, bound_port = self._server.server_address[:2]
        self.host = str(bound_host)
        self.port = int(bound_port)
        self.url = f"http://{self.host}:{self.port}"

    # -- life ------------------------------------------------------------------------------

    def start(self) -> ImdsEmulator:
        if self._thread is None:
            self._thread = threading.Thread(target=self._server.serve_forever,
                                            kwargs={"poll_interval": 0.1},
                                            name="imds-emulator", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        with self._server.sockets_lock:
            open_now = list(self._server.open_sockets)
        for sock in open_now:  # kept-alive client connections: end them so no thread lingers
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._server.server_close()

    def __enter__(self) -> ImdsEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- instances -------------------------------------------------------------------------

    def add_instance(self, instance_id: str, *, availability_zone: str,
                     region: str | None = None, instance_type: str = "g5.xlarge",
                     life_cycle: str = "spot", user_data: bytes | None = None,
                     tags: Mapping[str, str] | None = None,
                     ami_id: str = "ami-00000000000000000") -> str:
        """Add an instance; return its base URL (`{url}/{instance_id}`)."""
        if not re.fullmatch(r"[A-Za-z0-9-]+", instance_id) or instance_id in ("latest",
                                                                              "_control"):
            raise ValueError(f"bad instance id {instance_id!r}")
        inst = _Instance(instance_id, availability_zone, region or _region_of(availability_zone),
                         instance_type, life_cycle, ami_id, user_data,
                         dict(tags) if tags is not None else None)
        with self._lock:
            if instance_id in self._instances:
                raise ValueError(f"instance {instance_id} already exists")
            self._instances[instance_id] = inst
        return f"{self.url}/{instance_id}"

    def instance_url(self, instance_id: str) -> str:
        self._get(instance_id)
        return f"{self.url}/{instance_id}"

    def set_tags(self, instance_id: str, tags: Mapping[str, str] | None) -> None:
        """Replace the tags; None turns tags in instance metadata off (404)."""
        with self._lock:
            self._get(instance_id).tags = dict(tags) if tags is not None else None

    def set_user_data(self, instance_id: str, user_data: bytes | None) -> None:
        with self._lock:
            self._get(instance_id).user_data = user_data

    # -- notices ---------------------------------------------------------------------------

    def fire_spot_action(self, instance_id: str, action: str = "terminate",
                         at: datetime | None = None) -> None:
        """Publish an instance-action notice (default time: two minutes from now)."""
        when = at if at is not None else _now() + timedelta(seconds=120)
        with self._lock:
            self._get(instance_id).spot_action = {"action": action, "time": iso_time(when)}

    def fire_rebalance(self, instance_id: str, notice_time: datetime | None = None) -> None:
        when = notice_time if notice_time is not None else _now()
        with self._lock:
            self._get(instance_id).rebalance = {"noticeTime": iso_time(when)}

    def add_scheduled_event(self, instance_id: str, code: str = "system-reboot", *,
                            not_before: datetime | None = None,
                            not_after: datetime | None = None, state: str = "active",
                            event_id: str | None = None,
                            description: str = "scheduled reboot") -> str:
        """Add (or replace, same event_id) a scheduled event; return its EventId."""
        nb = not_before if not_before is not None else _now() + timedelta(days=1)
        na = not_after if not_after is not None else nb + timedelta(days=6)
        eid = event_id or "instance-event-" + secrets.token_hex(9)[:17]
        if state.lower() in ("completed", "canceled") and not description.startswith("["):
            description = f"[{state.capitalize()}] {description}"
        event = {
            "Code": code, "Description": description, "EventId": eid,
            "NotAfter": event_time(na), "NotBefore": event_time(nb),
            "NotBeforeDeadline": event_time(nb + timedelta(days=9)), "State": state,
        }
        with self._lock:
            inst = self._get(instance_id)
            inst.scheduled = [e for e in inst.scheduled if e["EventId"] != eid] + [event]
        return eid

    def clear_events(self, instance_id: str) -> None:
        """Withdraw every notice of the instance (spot action, rebalance, scheduled events)."""
        with self._lock:
            inst = self._get(instance_id)
            inst.spot_action = None
            inst.rebalance = None
            inst.scheduled = []

    def set_raw(self, instance_id: str, source: str, body: str | None) -> None:
        """Serve `body` verbatim at a notice path ("spot", "rebalance" or "scheduled"), to
        test malformed answers; None restores the normal behaviour for that path."""
        with self._lock:
            self._get(instance_id)
            key = (instance_id, RAW_PATHS[source])
            if body is None:
                self._raw.pop(key, None)
            else:
                self._raw[key] = body.encode()

    # -- faults ----------------------------------------------------------------------------

    def inject_fault(self, instance_id: str | None, kind: str, *, count: int = 1,
                     delay: float = 0.0, status: int = 503, path: str | None = None) -> None:
        """Make the next `count` requests (to `instance_id`, or any with None; to paths
        containing `path` if given) misbehave:

        - "status": answer `status`; with `delay` > 0 a Retry-After of `delay` seconds;
        - "slow": sleep `delay` seconds, then answer normally;
        - "drop": close the connection without an answer;
        - "expire_tokens": every token issued so far is invalid at once (401); count ignored;
        - "forbidden": 403 from now on until `clear_faults`; count ignored.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r} (known: {sorted(FAULT_KINDS)})")
        with self._lock:
            targets = ([self._get(instance_id)] if instance_id is not None
                       else list(self._instances.values()))
            if kind == "expire_tokens":
                for inst in targets:
                    inst.tokens.clear()
                return
            self._faults.append(_Fault(instance_id, kind, max(count, 1), delay, status, path))

    def clear_faults(self, instance_id: str | None = None) -> None:
        with self._lock:
            self._faults = [f for f in self._faults
                            if instance_id is not None and f.instance_id != instance_id]

    # -- observation -----------------------------------------------------------------------

    def requests(self, instance_id: str | None = None) -> list[tuple[str, str, float]]:
        """(method, path, time.monotonic()) of each metadata request received, oldest first.
        Paths are relative to the instance ("/latest/meta-data/..."); control calls are not
        logged; the last REQUEST_LOG_MAX per instance are kept."""
        with self._lock:
            if instance_id is not None:
                return list(self._get(instance_id).requests)
            merged = [r for inst in self._instances.values() for r in inst.requests]
        return sorted(merged, key=lambda r: r[2])

    def issued_tokens(self, instance_id: str | None = None) -> list[str]:
        """Every token still valid (tests check that none leaks into logs)."""
        with self._lock:
            insts = ([self._get(instance_id)] if instance_id is not None
                     else list(self._instances.values()))
            return [t for inst in insts for t in inst.tokens]

    # -- HTTP ------------------------------------------------------------------------------

    def _get(self, instance_id: str) -> _Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise KeyError(f"no instance {instance_id!r} in the IMDS emulator") from None

    def _handle(self, h: _Handler, method: str) -> None:
        path = unquote(urlsplit(h.path).path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length > 0 else b""
        if path == "/_control" or path.startswith("/_control/"):
            self._control(h, method, path, body)
            return
        with self._lock:
            inst, rel = self._route(path)
            if inst is None:
                fault = None
            else:
                inst.requests.append((method, "/" + rel, time.monotonic()))
                fault = self._take_fault(inst.instance_id, rel)
        if inst is None:
            h.reply(404, b"Not Found")
            return
        if fault is not None:
            if fault.kind == "drop":
                h.close_connection = True
                return
            if fault.kind == "forbidden":
                h.reply(403, b"Forbidden")
                return
            if fault.kind == "status":
                extra = {"Retry-After": f"{fault.delay:g}"} if fault.delay > 0 else {}
                h.reply(fault.status, f"HTTP {fault.status}".encode(), headers=extra)
                return
            if fault.kind == "slow":
                time.sleep(fault.delay)
        if rel == TOKEN_PATH:
            self._token(h, method, inst)
            return
        if method != "GET":
            h.reply(405, b"Method Not Allowed", headers={"Allow": "GET"})
            return
        status, out, ctype = self._metadata(h, inst, rel)
        h.reply(status, out, content_type=ctype)

    def _route(self, path: str) -> tuple[_Instance | None, str]:
        segments = path.lstrip("/").split("/", 1)
        if segments[0] == "latest":
            first = next(iter(self._instances.values()), None)
            return first, path.lstrip("/")
        inst = self._instances.get(segments[0])
        rest = segments[1] if len(segments) > 1 else ""
        if inst is None or not (rest == "latest" or rest.startswith("latest/")):
            return None, ""
        return inst, rest

    def _take_fault(self, instance_id: str, rel: str) -> _Fault | None:
        matching = [f for f in self._faults if f.matches(instance_id, rel)]
        for f in matching:
            if f.kind == "forbidden":
                return f
        if not matching:
            return None
        f = matching[0]
        f.remaining -= 1
        if f.remaining <= 0:
            self._faults.remove(f)
        return f

    def _token(self, h: _Handler, method: str, inst: _Instance) -> None:
        if method != "PUT":
            h.reply(405, b"Method Not Allowed", headers={"Allow": "PUT"})
            return
        if h.headers.get("X-Forwarded-For") is not None:
            h.reply(400, b"Bad Request")  # IMDSv2 refuses token requests relayed by a proxy
            return
        raw = h.headers.get(TTL_HEADER)
        try:
            ttl = int(raw) if raw is not None else 0
        except ValueError:
            ttl = 0
        if not 1 <= ttl <= MAX_TTL:
            h.reply(400, b"Bad Request")
            return
        token = secrets.token_urlsafe(42)
        now = time.monotonic()
        with self._lock:
            inst.tokens = {t: exp for t, exp in inst.tokens.items() if exp > now}
            inst.tokens[token] = now + ttl
        h.reply(200, token.encode(), headers={TTL_HEADER: str(ttl)})

    def _metadata(self, h: _Handler, inst: _Instance, rel: str) -> tuple[int, bytes, str]:
        token = h.headers.get(TOKEN_HEADER)
        with self._lock:
            if token is not None or self.require_v2:
                expiry = inst.tokens.get(token or "")
                if expiry is None or expiry <= time.monotonic():
                    return 401, b"Unauthorized", "text/plain"
            docs = inst.documents()
            for (iid, p), raw in self._raw.items():
                if iid == inst.instance_id:
                    docs[p] = raw
        sub = rel[len("latest"):].strip("/")
        if sub in docs:
            ctype = "application/octet-stream" if sub == "user-data" else "text/plain"
            return 200, docs[sub], ctype
        prefix = sub + "/" if sub else ""
        children: dict[str, None] = {}
        for p in sorted(docs):
            if p.startswith(prefix):
                head, sep, _ = p[len(prefix):].partition("/")
                children[head + sep] = None
        if children:
            return 200, "\n".join(children).encode(), "text/plain"
        return 404, b"Not Found", "text/plain"

    # -- control API -----------------------------------------------------------------------

    def _control(self, h: _Handler, method: str, path: str, body: bytes) -> None:
        parts = path.strip("/").split("/")[1:]  # after "_control"
        try:
            raw_body = parts[-1:] == ["user-data"]  # the body is the user data itself
            data: Any = json.loads(body) if body.strip() and not raw_body else {}
            result = self._control_call(method, parts, data, body)
        except (KeyError, ValueError, TypeError) as exc:
            h.reply(400, json.dumps({"error": str(exc)}).encode(),
                    content_type="application/json")
            return
        h.reply(200, json.dumps(result).encode(), content_type="application/json")

    def _control_call(self, method: str, parts: Sequence[str], data: Any,
                      body: bytes) -> Any:
        if parts == ["instances"]:
            if method == "GET":
                with self._lock:
                    return {iid: f"{self.url}/{iid}" for iid in self._instances}
            return {"url": self.add_instance(
                data["instance_id"], availability_zone=data["availability_zone"],
                region=data.get("region"), instance_type=data.get("instance_type", "g5.xlarge"),
                life_cycle=data.get("life_cycle", "spot"),
                user_data=data["user_data"].encode() if data.get("user_data") is not None
                else None,
                tags=data.get("tags"), ami_id=data.get("ami_id", "ami-00000000000000000"))}
        if len(parts) != 2:
            raise ValueError("control paths are /_control/instances or "
                             "/_control/<instance-id|_all>/<action>")
        iid_raw, action = parts
        iid = None if iid_raw == "_all" else iid_raw
        if iid is None and action not in ("fault", "clear-faults", "requests"):
            raise ValueError(f"{action} needs an instance id")

        def when(key: str) -> datetime | None:
            raw = data.get(key)
            return datetime.fromisoformat(raw) if raw else None

        if action == "requests":
            return [list(r) for r in self.requests(iid)]
        if method != "POST":
            raise ValueError(f"{action} takes POST")
        if action == "spot-action":
            self.fire_spot_action(str(iid), data.get("action", "terminate"), when("time"))
        elif action == "rebalance":
            self.fire_rebalance(str(iid), when("noticeTime"))
        elif action == "scheduled":
            eid = self.add_scheduled_event(
                str(iid), data.get("code", "system-reboot"), not_before=when("not_before"),
                not_after=when("not_after"), state=data.get("state", "active"),
                event_id=data.get("event_id"),
                description=data.get("description", "scheduled reboot"))
            return {"event_id": eid}
        elif action == "clear":
            self.clear_events(str(iid))
        elif action == "fault":
            self.inject_fault(iid, data["kind"], count=int(data.get("count", 1)),
                              delay=float(data.get("delay", 0.0)),
                              status=int(data.get("status", 503)), path=data.get("path"))
        elif action == "clear-faults":
            self.clear_faults(iid)
        elif action == "tags":
            self.set_tags(str(iid), data)
        elif action == "user-data":
            self.set_user_data(str(iid), body)
        elif action == "raw":
            self.set_raw(str(iid), data["source"], data.get("body"))
        else:
            raise ValueError(f"unknown control action {action!r}")
        return {"ok": True}


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one instance in the foreground until SIGINT/SIGTERM; print the URL first."""
    p = argparse.ArgumentParser(prog="python -m spotagent.testbed.imds",
                                description="IMDSv2 emulator (loopback)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--instance", default="i-0123456789abcdef0")
    p.add_argument("--az", default="us-east-1a")
    p.add_argument("--region", default=None)
    p.add_argument("--instance-type", default="g5.xlarge")
    p.add_argument("--life-cycle", default="spot", choices=("spot", "on-demand"))
    p.add_argument("--user-data-file", default=None)
    p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--allow-v1", action="store_true", help="serve GETs without a token")
    args = p.parse_args(argv)
    user_data = None
    if args.user_data_file:
        with open(args.user_data_file, "rb") as f:
            user_data = f.read()
    tags = dict(t.split("=", 1) for t in args.tag) if args.tag else None
    stop = threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with ImdsEmulator(args.host, args.port, require_v2=not args.allow_v1) as emu:
        emu.add_instance(args.instance, availability_zone=args.az, region=args.region,
                         instance_type=args.instance_type, life_cycle=args.life_cycle,
                         user_data=user_data, tags=tags)
        sys.stdout.write(emu.url + "\n")
        sys.stdout.flush()
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
