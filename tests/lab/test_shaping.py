"""The home uplink's shaping as measured: delay, loss and rate each match their setting."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from wanswarm.node.tools.netlab import Lab
from wanswarm.node.tools.netlab_topology import Home, Link, Topology

LabFactory = Callable[[Topology], Lab]
ECHO = "9000"


def test_round_trip_is_twice_the_one_way_delay(lab: LabFactory) -> None:
    delay_ms = 30.0
    net = lab(Topology(public=("boot",), homes=(Home("alice", link=Link(delay_ms=delay_ms)),)))
    net.probe_server("boot", "echo", "--port", ECHO)
    pings = net.probe("alice", "ping", "--to", f"{net.address('boot')}:{ECHO}", "--count", "20",
                      "--interval", "0.01", "--timeout", "2")
    rtts = pings["rtts_ms"]
    assert pings["lost"] == 0
    # each packet is held at least the delay, each way; the slack above it is timer and
    # scheduling latency, generous because the cores are shared
    assert min(rtts) >= 2 * delay_ms, rtts
    assert statistics.median(rtts) <= 2 * delay_ms + 20.0, rtts


def _within_binomial(count: int, trials: int, p: float, sigmas: float = 5.0) -> bool:
    """Whether ``count`` successes in ``trials`` fit probability ``p`` (5 sigmas: 1 in 1.7M)."""
    mean, sd = trials * p, math.sqrt(trials * p * (1.0 - p))
    return abs(count - mean) <= sigmas * sd


def test_loss_rate_matches_the_setting_each_way(lab: LabFactory) -> None:
    loss = 0.2
    net = lab(Topology(public=("boot",), homes=(Home("bob", link=Link(loss=loss)),)))
    to = f"{net.address('boot')}:9001"
    # one way: numbered datagrams up to a sink
    net.probe_server("boot", "sink", "--port", "9001", "--timeout", "30")
    trials = 2000
    up = net.probe("bob", "blast", "--to", to, "--count", str(trials), "--rate-pps", "2000",
                   "--size", "200", timeout=60)
    assert up["send_errors"] == 0
    assert _within_binomial(up["received"], trials, 1.0 - loss), up
    # both ways: numbered datagrams through an echo server, each answer crossing the link twice
    net.probe_server("boot", "echo", "--port", ECHO)
    rt = net.probe("bob", "roundtrip", "--to", f"{net.address('boot')}:{ECHO}", "--count",
                   str(trials), "--rate-pps", "2000", timeout=60)
    assert not rt["timed_out"]
    assert _within_binomial(rt["answered"], trials, (1.0 - loss) ** 2), rt


def test_rate_limit_matches_the_setting_each_way(lab: LabFactory) -> None:
    rate_mbit = 20.0
    net = lab(Topology(public=("boot",), homes=(Home("alice", link=Link(rate_mbit=rate_mbit)),)))
    net.probe_server("boot", "bulk-server", "--port", "9002")
    to = f"{net.address('boot')}:9002"
    size = str(int(rate_mbit * 1e6 / 8 * 1.0))  # about one second at the rate
    for direction in ("up", "down"):
        bulk = net.probe("alice", "bulk", "--to", to, "--bytes", size, "--direction", direction,
                         timeout=60)
        # TCP payload is ~96% of what tbf counts (Ethernet, IP and TCP headers)
        assert 0.8 * rate_mbit <= bulk["mbit_s"] <= 1.05 * rate_mbit, bulk
