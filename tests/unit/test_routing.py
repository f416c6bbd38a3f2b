"""Router: cost model, stochastic choice, bans with back-off, simulated swarms (no sockets)."""

from __future__ import annotations

import heapq
import math
import random

import pytest
from wanswarm.node.training.routing import Candidate, Router, RouterConfig


def _router(**overrides: float) -> Router:
    return Router(RouterConfig(**overrides))


def _pick(router: Router, peers: list[Candidate], rng: random.Random, batch_size: int = 4) -> str:
    pick = router.choose(peers, payload_bytes=0, batch_size=batch_size, now=0.0, rng=rng)
    assert pick is not None
    return pick.peer_id


def test_expected_time_adds_rtt_queued_work_and_transfer() -> None:
    router = _router()
    c = Candidate("a", throughput=50.0, queue_len=3, rtt_s=0.04, delivery_rate_bps=8e6)
    # 0.04 s RTT + (3 queued + 0 ours + 1) * 10 samples / 50 samples/s + 1e6 B * 8 / 8e6 b/s
    assert router.expected_time(c, payload_bytes=1_000_000, batch_size=10) == pytest.approx(
        0.04 + 0.8 + 1.0
    )
    router.started("a")
    router.started("a")
    assert router.expected_time(c, payload_bytes=0, batch_size=10) == pytest.approx(0.04 + 1.2)


def test_unknown_or_garbage_figures_fall_back_to_defaults() -> None:
    cfg = RouterConfig(default_rtt_s=0.2, default_delivery_rate_bps=1e6, min_throughput=0.5)
    router = Router(cfg)
    for c in (
        Candidate("a", throughput=0.0),
        Candidate("a", throughput=math.nan, rtt_s=-1.0, delivery_rate_bps=math.inf),
        Candidate("a", throughput=-5.0, queue_len=-7, rtt_s=math.nan, delivery_rate_bps=0.0),
    ):
        assert router.expected_time(c, payload_bytes=125, batch_size=1) == pytest.approx(
            0.2 + 1 / 0.5 + 125 * 8 / 1e6
        )


def test_zero_temperature_picks_the_fastest_and_breaks_ties_at_random() -> None:
    router = _router(temperature=0.0, min_temperature_s=0.0)
    rng = random.Random(1)
    peers = [Candidate("slow", 10.0, rtt_s=0.01), Candidate("fast", 100.0, rtt_s=0.01)]
    picks = {_pick(router, peers, rng) for _ in range(50)}
    assert picks == {"fast"}
    twins = [Candidate("x", 10.0, rtt_s=0.01), Candidate("y", 10.0, rtt_s=0.01)]
    counts = {"x": 0, "y": 0}
    for _ in range(400):
        pick = router.choose(twins, payload_bytes=0, batch_size=4, now=0.0, rng=rng)
        assert pick is not None
        counts[pick.peer_id] += 1
    assert 150 < counts["x"] < 250


def test_choice_probabilities_follow_the_softmax_of_costs() -> None:
    router = _router(temperature=0.1, min_temperature_s=0.0)
    rng = random.Random(7)
    # costs 1.0 and 1.1 s: tau = 0.1, so weights 1 and e^-1
    a = Candidate("a", throughput=1.0, rtt_s=1e-9, delivery_rate_bps=1e12)
    b = Candidate("b", throughput=1.0, rtt_s=0.1, delivery_rate_bps=1e12)
    n = 20_000
    hits = sum(_pick(router, [a, b], rng, batch_size=1) == "b" for _ in range(n))
    expected = math.exp(-1.0) / (1.0 + math.exp(-1.0))
    assert abs(hits / n - expected) < 0.015


def test_per_peer_payload_prefers_the_server_holding_the_input() -> None:
    router = _router(temperature=0.0, min_temperature_s=0.0)
    rng = random.Random(3)
    peers = [
        Candidate("holder", 10.0, rtt_s=0.05, delivery_rate_bps=8e6),
        Candidate("other", 10.0, rtt_s=0.05, delivery_rate_bps=8e6),
    ]
    pick = router.choose(
        peers, payload_bytes={"holder": 1000, "other": 1_000_000}, batch_size=1, now=0.0, rng=rng
    )
    assert pick is not None and pick.peer_id == "holder"


def test_backoff_doubles_up_to_the_cap_and_success_resets_it() -> None:
    router = _router(ban_base_s=1.0, ban_max_s=10.0, ban_jitter=0.0)
    rng = random.Random(0)
    now, bans = 100.0, []
    for _ in range(6):
        router.started("p")
        ban = router.finished("p", ok=False, now=now, rng=rng)
        assert ban is not None
        bans.append(ban)
        now += ban  # the probe after each ban fails again
    assert bans == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert router.banned_until("p") == now == 135.0
    assert router.failures("p") == 6
    assert router.finished("p", ok=True, now=136.0, rng=rng) is None
    assert router.failures("p") == 0
    assert router.finished("p", ok=False, now=136.0, rng=rng) == 1.0


def test_failures_of_requests_caught_by_one_outage_count_once() -> None:
    router = _router(ban_base_s=1.0, ban_jitter=0.0)
    rng = random.Random(0)
    for _ in range(8):
        router.started("p")
    assert router.finished("p", ok=False, now=10.0, rng=rng) == 1.0
    for t in (10.0, 10.2, 10.9):  # the rest of the window times out during the ban
        assert router.finished("p", ok=False, now=t, rng=rng) == 0.0
    assert router.failures("p") == 1
    assert router.banned_until("p") == 11.0


def test_after_a_ban_a_peer_gets_one_probe_at_a_time() -> None:
    router = _router(ban_base_s=1.0, ban_jitter=0.0, temperature=0.0, min_temperature_s=0.0)
    rng = random.Random(0)
    fast, slow = Candidate("fast", 100.0), Candidate("slow", 1.0)
    router.ban("fast", now=0.0, rng=rng)
    pick = router.choose([fast, slow], payload_bytes=0, batch_size=1, now=1.0, rng=rng)
    assert pick is not None and pick.peer_id == "fast"
    router.started("fast")  # the probe
    pick = router.choose([fast, slow], payload_bytes=0, batch_size=1, now=1.0, rng=rng)
    assert pick is not None and pick.peer_id == "slow"
    router.finished("fast", ok=True, now=1.1, rng=rng)  # recovered: back to normal
    router.started("fast")
    pick = router.choose([fast, slow], payload_bytes=0, batch_size=1, now=1.1, rng=rng)
    assert pick is not None and pick.peer_id == "fast"


def test_backoff_jitter_stays_within_its_band() -> None:
    router = _router(ban_base_s=2.0, ban_max_s=1000.0, ban_jitter=0.25)
    rng = random.Random(5)
    durations, now = [], 0.0
    for _ in range(8):
        durations.append(router.ban("p", now=now, rng=rng))
        now += durations[-1]
    for k, d in enumerate(durations):
        nominal = 2.0 * 2**k
        assert 0.75 * nominal <= d <= 1.25 * nominal
    assert len(set(durations)) == len(durations)  # jittered, not a fixed ladder


def test_banned_peer_is_avoided_until_its_ban_ends() -> None:
    router = _router(ban_base_s=5.0, ban_jitter=0.0, temperature=0.0, min_temperature_s=0.0)
    rng = random.Random(2)
    fast, slow = Candidate("fast", 100.0), Candidate("slow", 1.0)
    router.finished("fast", ok=False, now=0.0, rng=rng)
    for t in (0.0, 2.5, 4.999):
        pick = router.choose([fast, slow], payload_bytes=0, batch_size=1, now=t, rng=rng)
        assert pick is not None and pick.peer_id == "slow"
    pick = router.choose([fast, slow], payload_bytes=0, batch_size=1, now=5.0, rng=rng)
    assert pick is not None and pick.peer_id == "fast"


def test_clear_ban_makes_a_moved_server_a_fresh_candidate() -> None:
    router = _router(ban_base_s=5.0, ban_jitter=0.0, temperature=0.0, min_temperature_s=0.0)
    rng = random.Random(3)
    fast, slow = Candidate("fast", 100.0), Candidate("slow", 1.0)
    for t in (0.0, 6.0, 17.0):  # refused three times while it drained: banned 5, 10, 20 s
        router.finished("fast", ok=False, now=t, rng=rng)
    assert router.failures("fast") == 3 and router.is_banned("fast", 20.0)
    router.clear_ban("fast")  # it now serves another stage
    assert router.failures("fast") == 0 and not router.is_banned("fast", 20.0)
    pick = router.choose([fast, slow], payload_bytes=0, batch_size=1, now=20.0, rng=rng)
    assert pick is not None and pick.peer_id == "fast"
    router.clear_ban("never-seen")  # a no-op
    assert router.banned_until("never-seen") is None


def test_when_every_peer_is_banned_the_bans_are_ignored() -> None:
    router = _router(temperature=0.0, min_temperature_s=0.0)
    rng = random.Random(4)
    peers = [Candidate("a", 10.0), Candidate("b", 20.0)]
    for p in peers:
        router.ban(p.peer_id, now=0.0, rng=rng)
    pick = router.choose(peers, payload_bytes=0, batch_size=1, now=0.1, rng=rng)
    assert pick is not None and pick.peer_id == "b"
    # peers already tried for this hop go last, even among banned ones
    pick = router.choose(peers, payload_bytes=0, batch_size=1, now=0.1, rng=rng, avoid={"b"})
    assert pick is not None and pick.peer_id == "a"
    pick = router.choose(peers, payload_bytes=0, batch_size=1, now=0.1, rng=rng, avoid={"a", "b"})
    assert pick is not None and pick.peer_id == "b"
    assert router.choose([], payload_bytes=0, batch_size=1, now=0.1, rng=rng) is None


def test_prune_forgets_idle_departed_peers_only() -> None:
    router = _router(ban_jitter=0.0)
    rng = random.Random(0)
    router.started("busy")
    router.ban("banned", now=0.0, rng=rng)
    router.started("done")
    router.finished("done", ok=True, now=0.0, rng=rng)
    router.prune(live=[], now=0.5)
    assert router.in_flight("busy") == 1
    assert router.banned_until("banned") == 1.0
    assert len(router) == 2
    router.prune(live=["busy"], now=2.0)
    assert len(router) == 1


def _simulate(
    router: Router,
    peers: list[Candidate],
    *,
    dead: frozenset[str] = frozenset(),
    hops: int,
    in_flight: int,
    timeout: float = 1.0,
    seed: int = 0,
) -> tuple[dict[str, int], dict[str, int], float]:
    """Discrete-event swarm: FIFO servers at their throughput, a trainer with a window.

    Returns (hops completed per peer, attempts per peer, simulated seconds).
    """
    rng = random.Random(seed)
    by_id = {p.peer_id: p for p in peers}
    free_at = {p.peer_id: 0.0 for p in peers}
    done = {p.peer_id: 0 for p in peers}
    attempts = {p.peer_id: 0 for p in peers}
    events: list[tuple[float, int, str, bool]] = []  # (time, seq, peer, ok)
    seq = 0
    now = 0.0
    completed = 0
    sent = 0

    def send(t: float) -> None:
        nonlocal seq, sent
        pick = router.choose(peers, payload_bytes=0, batch_size=1, now=t, rng=rng)
        assert pick is not None
        router.started(pick.peer_id)
        attempts[pick.peer_id] += 1
        rtt = pick.rtt_s or 0.0
        if pick.peer_id in dead:
            heapq.heappush(events, (t + timeout, seq, pick.peer_id, False))
        else:
            start = max(free_at[pick.peer_id], t + rtt / 2)
            free_at[pick.peer_id] = start + 1.0 / by_id[pick.peer_id].throughput
            heapq.heappush(events, (free_at[pick.peer_id] + rtt / 2, seq, pick.peer_id, True))
        seq += 1
        sent += 1

    for _ in range(in_flight):
        send(0.0)
    while completed < hops:
        now, _, peer, ok = heapq.heappop(events)
        router.finished(peer, ok=ok, now=now, rng=rng)
        if ok:
            done[peer] += 1
            completed += 1
        send(now)  # a failed hop is retried at once, a completed one makes room
    return done, attempts, now


def test_load_spreads_in_proportion_to_throughput() -> None:
    peers = [
        Candidate("slow", 10.0, rtt_s=0.01),
        Candidate("mid", 20.0, rtt_s=0.01),
        Candidate("fast", 40.0, rtt_s=0.01),
    ]
    done, _, _ = _simulate(_router(), peers, hops=3000, in_flight=16)
    total = sum(done.values())
    for peer, share in (("slow", 1 / 7), ("mid", 2 / 7), ("fast", 4 / 7)):
        assert abs(done[peer] / total - share) < 0.04, (peer, done)


def test_a_dead_peer_is_routed_around() -> None:
    peers = [
        Candidate("dead", 1000.0, rtt_s=0.01),
        Candidate("a", 20.0, rtt_s=0.01),
        Candidate("b", 20.0, rtt_s=0.01),
    ]
    router = _router(ban_base_s=1.0, ban_max_s=30.0)
    done, attempts, elapsed = _simulate(
        router, peers, dead=frozenset({"dead"}), hops=2000, in_flight=8, timeout=0.5
    )
    assert done["dead"] == 0
    assert done["a"] + done["b"] == 2000
    # ~50 s of simulated time: the first window lands on the (fastest-looking) dead peer,
    # then one probe per ban, and bans double: 1, 2, 4, 8, 16, 30 ... seconds (+-20 %)
    assert elapsed > 40.0
    assert attempts["dead"] <= 8 + 7, attempts
    assert 5 <= router.failures("dead") <= 7
