"""sd_notify over a real AF_UNIX datagram socket (a path and an abstract name).

Loopback tier: a real socket in this one test process; each receive is bounded by the
socket's timeout."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from wanswarm.node.service.sdnotify import notifier_from_env


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield sock, str(path)


def test_no_notify_socket_means_no_notifier() -> None:
    assert notifier_from_env({}) is None
    assert notifier_from_env({"NOTIFY_SOCKET": "vsock:2:1234"}) is None


def test_ready_status_watchdog_stopping(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = notifier_from_env({"NOTIFY_SOCKET": path})
    assert notifier is not None and notifier.watchdog_interval is None
    assert notifier.ready("online: 2 peers")
    assert sock.recv(4096).decode().split("\n") == [
        "READY=1", "STATUS=online: 2 peers", f"MAINPID={os.getpid()}"
    ]
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.status("draining")
    assert sock.recv(4096) == b"STATUS=draining"
    assert notifier.stopping("draining")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"


def test_abstract_socket() -> None:
    name = f"wanswarm-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        notifier = notifier_from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier is not None
        assert notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_watchdog_interval_is_half_of_watchdog_usec(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"}
    assert notifier_from_env(env).watchdog_interval == 15.0  # type: ignore[union-attr]
    assert notifier_from_env({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 15.0  # type: ignore[union-attr]
    assert notifier_from_env({**env, "WATCHDOG_PID": "1"}).watchdog_interval is None  # type: ignore[union-attr]
    assert notifier_from_env({**env, "WATCHDOG_USEC": "junk"}).watchdog_interval is None  # type: ignore[union-attr]


def test_a_dead_socket_is_reported_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = notifier_from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert notifier is not None
    assert notifier.ready("x") is False
    assert "sd_notify" in caplog.text
