"""The demo's figures, read from its daemons' status reports: totals, traffic, stages.

Pure functions of the statuses the demo last polled (``status --json`` dicts, one per
daemon, ``{}`` for a daemon not polled yet) and of the run's stage count: the training
totals behind the progress line, the traffic counters that ``run_swarm`` returns, the
per-stage table, and the stage servers an evaluation client routes through. The text
they are shown as (progress line, stage table) is formatted here too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

Status = dict[str, Any]


def _components(statuses: Sequence[Status], name: str) -> list[dict[str, Any]]:
    return [s.get("components", {}).get(name, {}) for s in statuses if s]


def totals(statuses: Sequence[Status], retired: Sequence[Status] = ()) -> dict[str, Any]:
    """Tokens, tokens/s, mean loss, epoch, micro-batches and re-routed hops, summed over the
    daemons.

    ``retired`` are the last statuses of daemon processes that have ended (a daemon killed
    and restarted counts from zero again): their tokens, micro-batches and re-routed hops
    still count, their rate and loss no longer do.
    """
    trainers = _components(statuses, "trainer")
    everyone = trainers + _components(retired, "trainer")
    servers = _components(statuses, "stage_server")
    losses = [t["loss_ewma"] for t in trainers if t.get("loss_ewma") is not None]
    return {
        "tokens": sum(t.get("tokens", 0) for t in everyone),
        "tokens_per_s": sum(t.get("tokens_per_s", 0.0) for t in trainers),
        "loss": sum(losses) / len(losses) if losses else None,
        "epoch": max((s.get("epoch", 0) for s in servers), default=0),
        "completed": sum(t.get("micro_batches", {}).get("completed", 0) for t in everyone),
        "failed": sum(t.get("micro_batches", {}).get("failed", 0) for t in everyone),
        "retried": sum(t.get("retried_hops", 0) for t in everyone),
        # trainers' spot checks (docs/hostile.md): checked, skipped (no second replica, or
        # answers from parameters not promised equal), disagreements, convictions
        "spot_checks": {
            **{
                key: sum(int((t.get("spot_checks") or {}).get(key, 0)) for t in everyone)
                for key in ("checked", "skipped", "disagreements", "convicted")
            },
            # the reasons as the trainers name them (training/spot_checks.py SKIP_REASONS:
            # not imported here, the status path must not load torch)
            "skipped_by": _summed(
                (t.get("spot_checks") or {}).get("skipped_by") or {} for t in everyone
            ),
            "compared_by": _summed(
                (t.get("spot_checks") or {}).get("compared_by") or {} for t in everyone
            ),
        },
    }


def _summed(counts: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Counts by name, summed over dicts (a non-integer count is skipped)."""
    out: dict[str, int] = {}
    for one in counts:
        for key, value in one.items():
            if isinstance(value, int) and not isinstance(value, bool):
                out[str(key)] = out.get(str(key), 0) + value
    return out


def traffic(statuses: Sequence[Status], n_stages: int) -> dict[str, Any]:
    """Cumulative traffic counters summed over the daemons.

    Trainer payload bytes count the encoded tensors of every successful hop, both
    directions, as the trainers' status reports them; hops are successful hops per stage;
    QUIC bytes are UDP payload bytes of every daemon's endpoint (trainer and server
    traffic, FEC repair symbols, retransmissions, acknowledgements and pings included).
    """
    trainers = _components(statuses, "trainer")
    endpoints = _components(statuses, "endpoint")
    hops = [0] * n_stages
    for t in trainers:
        for stage, count in t.get("hops", {}).items():
            if 0 <= int(stage) < len(hops):
                hops[int(stage)] += int(count)
    return {
        "tokens": sum(t.get("tokens", 0) for t in trainers),
        "payload_bytes_sent": sum(t.get("payload_bytes", {}).get("sent", 0) for t in trainers),
        "payload_bytes_received": sum(
            t.get("payload_bytes", {}).get("received", 0) for t in trainers
        ),
        "hops": hops,
        "retried_hops": sum(t.get("retried_hops", 0) for t in trainers),
        "cache_misses": sum(t.get("cache_misses", 0) for t in trainers),
        "failed_micro_batches": sum(
            t.get("micro_batches", {}).get("failed", 0) for t in trainers
        ),
        "quic_bytes_out": sum(e.get("bytes_out") or 0 for e in endpoints),
        "quic_bytes_in": sum(e.get("bytes_in") or 0 for e in endpoints),
    }


def traffic_delta(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """``end - start`` of two :func:`traffic` readings, per counter (per stage for hops)."""
    return {
        key: (
            [b - a for a, b in zip(start[key], end[key], strict=True)]
            if isinstance(start[key], list)
            else end[key] - start[key]
        )
        for key in start
    }


def stage_rows(statuses: Sequence[Status], n_stages: int) -> list[dict[str, Any]]:
    """One row per stage: its servers, micro-batches, bytes sent, mean RTT to it, seconds."""
    rows = []
    for stage in range(n_stages):
        members = [s for s in statuses if s.get("stage") == stage]
        ids = {s["peer_id"] for s in members}
        rtts = [
            p["rtt_ms"]
            for s in statuses
            for p in s.get("peers", [])
            if p["peer_id"] in ids and p.get("rtt_ms") is not None
        ]
        comp = [s.get("components", {}) for s in members]
        rows.append(
            {
                "stage": stage,
                "peers": len(members),
                "micro_batches": sum(c.get("stage_server", {}).get("applied", 0) for c in comp),
                "bytes_sent": sum(c.get("endpoint", {}).get("bytes_out", 0) for c in comp),
                "mean_rtt_ms": sum(rtts) / len(rtts) if rtts else None,
                # device-thread seconds, summed over the stage's servers: running requests, and
                # inside the optimizer, from requests or the periodic step check (a synchronous
                # step waits there for the all-reduce)
                "compute_s": round(
                    sum(c.get("stage_server", {}).get("compute_s", 0.0) for c in comp), 1
                ),
                "optimizer_s": round(
                    sum(c.get("stage_server", {}).get("optimizer_s", 0.0) for c in comp), 1
                ),
                "epoch": max(
                    (c.get("stage_server", {}).get("epoch", 0) for c in comp), default=0
                ),
                **step_size([c.get("stage_server", {}) for c in comp]),
                "averaging": averaging_summary([c.get("stage_server", {}) for c in comp]),
            }
        )
    return rows


def averaging_summary(servers: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A stage's averaging over its replicas (``averaging_status`` of each): the mode, each
    replica's rounds taken (``last_round``: the epoch for the per-step all-reduce, the outer
    or gossip round otherwise), and for DiLoCo and gossip the rounds missed, the rounds due
    while a replica knew no partner (gossip), the rounds under way and the bytes the rounds
    sent, summed; ``replicas_agree``: whether the replicas that last stepped at the same
    epoch hold the same parameters (their ``param_digest``; None when no two replicas are at
    the same epoch). None when no replica reported one."""
    found = [(s.get("averaging") or {}) for s in servers if s]
    found = [a for a in found if a.get("mode")]
    if not found:
        return None
    digests: dict[Any, list[Any]] = {}  # digest epoch -> the replicas' digests
    for s in servers:
        if s and s.get("param_digest"):
            digests.setdefault(s.get("digest_epoch"), []).append(s["param_digest"])
    shared = [d for d in digests.values() if len(d) > 1]
    agree = all(len(set(d)) == 1 for d in shared) if shared else None
    # how far apart they are: the largest relative distance of two replicas' parameter
    # sketches at the same epoch (fingerprint.py; about 1e-7 is rounding, 1e-3 a real split)
    sketches: dict[Any, list[list[float]]] = {}
    for s in servers:
        sketch = s.get("param_sketch") if s else None
        if isinstance(sketch, list) and sketch:
            sketches.setdefault(s.get("digest_epoch"), []).append(sketch)
    # imported here: fingerprint imports torch, and this module is on the path of every
    # CLI command ('wanswarm status' runs every few seconds as Docker's health check)
    from ..stage.fingerprint import relative_distance

    distances = [
        relative_distance(group[0], other)
        for group in sketches.values() if len(group) > 1
        for other in group[1:] if len(other) == len(group[0])
    ]
    distance = float(f"{max(distances):.3g}") if distances else None
    return {
        "mode": found[0]["mode"],
        "rounds": [a.get("last_round") for a in found],
        "last_round_s": [a.get("round_s") for a in found],
        "rounds_missed": sum(int(a.get("rounds_missed") or 0) for a in found),
        "rounds_alone": sum(int(a.get("rounds_alone") or 0) for a in found),
        "in_progress": sum(bool(a.get("round_in_progress")) for a in found),
        "bytes_sent": sum(int(a.get("bytes_sent_total") or 0) for a in found),
        "replicas_agree": agree,
        "replica_distance": distance,
        # per-step all-reduce: steps a replica took on its own gradients (a failed round)
        "local_gradient_steps": sum(int(a.get("local_gradient_steps") or 0) for a in found),
    }


def step_size(servers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The samples in a step of one stage: each replica's status lists the samples it brought
    to its last steps (``averaging.step_samples``, by epoch); a step's samples are their sum
    over the replicas. Only the epochs that every replica lists count (one that a replica
    missed, or that fell out of its list, would be counted short). Returns
    ``samples_per_step`` (the mean; None when no epoch counts), ``samples_per_step_range``
    (min, max) and ``steps_measured``."""
    lists = [
        {int(e): int(n) for e, n in (s.get("averaging") or {}).get("step_samples", {}).items()}
        for s in servers
        if s
    ]
    common = set.intersection(*(set(x) for x in lists)) if lists else set()
    sizes = [sum(x[e] for x in lists) for e in sorted(common)]
    if not sizes:
        return {"samples_per_step": None, "samples_per_step_range": None, "steps_measured": 0}
    return {
        "samples_per_step": round(sum(sizes) / len(sizes), 1),
        "samples_per_step_range": [min(sizes), max(sizes)],
        "steps_measured": len(sizes),
    }


def stage_servers(statuses: Sequence[Status]) -> dict[int, list[Any]]:
    """The stage servers among ``statuses`` (of running daemons), as the trainer's
    ``ServerInfo`` by stage."""
    from ..training.servers import ServerInfo

    out: dict[int, list[Any]] = {}
    for status in statuses:
        server = status.get("components", {}).get("stage_server", {})
        addr = status.get("quic_addr")
        if not server or addr is None:
            continue
        host, _, port = addr.rpartition(":")
        out.setdefault(server["stage"], []).append(
            ServerInfo(
                peer_id=status["peer_id"],
                host=host.strip("[]"),
                port=int(port),
                throughput=server["throughput"],
                queue_len=server["queue"],
                state=server["state"],
                rtt=None,
            )
        )
    return out


def eta_s(
    tokens: float, tokens_at_start: float, budget: float, elapsed: float, duration_s: float
) -> float | None:
    """Seconds until training ends: at the token ``budget`` at the mean rate since training
    started, or at ``duration_s``, whichever comes first (None before any rate is known and
    the duration is still far)."""
    left_by_time = max(0.0, duration_s - elapsed)
    done = tokens - tokens_at_start
    if done <= 0 or elapsed <= 0:
        return left_by_time if math.isfinite(left_by_time) else None
    left_by_tokens = max(0.0, budget - tokens) / (done / elapsed)
    return min(left_by_time, left_by_tokens)


def format_duration(seconds: float) -> str:
    """``seconds`` as ``1h02m``, ``4m05s`` or ``42s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def progress_line(
    t: dict[str, Any], elapsed: float, eta: float | None = None, extra: str = ""
) -> str:
    """The progress line of :func:`totals` ``t`` after ``elapsed`` seconds of training, with
    the time left (``eta``, :func:`eta_s`) and ``extra`` (the supervisor's count of daemons
    up, killed and restarted) when given."""
    loss = "-" if t["loss"] is None else f"{t['loss']:.3f}"
    left = "" if eta is None else f"  ETA {format_duration(eta)}"
    return (
        f"epoch {t['epoch']:>4}  loss {loss:>6}  {t['tokens_per_s']:>7.0f} tok/s  "
        f"{t['tokens'] / 1e3:>7.0f}k tokens  "
        f"{t['completed']} micro-batches ({t['failed']} failed)  "
        f"{elapsed:>5.0f}s{left}" + (f"  [{extra}]" if extra else "")
    )


def stage_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The lines of the per-stage table of :func:`stage_rows`, header and footnote included."""
    lines = [
        f"{'stage':>5} {'peers':>5} {'micro-batches':>13} {'bytes sent':>12} {'mean RTT':>10} "
        f"{'device s':>9} {'in step s':>9} {'epoch':>6} {'samples/step':>12}"
    ]
    for r in rows:
        rtt = "-" if r["mean_rtt_ms"] is None else f"{r['mean_rtt_ms']:.1f} ms"
        size = r.get("samples_per_step")
        lines.append(
            f"{r['stage']:>5} {r['peers']:>5} {r['micro_batches']:>13} "
            f"{format_bytes(r['bytes_sent']):>12} "
            f"{rtt:>10} {r['compute_s']:>9.1f} {r['optimizer_s']:>9.1f} {r['epoch']:>6} "
            f"{'-' if size is None else f'{size:.1f}':>12}"
        )
    lines.append(
        "(device s: seconds the stage's servers ran requests, summed; in step s: seconds "
        "inside the optimizer, from requests and from the periodic step check, where a "
        "synchronous step waits for the stage's all-reduce; samples/step: the mean samples "
        "in the stage's last steps, summed over its replicas)"
    )
    return lines


def format_bytes(n: int) -> str:
    """``n`` bytes in B, kB, MB or GB (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """The value at ``x`` of the piecewise-linear curve through ``points`` (sorted by their
    first item), rounded to 4 places; None outside the points' range or without points."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            y = y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            return round(y, 4)
    if points and points[-1][0] == x:
        return round(points[-1][1], 4)
    return None


def wire_bytes_per_token(statuses: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage boundary, the payload bytes per token that crossed it forward and backward
    (every trainer's ``wire_bytes_per_token``, weighted by its tokens): the figure a subspace
    run's benchmark predicts (docs/compression.md)."""
    sums: list[list[float]] = []
    total = 0
    for t in _components(statuses, "trainer"):
        tokens = int(t.get("tokens", 0))
        wire = t.get("wire_bytes_per_token") or []
        if tokens <= 0 or not wire:
            continue
        total += tokens
        for b, figures in enumerate(wire):
            if b == len(sums):
                sums.append([0.0, 0.0])
            sums[b][0] += float(figures.get("forward", 0.0)) * tokens
            sums[b][1] += float(figures.get("backward", 0.0)) * tokens
    return [
        {"forward": round(f / total, 3), "backward": round(b / total, 3)} for f, b in sums
    ] if total else []
