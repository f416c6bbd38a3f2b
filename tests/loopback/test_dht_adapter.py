"""The DHT adapter against real hivemind DHT processes: identity, typed records, ping, join
failure.

Loopback tier: each adapter forks its hivemind DHT process (and libp2p daemon) on 127.0.0.1
from this one test process; no wanswarm daemon runs.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
from functools import partial
from pathlib import Path

import pytest
from hivemind.utils.mpfuture import MPFuture
from wanswarm.node.config.node_config import DhtConfig
from wanswarm.node.errors import JoinError, ProbeError
from wanswarm.node.membership.records import QuicAddress, RttEntry, RttRecord, ServerRecord
from wanswarm.node.service.statedir import load_identity

dht_module = pytest.importorskip("wanswarm.node.membership.dht")

CONFIG = DhtConfig(host="127.0.0.1", bootstrap_timeout=20, rpc_timeout=3, request_timeout=5)


@pytest.mark.timeout(60)
def test_two_nodes_share_typed_records_and_ping(tmp_path: Path) -> None:
    alice, alice_key = load_identity(tmp_path / "a")
    bob, bob_key = load_identity(tmp_path / "b")
    first = dht_module.Dht.spawn(CONFIG, "demo", alice, alice_key)
    try:
        asyncio.run(first.wait_ready())
        addrs = asyncio.run(first.visible_maddrs())
        # the key file is hivemind's identity: the DHT's peer id is the node's peer id
        assert addrs and all(addr.endswith(f"/p2p/{alice.peer_id}") for addr in addrs)
        joining = CONFIG.model_copy(update={"initial_peers": tuple(addrs)})
        second = dht_module.Dht.spawn(joining, "demo", bob, bob_key)
        try:
            async def scenario() -> None:
                await second.wait_ready()
                expiration = time.time() + 30
                server = ServerRecord(
                    peer_id=bob.peer_id, state="online", stage=1, throughput=3.5,
                    quic=QuicAddress(host="127.0.0.1", port=4433), version="0.1.0",
                )
                rtt = RttRecord(
                    peer_id=bob.peer_id, rtts={alice.peer_id: RttEntry(srtt_ms=1.5, min_ms=1.0)}
                )
                assert await second.publish(server, rtt, expiration)
                read = await first.read_membership()
                assert read.servers[bob.peer_id] == (server, pytest.approx(expiration))
                assert read.rtts[bob.peer_id] == rtt and read.dropped == []
                seconds = await first.ping(bob.peer_id, timeout=3)
                assert 0 < seconds < 1
                with pytest.raises(ProbeError):
                    await first.ping("not-a-peer-id", timeout=1)
                await second.shutdown(timeout=10)
                await first.shutdown(timeout=10)

            asyncio.run(scenario())
        finally:
            if second.is_alive():
                second.shutdown_blocking()
    finally:
        if first.is_alive():
            first.shutdown_blocking()
    assert not first.is_alive() and not second.is_alive()


@pytest.mark.timeout(60)
def test_unreachable_initial_peers_fail_the_join_clearly(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nobody listens there
    identity, key = load_identity(tmp_path)
    ghost, _ = load_identity(tmp_path / "ghost")
    ghost_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ghost.peer_id}"
    config = CONFIG.model_copy(update={"initial_peers": (ghost_addr,)})
    node = dht_module.Dht.spawn(config, "demo", identity, key)
    try:
        with pytest.raises(JoinError, match="none of the initial peers answered"):
            asyncio.run(node.wait_ready())
    finally:
        if node.is_alive():
            node.shutdown_blocking()


def _fail_to_read() -> None:
    raise FileNotFoundError("the sender's resource sharer is gone")


class _Unreadable:
    """A request whose unpickling fails as one does whose sender exited: its MPFuture's file
    descriptors cannot be fetched from the sender's resource sharer any more."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return _fail_to_read, ()


@pytest.mark.timeout(60)
def test_unreadable_requests_are_dropped_without_holding_the_next_ones(tmp_path: Path) -> None:
    """hivemind's DHT loop sleeps wait_timeout (the rpc timeout, 3 s here) after each request
    it cannot read; a backlog of them, left by a stage's averager processes that exited
    during a move, held every later request of the node for minutes. They are dropped at
    once: a request sent behind five of them is answered within its own 3 s deadline."""
    identity, key = load_identity(tmp_path)
    node = dht_module.Dht.spawn(CONFIG, "demo", identity, key)
    try:
        async def scenario() -> list[str]:
            await node.wait_ready()
            for _ in range(5):
                node._process._outer_pipe.send(("_run_coroutine", [], {"coro": _Unreadable()}))
            return await node.visible_maddrs()

        addrs = asyncio.run(scenario())
        assert addrs and all(addr.endswith(f"/p2p/{identity.peer_id}") for addr in addrs)
        assert node.is_alive()
    finally:
        if node.is_alive():
            node.shutdown_blocking()


# set in the DHT process by _park: the uid of the MPFuture its request waits on
_PARKED: list[int] = []


async def _park(_dht: object, _node: object) -> str:
    """A DHT request that waits for an answer from another process (an MPFuture), held by
    nothing but itself: hivemind's request loop drops the task that runs it."""
    later: MPFuture[str] = MPFuture()
    _PARKED.append(later._uid)
    return await later


async def _collect_and_answer(_dht: object, _node: object) -> bool:
    """Collect garbage in the DHT process, then answer the parked request's future by its
    uid, as hivemind's update thread does; False if the future was gone."""
    await asyncio.sleep(0)
    gc.collect()
    ref = MPFuture._active_futures.get(_PARKED[-1]) if _PARKED else None
    future = ref() if ref is not None else None
    if future is None:
        return False
    future.set_result("answered")
    return True


@pytest.mark.timeout(60)
def test_a_request_waiting_on_another_process_survives_garbage_collection(tmp_path: Path) -> None:
    """hivemind holds the DHT process's request tasks weakly: one waiting on an MPFuture was
    destroyed by the collector, and its caller got GeneratorExit (it ended a daemon). The
    process's loop keeps them (node/membership/hivemind_loops.py): the parked request gets
    its answer after a collection."""
    identity, key = load_identity(tmp_path)
    node = dht_module.Dht.spawn(CONFIG, "demo", identity, key)
    try:
        asyncio.run(node.wait_ready())
        process = node._process
        # requests run in the order sent, and _collect_and_answer yields once first: the
        # parked request is at its await when the collection runs
        parked = process.run_coroutine(_park, return_future=True)
        assert process.run_coroutine(_collect_and_answer, return_future=True).result(timeout=10)
        assert parked.result(timeout=10) == "answered"
        assert node.is_alive()
    finally:
        if node.is_alive():
            node.shutdown_blocking()


async def _log_to(_dht: object, _node: object, *, path: str) -> None:
    """In the DHT process: hivemind's and asyncio's log records also go to ``path``."""
    handler = logging.FileHandler(path)
    for name in ("hivemind", "asyncio"):
        logging.getLogger(name).addHandler(handler)


async def _late(_dht: object, _node: object) -> str:
    await asyncio.sleep(1.0)
    return "late"


@pytest.mark.timeout(60)
def test_an_outcome_after_the_caller_gave_up_is_dropped_quietly(tmp_path: Path) -> None:
    """The caller's deadline passes and it cancels the request's future; hivemind's DHT
    process then logged two ERROR tracebacks when the outcome came (setting a cancelled
    future's result, then its exception). The late outcome is dropped with a debug line,
    and the process goes on answering."""
    identity, key = load_identity(tmp_path)
    node = dht_module.Dht.spawn(CONFIG, "demo", identity, key)
    logged = tmp_path / "dht-process.log"
    try:
        async def scenario() -> list[str]:
            await node.wait_ready()
            await node._call(partial(_log_to, path=str(logged)), 5, "log to a file")
            with pytest.raises(dht_module.DhtTimeout, match="took longer than 0.2s"):
                await node._call(_late, 0.2, "late request")
            await asyncio.sleep(1.5)  # the outcome comes, to a cancelled future
            return await node.visible_maddrs()

        assert asyncio.run(scenario())
        text = logged.read_text()
        assert "CANCELLED" not in text and "never retrieved" not in text, text
        assert node.is_alive()
    finally:
        if node.is_alive():
            node.shutdown_blocking()
