"""Strict EC2 emulator: moto's EC2 over real HTTP, plus the volume rules moto 5.2.5 lacks.

moto's WSGI application runs in-process behind a small WSGI layer. Every request is served
under one lock (moto has none), so the checks below and moto's state change are atomic:

- AttachVolume: `VolumeInUse` for a volume with an attachment (attaching, attached or
  detaching); `IncorrectState` for a volume that is not available (a `creating` fault) or an
  instance that is neither running nor stopped (AWS attaches to stopped instances);
  `InvalidVolume.ZoneMismatch` across zones; `InvalidParameterValue` for a device name in use.
- DetachVolume: `IncorrectState` for an available volume; `InvalidAttachment.NotFound` for
  the wrong instance or device.
- TerminateInstances detaches only the volumes attached to that instance.
- RegisterImage keeps the block device mappings it was given (moto drops them), so
  DescribeImages shows the root snapshot.
- Attach and detach go through `attaching` / `detaching` for `attach_delay` / `detach_delay`
  seconds; faults (`stick`, `set_instance_state`) hold volumes and instances in a state.

With a `DevicePlane`, loop devices follow the attachments: a completed attach gets a device,
a detach removes it at its start (a device still mounted keeps the volume `detaching`, as a
busy device does on AWS), and created volumes and snapshots get image files.

moto's state is global to the process: one StrictEc2Server runs per process at a time, and
`start()` wipes moto's state.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl
from xml.sax.saxutils import escape

import boto3
from botocore.config import Config
from moto.backends import get_backend
from moto.core.models import DEFAULT_ACCOUNT_ID
from moto.ec2.exceptions import EC2ClientError
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.serving import BaseWSGIServer, make_server

from spotagent.errors import SpotagentError, SubprocessError
from spotagent.log import configure, get_logger
from spotagent.testbed.devices import DeviceBusyError, DevicePlane, DevicePlaneError

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

log = get_logger("testbed.ec2")

EC2_API_VERSION = "2016-11-15"
EC2_XMLNS = f"http://ec2.amazonaws.com/doc/{EC2_API_VERSION}/"
CONTROL_PREFIX = "/_spotagent/"
DUMMY_CREDENTIALS = ("testing", "testing")  # access key id, secret: moto accepts any
STICK_STATES = ("attaching", "detaching", "creating")
# AWS attaches to running and stopped instances; every other state is IncorrectState.
ATTACHABLE_INSTANCE_STATES = ("running", "stopped")
FAULT_INSTANCE_STATES = {"pending": 0, "running": 16, "shutting-down": 32, "stopping": 64,
                         "stopped": 80}
BUSY_RETRY_SECONDS = 0.2

_CREDENTIAL_RE = re.compile(r"Credential=([^/,\s]+)/\d{8}/([^/]+)/([^/]+)/aws4_request")
_ACTIVE_LOCK = threading.Lock()
_active: StrictEc2Server | None = None

Environ = dict[str, Any]
StartResponse = Callable[..., Any]


class Ec2EmulatorError(SpotagentError):
    """The emulator was misused (second server in one process, unknown fault state...)."""


@dataclass
class _Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True)
class _Call:
    action: str
    params: dict[str, str]
    account: str
    region: str
    environ: Environ


@dataclass
class _Transition:
    """An attachment on its way to `attached` or to gone; moto already holds the attachment."""

    kind: str  # "attaching" | "detaching"
    volume_id: str
    instance_id: str
    device: str
    backend: Any
    volume: Any
    attachment: Any
    due: float
    force: bool = False
    device_released: bool = False
    busy: bool = False
    retry_at: float = 0.0


@dataclass
class _ImageMapping:
    device_name: str
    fields: dict[str, str] = field(default_factory=dict)


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _find_text(root: ET.Element, name: str) -> str | None:
    for element in root.iter():
        if _local(element.tag) == name:
            return element.text
    return None


def _child(parent: ET.Element, name: str) -> ET.Element | None:
    for element in parent:
        if _local(element.tag) == name:
            return element
    return None


def _namespace(root: ET.Element) -> str:
    return root.tag[1:].split("}", 1)[0] if root.tag.startswith("{") else ""


def _error(code: str, message: str, status: int = 400) -> _Reply:
    """An EC2 error as botocore's EC2 parser reads it (Response/Errors/Error, RequestID)."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Response><Errors><Error><Code>{escape(code)}</Code>"
        f"<Message>{escape(message)}</Message></Error></Errors>"
        f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
    )
    return _Reply(status, [("Content-Type", "text/xml")], body.encode())


def _xml_reply(root: ET.Element) -> bytes:
    ns = _namespace(root)
    text = ET.tostring(root, encoding="unicode", default_namespace=ns or None)
    return ('<?xml version="1.0" encoding="UTF-8"?>\n' + text).encode()


def _iso(moment: Any) -> str:
    return str(moment.strftime("%Y-%m-%dT%H:%M:%S.000Z"))


def _parse_mappings(params: dict[str, str]) -> list[_ImageMapping]:
    """RegisterImage's BlockDeviceMapping.N.* parameters, in N order."""
    by_index: dict[int, dict[str, str]] = {}
    for key, value in params.items():
        parts = key.split(".", 2)
        if len(parts) == 3 and parts[0] == "BlockDeviceMapping" and parts[1].isdigit():
            by_index.setdefault(int(parts[1]), {})[parts[2]] = value
    mappings = []
    for index in sorted(by_index):
        entry = by_index[index]
        name = entry.pop("DeviceName", "")
        mappings.append(_ImageMapping(name, entry))
    return mappings


class _QuietHandler(MotoRequestHandler):
    """moto's request handler without a line per request; server errors still get logged."""

    def log(self, type: str, message: str, *args: Any) -> None:
        if type != "info":
            log.warning("ec2_http_error", kind=type, line=(message % args) if args else message)


class StrictEc2Server:
    """moto's EC2 over HTTP on `host:port` with AWS's volume rules; see the module docstring."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        region: str = "us-east-1",
        attach_delay: float = 0.0,
        detach_delay: float = 0.0,
        device_plane: DevicePlane | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.region = region
        self.device_plane = device_plane
        self._attach_delay = 0.0
        self._detach_delay = 0.0
        self.set_delays(attach_delay, detach_delay)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._moto = DomainDispatcherApplication(create_backend_app)
        self._server: BaseWSGIServer | None = None
        self._session_lock = threading.Lock()
        self._sessions: dict[str, boto3.session.Session] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._pending: dict[str, _Transition] = {}
        self._stuck: dict[str, str] = {}
        self._image_mappings: dict[tuple[str, str, str], list[_ImageMapping]] = {}
        self._handlers: dict[str, Callable[[_Call], _Reply]] = {
            "AttachVolume": self._attach_volume,
            "DetachVolume": self._detach_volume,
            "TerminateInstances": self._terminate_instances,
            "CreateVolume": self._create_volume,
            "CreateSnapshot": self._create_snapshot,
            "DescribeVolumes": self._describe_volumes,
            "RegisterImage": self._register_image,
            "DescribeImages": self._describe_images,
        }
        self.errors: list[str] = []
        """Failures inside the emulator (device plane, crashes); tests assert it stays empty."""

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> StrictEc2Server:
        """Wipe moto's state, bind, and serve in background threads."""
        global _active
        with _ACTIVE_LOCK:
            if _active is not None:
                raise Ec2EmulatorError(
                    "another StrictEc2Server runs in this process (moto state is global)",
                    endpoint=_active.endpoint_url,
                )
            _active = self
        started = False
        try:
            self.reset()
            self._stopping = False
            server = make_server(self.host, self.port, self._wsgi, threaded=True,
                                 request_handler=_QuietHandler)
            self._server = server
            self.port = server.server_port
            self._threads = [
                threading.Thread(target=server.serve_forever, name="ec2-http", daemon=True),
                threading.Thread(target=self._worker, name="ec2-transitions", daemon=True),
            ]
            for thread in self._threads:
                thread.start()
            started = True
        finally:
            if not started:
                with _ACTIVE_LOCK:
                    _active = None
        log.info("ec2_emulator_started", endpoint=self.endpoint_url, region=self.region)
        return self

    def stop(self) -> None:
        """Stop serving and drop pending transitions; the device plane stays the caller's."""
        global _active
        with self._cond:
            self._stopping = True
            self._pending.clear()
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []
        self._server = None
        with _ACTIVE_LOCK:
            if _active is self:
                _active = None
        log.info("ec2_emulator_stopped")

    def __enter__(self) -> StrictEc2Server:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def endpoint_url(self) -> str:
        if self._server is None:
            raise Ec2EmulatorError("StrictEc2Server is not started")
        return f"http://{self.host}:{self.port}"

    def client(self, region: str | None = None) -> EC2Client:
        """A new boto3 EC2 client for this server: dummy credentials, bounded retries, timeouts.

        Clients share one boto3 session per region (loading the EC2 model once makes a
        client cost milliseconds instead of a quarter second); each client is independent.
        """
        region = region or self.region
        config = Config(retries={"mode": "standard", "max_attempts": 3},
                        connect_timeout=5, read_timeout=60, max_pool_connections=32)
        with self._session_lock:  # boto3 sessions are not thread-safe
            session = self._sessions.get(region)
            if session is None:
                session = boto3.session.Session(
                    aws_access_key_id=DUMMY_CREDENTIALS[0],
                    aws_secret_access_key=DUMMY_CREDENTIALS[1], region_name=region)
                self._sessions[region] = session
            return session.client("ec2", endpoint_url=self.endpoint_url, config=config)

    # -- faults and knobs ------------------------------------------------------------------

    def set_delays(self, attach: float, detach: float) -> None:
        """Seconds future attaches spend `attaching` and detaches spend `detaching`."""
        if attach < 0 or detach < 0:
            raise Ec2EmulatorError("delays must be >= 0", attach=attach, detach=detach)
        self._attach_delay = float(attach)
        self._detach_delay = float(detach)

    def stick(self, volume_id: str, state: str = "attaching") -> None:
        """Hold `volume_id` in `state` until `unstick`.

        `attaching` / `detaching`: the volume's current or next attach / detach does not
        complete. `creating`: DescribeVolumes shows the volume `creating` and AttachVolume
        answers IncorrectState.
        """
        if state not in STICK_STATES:
            raise Ec2EmulatorError("cannot stick a volume in that state", volume_id=volume_id,
                                   state=state, allowed="|".join(STICK_STATES))
        with self._cond:
            self._stuck[volume_id] = state
        log.info("ec2_fault_stick", volume_id=volume_id, state=state)

    def unstick(self, volume_id: str) -> None:
        """Let a stuck volume move on (an overdue transition completes now)."""
        with self._cond:
            self._stuck.pop(volume_id, None)
            self._advance()
            self._cond.notify_all()
        log.info("ec2_fault_unstick", volume_id=volume_id)

    def set_instance_state(self, instance_id: str, state: str, *,
                           region: str | None = None) -> None:
        """Put an instance in `state` (pending, stopping, ...) as if AWS were slow to move it."""
        if state not in FAULT_INSTANCE_STATES:
            raise Ec2EmulatorError("cannot set that instance state", instance_id=instance_id,
                                   state=state, allowed="|".join(FAULT_INSTANCE_STATES))
        with self._cond:
            backend = self._backend(self._default_account(), region or self.region)
            instance = self._instance(backend, instance_id)
            if instance is None:
                raise Ec2EmulatorError("no such instance", instance_id=instance_id)
            instance._state.name = state
            instance._state.code = FAULT_INSTANCE_STATES[state]
        log.info("ec2_fault_instance_state", instance_id=instance_id, state=state)

    def reset(self) -> None:
        """Wipe moto's state, pending transitions, faults and the device plane's devices."""
        from moto.moto_api._internal.models import moto_api_backend

        with self._cond:
            self._pending.clear()
            self._stuck.clear()
            self._image_mappings.clear()
            if self.device_plane is not None:
                self.device_plane.close()
            moto_api_backend.reset()
        log.info("ec2_emulator_reset")

    # -- WSGI -------------------------------------------------------------------------------

    def _wsgi(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        try:
            reply = self._handle(environ)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            log.error("ec2_emulator_crash", error=str(exc), exc_info=True)
            raise
        headers = [(k, v) for k, v in reply.headers if k.lower() != "content-length"]
        headers.append(("Content-Length", str(len(reply.body))))
        start_response(f"{reply.status} {HTTP_STATUS_CODES.get(reply.status, '')}", headers)
        return [reply.body]

    def _handle(self, environ: Environ) -> _Reply:
        path = environ.get("PATH_INFO", "")
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length > 0 else b""
        environ["wsgi.input"] = io.BytesIO(body)
        if path.startswith(CONTROL_PREFIX):
            return self._control(path[len(CONTROL_PREFIX):], body)
        if path == "/moto-api/reset" and environ.get("REQUEST_METHOD") == "POST":
            self.reset()
            return _Reply(200, [("Content-Type", "application/json")], b'{"status": "ok"}')
        call = self._parse(environ, body)
        with self._cond:
            handler = self._handlers.get(call.action) if call else None
            if call is None or handler is None:
                return self._forward(environ)
            return handler(call)

    def _parse(self, environ: Environ, body: bytes) -> _Call | None:
        """The EC2 Query API call in this request, or None for anything else."""
        match = _CREDENTIAL_RE.search(environ.get("HTTP_AUTHORIZATION", ""))
        params = dict(parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
        if environ.get("CONTENT_TYPE", "").startswith("application/x-www-form-urlencoded"):
            params.update(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
        service = match.group(3) if match else None
        if service != "ec2" and not (service is None
                                     and params.get("Version") == EC2_API_VERSION):
            return None
        action = params.get("Action")
        if not action:
            return None
        access_key = match.group(1) if match else "AKIAEXAMPLE"
        region = match.group(2) if match else self.region
        return _Call(action, params, self._account(environ, access_key), region, environ)

    def _account(self, environ: Environ, access_key: str) -> str:
        """The account moto files this request under (same order as moto's own lookup)."""
        if "MOTO_ACCOUNT_ID" in os.environ:
            return os.environ["MOTO_ACCOUNT_ID"]
        if environ.get("HTTP_X_MOTO_ACCOUNT_ID"):
            return str(environ["HTTP_X_MOTO_ACCOUNT_ID"])
        from moto.iam.models import get_account_id_from

        return str(get_account_id_from(access_key))

    def _default_account(self) -> str:
        return os.environ.get("MOTO_ACCOUNT_ID", DEFAULT_ACCOUNT_ID)

    def _forward(self, environ: Environ) -> _Reply:
        """Run the request through moto and collect its whole response (under the lock)."""
        captured: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> Callable[[bytes], object]:
            captured["status"] = status
            captured["headers"] = headers
            return lambda _data: None

        chunks = self._moto(environ, start_response)
        try:
            body = b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        return _Reply(int(str(captured["status"]).split()[0]), list(captured["headers"]), body)

    def _control(self, op: str, body: bytes) -> _Reply:
        """The emulator's own control API (JSON), for a test harness in another process."""
        try:
            args = json.loads(body or b"{}")
            if op == "stick":
                self.stick(args["volume_id"], args.get("state", "attaching"))
            elif op == "unstick":
                self.unstick(args["volume_id"])
            elif op == "delays":
                self.set_delays(float(args.get("attach", 0)), float(args.get("detach", 0)))
            elif op == "instance-state":
                self.set_instance_state(args["instance_id"], args["state"],
                                        region=args.get("region"))
            elif op == "register-instance":
                if self.device_plane is None:
                    raise Ec2EmulatorError("no device plane (start with --image-dir)")
                self.device_plane.register_instance(args["instance_id"], Path(args["by_id_dir"]))
            elif op == "reset":
                self.reset()
            else:
                raise Ec2EmulatorError("unknown control operation", op=op)
        except (ValueError, KeyError, TypeError, SpotagentError) as exc:
            return _Reply(400, [("Content-Type", "application/json")],
                          json.dumps({"error": str(exc)}).encode())
        return _Reply(200, [("Content-Type", "application/json")], b'{"ok": true}')

    # -- moto state --------------------------------------------------------------------------

    @staticmethod
    def _backend(account: str, region: str) -> Any:
        return get_backend("ec2")[account][region]

    @staticmethod
    def _instance(backend: Any, instance_id: str) -> Any | None:
        for instance in backend.all_instances():
            if instance.id == instance_id:
                return instance
        return None

    def _record(self, event: str, exc: BaseException, **context: str) -> None:
        self.errors.append(f"{event}: {exc}")
        log.error(event, error=str(exc), **context)

    # -- actions -------------------------------------------------------------------------------

    def _attach_volume(self, call: _Call) -> _Reply:
        volume_id = call.params.get("VolumeId", "")
        instance_id = call.params.get("InstanceId", "")
        device = call.params.get("Device", "")
        if _truthy(call.params.get("DryRun")):
            return self._forward(call.environ)
        backend = self._backend(call.account, call.region)
        volume = backend.volumes.get(volume_id)
        instance = self._instance(backend, instance_id)
        if volume is None or instance is None or not device:
            return self._forward(call.environ)  # moto's own NotFound / missing-parameter errors
        if self._stuck.get(volume_id) == "creating":
            return _error("IncorrectState", f"{volume_id} is not 'available'.")
        if volume.attachment is not None:
            if volume.multi_attach_enabled:
                return _error("UnsupportedOperation", "spotagent testbed: multi-attach volumes "
                              "are not emulated (moto keeps one attachment per volume)")
            return _error("VolumeInUse", f"{volume_id} is already attached to an instance")
        if instance.state not in ATTACHABLE_INSTANCE_STATES:
            return _error("IncorrectState", f"Instance '{instance_id}' is not 'running'.")
        if volume.availability_zone != instance.availability_zone:
            return _error("InvalidVolume.ZoneMismatch",
                          f"The volume '{volume_id}' is not in the same availability zone as "
                          f"instance '{instance_id}'")
        if device in instance.block_device_mapping:
            return _error("InvalidParameterValue", f"Attachment point {device} is already in use")
        reply = self._forward(call.environ)
        if not reply.ok:
            return reply
        attachment: Any = volume.attachment  # set by moto just now
        attachment.status = "attaching"
        self._pending[volume_id] = _Transition(
            "attaching", volume_id, instance_id, device, backend, volume, attachment,
            due=time.monotonic() + self._attach_delay)
        log.info("ec2_attach_started", volume_id=volume_id, instance_id=instance_id,
                 device=device)
        self._advance()
        self._cond.notify_all()
        return reply

    def _detach_volume(self, call: _Call) -> _Reply:
        volume_id = call.params.get("VolumeId", "")
        instance_id = call.params.get("InstanceId") or None
        device = call.params.get("Device") or None
        if _truthy(call.params.get("DryRun")):
            return self._forward(call.environ)
        backend = self._backend(call.account, call.region)
        volume = backend.volumes.get(volume_id)
        if volume is None or (instance_id and self._instance(backend, instance_id) is None):
            return self._forward(call.environ)  # moto's own NotFound errors, state untouched
        attachment = volume.attachment
        if attachment is None:
            return _error("IncorrectState", f"Volume '{volume_id}' is in the 'available' state.")
        if instance_id and attachment.instance.id != instance_id:
            return _error("InvalidAttachment.NotFound",
                          f"Volume {volume_id} can not be detached from {instance_id} because "
                          "it is not attached")
        if device and attachment.device != device:
            return _error("InvalidAttachment.NotFound",
                          f"The volume {volume_id} is not attached to instance "
                          f"{attachment.instance.id} as device {device}")
        force = _truthy(call.params.get("Force"))
        current = self._pending.get(volume_id)
        if current is not None and current.kind == "detaching":
            current.force = current.force or force  # a repeated (maybe forced) detach
            current.retry_at = 0.0
        else:
            transition = _Transition(
                "detaching", volume_id, attachment.instance.id, attachment.device, backend,
                volume, attachment, due=time.monotonic() + self._detach_delay, force=force)
            attachment.status = "detaching"
            self._pending[volume_id] = transition  # replaces an unfinished attach
            log.info("ec2_detach_started", volume_id=volume_id,
                     instance_id=attachment.instance.id, force=force)
            self._release_device(transition)
        self._advance()
        self._cond.notify_all()
        return self._detach_reply(volume_id, attachment)

    def _detach_reply(self, volume_id: str, attachment: Any) -> _Reply:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<DetachVolumeResponse xmlns="{EC2_XMLNS}">'
            f"<requestId>{uuid.uuid4()}</requestId>"
            f"<volumeId>{escape(volume_id)}</volumeId>"
            f"<instanceId>{escape(attachment.instance.id)}</instanceId>"
            f"<device>{escape(attachment.device)}</device>"
            "<status>detaching</status>"
            f"<attachTime>{_iso(attachment.attach_time)}</attachTime>"
            "</DetachVolumeResponse>"
        )
        return _Reply(200, [("Content-Type", "text/xml")], body.encode())

    def _terminate_instances(self, call: _Call) -> _Reply:
        if _truthy(call.params.get("DryRun")):
            return self._forward(call.environ)
        backend = self._backend(call.account, call.region)
        held: list[tuple[str, Any]] = []
        for key, instance_id in sorted(call.params.items()):
            if not key.startswith("InstanceId."):
                continue
            instance = self._instance(backend, instance_id)
            if instance is None:
                continue
            for device, mapping in list(instance.block_device_mapping.items()):
                volume = backend.volumes.get(mapping.volume_id)
                owner = volume.attachment.instance.id if volume and volume.attachment else None
                if owner != instance_id:
                    # moto would detach through this stale entry a volume another instance
                    # now holds (or fail on an available one): drop it first.
                    del instance.block_device_mapping[device]
                    log.warning("ec2_stale_mapping_dropped", instance_id=instance_id,
                                device=device, volume_id=mapping.volume_id)
            held.extend(
                (instance_id, volume) for volume in backend.volumes.values()
                if volume.attachment is not None and volume.attachment.instance.id == instance_id
            )
        reply = self._forward(call.environ)
        if not reply.ok:
            return reply
        for instance_id, volume in held:
            self._pending.pop(volume.id, None)
            if self.device_plane is not None:
                try:
                    self.device_plane.on_detach(instance_id, volume.id, force=True)
                except (DevicePlaneError, SubprocessError, OSError) as exc:
                    self._record("device_detach_failed", exc, volume_id=volume.id,
                                 instance_id=instance_id)
            log.info("ec2_terminate_detached", volume_id=volume.id, instance_id=instance_id)
        return reply

    def _create_volume(self, call: _Call) -> _Reply:
        reply = self._forward(call.environ)
        if not reply.ok or self.device_plane is None:
            return reply
        root = ET.fromstring(reply.body)
        volume_id = _find_text(root, "volumeId") or ""
        size = int(_find_text(root, "size") or 0)
        snapshot_id = call.params.get("SnapshotId") or None
        try:
            self.device_plane.on_create(volume_id, size, snapshot_id)
        except (DevicePlaneError, SubprocessError, OSError) as exc:
            self._record("device_create_failed", exc, volume_id=volume_id)
        return reply

    def _create_snapshot(self, call: _Call) -> _Reply:
        reply = self._forward(call.environ)
        if not reply.ok or self.device_plane is None:
            return reply
        snapshot_id = _find_text(ET.fromstring(reply.body), "snapshotId") or ""
        volume_id = call.params.get("VolumeId", "")
        try:
            self.device_plane.on_snapshot(snapshot_id, volume_id)
        except (DevicePlaneError, SubprocessError, OSError) as exc:
            self._record("device_snapshot_failed", exc, snapshot_id=snapshot_id)
        return reply

    def _describe_volumes(self, call: _Call) -> _Reply:
        reply = self._forward(call.environ)
        creating = {v for v, state in self._stuck.items() if state == "creating"}
        if not reply.ok or not creating:
            return reply
        root = ET.fromstring(reply.body)
        volume_set = _child(root, "volumeSet")
        for item in list(volume_set) if volume_set is not None else []:
            status = _child(item, "status")
            volume_id = _child(item, "volumeId")
            if volume_id is not None and volume_id.text in creating and status is not None:
                status.text = "creating"
        reply.body = _xml_reply(root)
        return reply

    def _register_image(self, call: _Call) -> _Reply:
        if _truthy(call.params.get("DryRun")):
            return self._forward(call.environ)
        backend = self._backend(call.account, call.region)
        mappings = _parse_mappings(call.params)
        for mapping in mappings:
            snapshot_id = mapping.fields.get("Ebs.SnapshotId")
            if snapshot_id and snapshot_id not in backend.snapshots:
                return _error("InvalidSnapshot.NotFound",
                              f"The snapshot '{snapshot_id}' does not exist.")
        reply = self._forward(call.environ)
        if not reply.ok or not mappings:
            return reply
        image_id = _find_text(ET.fromstring(reply.body), "imageId") or ""
        ami = backend.amis[image_id]
        root_name = call.params.get("RootDeviceName") or mappings[0].device_name
        for mapping in mappings:
            snapshot_id = mapping.fields.get("Ebs.SnapshotId")
            if snapshot_id and "Ebs.VolumeSize" not in mapping.fields:
                mapping.fields["Ebs.VolumeSize"] = str(backend.snapshots[snapshot_id].volume.size)
            if mapping.device_name == root_name and snapshot_id:
                # moto made its own 15 GiB snapshot and ignored ours: put ours in its place.
                backend.snapshots.pop(ami.ebs_snapshot.id, None)
                ami.ebs_snapshot = backend.snapshots[snapshot_id]
                ami.ebs_snapshot.from_ami = image_id
        ami.root_device_name = root_name
        ami.root_device_type = "ebs"
        for param, attr in (("Architecture", "architecture"),
                            ("VirtualizationType", "virtualization_type")):
            if call.params.get(param):
                setattr(ami, attr, call.params[param])
        self._image_mappings[(call.account, call.region, image_id)] = mappings
        return reply

    def _describe_images(self, call: _Call) -> _Reply:
        reply = self._forward(call.environ)
        if not reply.ok or not any(k[:2] == (call.account, call.region)
                                   for k in self._image_mappings):
            return reply
        root = ET.fromstring(reply.body)
        ns = _namespace(root)
        images = _child(root, "imagesSet")
        for item in list(images) if images is not None else []:
            image_id = _child(item, "imageId")
            key = (call.account, call.region, image_id.text or "" if image_id is not None else "")
            if key not in self._image_mappings:
                continue
            old = _child(item, "blockDeviceMapping")
            if old is not None:
                item.remove(old)
            item.insert(0, self._mapping_element(ns, self._image_mappings[key]))
        reply.body = _xml_reply(root)
        return reply

    @staticmethod
    def _mapping_element(ns: str, mappings: list[_ImageMapping]) -> ET.Element:
        def sub(parent: ET.Element, name: str, text: str | None = None) -> ET.Element:
            element = ET.SubElement(parent, f"{{{ns}}}{name}" if ns else name)
            element.text = text
            return element

        container = ET.Element(f"{{{ns}}}blockDeviceMapping" if ns else "blockDeviceMapping")
        for mapping in mappings:
            item = sub(container, "item")
            sub(item, "deviceName", mapping.device_name)
            if "VirtualName" in mapping.fields:
                sub(item, "virtualName", mapping.fields["VirtualName"])
            if "NoDevice" in mapping.fields:
                sub(item, "noDevice", "")
            ebs_fields = {k[4:]: v for k, v in mapping.fields.items() if k.startswith("Ebs.")}
            if not ebs_fields:
                continue
            ebs = sub(item, "ebs")
            ebs_fields.setdefault("DeleteOnTermination", "true")
            ebs_fields.setdefault("VolumeType", "gp2")
            ebs_fields.setdefault("Encrypted", "false")
            for name, value in ebs_fields.items():
                sub(ebs, name[0].lower() + name[1:], value)
        return container

    # -- transitions ----------------------------------------------------------------------------

    def _release_device(self, transition: _Transition) -> bool:
        """Take the volume's device away at the start of a detach; False while it is busy."""
        if self.device_plane is not None:
            try:
                self.device_plane.on_detach(transition.instance_id, transition.volume_id,
                                            force=transition.force)
            except DeviceBusyError as exc:
                if not transition.busy:
                    transition.busy = True
                    log.error("ec2_detach_busy", volume_id=transition.volume_id,
                              instance_id=transition.instance_id, error=str(exc))
                transition.retry_at = time.monotonic() + BUSY_RETRY_SECONDS
                return False
            except (DevicePlaneError, SubprocessError, OSError) as exc:
                self._record("device_detach_failed", exc, volume_id=transition.volume_id,
                             instance_id=transition.instance_id)
        if transition.busy:
            # The clock of the detach starts once the device let go, as on AWS.
            transition.due = time.monotonic() + self._detach_delay
        transition.device_released = True
        return True

    def _advance(self) -> None:
        """Complete every transition that is due and not held by a fault (lock held)."""
        now = time.monotonic()
        for volume_id, transition in list(self._pending.items()):
            if transition.volume.attachment is not transition.attachment:
                del self._pending[volume_id]  # the attachment went away (terminate, reset)
                continue
            if self._stuck.get(volume_id) == transition.kind:
                continue
            if (transition.kind == "detaching" and not transition.device_released
                    and (now < transition.retry_at or not self._release_device(transition))):
                continue
            if time.monotonic() < transition.due:
                continue
            del self._pending[volume_id]
            if transition.kind == "attaching":
                self._complete_attach(transition)
            else:
                self._complete_detach(transition)

    def _next_wake(self) -> float | None:
        times = [
            t.due if t.kind == "attaching" or t.device_released else t.retry_at
            for v, t in self._pending.items() if self._stuck.get(v) != t.kind
        ]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _complete_attach(self, transition: _Transition) -> None:
        plane = self.device_plane
        if plane is not None:
            try:
                if not plane.knows(transition.volume_id):
                    plane.on_create(transition.volume_id, transition.volume.size,
                                    transition.volume.snapshot_id)
                plane.on_attach(transition.instance_id, transition.volume_id)
            except (DevicePlaneError, SubprocessError, OSError) as exc:
                self._record("device_attach_failed", exc, volume_id=transition.volume_id,
                             instance_id=transition.instance_id)
        transition.attachment.status = "attached"
        log.info("ec2_attach_completed", volume_id=transition.volume_id,
                 instance_id=transition.instance_id)

    def _complete_detach(self, transition: _Transition) -> None:
        try:
            transition.backend.detach_volume(transition.volume_id, transition.instance_id,
                                             transition.device)
        except EC2ClientError as exc:  # moto disagrees with our bookkeeping: an emulator bug
            self._record("ec2_detach_complete_failed", exc, volume_id=transition.volume_id,
                         instance_id=transition.instance_id)
            return
        log.info("ec2_detach_completed", volume_id=transition.volume_id,
                 instance_id=transition.instance_id)

    def _worker(self) -> None:
        with self._cond:
            while not self._stopping:
                self._advance()
                self._cond.wait(self._next_wake())


_stop_requested = threading.Event()


def _request_stop(_signum: int, _frame: FrameType | None) -> None:
    _stop_requested.set()


def main(argv: list[str] | None = None) -> int:
    """`python -m spotagent.testbed.ec2`: serve in the foreground, print the endpoint."""
    parser = argparse.ArgumentParser(prog="python -m spotagent.testbed.ec2",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--image-dir", type=Path, default=None,
                        help="run a device plane with its image files here (needs root)")
    parser.add_argument("--attach-delay", type=float, default=0.0)
    parser.add_argument("--detach-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    configure()
    plane = DevicePlane(args.image_dir) if args.image_dir else None
    server = StrictEc2Server(args.host, args.port, region=args.region,
                             attach_delay=args.attach_delay, detach_delay=args.detach_delay,
                             device_plane=plane)
    signal.signal(signal.SIGINT, _request_stop)
    signal.signal(signal.SIGTERM, _request_stop)
    server.start()
    try:
        sys.stdout.write(server.endpoint_url + "\n")
        sys.stdout.flush()
        while not _stop_requested.wait(1.0):
            pass
    finally:
        server.stop()
        if plane is not None:
            plane.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
