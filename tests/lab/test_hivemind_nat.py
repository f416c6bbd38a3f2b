"""hivemind's DHT and averaging between a public host and hosts behind cone and symmetric NAT,
with nothing configured but the bootstrap's multiaddr (docs/nat.md).

Each lab host runs tests/lab/hivemind_peer.py: the node's DHT as the daemon starts it
(``Dht.spawn``), plus one hivemind DecentralizedAverager for the averaging round.

The lab's public addresses (11.0.0.0/15) are ones libp2p takes for public: on a reserved
range its identify protocol would keep no address of a peer (docs/nat.md, docs/netlab.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from wanswarm.node.config.sections import DhtConfig
from wanswarm.node.membership.dht import others_maddrs, p2p_options
from wanswarm.node.tools.netlab import Lab, read_line
from wanswarm.node.tools.netlab_topology import Home, Link, Topology

LabFactory = Callable[[Topology], Lab]
PEER = str(Path(__file__).with_name("hivemind_peer.py"))
CONFIG = {"rpc_timeout": 3.0, "request_timeout": 10.0, "bootstrap_timeout": 30.0}
SIZE = 250_000  # floats averaged: 1 MB per peer, more than one relay buffer


class Peer:
    def __init__(self, net: Lab, host: str, state: Path, **config: Any) -> None:
        self.host = host
        self.proc = net.popen(host, [sys.executable, PEER, str(state / host),
                                     json.dumps({**CONFIG, **config})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> Peer:
        self.ready = json.loads(read_line(self.proc, 60))
        return self

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()

    def ask(self, line: str, timeout: float = 30) -> Any:
        self.send(line)
        return json.loads(read_line(self.proc, timeout))


def wait_for(peer: Peer, predicate: Callable[[list[str]], bool], timeout: float) -> list[str]:
    """Ask ``peer`` for its maddrs (each answer bounded) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        maddrs: list[str] = peer.ask("maddrs")["maddrs"]
        if predicate(maddrs) or time.monotonic() > deadline:
            return maddrs


def test_relays_are_the_initial_peers_reserved_at_once() -> None:
    boot = "/ip4/11.0.0.10/tcp/4001/p2p/12D3KooWBCNVD5Bp73CxWXePTvnwRUGpNUapmEyxYReoxT5DVXWN"
    options, flags = p2p_options(DhtConfig(initial_peers=(boot,)))
    assert options["use_auto_relay"] and options["trusted_relays"] == [boot]
    assert flags["relayDiscovery"] is False and flags["relayService"] is True
    # the first node of a swarm has nobody to name: libp2p's discovery, p2pd's default
    options, flags = p2p_options(DhtConfig())
    assert "trusted_relays" not in options and "relayDiscovery" not in flags
    assert others_maddrs(["/ip4/127.0.0.1/tcp/1/p2p/x", "/ip4/11.0.0.10/tcp/1/p2p/x"]) == [
        "/ip4/11.0.0.10/tcp/1/p2p/x"
    ]
    assert others_maddrs(["/ip4/127.0.0.1/tcp/1/p2p/x"]) == ["/ip4/127.0.0.1/tcp/1/p2p/x"]


@pytest.mark.timeout(150)
def test_dht_and_averaging_reach_hosts_behind_nat(
    lab: LabFactory, tmp_path: Path
) -> None:
    net = lab(Topology(public=("boot", "pub"), homes=(
        Home("alice", link=Link(delay_ms=10)), Home("carol", nat="symmetric"),
    )))
    boot = Peer(net, "boot", tmp_path).wait_ready()
    boot_maddrs = boot.ask("maddrs")["maddrs"]
    assert boot_maddrs and not any("/ip4/127." in m for m in boot_maddrs), boot_maddrs
    join = {"initial_peers": boot_maddrs}
    pub, alice, carol = [Peer(net, h, tmp_path, **join) for h in ("pub", "alice", "carol")]
    for peer in (pub, alice, carol):
        peer.wait_ready()  # started together: each spends seconds importing torch

    # store on one side of the NAT, read on the other, both ways
    assert alice.ask("publish 1")["stored"] and pub.ask("publish 0")["stored"]
    assert pub.ask("read")["servers"] == {pub.ready["peer_id"]: 0, alice.ready["peer_id"]: 1}
    assert carol.ask("read")["servers"][pub.ready["peer_id"]] == 0

    # behind NAT: a relayed address through the bootstrap, once AutoNAT finds the host private
    for home in (alice, carol):
        maddrs = wait_for(home, lambda ms: any("/p2p-circuit" in m for m in ms), 45)
        assert any("/p2p-circuit" in m for m in maddrs), (home.host, maddrs)
        assert not any("/ip4/127." in m for m in maddrs), (home.host, maddrs)
        assert maddrs[-1].endswith(f"/p2p-circuit/p2p/{home.ready['peer_id']}")
    assert not any("/ip4/127." in m for m in pub.ask("maddrs")["maddrs"])

    # one all-reduce among the public host and both NATed hosts (alice <-> carol: relayed)
    for value, peer in enumerate((pub, alice, carol)):
        peer.send(f"average {value} {SIZE} 3 60")
    rounds = [json.loads(read_line(peer.proc, 75)) for peer in (pub, alice, carol)]
    for result in rounds:
        assert result["ok"] and result["group"] == 3, rounds
        assert result["mean"] == pytest.approx(1.0), rounds
    # and a state download from the others (hivemind's load_state_from_peers)
    loaded = pub.ask("load 30", timeout=45)
    assert loaded["ok"] and loaded["mean"] == pytest.approx(1.0), loaded

    # the lab stops the peers at teardown
