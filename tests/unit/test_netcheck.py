"""``wanswarm netcheck``'s advice and text: what a volunteer reads for each outcome of the
check (the check itself runs against real daemons in tests/lab/test_lab_swarm.py)."""

from __future__ import annotations

from typing import Any

from wanswarm.node.tools.netcheck import advice, render


def _result(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "peers": 3, "observed": "203.0.113.7:40000", "nat": "cone", "udp_reachable": False,
        "tcp_reachable": None, "rendezvous": "12D3KooWRendezvous", "lan": ["192.168.1.2"],
        "quic_port": 31338, "checked_from_port": 31338, "dht_port": 31337,
    }
    return {**base, **fields}


def test_no_peers_asks_for_the_swarm_address() -> None:
    (line,) = advice(_result(peers=0, observed=None, nat="unknown", rendezvous=None))
    assert "--initial-peers" in line


def test_no_answer_points_at_outbound_udp() -> None:
    (line,) = advice(_result(observed=None, nat="unknown", rendezvous=None))
    assert "outbound UDP" in line


def test_reachable_needs_nothing_and_names_a_closed_dht_port() -> None:
    lines = advice(_result(nat="public", udp_reachable=True, tcp_reachable=False))
    assert lines[0].startswith("Nothing to do")
    assert "TCP port 31337" in lines[1]


def test_cone_punches_and_forwarding_is_optional() -> None:
    lines = advice(_result())
    assert "hole punching" in lines[0] and "12D3KooWRendezvous" in lines[0]
    assert lines[1].startswith("Optional") and "UDP 31338" in lines[1]
    assert "192.168.1.2" in lines[1] and "TCP 31337" in lines[1]


def test_symmetric_is_relayed_and_forwarding_is_recommended() -> None:
    lines = advice(_result(nat="symmetric"))
    assert "relay" in lines[0] and lines[1].startswith("Recommended")


def test_unknown_nat_with_a_rendezvous_still_works() -> None:
    lines = advice(_result(nat="unknown"))
    assert lines[0].startswith("Works")


def test_render_lists_every_field_and_the_advice() -> None:
    result = _result()
    result["advice"] = advice(result)
    text = render(result)
    for label in ("public address", "NAT", "UDP reachable", "TCP reachable", "rendezvous/relay",
                  "LAN addresses", "advice"):
        assert label in text
    assert "203.0.113.7:40000" in text and "not checked" in text
