"""Discrete-event simulation of stage selection under churn (SWARM §4.3's experiment).

A swarm of ``--peers`` servers with log-normal throughput spread over ``--stages`` stages.
Servers leave (uniformly at random) and join (fresh throughput) as Poisson processes,
each at ``--churn`` x peers per hour, so the swarm size stays near ``--peers``. A joiner
picks its stage with ``choose_stage`` and serves after ``--load`` seconds of loading.
With rebalancing, every server runs ``rebalance_decision`` at jittered ``--period``
intervals and, when the plan names it, moves (and loads again). Both variants replay the
same membership trace and call the same pure code as the daemon
(``wanswarm.node.stage.selection``).

Measured: the swarm's bottleneck (lowest total throughput of a stage, counting only
servers that are serving) as a fraction of the optimum for the servers present (loading
ones included), averaged over time. The optimum is replaced by an upper bound, so the
printed fractions are lower bounds of the true ones:

    U = min over k = 0..S-1 of (sum of throughputs - sum of the k largest) / (S - k)

(in any assignment the k largest servers sit in at most k stages, so some S - k stages
hold only the other servers, and the smallest of those is at most their mean). The
script also prints what the greedy LPT assignment (largest first onto the least-loaded
stage) reaches, to show how tight U is.

    python benchmarks/rebalance_sim.py --peers 1000 --stages 8 --hours 6 --churn 0.1

The last line is JSON: {"with_rebalancing": ..., "without_rebalancing": ..., ...}.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from dataclasses import dataclass

from wanswarm.node.membership.records import ServerState
from wanswarm.node.stage.selection import (
    RebalancePolicy,
    ServerLoad,
    choose_stage,
    next_rebalance_delay,
    plan_rebalance,
)


def upper_bound(throughputs: list[float], n_stages: int) -> float:
    """An upper bound of the best achievable bottleneck (see the module docstring)."""
    if len(throughputs) < n_stages:
        return 0.0
    ordered = sorted(throughputs, reverse=True)
    rest = sum(ordered)
    bound = rest / n_stages
    for k in range(1, n_stages):
        rest -= ordered[k - 1]
        bound = min(bound, rest / (n_stages - k))
    return bound


def lpt_bottleneck(throughputs: list[float], n_stages: int) -> float:
    """Bottleneck of the greedy LPT assignment: an achievable value, a lower bound of optimum."""
    totals = [0.0] * n_stages
    heap = [(0.0, s) for s in range(n_stages)]
    for t in sorted(throughputs, reverse=True):
        total, s = heapq.heappop(heap)
        totals[s] = total + t
        heapq.heappush(heap, (totals[s], s))
    return min(totals)


@dataclass(frozen=True)
class TraceEvent:
    """One membership change: ``peer`` joins with ``throughput``, or leaves."""

    time: float
    peer: str
    joins: bool
    throughput: float = 0.0


@dataclass(frozen=True)
class Trace:
    """Initial servers and the membership changes of one simulated run."""

    initial: tuple[tuple[str, float], ...]
    events: tuple[TraceEvent, ...]
    horizon_s: float


def make_trace(peers: int, hours: float, churn: float, sigma: float, seed: int) -> Trace:
    """Poisson joins and leaves, each at ``churn * peers`` per hour; log-normal throughput."""
    rng = random.Random(seed)
    present = [f"p{i}" for i in range(peers)]
    initial = tuple((p, rng.lognormvariate(0.0, sigma)) for p in present)
    rate = churn * peers / 3600.0  # events of each kind per second
    horizon = hours * 3600.0
    events: list[TraceEvent] = []
    now, next_id = 0.0, peers
    while rate > 0:
        now += rng.expovariate(2 * rate)
        if now >= horizon:
            break
        if rng.random() < 0.5 or len(present) <= 1:
            peer = f"p{next_id}"
            next_id += 1
            present.append(peer)
            events.append(TraceEvent(now, peer, True, rng.lognormvariate(0.0, sigma)))
        else:
            peer = present.pop(rng.randrange(len(present)))
            events.append(TraceEvent(now, peer, False))
    return Trace(initial, tuple(events), horizon)


@dataclass
class _Peer:
    throughput: float
    stage: int
    state: ServerState
    fresh: bool  # joined and still loading its first stage: no assignment could use it yet
    epoch: int = 0  # bumped on every move, so that stale "ready" events are recognised


@dataclass(frozen=True)
class SimResult:
    """Time-averaged fraction of the bound, per-hour fractions, and how many moves were made."""

    mean_fraction: float
    hourly: tuple[float, ...]
    moves: int
    plans: int
    lpt_fraction_of_bound: float  # at start and end, the worse: how close LPT gets to U
    seconds: float


def simulate(
    trace: Trace,
    n_stages: int,
    policy: RebalancePolicy,
    *,
    rebalance: bool,
    seed: int,
    random_joins: bool = False,
) -> SimResult:
    """Replay ``trace``; return the time average of (serving bottleneck) / U.

    U is computed over the servers that some assignment could have serving now: everyone
    except fresh joiners still loading their first stage (a server moved by rebalancing
    stays in, so its loading time counts against the policy).
    """
    began = time.perf_counter()
    rng = random.Random(seed)
    peers: dict[str, _Peer] = {}
    records: dict[str, ServerLoad] = {}  # what the DHT shows: one record per server
    heap: list[tuple[float, int, str, str, int]] = []  # (time, seq, kind, peer, epoch)
    serving = [0.0] * n_stages  # throughput per stage of online servers
    seq = 0

    def push(at: float, kind: str, pid: str, epoch: int = 0) -> None:
        nonlocal seq
        heapq.heappush(heap, (at, seq, kind, pid, epoch))
        seq += 1

    def announce(pid: str) -> None:
        p = peers[pid]
        records[pid] = ServerLoad(pid, p.stage, p.throughput, p.state)

    def pick_stage(throughput: float) -> int:
        if random_joins:
            return rng.randrange(n_stages)
        return choose_stage(list(records.values()), n_stages, throughput, rng)

    def eligible() -> list[float]:
        return [p.throughput for p in peers.values() if not p.fresh]

    for pid, thr in trace.initial:  # a settled swarm: everyone joined in turn and loaded
        peers[pid] = _Peer(thr, pick_stage(thr), "online", fresh=False)
        serving[peers[pid].stage] += thr
        announce(pid)
        if rebalance:
            push(rng.uniform(0.0, policy.period_s), "check", pid)
    for event in trace.events:
        push(event.time, "join" if event.joins else "leave", event.peer)
    joins = {e.peer: e.throughput for e in trace.events if e.joins}

    bound = upper_bound(eligible(), n_stages)
    lpt_worst = lpt_bottleneck(eligible(), n_stages) / bound
    hours = max(1, math.ceil(trace.horizon_s / 3600.0))
    hourly = [0.0] * hours
    last_t, integral, moves, plans = 0.0, 0.0, 0, 0
    plan: dict[str, int] | None = None  # peer -> new stage; valid until the records change

    def advance(to: float) -> None:
        nonlocal last_t, integral
        r = min(serving) / bound if bound > 0 else 0.0
        while last_t < to:
            hour = min(int(last_t // 3600.0), hours - 1)
            step = min(to, (hour + 1) * 3600.0) - last_t
            hourly[hour] += r * step
            integral += r * step
            last_t += step

    while heap and heap[0][0] < trace.horizon_s:
        at, _, kind, pid, epoch = heapq.heappop(heap)
        advance(at)
        if kind == "check":
            peer = peers.get(pid)
            if peer is None:
                continue  # left; its timer dies with it
            push(at + next_rebalance_delay(rng, policy), "check", pid)
            if plan is None:
                # Every server with this view computes the same plan (rebalance_decision
                # is this lookup); computing it once per view keeps the simulation fast.
                plan = {
                    m.peer_id: m.to_stage
                    for m in plan_rebalance(list(records.values()), n_stages, policy).moves
                }
                plans += 1
            if peer.state != "online" or pid not in plan:
                continue
            serving[peer.stage] -= peer.throughput
            peer.stage, peer.state = plan[pid], "joining"
            peer.epoch += 1
            push(at + policy.load_s, "ready", pid, peer.epoch)
            moves += 1
        elif kind == "ready":
            peer = peers.get(pid)
            if peer is None or peer.epoch != epoch:
                continue
            peer.state = "online"
            serving[peer.stage] += peer.throughput
            if peer.fresh:
                peer.fresh = False
                bound = upper_bound(eligible(), n_stages)
        elif kind == "join":
            thr = joins[pid]
            peers[pid] = _Peer(thr, pick_stage(thr), "joining", fresh=True)
            push(at + policy.load_s, "ready", pid, 0)
            if rebalance:
                push(at + next_rebalance_delay(rng, policy), "check", pid)
        else:  # leave
            peer = peers.pop(pid)
            del records[pid]
            if peer.state == "online":
                serving[peer.stage] -= peer.throughput
            if not peer.fresh:
                bound = upper_bound(eligible(), n_stages)
            plan = None
            continue
        announce(pid)
        plan = None
    advance(trace.horizon_s)
    lpt_worst = min(lpt_worst, lpt_bottleneck(eligible(), n_stages) / bound)
    return SimResult(
        mean_fraction=integral / trace.horizon_s,
        hourly=tuple(h / min(3600.0, trace.horizon_s - i * 3600.0) for i, h in enumerate(hourly)),
        moves=moves,
        plans=plans,
        lpt_fraction_of_bound=lpt_worst,
        seconds=time.perf_counter() - began,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=1000, help="servers in the swarm")
    parser.add_argument("--stages", type=int, default=8, help="pipeline stages")
    parser.add_argument("--hours", type=float, default=6.0, help="simulated hours")
    parser.add_argument(
        "--churn", type=float, default=0.10, help="joins and leaves per peer per hour"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the trace and of the policy rng"
    )
    parser.add_argument("--sigma", type=float, default=0.7, help="log-normal sigma of throughput")
    parser.add_argument("--period", type=float, default=60.0, help="rebalance period, s")
    parser.add_argument("--load", type=float, default=30.0, help="seconds to load a stage")
    parser.add_argument(
        "--min-gain",
        type=float,
        default=RebalancePolicy().min_gain,
        help="required bottleneck gain",
    )
    args = parser.parse_args(argv)
    if args.peers < args.stages:
        parser.error("--peers must be at least --stages")
    policy = RebalancePolicy(period_s=args.period, load_s=args.load, min_gain=args.min_gain)
    trace = make_trace(args.peers, args.hours, args.churn, args.sigma, args.seed)
    joins = sum(e.joins for e in trace.events)
    print(
        f"{args.peers} peers, {args.stages} stages, {args.hours:g} h, churn {args.churn:.0%}/h "
        f"({joins} joins, {len(trace.events) - joins} leaves), "
        f"throughput lognormal(0, {args.sigma}), "
        f"period {args.period:g} s, load {args.load:g} s, min gain {args.min_gain:.1%}"
    )
    with_rb = simulate(trace, args.stages, policy, rebalance=True, seed=args.seed)
    without = simulate(trace, args.stages, policy, rebalance=False, seed=args.seed)
    randomly = simulate(
        trace, args.stages, policy, rebalance=False, seed=args.seed, random_joins=True
    )
    print("serving bottleneck as a fraction of the upper bound U on the optimum (see docstring):")
    print(f"{'hour':>5} {'with':>8} {'without':>8} {'random joins, without':>22}")
    for hour, fractions in enumerate(
        zip(with_rb.hourly, without.hourly, randomly.hourly, strict=True)
    ):
        print(f"{hour:>5} {fractions[0]:8.2%} {fractions[1]:8.2%} {fractions[2]:22.2%}")
    print(
        f"{'mean':>5} {with_rb.mean_fraction:8.2%} {without.mean_fraction:8.2%} "
        f"{randomly.mean_fraction:22.2%}"
    )
    print(
        f"rebalancing: {with_rb.moves} moves ({with_rb.moves / args.hours:.0f}/h) "
        f"from {with_rb.plans} plans; "
        f"greedy LPT reaches {with_rb.lpt_fraction_of_bound:.2%} of U (so the optimum is within "
        f"{1 - with_rb.lpt_fraction_of_bound:.2%} of U); simulated in "
        f"{with_rb.seconds + without.seconds + randomly.seconds:.1f} s"
    )
    print(
        json.dumps(
            {
                "with_rebalancing": round(with_rb.mean_fraction, 4),
                "without_rebalancing": round(without.mean_fraction, 4),
                "random_joins_without_rebalancing": round(randomly.mean_fraction, 4),
                "moves_per_hour": round(with_rb.moves / args.hours, 1),
                "lpt_fraction_of_bound": round(with_rb.lpt_fraction_of_bound, 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
