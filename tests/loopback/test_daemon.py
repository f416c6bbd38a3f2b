"""The daemon's lifecycle with an in-memory DHT: join, the component seam, the one leave path,
deadlines, hurrying, and failures that must end the daemon with status 1."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from wanswarm.node.component import ComponentContext
from wanswarm.node.config.node_config import NodeConfig, load_config, parse_assignment
from wanswarm.node.control import ControlClient
from wanswarm.node.daemon import Daemon
from wanswarm.node.membership.records import ServerRecord
from wanswarm.transport.identity import Identity

from tests.unit.fake_dht import FakeDht

OTHER = Identity.generate().peer_id


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="wsd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _config(state_dir: Path, *settings: str) -> NodeConfig:
    defaults = ["node.shutdown_timeout=5", "node.drain_grace=0", "node.membership_period=0.05",
                "prober.period=0.05", "prober.timeout=0.02"]
    return load_config(environ={}, overrides=[parse_assignment(s) for s in [
        f"node.state_dir={state_dir}", *defaults, *settings]])


class Recorder:
    """A component that records what the daemon asks of it."""

    name = "recorder"

    def __init__(self, drain_forever: bool = False, crash_loop: bool = False) -> None:
        self.events: list[str] = []
        self.drain_forever = drain_forever
        self.crash_loop = crash_loop
        self.deadline: float | None = None
        self.drain_cancelled = False

    async def start(self, ctx: ComponentContext) -> None:
        self.events.append("start")
        ctx.membership.update(stage=2, throughput=50.0)
        ctx.spawn(self._loop(), "recorder-loop")

    async def _loop(self) -> None:
        self.events.append("loop")
        if self.crash_loop:
            raise RuntimeError("component bug")
        await asyncio.Event().wait()

    async def drain(self, deadline: float) -> None:
        self.events.append("drain")
        self.deadline = deadline
        if self.drain_forever:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.drain_cancelled = True
                raise

    async def close(self) -> None:
        self.events.append("close")

    def status(self) -> dict[str, Any]:
        return {"events": len(self.events)}


class QuicPinger(Recorder):
    """A component that measures RTTs itself (as the QUIC endpoint will)."""

    name = "quic"

    def __init__(self) -> None:
        super().__init__()
        self.pinged: list[str] = []

    async def ping(self, peer_id: str, timeout: float) -> float:
        self.pinged.append(peer_id)
        return 0.003


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def _run(daemon: Daemon, body: Any) -> int:
    async def main() -> int:
        task = asyncio.ensure_future(daemon.main())
        try:
            await body(task)
            async with asyncio.timeout(15):
                return await task
        finally:
            task.cancel()

    return asyncio.run(main())


def test_join_serve_and_leave_in_order(state_dir: Path) -> None:
    identity = Identity.generate()
    dht = FakeDht(identity.peer_id)
    dht.servers[OTHER] = (ServerRecord(peer_id=OTHER, state="online", stage=1), 4e9)
    component = Recorder()
    daemon = Daemon(_config(state_dir), identity, dht, [component])

    async def body(task: asyncio.Future[int]) -> None:
        await _until(lambda: daemon.state == "online")
        await _until(
            lambda: daemon.table.get(OTHER) is not None
            and daemon.table.get(OTHER).rtt.srtt  # type: ignore[union-attr]
        )
        report = await asyncio.to_thread(ControlClient(state_dir / "control.sock").status)
        assert report.state == "online" and report.stage == 2 and report.peers[0].peer_id == OTHER
        assert report.peers[0].rtt_ms == 2.0 and report.components == {"recorder": {"events": 2}}
        assert report.dht_addrs == [f"/ip4/127.0.0.1/tcp/4000/p2p/{identity.peer_id}"]
        online = dht.servers[identity.peer_id][0]
        assert online.state == "online" and online.stage == 2 and online.throughput == 50.0
        ack = daemon.request_leave("test")
        assert ack.accepted and not ack.already_leaving

    assert _run(daemon, body) == 0
    assert component.events == ["start", "loop", "drain", "close"]
    states = [record.state for record, _ in dht.published]
    assert states[0] == "joining" and states[-2:] == ["draining", "left"]
    expirations = [expiration for _, expiration in dht.published]
    assert expirations == sorted(expirations)  # the tombstone outlives every record
    assert dht.shut_down and not (state_dir / "control.sock").exists()


def test_drain_is_bounded_by_shutdown_timeout(state_dir: Path) -> None:
    identity = Identity.generate()
    component = Recorder(drain_forever=True)
    daemon = Daemon(
        _config(state_dir, "node.shutdown_timeout=0.5"),
        identity,
        FakeDht(identity.peer_id),
        [component],
    )

    async def body(task: asyncio.Future[int]) -> None:
        await _until(lambda: daemon.state == "online")
        loop = asyncio.get_running_loop()
        started = loop.time()
        daemon.request_leave("test")
        await _until(lambda: task.done(), timeout=5)
        assert component.deadline is not None and abs(component.deadline - (started + 0.5)) < 0.1
        assert loop.time() - started < 3

    assert _run(daemon, body) == 0
    assert component.drain_cancelled and component.events[-1] == "close"


def test_a_second_request_hurries_the_drain(state_dir: Path) -> None:
    identity = Identity.generate()
    component = Recorder(drain_forever=True)
    config = _config(state_dir, "node.shutdown_timeout=60", "node.drain_grace=30")
    daemon = Daemon(config, identity, FakeDht(identity.peer_id), [component])

    async def body(task: asyncio.Future[int]) -> None:
        await _until(lambda: daemon.state == "online")
        daemon.request_leave("first")
        await _until(lambda: daemon.state == "draining" and component.deadline is not None)
        assert daemon.request_leave("second").already_leaving
        await _until(lambda: task.done(), timeout=5)  # not 60 s of drain nor 30 s of grace

    assert _run(daemon, body) == 0


def test_a_rtt_capable_component_replaces_the_dht_ping(state_dir: Path) -> None:
    identity = Identity.generate()
    dht = FakeDht(identity.peer_id)
    dht.servers[OTHER] = (ServerRecord(peer_id=OTHER, state="online"), 4e9)
    quic = QuicPinger()
    daemon = Daemon(_config(state_dir), identity, dht, [quic])

    async def body(task: asyncio.Future[int]) -> None:
        await _until(lambda: OTHER in quic.pinged)
        daemon.request_leave("test")

    assert _run(daemon, body) == 0
    assert dht.pings == []


@pytest.mark.parametrize("failure", ["join", "dht-dies", "component-crash"])
def test_failures_end_the_daemon_with_status_1(
    state_dir: Path, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    identity = Identity.generate()
    dht = FakeDht(
        identity.peer_id,
        join_error="none of the initial peers answered" if failure == "join" else None,
    )
    component = Recorder(crash_loop=failure == "component-crash")
    daemon = Daemon(_config(state_dir), identity, dht, [component])

    async def body(task: asyncio.Future[int]) -> None:
        if failure == "dht-dies":
            await _until(lambda: daemon.state == "online")
            dht.die()

    assert _run(daemon, body) == 1
    expected = {
        "join": "none of the initial peers answered",
        "dht-dies": "DHT process exited unexpectedly",
        "component-crash": "component bug",
    }[failure]
    assert expected in caplog.text
    assert dht.shut_down and not (state_dir / "control.sock").exists()
    if failure != "join":
        assert component.events[-1] == "close"


class SigintIgnorer(Recorder):
    """Does what hivemind's DecentralizedAverager.run_in_background does to the calling process."""

    name = "averager-like"

    async def start(self, ctx: ComponentContext) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        await super().start(ctx)


def test_sigint_leaves_even_after_a_component_ignored_it(state_dir: Path) -> None:
    identity = Identity.generate()
    dht = FakeDht(identity.peer_id)
    daemon = Daemon(_config(state_dir), identity, dht, [SigintIgnorer()])

    async def body(task: asyncio.Future[int]) -> None:
        await _until(lambda: daemon.state == "online")
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)  # handled by the daemon's loop: the graceful leave

    assert _run(daemon, body) == 0
    assert [record.state for record, _ in dht.published][-1] == "left"


def test_build_components_hands_each_its_own_section(state_dir: Path) -> None:
    from wanswarm.node.endpoint import EndpointComponent
    from wanswarm.node.stage.placement import ServerComponent
    from wanswarm.node.swarm_node import TrainerComponent, build_components

    config = _config(state_dir, "node.stage=1", "node.announce_port=9000", "node.join_backoff=2")
    endpoint, server, trainer = build_components(config)
    assert isinstance(endpoint, EndpointComponent)
    assert isinstance(server, ServerComponent) and isinstance(trainer, TrainerComponent)
    assert endpoint.config is config.transport and endpoint.announce_port == 9000
    assert endpoint.request_timeout_s == config.trainer.request_timeout_s
    assert server.config is config.stage_server and server.averaging is config.averaging
    assert server.rebalance is config.rebalance
    assert (server.pinned_stage, server.join_backoff) == (1, 2.0)
    assert trainer.config is config.trainer and trainer.server is server
    no_server = config.model_copy(update={"node": config.node.model_copy(update={"server": False})})
    assert [c.name for c in build_components(no_server)] == ["endpoint", "trainer"]


def test_remembered_peers_are_dialed_on_start_and_members_remembered(state_dir: Path) -> None:
    """The address book (membership/address_book.py): a peers.json from an earlier run is
    dialed before the swarm is read; connected peers that are members are written back, a
    connected stranger is not."""
    from wanswarm.node.membership.address_book import AddressBook

    identity = Identity.generate()
    earlier = AddressBook(state_dir, identity.peer_id)
    earlier.remember({OTHER: ["/ip4/192.0.2.7/tcp/31337"]}, [OTHER])
    earlier.save()
    stranger = Identity.generate().peer_id
    dht = FakeDht(identity.peer_id)
    dht.servers[OTHER] = (ServerRecord(peer_id=OTHER, state="online", stage=1), 4e9)
    daemon = Daemon(_config(state_dir), identity, dht, [Recorder()])
    book = state_dir / "peers.json"

    async def body(task: asyncio.Future[int]) -> None:
        # connected to nobody at start: the remembered peer is dialed
        await _until(lambda: bool(dht.dialed))
        dht.connected = {OTHER: ["/ip4/192.0.2.8/tcp/31337"], stranger: ["/ip4/192.0.2.9/tcp/1"]}
        await _until(lambda: daemon.state == "online")
        await _until(lambda: "192.0.2.8" in book.read_text())
        daemon.request_leave("test")

    assert _run(daemon, body) == 0
    assert dht.dialed[0] == [(OTHER, ("/ip4/192.0.2.7/tcp/31337",))]
    text = book.read_text()
    assert OTHER in text and stranger not in text


def test_the_address_book_loop_redials_initial_peers_and_everyone_while_alone(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An initial peer we are not connected to (a restarted bootstrap, which cannot dial a
    home behind NAT) is dialed again; while we know no member, so are the peers connected
    to us (a home that reconnected to it for a relay slot)."""
    import wanswarm.node.daemon as daemon_module

    monkeypatch.setattr(daemon_module, "REDIAL_PERIOD_S", 0.05)
    identity = Identity.generate()
    boot = Identity.generate().peer_id
    home = Identity.generate().peer_id
    dht = FakeDht(identity.peer_id)
    dht.connected = {home: ["/ip4/198.51.100.7/tcp/40000"]}
    config = _config(state_dir, f'dht.initial_peers=["/ip4/192.0.2.1/tcp/31337/p2p/{boot}"]')
    daemon = Daemon(config, identity, dht, [Recorder()])
    initial = (boot, ("/ip4/192.0.2.1/tcp/31337",))

    async def body(task: asyncio.Future[int]) -> None:
        await _until(lambda: daemon.state == "online")
        # alone (no member known): the initial peer and the peer connected to us
        await _until(lambda: any(home in dict(d) for d in dht.dialed))
        assert initial in next(d for d in dht.dialed if home in dict(d))
        # a member known: only the initial peer we are not connected to
        dht.servers[OTHER] = (ServerRecord(peer_id=OTHER, state="online", stage=1), 4e9)
        await _until(lambda: daemon.table.get(OTHER) is not None)
        seen = len(dht.dialed)
        await _until(lambda: len(dht.dialed) > seen + 1)
        assert dht.dialed[-1] == [initial]
        dht.connected[boot] = ["/ip4/192.0.2.1/tcp/31337"]  # connected: no more dials
        await asyncio.sleep(0.3)
        seen = len(dht.dialed)
        await asyncio.sleep(0.3)
        assert len(dht.dialed) == seen
        daemon.request_leave("test")

    assert _run(daemon, body) == 0
