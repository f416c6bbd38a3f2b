"""Who reaches whom: public hosts each other, home hosts the internet, nobody a home host."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

from wanswarm.node.tools.netlab import Lab, probe_argv
from wanswarm.node.tools.netlab_topology import Home, Topology

LabFactory = Callable[[Topology], Lab]
ECHO = "9000"


def test_public_hosts_reach_each_other_directly(lab: LabFactory) -> None:
    net = lab(Topology(public=("a", "b")))
    for host in ("a", "b"):
        net.probe_server(host, "echo", "--port", ECHO)
    for src, dst in (("a", "b"), ("b", "a")):
        to = f"{net.address(dst)}:{ECHO}"
        udp = net.probe(src, "ask", "--to", to)
        tcp = net.probe(src, "ask", "--tcp", "--to", to)
        assert udp["observed"] == [f"{net.address(src)}:{udp['local_port']}"]
        assert tcp["observed"][0].split(":")[0] == net.address(src)


def test_home_host_reaches_the_internet_from_its_router_address(lab: LabFactory) -> None:
    net = lab(Topology(public=("boot",), homes=(Home("alice"),)))
    net.probe_server("boot", "echo", "--port", ECHO)
    to = f"{net.address('boot')}:{ECHO}"
    udp = net.probe("alice", "ask", "--to", to)
    tcp = net.probe("alice", "ask", "--tcp", "--to", to)
    public, private = net.public_address("alice"), net.address("alice")
    assert public != private
    assert udp["observed"][0].split(":")[0] == public
    assert tcp["observed"][0].split(":")[0] == public


def test_unsolicited_inbound_never_reaches_a_home_host(lab: LabFactory) -> None:
    net = lab(Topology(public=("boot",), homes=(Home("alice"), Home("bob", nat="symmetric"))))
    targets = []
    for home in ("alice", "bob"):
        net.probe_server(home, "echo", "--port", ECHO)
        # the server answers on its own host, so silence below is the router's doing
        assert net.probe(home, "ask", "--to", f"127.0.0.1:{ECHO}")["observed"] != [None]
        for address in (net.public_address(home), net.address(home)):
            targets += ["--to", f"{address}:{ECHO}"]
    asks = [  # every target at once, UDP and TCP side by side: each waits out its second
        net.popen("boot", probe_argv("ask", *transport, *targets, "--timeout", "1"),
                  stdout=subprocess.PIPE)
        for transport in ((), ("--tcp",))
    ]
    for proc in asks:
        out, _ = proc.communicate(timeout=30)
        assert json.loads(out)["observed"] == [None] * 4, proc.args


def test_hosts_of_one_home_share_its_address_and_reach_each_other(lab: LabFactory) -> None:
    net = lab(Topology(public=("boot",), homes=(Home("house", hosts=("pc", "laptop")),)))
    assert net.public_address("pc") == net.public_address("laptop")
    net.probe_server("boot", "echo", "--port", ECHO)
    net.probe_server("laptop", "echo", "--port", ECHO)
    for host in ("pc", "laptop"):
        observed = net.probe(host, "ask", "--to", f"{net.address('boot')}:{ECHO}")["observed"]
        assert observed[0].split(":")[0] == net.public_address(host)
    # on the LAN, directly: the laptop sees the pc's own address
    lan = net.probe("pc", "ask", "--to", f"{net.address('laptop')}:{ECHO}")
    assert lan["observed"] == [f"{net.address('pc')}:{lan['local_port']}"]
