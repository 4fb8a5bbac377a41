"""sd_notify over a real AF_UNIX datagram socket, by path and in the abstract namespace."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotagent import systemd


def _recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


@pytest.fixture
def path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    addr = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(addr))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(addr))
        yield sock


@pytest.fixture
def abstract_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    name = f"spotagent-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        yield sock


def test_ready_with_status_is_one_datagram(path_socket: socket.socket) -> None:
    assert systemd.ready("waiting for a volume")
    assert _recv(path_socket) == "READY=1\nSTATUS=waiting for a volume"


def test_every_message_reaches_a_path_socket(path_socket: socket.socket) -> None:
    assert systemd.ready()
    assert systemd.status("training step 10")
    assert systemd.watchdog()
    assert systemd.extend_timeout(30_000_000)
    assert systemd.stopping("draining")
    assert [_recv(path_socket) for _ in range(5)] == [
        "READY=1",
        "STATUS=training step 10",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=30000000",
        "STOPPING=1\nSTATUS=draining",
    ]


def test_abstract_namespace_socket(abstract_socket: socket.socket) -> None:
    assert systemd.watchdog()
    assert systemd.notify(STATUS="two\nlines", READY=True)
    assert _recv(abstract_socket) == "WATCHDOG=1"
    # a newline in a value would start a new field: it becomes a space
    assert _recv(abstract_socket) == "STATUS=two lines\nREADY=1"


def test_no_notify_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.ready("x") is False
    assert systemd.watchdog() is False


def test_vanished_socket_returns_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert systemd.status("nobody listens") is False


def test_bad_field_name_is_refused(path_socket: socket.socket) -> None:
    with pytest.raises(ValueError, match="upper-case"):
        systemd.notify(status="lower")


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0


def test_watchdog_interval_for_another_pid_or_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "soon")
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert systemd.watchdog_interval() is None
