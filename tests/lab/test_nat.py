"""NAT behaviour: cone mappings keep one public port, symmetric ones do not; hole punching."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

from wanswarm.node.tools.netlab import Lab, probe_argv, read_line
from wanswarm.node.tools.netlab_topology import Home, Link, Topology

LabFactory = Callable[[Topology], Lab]
ECHO = "9000"


def test_cone_nat_keeps_one_public_port_symmetric_nat_does_not(lab: LabFactory) -> None:
    net = lab(Topology(public=("s1", "s2"), homes=(Home("cone"), Home("sym", nat="symmetric"))))
    for server in ("s1", "s2"):
        net.probe_server(server, "echo", "--port", ECHO)
    servers = ["--to", f"{net.address('s1')}:{ECHO}", "--to", f"{net.address('s2')}:{ECHO}"]
    for home in ("cone", "sym"):
        observed = net.probe(home, "ask", *servers)["observed"]
        assert None not in observed
        addresses = {o.split(":")[0] for o in observed}
        ports = {o.split(":")[1] for o in observed}
        assert addresses == {net.public_address(home)}
        assert len(ports) == (1 if home == "cone" else 2), observed


def _punch(net: Lab, a: str, b: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both hosts learn their mapping from the rendezvous server, swap them, punch at once."""
    rendezvous = f"{net.address('boot')}:{ECHO}"
    procs = [
        net.popen(host, probe_argv("punch", "--rendezvous", rendezvous, "--timeout", "2"),
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for host in (a, b)
    ]
    mappings = [json.loads(read_line(proc, 15))["mapping"] for proc in procs]
    assert None not in mappings
    for proc, peer in zip(procs, reversed(mappings), strict=True):
        assert proc.stdin is not None
        proc.stdin.write(f"{peer}\n".encode())
        proc.stdin.flush()
    results = [json.loads(proc.communicate(timeout=30)[0]) for proc in procs]
    return results[0], results[1]


def test_hole_punching_between_cone_nats_succeeds(lab: LabFactory) -> None:
    net = lab(Topology(public=("boot",), homes=(
        Home("alice", link=Link(delay_ms=10)), Home("bob", link=Link(delay_ms=5)),
    )))
    net.probe_server("boot", "echo", "--port", ECHO)
    alice, bob = _punch(net, "alice", "bob")
    assert alice["ok"] and bob["ok"], (alice, bob)
    assert alice["heard_from"].split(":")[0] == net.public_address("bob")
    assert bob["heard_from"].split(":")[0] == net.public_address("alice")


def test_hole_punching_between_cone_and_symmetric_nat_fails(lab: LabFactory) -> None:
    # what relays are for: the symmetric NAT maps the socket to a new port for the cone
    # host, so neither side's packets match a mapping the other opened
    net = lab(Topology(public=("boot",), homes=(Home("alice"), Home("carol", nat="symmetric"))))
    net.probe_server("boot", "echo", "--port", ECHO)
    alice, carol = _punch(net, "alice", "carol")
    assert not alice["ok"] and alice["heard_from"] is None, alice
    assert not carol["ok"] and carol["heard_from"] is None, carol
