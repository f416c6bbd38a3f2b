"""Addresses and reachability checks: what a node announces, how it classifies its NAT, and how
a peer's record becomes an address to dial.

Unit tier: the check runs against a scripted endpoint (the observed addresses and dial-back
answers real peers would give); the transport's own observe and dial-back over real sockets
are tested in tests/loopback/test_traversal.py and across real NATs in tests/lab.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from wanswarm.node.membership.addresses import (
    interface_addresses,
    is_loopback,
    local_hosts,
    peer_address,
)
from wanswarm.node.membership.peers import PeerTable
from wanswarm.node.membership.reachability import Observation, Reachability, classify
from wanswarm.node.membership.records import (
    PeerRef,
    QuicAddress,
    Reach,
    ServerRecord,
    decode_record,
    encode_record,
)
from wanswarm.transport.endpoint import PeerAddress
from wanswarm.transport.errors import ConnectError
from wanswarm.transport.peer_address import Resolver

A = "1" * 44
B = "2" * 44
C = "3" * 44
ME = "4" * 44


def _record(peer_id: str, host: str, port: int = 4000, reach: Reach | None = None) -> ServerRecord:
    return ServerRecord(
        peer_id=peer_id, state="online", stage=0, quic=QuicAddress(host=host, port=port),
        reach=reach,
    )


def _table(*records: ServerRecord) -> PeerTable:
    table = PeerTable(ME)
    table.apply({r.peer_id: (r, 1e12) for r in records}, {}, now=0.0, wall_now=0.0)
    return table


class ScriptedEndpoint:
    """Answers observe_mapping/dial_back as the peers of a scenario would: ``seen`` on each
    peer's QUIC port (None: it does not answer), ``probed`` on its second port (absent:
    it could not tell)."""

    def __init__(
        self,
        seen: dict[str, tuple[str, int] | None],
        dial_back: bool,
        probed: dict[str, tuple[str, int]] | None = None,
    ) -> None:
        self.seen = seen
        self.probed = probed or {}
        self.dial_back_answer = dial_back
        self.reachable = False
        self.kept: list[PeerAddress] = []
        self.resolve: Resolver | None = None
        self.released: list[str] = []
        self.asked: list[str] = []

    async def observe_mapping(
        self, peer: PeerAddress, *, timeout: float
    ) -> tuple[tuple[str, int], tuple[str, int] | None]:
        self.asked.append(peer.peer_id)
        answer = self.seen.get(peer.peer_id)
        if answer is None:
            raise ConnectError(f"{peer.peer_id} unreachable")
        return answer, self.probed.get(peer.peer_id)

    async def dial_back(self, peer: PeerAddress, *, timeout: float) -> bool:
        return self.dial_back_answer

    async def keep(
        self, peer: PeerAddress, *, timeout: float, resolve: Resolver | None = None
    ) -> None:
        self.kept.append(peer)
        self.resolve = resolve

    def release(self, peer_id: str) -> None:
        self.released.append(peer_id)

    def paths(self) -> dict[str, str]:
        return {}


def _reachability(
    table: PeerTable, endpoint: ScriptedEndpoint, local: list[str]
) -> tuple[Reachability, list[tuple[QuicAddress, Reach]]]:
    published: list[tuple[QuicAddress, Reach]] = []
    reach = Reachability(
        endpoint, table, local_hosts=lambda: local, bound_port=5000,
        publish=lambda q, r: published.append((q, r)), period_s=60, timeout_s=1,
        rng=random.Random(0),
    )
    return reach, published


def _check(
    table: PeerTable, endpoint: ScriptedEndpoint, local: list[str]
) -> tuple[bool, list[tuple[QuicAddress, Reach]], Reachability]:
    reach, published = _reachability(table, endpoint, local)
    known = asyncio.run(reach.check())
    return known, published, reach


def test_classify() -> None:
    assert classify(["10.0.0.2"], []) == "unknown"
    assert classify(["11.0.0.10"], [Observation(A, "11.0.0.10", 5000)]) == "public"
    cone = [Observation(A, "11.1.0.10", 5000), Observation(B, "11.1.0.10", 5000)]
    assert classify(["192.168.1.2"], cone) == "cone"
    symmetric = [Observation(A, "11.1.0.10", 40001), Observation(B, "11.1.0.10", 51234)]
    assert classify(["192.168.1.2"], symmetric) == "symmetric"


def test_classify_with_one_observers_two_ports() -> None:
    lan = ["192.168.1.2"]
    mapping = ("11.1.0.10", 40000)
    assert classify(lan, [Observation(A, *mapping, probed=mapping)]) == "cone"
    assert classify(lan, [Observation(A, *mapping, probed=("11.1.0.10", 40001))]) == "symmetric"
    assert classify(lan, [Observation(A, *mapping, probed=("11.1.0.11", 40000))]) == "symmetric"
    # one observation is no evidence either way
    assert classify(lan, [Observation(A, *mapping)]) == "unknown"
    # two observers that agree, one of whose second ports saw another mapping
    mixed = [Observation(A, *mapping, probed=("11.1.0.10", 40002)), Observation(B, *mapping)]
    assert classify(lan, mixed) == "symmetric"
    # no NAT: the observed host is ours, whatever the ports
    assert classify(["11.0.0.12"], [Observation(A, "11.0.0.12", 5000)]) == "public"


def test_a_public_node_announces_its_own_address_as_reachable() -> None:
    table = _table(_record(A, "11.0.0.10"), _record(B, "11.0.0.11"))
    endpoint = ScriptedEndpoint({A: ("11.0.0.12", 5000), B: ("11.0.0.12", 5000)}, True)
    known, published, reach = _check(table, endpoint, ["11.0.0.12"])
    assert known
    quic, announced = published[-1]
    assert quic == QuicAddress(host="11.0.0.12", port=5000)
    assert announced.nat == "public" and announced.reachable and announced.rendezvous is None
    assert announced.lan == ()
    assert endpoint.reachable is True and endpoint.kept == []
    assert reach.status()["observed"] == "11.0.0.12:5000"


def test_a_node_behind_a_cone_nat_announces_its_mapping_and_a_rendezvous() -> None:
    table = _table(_record(A, "11.0.0.10"), _record(B, "11.0.0.11"))
    endpoint = ScriptedEndpoint({A: ("11.1.0.10", 40000), B: ("11.1.0.10", 40000)}, False)
    _, published, _ = _check(table, endpoint, ["192.168.1.2"])
    quic, announced = published[-1]
    assert quic == QuicAddress(host="11.1.0.10", port=40000)
    assert announced.nat == "cone" and not announced.reachable
    assert announced.lan == (QuicAddress(host="192.168.1.2", port=5000),)
    assert announced.rendezvous is not None and announced.rendezvous.peer_id in (A, B)
    assert endpoint.kept[-1] is not None
    assert endpoint.kept[-1].peer_id == announced.rendezvous.peer_id
    assert table.own_public_host == "11.1.0.10"


def test_the_rendezvous_is_looked_up_anew_when_it_restarts_elsewhere() -> None:
    """The keeper's resolver gives the rendezvous' newest announced address (a restart on
    another port); a check that finds it at a new address hands that over, while a check
    that finds it where it was does not re-keep it."""
    table = _table(_record(A, "11.0.0.10"))
    endpoint = ScriptedEndpoint({A: ("11.1.0.10", 40000)}, False)
    reach, _ = _reachability(table, endpoint, ["192.168.1.2"])
    assert asyncio.run(reach.check())
    assert [(p.peer_id, p.port) for p in endpoint.kept] == [(A, 4000)]
    resolve = endpoint.resolve
    assert resolve is not None
    assert (resolve(A).host, resolve(A).port) == ("11.0.0.10", 4000)  # type: ignore[union-attr]
    assert asyncio.run(reach.check()) and len(endpoint.kept) == 1  # same address: kept as is
    # it restarts on port 4001 and announces it: the resolver knows at once
    table.apply({A: (_record(A, "11.0.0.10", 4001), 1e12)}, {}, now=1.0, wall_now=1.0)
    assert not reach._wake.is_set()
    assert resolve(A).port == 4001  # type: ignore[union-attr]
    assert reach._wake.is_set()  # our record names it at 4000: a check now re-announces it
    assert resolve(B) is None  # unknown peer: the keeper keeps its last address
    assert asyncio.run(reach.check())
    assert [(p.peer_id, p.port) for p in endpoint.kept] == [(A, 4000), (A, 4001)]
    # a rendezvous that now announces itself unreachable is no address to dial
    table.apply(
        {A: (_record(A, "11.0.0.10", 4002, reach=Reach(nat="cone", reachable=False)), 1e12)},
        {}, now=2.0, wall_now=2.0,
    )
    assert resolve(A) is None


def test_symmetric_nat_and_unreachable_candidates() -> None:
    # C announced itself unreachable: never asked; A does not answer; B and D do
    d = "5" * 44
    unreachable = Reach(nat="cone", reachable=False)
    table = _table(
        _record(A, "11.0.0.10"), _record(B, "11.0.0.11"),
        _record(C, "11.1.0.20", reach=unreachable), _record(d, "11.0.0.13"),
    )
    endpoint = ScriptedEndpoint(
        {A: None, B: ("11.1.0.10", 40001), d: ("11.1.0.10", 52000)}, False
    )
    _, published, _ = _check(table, endpoint, ["192.168.3.2"])
    assert C not in endpoint.asked
    assert published[-1][1].nat == "symmetric"


def test_loopback_peers_are_not_asked_and_no_answer_is_not_a_result() -> None:
    table = _table(_record(A, "127.0.0.1"))
    endpoint = ScriptedEndpoint({A: ("127.0.0.1", 5000)}, True)
    known, published, reach = _check(table, endpoint, ["192.168.1.2"])
    assert not known and published == [] and endpoint.asked == []
    assert reach.state.failures == 1


def test_local_hosts_never_announce_loopback_when_bound_to_all_addresses() -> None:
    hosts = local_hosts("0.0.0.0", ["127.0.0.1"])
    real = [h for h in interface_addresses() if not is_loopback(h)]
    if real:
        assert hosts and not any(is_loopback(h) for h in hosts)
    else:  # a host with nothing but loopback: announcing it is all it can do
        assert hosts == ["127.0.0.1"]
    assert local_hosts("10.1.2.3", ["127.0.0.1"]) == ["10.1.2.3"]


def test_peer_address_follows_the_record() -> None:
    plain = _record(A, "11.0.0.10")
    assert peer_address(plain) == PeerAddress(A, "11.0.0.10", 4000)
    rendezvous = PeerRef(peer_id=B, quic=QuicAddress(host="11.0.0.11", port=4001))
    natted = _record(
        C, "11.1.0.10", 40000,
        Reach(nat="cone", reachable=False, lan=(QuicAddress(host="192.168.1.2", port=4000),),
              rendezvous=rendezvous),
    )
    address = peer_address(natted)
    assert address is not None and not address.reachable
    assert address.rendezvous == PeerAddress(B, "11.0.0.11", 4001)
    # behind the same public address: its LAN address (routers rarely hairpin)
    assert peer_address(natted, own_public_host="11.1.0.10") == PeerAddress(
        C, "192.168.1.2", 4000
    )
    unknown = _record(A, "11.0.0.10", reach=Reach())
    assert peer_address(unknown) is not None and peer_address(unknown).reachable  # type: ignore[union-attr]


def test_reach_records_are_bounded() -> None:
    many = tuple(QuicAddress(host=f"10.0.0.{i}", port=1) for i in range(5))
    with pytest.raises(ValueError):
        Reach(lan=many)
    record = _record(A, "11.0.0.10", reach=Reach(nat="symmetric"))
    assert decode_record(ServerRecord, encode_record(record)) == record


def test_one_observer_tells_a_symmetric_nat_by_its_second_port() -> None:
    # the acceptance lab's case: one public bootstrap, a home behind a symmetric NAT
    table = _table(_record(A, "11.0.0.10"))
    endpoint = ScriptedEndpoint(
        {A: ("11.1.0.30", 40001)}, False, probed={A: ("11.1.0.30", 61017)}
    )
    _, published, _ = _check(table, endpoint, ["192.168.3.2"])
    quic, announced = published[-1]
    assert announced.nat == "symmetric" and not announced.reachable
    assert quic == QuicAddress(host="11.1.0.30", port=40001)  # the QUIC port's mapping
    assert announced.rendezvous is not None and announced.rendezvous.peer_id == A


def test_one_observer_tells_a_cone_nat_by_its_second_port() -> None:
    table = _table(_record(A, "11.0.0.10"))
    mapping = ("11.1.0.10", 40000)
    endpoint = ScriptedEndpoint({A: mapping}, False, probed={A: mapping})
    _, published, _ = _check(table, endpoint, ["192.168.1.2"])
    assert published[-1][1].nat == "cone"


def test_one_observation_alone_decides_nothing() -> None:
    table = _table(_record(A, "11.0.0.10"))
    mapping = ("11.1.0.10", 40000)
    endpoint = ScriptedEndpoint({A: mapping}, False)  # its second port saw nothing
    reach, published = _reachability(table, endpoint, ["192.168.1.2"])

    async def checks() -> None:
        await reach.check()
        assert published[-1][1].nat == "unknown"
        assert published[-1][1].rendezvous is not None  # measured: not reachable
        endpoint.probed = {A: ("11.1.0.10", 40007)}
        await reach.check()
        assert published[-1][1].nat == "symmetric"
        endpoint.probed = {}  # the NAT behind the same address told us before
        await reach.check()
        assert published[-1][1].nat == "symmetric"
        endpoint.seen = {A: ("11.9.0.1", 40000)}  # another network: it has not
        await reach.check()
        assert published[-1][1].nat == "unknown"

    asyncio.run(checks())


def test_a_peer_measured_unreachable_with_an_unknown_nat_is_not_asked() -> None:
    rendezvous = PeerRef(peer_id=A, quic=QuicAddress(host="11.0.0.10", port=4000))
    table = _table(
        _record(A, "11.0.0.10"),
        _record(B, "11.1.0.20", reach=Reach(nat="unknown", reachable=False,
                                             rendezvous=rendezvous)),
        _record(C, "11.0.0.11", reach=Reach()),  # not measured yet: asked
    )
    endpoint = ScriptedEndpoint(
        {A: ("11.1.0.10", 40000), B: ("11.1.0.10", 40000), C: ("11.1.0.10", 40000)}, False
    )
    _check(table, endpoint, ["192.168.1.2"])
    assert B not in endpoint.asked and set(endpoint.asked) == {A, C}
