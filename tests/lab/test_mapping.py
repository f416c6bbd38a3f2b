"""One observer tells a symmetric NAT from a cone NAT: the observed mapping on its QUIC port
and on its second port (``Endpoint.observe_mapping``), across the lab's real NATs, as the
node's reachability check classifies it (docs/nat.md). The acceptance lab has one public
peer only, the bootstrap: two observers are not to be had there."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from wanswarm.node.tools.netlab import Lab, read_line
from wanswarm.node.tools.netlab_topology import Home, Topology

LabFactory = Callable[[Topology], Lab]
PEER = str(Path(__file__).with_name("mapping_peer.py"))


def test_one_observer_tells_symmetric_from_cone_nat(lab: LabFactory) -> None:
    net = lab(Topology(public=("boot", "pub"),
                       homes=(Home("alice"), Home("carol", nat="symmetric"))))
    server = net.popen("boot", [sys.executable, PEER, "serve"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    ready = json.loads(read_line(server, 30))
    boot = [ready["peer_id"], net.address("boot"), str(ready["port"])]
    seen = {}
    for host in ("pub", "alice", "carol"):
        done = net.exec(host, [sys.executable, PEER, "observe", *boot], timeout=60)
        seen[host] = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["pub"]["nat"] == "public", seen
    assert seen["alice"]["nat"] == "cone", seen
    assert seen["alice"]["probed"] == seen["alice"]["seen"]
    assert seen["carol"]["nat"] == "symmetric", seen
    assert seen["carol"]["probed"][0] == seen["carol"]["seen"][0] == net.public_address("carol")
    assert seen["carol"]["probed"][1] != seen["carol"]["seen"][1]
    assert server.stdin is not None
    server.stdin.close()
    server.wait(timeout=10)
