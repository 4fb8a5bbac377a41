"""sd_notify: tell systemd we are ready, what we are doing, that we are alive, that we stop.

The protocol is one datagram of newline-separated KEY=VALUE lines to the AF_UNIX socket named
by $NOTIFY_SOCKET (a leading "@" means the abstract namespace). Without $NOTIFY_SOCKET (not
under systemd, or not Type=notify) every call is a no-op returning False. A failed send is
logged and returns False: losing a status line must never stop the agent (a missed WATCHDOG=1
is what systemd itself acts on).
"""

from __future__ import annotations

import os
import re
import socket

from spotagent.log import get_logger

log = get_logger("systemd")

_KEY = re.compile(r"[A-Z][A-Z0-9_]*")


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return None
    if addr.startswith("@"):
        return "\0" + addr[1:]
    if addr.startswith("/"):
        return addr
    log.warning("sd_notify_unsupported_socket", notify_socket=addr)
    return None


def notify(**fields: str | int) -> bool:
    """Send KEY=VALUE fields in one datagram, e.g. notify(READY=1, STATUS="training").

    Returns True when the datagram was sent.
    """
    addr = _address()
    if addr is None:
        return False
    lines = []
    for key, value in fields.items():
        if not _KEY.fullmatch(key):
            raise ValueError(f"sd_notify field name {key!r} is not an upper-case identifier")
        text = str(int(value)) if isinstance(value, bool) else str(value)
        lines.append(f"{key}={' '.join(text.splitlines())}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(addr)
            sock.sendall("\n".join(lines).encode())
        except OSError as exc:
            log.warning("sd_notify_failed", fields=",".join(fields), error=str(exc))
            return False
    return True


def ready(status: str | None = None) -> bool:
    return notify(READY=1, STATUS=status) if status is not None else notify(READY=1)


def status(text: str) -> bool:
    return notify(STATUS=text)


def watchdog() -> bool:
    return notify(WATCHDOG=1)


def stopping(status: str | None = None) -> bool:
    return notify(STOPPING=1, STATUS=status) if status is not None else notify(STOPPING=1)


def extend_timeout(usec: int) -> bool:
    """Ask for `usec` more microseconds for the current start-up or stop (systemd >= 236)."""
    return notify(EXTEND_TIMEOUT_USEC=int(usec))


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when systemd expects
    none from this process (unset, malformed, or WATCHDOG_PID names another process)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2 / 1_000_000
