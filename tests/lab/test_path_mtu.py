"""Path MTU probing between separate hosts (transport/path_mtu.py), across the lab's real
links: on the internet's 1500-byte MTU every probe is refused (sent with fragmentation
forbidden, a probe larger than the link fails at the sender) and the connection keeps
1452-byte datagrams, also through a home's NAT; on a jumbo-frame link (MTU 9000) the 16448
probe fails and the 8952 one is acknowledged and adopted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wanswarm.node.tools.netlab import INET, Lab, read_line
from wanswarm.node.tools.netlab_topology import HOST_IF, Home, Topology

LabFactory = Callable[[Topology], Lab]
PEER = str(Path(__file__).with_name("mtu_peer.py"))


def _dial(net: Lab, host: str, boot: list[str]) -> dict[str, Any]:
    done = net.exec(host, [sys.executable, PEER, "dial", *boot], timeout=60)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _serve(net: Lab, host: str) -> tuple[subprocess.Popen[Any], list[str]]:
    server = net.popen(host, [sys.executable, PEER, "serve"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    ready = json.loads(read_line(server, 30))
    return server, [ready["peer_id"], net.address(host), str(ready["port"])]


def _stop(server: subprocess.Popen[Any]) -> None:
    assert server.stdin is not None
    server.stdin.close()
    server.wait(timeout=10)


def test_a_1500_byte_path_keeps_1452_byte_datagrams(lab: LabFactory) -> None:
    net = lab(Topology(public=("boot", "pub"), homes=(Home("alice"),)))
    server, boot = _serve(net, "boot")
    try:
        for host in ("pub", "alice"):
            seen = _dial(net, host, boot)
            assert seen["max_udp_payload"] == 1452, (host, seen)
            assert seen["counts"].get("mtu_probe.sent") == 6, (host, seen)
            assert "mtu_probe.acked" not in seen["counts"], (host, seen)
    finally:
        _stop(server)


def test_a_jumbo_frame_path_carries_8952_byte_datagrams(lab: LabFactory) -> None:
    net = lab(Topology(public=("boot", "pub")))
    for host in ("boot", "pub"):
        net.exec(host, ["ip", "link", "set", HOST_IF, "mtu", "9000"])
    for port in ("p0", "p1"):  # their ends on the internet's bridge
        net.exec(INET, ["ip", "link", "set", port, "mtu", "9000"])
    server, boot = _serve(net, "boot")
    try:
        seen = _dial(net, "pub", boot)
        assert seen["max_udp_payload"] == 8952, seen
        assert seen["counts"]["mtu_probe.acked"] == 1, seen
        assert seen["counts"]["mtu_probe.sent"] == 4, seen  # 16448 three times, then 8952
    finally:
        _stop(server)
