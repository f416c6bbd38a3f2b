"""Membership, the peer table and the prober over an in-memory DHT: no sockets, no sleeps."""

from __future__ import annotations

import asyncio
import random

import pytest
from wanswarm.node.config.node_config import NodeSection
from wanswarm.node.errors import DhtError, ProbeError
from wanswarm.node.membership.peers import PeerTable, ServerPeer
from wanswarm.node.membership.prober import Prober, ProberConfig, choose_targets
from wanswarm.node.membership.records import (
    PeerRef,
    QuicAddress,
    Reach,
    RttEntry,
    RttRecord,
    ServerRecord,
)
from wanswarm.node.membership.tracker import Membership
from wanswarm.transport.identity import Identity

from .fake_dht import MemoryDht

IDS = [Identity.generate().peer_id for _ in range(6)]


class Clocks:
    def __init__(self) -> None:
        self.mono = 100.0
        self.wall = 1_000_000.0

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def _node(dht: MemoryDht, peer_id: str, clocks: Clocks, **config: object) -> Membership:
    section = NodeSection.model_validate({"record_ttl": 30.0, **config})
    return Membership(dht, section, peer_id, PeerTable(peer_id), random.Random(0),
                      clock=lambda: clocks.mono, wall_clock=lambda: clocks.wall)


def test_announce_read_and_withdraw() -> None:
    clocks = Clocks()
    dht = MemoryDht(wall_clock=lambda: clocks.wall)
    a, b = _node(dht, IDS[0], clocks), _node(dht, IDS[1], clocks)

    async def scenario() -> None:
        a.update(stage=1, throughput=12.0, queue=2, quic=QuicAddress(host="127.0.0.1", port=4433))
        a.set_state("online")
        assert await a.announce()
        assert await b.announce()
        changes = await b.refresh()
        assert changes.joined == (IDS[0],) and changes.left == ()
        peer = b.table.get(IDS[0])
        assert peer is not None and peer.stage == 1
        assert peer.record.quic == QuicAddress(host="127.0.0.1", port=4433)
        assert (await a.refresh()).joined == (IDS[1],)
        assert IDS[0] not in a.table  # never lists itself

        # leave: draining first, then a tombstone that outlives the last record
        a.set_state("draining")
        assert await a.announce()
        await b.refresh()
        assert b.table.get(IDS[0]).record.state == "draining"  # type: ignore[union-attr]
        last = dht.published[-1][1]
        clocks.advance(1.0)
        assert await a.withdraw()
        tombstone, expiration = dht.servers[IDS[0]]
        assert tombstone.state == "left" and last < expiration <= last + 0.01
        assert (await b.refresh()).left == (IDS[0],)  # dropped at once, not after 30 s

    asyncio.run(scenario())


def test_a_pinned_server_says_so_in_its_record_and_old_records_read_as_movable() -> None:
    """``movable`` (stage_selection.md, pinned servers): announced by the server, read by
    the others' rebalancing; a record written before the field existed reads as movable."""
    clocks = Clocks()
    dht = MemoryDht(wall_clock=lambda: clocks.wall)
    a, b = _node(dht, IDS[0], clocks), _node(dht, IDS[1], clocks)

    async def scenario() -> None:
        assert a.own_record().movable
        a.update(stage=0, throughput=5.0, movable=False)
        a.set_state("online")
        assert await a.announce()
        await b.refresh()
        peer = b.table.get(IDS[0])
        assert peer is not None and peer.record.movable is False

    asyncio.run(scenario())
    old = ServerRecord.model_validate_json(
        f'{{"v": 1, "peer_id": "{IDS[2]}", "state": "online", "stage": 1}}'
    )
    assert old.movable is True


def test_a_failed_store_still_counts_for_the_tombstone() -> None:
    clocks = Clocks()
    dht = MemoryDht(wall_clock=lambda: clocks.wall)
    a = _node(dht, IDS[0], clocks)

    async def scenario() -> None:
        await a.announce()
        clocks.advance(5)
        dht.down = True
        with pytest.raises(DhtError):
            await a.announce()  # may have landed on some replica: its expiration is remembered
        dht.down = False
        await a.withdraw()
        assert dht.servers[IDS[0]][1] > clocks.wall + 30 - 0.01

    asyncio.run(scenario())


def test_expired_and_failed_reads() -> None:
    clocks = Clocks()
    dht = MemoryDht(wall_clock=lambda: clocks.wall)
    a, b = _node(dht, IDS[0], clocks, record_ttl=10.0), _node(dht, IDS[1], clocks)

    async def scenario() -> None:
        await a.announce()
        await b.refresh()
        assert IDS[0] in b.table
        dht.down = True
        with pytest.raises(DhtError):
            await b.refresh()
        assert IDS[0] in b.table  # a failed read changes nothing
        dht.down = False
        clocks.advance(10.5)  # a died without leaving: its record expires
        assert (await b.refresh()).left == (IDS[0],)

    asyncio.run(scenario())


def test_announce_loop_reacts_to_changes_at_once() -> None:
    clocks = Clocks()
    dht = MemoryDht(wall_clock=lambda: clocks.wall)
    a = _node(dht, IDS[0], clocks, record_ttl=3600.0)

    async def scenario() -> None:
        loop_task = asyncio.ensure_future(a.announce_loop())
        try:
            async with asyncio.timeout(5):
                while not dht.published:
                    await asyncio.sleep(0)  # first announce happens at once
                a.update(stage=3)  # a stage change must not wait for the 20-minute period
                while dht.published[-1][0].stage != 3:
                    await asyncio.sleep(0)
        finally:
            loop_task.cancel()

    asyncio.run(scenario())


def test_peer_table_publishes_measured_rtts_and_keeps_reports() -> None:
    table = PeerTable(IDS[0], rtt_window=60)
    servers = {
        pid: (ServerRecord(peer_id=pid, state="online", stage=i), 2e9)
        for i, pid in enumerate(IDS[1:4])
    }
    report = RttRecord(peer_id=IDS[1], rtts={IDS[2]: RttEntry(srtt_ms=7.0, min_ms=5.0)})
    table.apply(servers, {IDS[1]: report}, now=0.0, wall_now=1e9)
    table.on_rtt_sample(IDS[1], 0.010, now=1.0)
    table.on_rtt_sample(IDS[2], 0.020, now=2.0)
    table.on_rtt_sample("unknown peer", 0.5, now=2.0)  # ignored
    table.on_probe_failure(IDS[3])
    measured = table.measured_rtts(now=2.0)
    assert list(measured) == [IDS[2], IDS[1]]  # most recent first
    assert measured[IDS[1]] == RttEntry(srtt_ms=10.0, min_ms=10.0)
    assert table.get(IDS[1]).reported_rtts == {IDS[2]: RttEntry(srtt_ms=7.0, min_ms=5.0)}  # type: ignore[union-attr]
    assert table.get(IDS[3]).rtt.consecutive_failures == 1  # type: ignore[union-attr]
    assert [p.stage for p in table.peers()] == [0, 1, 2]
    assert list(table.by_stage()) == [0, 1, 2]


def test_servers_lists_reachable_stage_servers_by_state_stage_and_run() -> None:
    table = PeerTable(IDS[0])
    run_a, run_b = "0123456789abcdef", "fedcba9876543210"
    quic = QuicAddress(host="10.0.0.1", port=4000)
    unassigned, trainer_only = Identity.generate().peer_id, Identity.generate().peer_id
    records = [
        ServerRecord(peer_id=IDS[1], state="online", stage=1, quic=quic, run_id=run_a),
        ServerRecord(peer_id=IDS[2], state="joining", stage=0, quic=quic, run_id=run_a),
        ServerRecord(peer_id=IDS[3], state="draining", stage=1, quic=quic, run_id=run_b),
        ServerRecord(peer_id=IDS[4], state="online", stage=1),  # no QUIC address
        ServerRecord(peer_id=unassigned, state="online", quic=quic),  # no stage claimed yet
        ServerRecord(peer_id=trainer_only, state="online", stage=2, quic=quic, server=False),
    ]
    table.apply({r.peer_id: (r, 2e9) for r in records}, {}, now=0.0, wall_now=1e9)

    def ids(servers: list[ServerPeer]) -> list[str]:
        return [s.peer.peer_id for s in servers]

    assert ids(table.servers()) == [IDS[2], *sorted([IDS[1], IDS[3]])]  # by stage, then id
    assert [(s.stage, s.quic, s.record.state) for s in table.servers()][0] == (0, quic, "joining")
    assert ids(table.servers(("joining", "online"))) == [IDS[2], IDS[1]]
    assert ids(table.servers(("online",), stage=1, run_id=run_a)) == [IDS[1]]
    assert ids(table.servers(stage=1, run_id=run_b)) == [IDS[3]]
    assert table.servers(("online",), stage=0) == []


def test_a_peer_behind_nat_is_reached_through_its_rendezvous_where_that_now_announces() -> None:
    """A record names its rendezvous as it was at its last reachability check; when the
    rendezvous restarts on another port, the table already routes through the new one."""
    table = PeerTable(IDS[0])
    home, rendezvous = IDS[1], IDS[2]
    behind = Reach(
        nat="cone", reachable=False,
        rendezvous=PeerRef(peer_id=rendezvous, quic=QuicAddress(host="11.0.0.10", port=4000)),
    )

    def read(rendezvous_port: int, rendezvous_reach: Reach | None = None) -> None:
        records = [
            ServerRecord(peer_id=home, state="online", stage=0,
                         quic=QuicAddress(host="11.1.0.10", port=40000), reach=behind),
            ServerRecord(peer_id=rendezvous, state="online", stage=1,
                         quic=QuicAddress(host="11.0.0.10", port=rendezvous_port),
                         reach=rendezvous_reach),
        ]
        table.apply({r.peer_id: (r, 2e9) for r in records}, {}, now=0.0, wall_now=1e9)

    def via() -> tuple[str, int]:
        address = table.address(home)
        assert address is not None and not address.reachable and address.rendezvous is not None
        (server,) = table.servers(stage=0)
        assert server.address == address
        return address.rendezvous.host, address.rendezvous.port

    read(4000)
    assert via() == ("11.0.0.10", 4000)
    read(4100)  # restarted on another port; the home's record still names port 4000
    assert via() == ("11.0.0.10", 4100)
    # a rendezvous that now says it cannot be dialled is not taken at its word for a new
    # address: the reference in the record stands (and fails, and the home re-checks)
    read(4200, Reach(nat="cone", reachable=False))
    assert via() == ("11.0.0.10", 4000)


def test_a_server_that_stops_serving_its_stage_is_gone_from_it_until_it_serves_again() -> None:
    """What a stage's averaging leaves out: servers seen serving the stage whose record
    expired, moved on, or came back at ``joining`` (restarted, loading); never one that has
    not served it yet (a newcomer at ``joining``)."""
    from wanswarm.node.membership import peers
    from wanswarm.node.stage.placement import DepartedReplicas

    table = PeerTable(IDS[0])

    def read(now: float, *records: ServerRecord) -> None:
        table.apply({r.peer_id: (r, 2e9) for r in records}, {}, now=now, wall_now=1e9)

    a, b, c, d = IDS[1:5]
    read(0.0, ServerRecord(peer_id=a, state="online", stage=1),
         ServerRecord(peer_id=b, state="draining", stage=1),
         ServerRecord(peer_id=c, state="joining", stage=1),
         ServerRecord(peer_id=d, state="online", stage=2))
    assert table.gone_from(1) == frozenset() and table.gone_from(2) == frozenset()
    # a was SIGKILLed (its record expired), b left, c came online, d moved to stage 1
    read(10.0, ServerRecord(peer_id=c, state="online", stage=1),
         ServerRecord(peer_id=d, state="joining", stage=1))
    assert table.gone_from(1) == {a, b} and table.gone_from(2) == {d}
    # a restarts: listed again, loading its state; then online
    read(20.0, ServerRecord(peer_id=a, state="joining", stage=1),
         ServerRecord(peer_id=c, state="online", stage=1),
         ServerRecord(peer_id=d, state="online", stage=1))
    assert table.gone_from(1) == {a, b}
    departed = DepartedReplicas(table, 1)
    from hivemind.p2p import PeerID

    assert departed() == {PeerID.from_base58(p).to_bytes() for p in (a, b)}
    read(30.0, ServerRecord(peer_id=a, state="online", stage=1),
         ServerRecord(peer_id=c, state="online", stage=1),
         ServerRecord(peer_id=d, state="online", stage=1))
    assert table.gone_from(1) == {b} and table.gone_from(2) == {d}
    # remembered for GONE_MEMORY_S, then forgotten
    read(10.0 + peers.GONE_MEMORY_S + 1, ServerRecord(peer_id=a, state="online", stage=1))
    assert table.gone_from(1) == {c, d} and table.gone_from(2) == frozenset()


def test_a_stage_averages_with_its_online_replicas_not_loading_nor_leaving_ones() -> None:
    """The count that sizes a DiLoCo or gossip round's group (and lets a replica alone skip
    matchmaking): servers of our stage and run that are online. A replica still joining
    loads its state and takes no round: counting it made every round wait out the
    matchmaking time for a member that could not come."""
    from wanswarm.node.stage.placement import ReplicasOnline

    table = PeerTable(IDS[0])
    quic = QuicAddress(host="10.0.0.2", port=4000)
    run, other_run = "a" * 16, "b" * 16

    def read(*records: ServerRecord) -> None:
        table.apply({r.peer_id: (r, 2e9) for r in records}, {}, now=0.0, wall_now=1e9)

    def server(i: int, state: str, stage: int = 1, run_id: str = run) -> ServerRecord:
        return ServerRecord(peer_id=IDS[i], state=state, stage=stage, quic=quic, run_id=run_id)

    others = ReplicasOnline(table, 1, run)
    read(server(0, "online"), server(1, "online"), server(2, "joining"),
         server(3, "draining"), server(4, "online", stage=2), server(5, "online", run_id=other_run))
    assert others() == 1  # ourselves (IDS[0]) never counted
    read(server(0, "online"), server(1, "online"), server(2, "online"), server(3, "draining"))
    assert others() == 2


def test_choose_targets_prefers_neighbouring_stages() -> None:
    table = PeerTable(IDS[0])
    stages = {IDS[1]: 0, IDS[2]: 1, IDS[3]: 2, IDS[4]: 5, IDS[5]: None}
    records = {
        p: (ServerRecord(peer_id=p, state="online", stage=s), 2e9) for p, s in stages.items()
    }
    table.apply(records, {}, now=0.0, wall_now=1e9)
    for seed in range(20):
        chosen = choose_targets(table.peers(), own_stage=1, limit=3, rng=random.Random(seed))
        assert set(chosen) == {IDS[1], IDS[2], IDS[3]}
    everyone = choose_targets(table.peers(), own_stage=None, limit=10, rng=random.Random(0))
    assert sorted(everyone) == sorted(stages)


class FakeSource:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    async def ping(self, peer_id: str, timeout: float) -> float:
        self.calls.append((peer_id, timeout))
        if peer_id == IDS[2]:
            raise ProbeError("no answer")
        if peer_id == IDS[3]:
            await asyncio.Event().wait()  # never answers: the prober's own deadline must end it
        return 0.004


def test_probe_round_records_samples_failures_and_timeouts() -> None:
    table = PeerTable(IDS[0])
    records = {p: (ServerRecord(peer_id=p, state="online"), 2e9) for p in IDS[1:4]}
    table.apply(records, {}, now=0.0, wall_now=1e9)
    source = FakeSource()
    samples: list[str] = []
    prober = Prober(
        ProberConfig(period=1.0, timeout=0.05), source, table, lambda: None, random.Random(1),
        clock=lambda: 5.0, on_sample=lambda peer, rtt: samples.append(peer),
    )
    results = asyncio.run(prober.probe_round())
    assert results == {IDS[1]: 0.004, IDS[2]: None, IDS[3]: None}
    assert samples == [IDS[1]]
    assert table.get(IDS[1]).rtt.srtt == 0.004  # type: ignore[union-attr]
    assert table.get(IDS[2]).rtt.consecutive_failures == 1  # type: ignore[union-attr]
    assert table.get(IDS[3]).rtt.consecutive_failures == 1  # type: ignore[union-attr]
    assert all(timeout == 0.05 for _, timeout in source.calls)


def test_expirations_only_grow_even_when_the_clock_steps_back() -> None:
    clocks = Clocks()
    dht = MemoryDht(wall_clock=lambda: clocks.wall)
    a = _node(dht, IDS[0], clocks)

    async def scenario() -> None:
        assert await a.announce()
        assert await a.announce()  # same instant: still accepted
        clocks.wall -= 60  # NTP steps the clock back a minute
        assert await a.announce()
        expirations = [expiration for _, expiration in dht.published]
        assert expirations == sorted(expirations) and len(set(expirations)) == 3

    asyncio.run(scenario())
