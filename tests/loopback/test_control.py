"""The control socket: requests, answers, bad input, permissions, stale sockets, the client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from wanswarm.node.control import ControlClient, ControlConfig, ControlServer, LeaveAck
from wanswarm.node.errors import ControlProtocolError, DaemonNotRunning, StateDirError
from wanswarm.node.status import StatusReport, render_text

PEER = "12D3KooWPfgLbNkKzKggCYFjwxJqEseiFJ1V37Enkgs6TDrMjZLk"


class FakeDaemon:
    def __init__(self) -> None:
        self.leaves: list[str] = []
        self.broken = False

    def status(self) -> StatusReport:
        if self.broken:
            raise RuntimeError("status provider bug")
        return StatusReport(
            peer_id=PEER,
            run="demo",
            stage=None,
            state="online",
            server=True,
            trainer=True,
            pid=os.getpid(),
            version="0.1.0",
            uptime_s=1.0,
            dht_addrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"],
            quic_addr=None,
            peers=[],
        )

    def request_leave(self, reason: str) -> LeaveAck:
        self.leaves.append(reason)
        return LeaveAck(
            accepted=True,
            already_leaving=len(self.leaves) > 1,
            pid=os.getpid(),
            shutdown_timeout_s=30,
        )


def _short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="wsc-", dir="/tmp"))


def _serve(body: Callable[[ControlServer, FakeDaemon, Path], Awaitable[None]]) -> None:
    async def main() -> None:
        directory = _short_dir()
        path = directory / "control.sock"
        daemon = FakeDaemon()
        server = ControlServer(
            ControlConfig(request_timeout=2.0, max_request_bytes=1024), path, daemon
        )
        await server.start()
        task = asyncio.ensure_future(server.serve())
        try:
            await body(server, daemon, path)
        finally:
            task.cancel()
            await server.close()
            directory.rmdir()

    asyncio.run(main())


async def _raw(path: Path, payload: bytes) -> dict:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(payload)
    await writer.drain()
    async with asyncio.timeout(5):
        line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return json.loads(line)


def test_status_and_leave_through_the_client() -> None:
    async def body(server: ControlServer, daemon: FakeDaemon, path: Path) -> None:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        client = ControlClient(path, timeout=5)
        report = await asyncio.to_thread(client.status)
        assert report.peer_id == PEER and report.state == "online"
        assert PEER in render_text(report)
        ack = await asyncio.to_thread(client.leave)
        assert ack.accepted and not ack.already_leaving and daemon.leaves == ["control request"]
        assert (await asyncio.to_thread(client.leave)).already_leaving

    _serve(body)


def test_bad_requests_get_error_answers_and_the_server_lives_on() -> None:
    async def body(server: ControlServer, daemon: FakeDaemon, path: Path) -> None:
        cases = [
            (b"not json\n", "bad_request"),
            (b'{"v": 1, "op": "reboot"}\n', "bad_request"),
            (b'{"v": 1, "op": "status", "extra": 1}\n', "bad_request"),
            (b'{"v": 9, "op": "status"}\n', "unsupported_version"),
            (
                b'{"v": 1, "op": "status"' + b" " * 2000 + b"}\n",
                "bad_request",
            ),  # over max_request_bytes
            (b'["v", 1]\n', "bad_request"),
        ]
        for payload, code in cases:
            answer = await _raw(path, payload)
            assert answer["ok"] is False and answer["error"]["code"] == code, (payload, answer)
        daemon.broken = True
        answer = await _raw(path, b'{"v": 1, "op": "status"}\n')
        assert answer["error"]["code"] == "internal"
        with pytest.raises(ControlProtocolError, match="internal"):
            await asyncio.to_thread(ControlClient(path, timeout=5).status)
        daemon.broken = False
        # a client that connects and says nothing is dropped at the deadline; others still get
        # answers
        reader, writer = await asyncio.open_unix_connection(str(path))
        answer = await _raw(path, b'{"v": 1, "op": "status"}\n')
        assert answer["ok"] is True
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the server after request_timeout
        writer.close()
        assert daemon.leaves == []

    _serve(body)


def test_client_without_daemon() -> None:
    directory = _short_dir()
    try:
        with pytest.raises(DaemonNotRunning, match="no daemon is running"):
            ControlClient(directory / "control.sock").status()
        # a socket file nobody listens on (a crashed daemon's) also means "not running"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(str(directory / "stale.sock"))
        with pytest.raises(DaemonNotRunning):
            ControlClient(directory / "stale.sock").status()
    finally:
        for item in directory.iterdir():
            item.unlink()
        directory.rmdir()
    with pytest.raises(StateDirError, match="107-byte limit"):
        ControlClient(Path("/tmp/" + "x" * 120) / "control.sock").status()


def test_leave_waits_for_a_daemon_that_stops_answering_while_it_closes() -> None:
    """After ``leave`` the daemon closes its components; a status request it accepts but
    does not answer then is reported and its process waited for: ``wanswarm leave`` succeeds
    once it exits (it failed with "daemon did not answer" while the daemon went on to exit)."""
    import subprocess
    import sys

    directory = _short_dir()
    path = directory / "control.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)  # accepted by the kernel, never answered
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    lines: list[str] = []
    try:
        client = ControlClient(path, timeout=0.3)
        assert client.wait_until_gone(daemon.pid, 20.0, lines.append)
        assert len(lines) == 1 and "not answering" in lines[0], lines
        assert "waiting for it to exit" in lines[0]
        # a daemon that never exits is still reported as running at the deadline
        stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert not client.wait_until_gone(stuck.pid, 1.0, lines.append)
        finally:
            stuck.kill()
            stuck.wait()
    finally:
        daemon.kill()
        daemon.wait()
        listener.close()
        path.unlink()
        directory.rmdir()


def test_stale_socket_is_replaced_and_a_live_one_refused() -> None:
    async def main() -> None:
        directory = _short_dir()
        path = directory / "control.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
            stale.bind(str(path))  # bound, never listening: what a killed daemon leaves behind
        first = ControlServer(ControlConfig(), path, FakeDaemon())
        await first.start()
        second = ControlServer(ControlConfig(), path, FakeDaemon())
        with pytest.raises(StateDirError, match="another daemon answers"):
            await second.start()
        await first.close()
        assert not path.exists()
        directory.rmdir()

    asyncio.run(main())


def test_text_status_shows_the_servers_state_source_checkpoint_moves_and_device_times() -> None:
    server = {
        "stage": 1,
        "state": "online",
        "applied": 12,
        "epoch": 7,
        "queue": 0,
        "throughput": 9.5,
        "resumed_from": "checkpoint",
        "checkpoint_epoch": 6,
        "moves": 2,
        "last_move": {"from": 0, "to": 1},
    }
    report = StatusReport(
        peer_id=PEER,
        run="demo",
        stage=1,
        state="online",
        server=True,
        trainer=False,
        pid=1,
        version="0",
        uptime_s=3.0,
        dht_addrs=[],
        quic_addr=None,
        peers=[],
        components={"stage_server": server},
    )
    text = render_text(report)
    assert "12 micro-batches served   optimizer step 7" in text
    assert "state from checkpoint   checkpoint at step 6   moves 2 (last 0 -> 1)" in text
    assert "requests ran" not in text  # nothing ran yet
    busy = report.model_copy(update={"components": {"stage_server": {
        **server, "compute_s": 120.4, "optimizer_s": 31.2, "optimizer_max_s": 2.46}}})
    assert "requests ran 120s   in the optimizer 31s (longest 2.5s)" in render_text(busy)
    fresh = report.model_copy(
        update={
            "components": {
                "stage_server": {
                    **server,
                    "resumed_from": None,
                    "checkpoint_epoch": None,
                    "moves": 0,
                }
            }
        }
    )
    assert "state from" not in render_text(fresh) and "moves" not in render_text(fresh)
