"""The lab's topology, address plan and router rules as data (no root needed)."""

from __future__ import annotations

import pytest
from wanswarm.node.tools import netlab_topology as topo
from wanswarm.node.tools.netlab_topology import Home, Link, Topology, TopologyError


def test_plan_assigns_public_router_and_lan_addresses() -> None:
    plan = topo.plan(Topology(public=("a", "b"), homes=(Home("h1"), Home("h2", hosts=("x", "y")))))
    assert [plan.hosts[h].address for h in ("a", "b")] == ["11.0.0.10", "11.0.0.11"]
    assert plan.hosts["a"].public_address == "11.0.0.10"
    assert plan.hosts["a"].gateway == "11.0.0.1"
    assert plan.routers["h1"].wan_address == "11.1.0.10"
    assert plan.routers["h2"].wan_address == "11.1.0.11"
    assert plan.hosts["h1"].address == "192.168.1.2"
    assert plan.hosts["h1"].gateway == "192.168.1.1"
    assert plan.hosts["h1"].public_address == "11.1.0.10"
    assert [plan.hosts[h].address for h in ("x", "y")] == ["192.168.2.2", "192.168.2.3"]
    assert plan.routers["h2"].node == "r-h2"


def test_homes_may_share_one_lan() -> None:
    lan = "192.168.1.0/24"
    plan = topo.plan(Topology(homes=(Home("h1", lan=lan), Home("h2", lan=lan))))
    assert plan.hosts["h1"].address == plan.hosts["h2"].address == "192.168.1.2"
    assert plan.hosts["h1"].public_address != plan.hosts["h2"].public_address


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Topology(), "at least one host"),
        (lambda: Topology(public=("Boot",)), "public host name"),
        (lambda: Topology(public=("inet",)), "not 'inet'"),
        (lambda: Topology(public=("a",), homes=(Home("b", hosts=("a",)),)), "repeated: a"),
        (lambda: Topology(homes=(Home("a", hosts=("x",)), Home("a", hosts=("y",)))),
         "home names"),
        (lambda: Home("a", nat="full-cone"), "nat is one of"),
        (lambda: Home("a", lan="11.0.5.0/24"), "must not overlap"),
        (lambda: Home("a", lan="10.0.0.0/30", hosts=("x", "y")), "too small"),
        (lambda: Link(loss=1.0), "loss"),
        (lambda: Link(delay_ms=-1), "delay_ms"),
        (lambda: Link(rate_mbit=0), "rate_mbit"),
    ],
)
def test_unusable_topologies_say_what_to_change(build: object, message: str) -> None:
    assert callable(build)
    with pytest.raises(TopologyError, match=message):
        build()


def test_cone_and_symmetric_nat_rules() -> None:
    plan = topo.plan(Topology(homes=(Home("c"), Home("s", nat="symmetric"))))
    cone = topo.router_ruleset(plan.routers["c"])
    symmetric = topo.router_ruleset(plan.routers["s"])
    assert 'oifname "wan" masquerade\n' in cone
    assert 'oifname "wan" masquerade random,fully-random\n' in symmetric
    for rules in (cone, symmetric):
        assert 'iifname "wan" drop' in rules  # nothing unsolicited reaches the router
        assert "policy drop" in rules  # nor is forwarded through it
        assert "notrack" not in rules and "numgen" not in rules


def test_delay_and_loss_rules() -> None:
    home = Home("h", link=Link(delay_ms=25, loss=0.01))
    rules = topo.router_ruleset(topo.plan(Topology(homes=(home,))).routers["h"])
    # the LAN <-> TUN legs stay untracked so that conntrack NATs the TUN <-> WAN leg
    assert 'iifname "lan" notrack' in rules
    assert 'iifname "dly" ip daddr 192.168.1.0/24 notrack' in rules
    assert 'iifname "dly" oifname "wan" accept' in rules
    # loss drawn once per packet and direction: on the way into the delay stage
    assert 'oifname "dly" numgen random mod 1000000 < 10000 drop' in rules
    undelayed = topo.router_ruleset(
        topo.plan(Topology(homes=(Home("h", link=Link(loss=0.01)),))).routers["h"]
    )
    assert "\t\tnumgen random mod 1000000 < 10000 drop" in undelayed
    assert 'iifname "lan" oifname "wan" accept' in undelayed


def test_tbf_burst_is_four_milliseconds_of_rate_and_at_least_two_frames() -> None:
    assert topo.tbf_args(Link(rate_mbit=100)) == [
        "tbf", "rate", "100000000bit", "burst", "50000", "latency", "50ms"]
    assert topo.tbf_args(Link(rate_mbit=1, queue_ms=20))[4:] == ["3200", "latency", "20ms"]


def test_topology_from_toml_and_flags() -> None:
    text = topo.__doc__ or ""
    toml = text[text.index("[[public]]"):text.index('lan = "192.168.1.0/24"') + 24]
    parsed = topo.from_toml("\n".join(line.strip() for line in toml.splitlines()))
    assert parsed == Topology(
        public=("boot",),
        homes=(Home("alice", "cone", Link(25.0, 0.01, 100.0), ("alice",), "192.168.1.0/24"),),
    )
    with pytest.raises(TopologyError, match="unknown keys"):
        topo.from_toml('[[home]]\nname = "a"\nspeed = 3\n')
    with pytest.raises(TopologyError, match="not TOML"):
        topo.from_toml("[[home]\n")
    flags = topo.from_flags(["boot"], ["a", "b:symmetric"], Link(delay_ms=5))
    assert flags.homes[1] == Home("b", "symmetric", Link(delay_ms=5))
    assert flags.homes[0].nat == "cone"
