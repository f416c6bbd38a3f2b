"""Path MTU probing between separate hosts (transport/path_mtu.py), across the lab's real
links: on the internet's 1500-byte MTU every probe is refused (sent with fragmentation
forbidden, a probe larger than the link fails at the sender) and the connection keeps
1452-byte datagrams, also through a home's NAT; on a jumbo-frame link (MTU 9000) the 16448
probe fails and the 8952 one is acknowledged and adopted; and when that link's MTU later
shrinks under the connection, it goes back to 1452."""

from __future__ import annotations

import json
import subprocess
import sys
import time
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


def test_a_path_whose_mtu_shrinks_under_a_connection_goes_back_to_1452(lab: LabFactory) -> None:
    """Black-hole detection between separate hosts: the connection adopted 8952-byte
    datagrams on a jumbo-frame path, then the internet's ports go back to a 1500-byte MTU
    and drop every larger frame without a word (a bridge does not fragment, nor send ICMP).
    Three 400 KB requests sent after that complete on the same connection, the first one
    sent again once (its FEC transfer's symbols no longer fit), the dialling side back at
    1452-byte datagrams. Without the check the first two failed (transfer_failed, their
    connection still at 8952 bytes) and the third completed after 6 s on a new connection,
    the first one declared dead."""
    net = lab(Topology(public=("boot", "pub")))
    for host in ("boot", "pub"):
        net.exec(host, ["ip", "link", "set", HOST_IF, "mtu", "9000"])
    for port in ("p0", "p1"):
        net.exec(INET, ["ip", "link", "set", port, "mtu", "9000"])
    server, boot = _serve(net, "boot")
    dialer = net.popen("pub", [sys.executable, PEER, "dial", *boot, "shrink"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        adopted = json.loads(read_line(dialer, 60))
        assert adopted["max_udp_payload"] == 8952, adopted
        time.sleep(1.2)  # past the earliest confirmation after the search
        for port in ("p0", "p1"):
            net.exec(INET, ["ip", "link", "set", port, "mtu", "1500"])
        assert dialer.stdin is not None
        dialer.stdin.write(b"\n")
        dialer.stdin.flush()
        after = json.loads(read_line(dialer, 60))
        assert after["outcomes"] == ["ok"] * 3, after
        assert after["same_connection"], after
        assert after["max_udp_payload"] == 1452, after
        assert after["counts"]["mtu_probe.black_hole"] == 1, after
        assert after["seconds"][0] < 10, after
        dialer.wait(timeout=10)
    finally:
        if dialer.poll() is None:
            dialer.kill()
        _stop(server)
