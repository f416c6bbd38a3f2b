"""A joining node and records of another run spec: refused when no peer runs ours (a
misconfigured node), ignored when some do (anyone can sign a record: one must not keep
every new node out), and never routed to or counted by stage selection."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from wanswarm.node.config.runspec import default_run_spec
from wanswarm.node.endpoint import EndpointComponent
from wanswarm.node.errors import JoinError
from wanswarm.node.membership.peers import PeerTable
from wanswarm.node.membership.records import QuicAddress, ServerRecord
from wanswarm.node.training.servers import servers_from_peers
from wanswarm.transport.config import TransportConfig

SPEC = default_run_spec()
HONEST, HOSTILE, ME = "1" * 44, "2" * 44, "3" * 44


def _record(peer_id: str, run_id: str) -> ServerRecord:
    return ServerRecord(
        peer_id=peer_id, state="online", stage=0, run_id=run_id,
        quic=QuicAddress(host="10.0.0.1", port=4000),
    )


def _table(*records: ServerRecord) -> PeerTable:
    table = PeerTable(ME)
    table.apply({r.peer_id: (r, 1e12) for r in records}, {}, now=0.0, wall_now=0.0)
    return table


def _check(table: PeerTable) -> None:
    component = EndpointComponent(
        TransportConfig(), SPEC, announce_host="", announce_port=0, request_timeout_s=1.0
    )
    ctx = SimpleNamespace(peers=table, run="demo")
    asyncio.run(component._check_run_spec(ctx))  # type: ignore[arg-type]


def test_only_other_specs_refuse_the_join() -> None:
    with pytest.raises(JoinError, match="refusing to join run 'demo'"):
        _check(_table(_record(HOSTILE, "f" * 16)))


def test_a_forged_record_of_another_spec_is_ignored_when_peers_run_ours() -> None:
    table = _table(_record(HONEST, SPEC.run_id), _record(HOSTILE, "f" * 16))
    _check(table)  # no JoinError
    view = servers_from_peers(table, SPEC.run_id)
    assert [s.peer_id for s in view[0]] == [HONEST]
