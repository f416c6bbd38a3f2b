"""Stage selection: which stage a server joins, and when it moves (pure; SWARM §3.2).

The swarm's training throughput is bounded by its worst-served stage, so the quantity to
maximize is the **bottleneck**: ``min over stages of the summed throughput of the stage's
servers``. Totals count ``online`` and ``joining`` servers (a joining server will serve
soon, and counting it stops every newcomer piling onto the same stage); ``draining``
servers are already gone.

- **Join** (``choose_stage``): take the stage whose total is lowest (the join that raises
  the bottleneck most), ties broken by the caller's seeded rng. Simultaneous joiners would
  all see the same records and pick the same stage, so a joiner first waits
  ``join_backoff(rng, ...)`` (uniform random), re-reads the records, then chooses.
- **Rebalance** (``plan_rebalance``, ``rebalance_decision``): every jittered
  ``period_s`` each server computes, from its view of the records, a deterministic
  plan: repeatedly move the online server of the best-served stage whose move best
  evens that stage with the worst-served one, while the pair's minimum strictly rises.
  The plan's prefix with the best **amortized** bottleneck is kept if it beats the
  current bottleneck by the factor ``1 + min_gain``; amortized means averaged over one
  period in which each moved server contributes nothing for ``load_s`` seconds (it
  downloads its new stage). A stage never loses its last online server. Each server
  acts only on its own entry of the plan: servers with the same view compute the same
  plan, so a move is made by exactly the server it names, and no two servers race for
  the same gap. Ties between equal servers are broken by a hash of (peer id, view).
  A server pinned to its stage (its record's ``movable`` is false) is never named; it
  still counts as its stage's online server.

Why it does not oscillate: a plan is accepted only if it raises the bottleneck by a
factor, and only online servers move, so with a fixed membership the bottleneck rises
with every accepted plan and can do so only finitely often; moved servers are
``joining`` (unmovable) until loaded. ``docs/stage_selection.md`` has the details and
the churn simulation (``benchmarks/rebalance_sim.py``).

- **Claims** (``clamp_claims``): throughput figures are announced by the servers
  themselves, so one absurd claim (1e12 samples/s) would make its stage look served
  forever: joiners would avoid it and rebalancing would move its honest servers away.
  Before any decision each figure is capped at ``max_claim_ratio`` times the lower median
  of the counted servers' figures (across stages). The cap is a function of the shared
  view only, so every server still computes the same plan; one peer (or any minority)
  cannot move the median. The default, 2, is low on purpose: a plan moves a stage's honest
  servers away only when what stays beats the worst stage, and at 2 one server's claim is
  worth at most two typical servers, which no move can pay for on its own (at 8 a single
  liar could empty its stage of honest servers). Honest hardware faster than twice the
  median is undercounted for placement only; routing uses what trainers measure.

- **Resume** (``encode_stage_claim``, ``resume_stage``): the stage a server claims or moves
  to is remembered as ``{v, run_id, stage}`` (small JSON, the daemon writes it to its state
  directory), so that a restarted server of the same run claims the same stage again at
  once instead of choosing anew (its replicas there expect it back, and its optimizer state
  on disk, if any, belongs to that stage).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..membership.records import ServerState

# the states whose throughput counts toward a stage's total (draining servers are gone)
COUNTED_STATES: frozenset[ServerState] = frozenset({"joining", "online"})


@dataclass(frozen=True)
class ServerLoad:
    """What stage selection needs from one ``{run}.servers`` record."""

    peer_id: str
    stage: int
    throughput: float  # samples/s this server processes at its stage
    state: ServerState = "online"
    movable: bool = True  # False: pinned to its stage (node.stage), never in a plan


@dataclass(frozen=True)
class Move:
    """A decision: ``peer_id`` should leave ``from_stage`` and load ``to_stage``."""

    peer_id: str
    from_stage: int
    to_stage: int
    throughput: float


@dataclass(frozen=True)
class RebalancePlan:
    """Moves to make now (possibly none) and the bottlenecks they were judged by."""

    moves: tuple[Move, ...]
    bottleneck_before: float
    bottleneck_after: float  # once every moved server has loaded its new stage
    bottleneck_amortized: float  # averaged over one period, counting the loading time


class RebalancePolicy(BaseModel):
    """Settings of periodic rebalancing (a section of the node config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    period_s: float = Field(
        default=60.0, gt=0.0, description="Mean seconds between rebalance checks."
    )
    jitter: float = Field(
        default=0.25,
        ge=0.0,
        lt=1.0,
        description="Each wait is period_s * U(1 - jitter, 1 + jitter).",
    )
    min_gain: float = Field(
        default=0.02,
        ge=0.0,
        le=10.0,
        description="Move only if the amortized bottleneck rises by this factor (0.02 = 2%).",
    )
    load_s: float = Field(
        default=20.0,
        ge=0.0,
        description="Seconds a moved server serves nothing while it downloads its new stage.",
    )
    max_moves: int = Field(default=16, ge=1, le=100_000, description="Most moves in one plan.")
    max_claim_ratio: float = Field(
        default=2.0,
        ge=1.0,
        le=1e6,
        description=(
            "A server's announced throughput counts at most this many times the lower "
            "median of the counted servers' figures (one absurd claim moves nothing)."
        ),
    )

    @model_validator(mode="after")
    def _load_shorter_than_period(self) -> RebalancePolicy:
        if self.load_s >= self.period_s:
            raise ValueError(
                f"load_s ({self.load_s}) must be below period_s ({self.period_s}): a move "
                "must be able to pay for its loading time within one period; raise period_s"
            )
        return self


def _counted(server: ServerLoad, n_stages: int) -> bool:
    return (
        server.state in COUNTED_STATES
        and 0 <= server.stage < n_stages
        and server.throughput > 0
    )


def clamp_claims(
    servers: Iterable[ServerLoad], n_stages: int, max_ratio: float
) -> list[ServerLoad]:
    """``servers`` with each throughput capped at ``max_ratio`` times the lower median of
    the counted servers' figures (see the module docstring; pure and order-independent)."""
    view = list(servers)
    figures = sorted(s.throughput for s in view if _counted(s, n_stages))
    if not figures:
        return view
    cap = max_ratio * figures[(len(figures) - 1) // 2]
    return [replace(s, throughput=cap) if s.throughput > cap else s for s in view]


def stage_totals(servers: Iterable[ServerLoad], n_stages: int) -> list[float]:
    """Summed throughput per stage of the joining and online servers."""
    totals = [0.0] * n_stages
    for server in servers:
        if _counted(server, n_stages):
            totals[server.stage] += server.throughput
    return totals


def bottleneck(servers: Iterable[ServerLoad], n_stages: int) -> float:
    """The swarm's throughput bound: the lowest stage total."""
    return min(stage_totals(servers, n_stages))


def choose_stage(
    servers: Iterable[ServerLoad],
    n_stages: int,
    own_throughput: float | Sequence[float],
    rng: random.Random,
    *,
    exclude_peer: str | None = None,
) -> int:
    """The stage a joining server should take: the one whose join raises the bottleneck most.

    ``own_throughput`` is this server's throughput, or one value per stage when stages
    differ in cost. Among equally good stages the lowest current total wins, then the rng.
    ``exclude_peer`` drops this server's own record (when it re-chooses).
    """
    if n_stages < 1:
        raise ValueError("n_stages must be at least 1")
    own = (
        [float(own_throughput)] * n_stages
        if isinstance(own_throughput, int | float)
        else list(own_throughput)
    )
    if len(own) != n_stages:
        raise ValueError(f"own_throughput has {len(own)} values for {n_stages} stages")
    totals = stage_totals((s for s in servers if s.peer_id != exclude_peer), n_stages)

    def key(stage: int) -> tuple[float, float]:
        after = totals.copy()
        after[stage] += own[stage]
        return (min(after), -totals[stage])

    keys = [key(s) for s in range(n_stages)]
    best = max(keys)
    return rng.choice([s for s in range(n_stages) if keys[s] == best])


def join_backoff(rng: random.Random, max_delay_s: float) -> float:
    """Seconds to wait before (re-)reading the records and choosing a stage.

    Uniform in ``[0, max_delay_s)``: joiners that start together then read the records one
    after another, each seeing the earlier ones' ``joining`` announcements. Choose
    ``max_delay_s`` several times the time a record takes to become visible in the DHT.
    """
    if max_delay_s < 0:
        raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
    return rng.uniform(0.0, max_delay_s)


def next_rebalance_delay(rng: random.Random, policy: RebalancePolicy) -> float:
    """Seconds until the next rebalance check (jittered so that servers do not align)."""
    return policy.period_s * rng.uniform(1.0 - policy.jitter, 1.0 + policy.jitter)


def _view_digest(servers: Sequence[ServerLoad]) -> bytes:
    h = hashlib.sha256()
    for s in sorted(servers, key=lambda s: s.peer_id):
        h.update(f"{s.peer_id}\0{s.stage}\0{s.throughput!r}\0{s.state}\0{s.movable}\n".encode())
    return h.digest()


def _tie_key(peer_id: str, digest: bytes) -> bytes:
    return hashlib.sha256(digest + peer_id.encode()).digest()


def plan_rebalance(
    servers: Sequence[ServerLoad], n_stages: int, policy: RebalancePolicy
) -> RebalancePlan:
    """The moves the swarm should make now, computed identically by every server (pure)."""
    counted = [s for s in servers if _counted(s, n_stages)]
    totals = [0.0] * n_stages
    for server in counted:
        totals[server.stage] += server.throughput
    before = min(totals)
    initial_totals = tuple(totals)
    movable: list[list[ServerLoad]] = [[] for _ in range(n_stages)]
    online = [0] * n_stages
    for server in counted:
        if server.state == "online":
            online[server.stage] += 1  # pinned ones too: they keep their stage served
            if server.movable:
                movable[server.stage].append(server)
    digest: bytes | None = None  # of the whole view; computed only if a tie must be broken
    tie_keys: dict[str, bytes] = {}

    def tie_key(peer_id: str) -> bytes:
        nonlocal digest
        if digest is None:
            digest = _view_digest(counted)
        if peer_id not in tie_keys:
            tie_keys[peer_id] = _tie_key(peer_id, digest)
        return tie_keys[peer_id]

    moves: list[Move] = []
    while len(moves) < policy.max_moves:
        worst = min(range(n_stages), key=lambda s: (totals[s], s))
        donors = [s for s in range(n_stages) if s != worst and online[s] >= 2 and movable[s]]
        donors.sort(key=lambda s: (-totals[s], s))  # best-served first
        donor, best_index = -1, -1
        for candidate in donors:
            # The donor's server whose move leaves the pair (donor, worst) most even; the
            # pair's minimum must strictly rise, or the move only shuffles the imbalance.
            best_pair_min = low = totals[worst]
            high = totals[candidate]
            for i, server in enumerate(movable[candidate]):
                t = server.throughput
                pair_min = min(low + t, high - t)
                if pair_min > best_pair_min or (
                    pair_min == best_pair_min
                    and best_index >= 0
                    and tie_key(server.peer_id) < tie_key(movable[candidate][best_index].peer_id)
                ):
                    best_index, best_pair_min = i, pair_min
            if best_index >= 0:
                donor = candidate
                break
        if best_index < 0:
            break
        server = movable[donor].pop(best_index)
        online[donor] -= 1
        totals[donor] -= server.throughput
        totals[worst] += server.throughput
        moves.append(Move(server.peer_id, donor, worst, server.throughput))

    # Keep the prefix with the best amortized bottleneck: during loading the moved servers
    # count nowhere (gone from their old stage, not yet serving the new one).
    best_k, best_amortized, best_after = 0, before, before
    after_totals = list(initial_totals)
    loading = [0.0] * n_stages
    share = policy.load_s / policy.period_s
    for k, move in enumerate(moves, start=1):
        after_totals[move.from_stage] -= move.throughput
        after_totals[move.to_stage] += move.throughput
        loading[move.to_stage] += move.throughput
        after = min(after_totals)
        during = min(t - ld for t, ld in zip(after_totals, loading, strict=True))
        amortized = share * during + (1.0 - share) * after
        if amortized > best_amortized:
            best_k, best_amortized, best_after = k, amortized, after
    if best_k == 0 or best_amortized < before * (1.0 + policy.min_gain) or best_amortized <= before:
        return RebalancePlan((), before, before, before)
    return RebalancePlan(tuple(moves[:best_k]), before, best_after, best_amortized)


def plan_move(plan: RebalancePlan, peer_id: str) -> Move | None:
    """``peer_id``'s entry of ``plan``, or None when the plan does not name it."""
    for move in plan.moves:
        if move.peer_id == peer_id:
            return move
    return None


def rebalance_decision(
    servers: Sequence[ServerLoad], n_stages: int, peer_id: str, policy: RebalancePolicy
) -> Move | None:
    """This server's part of the current plan: where to move, or None to stay."""
    return plan_move(plan_rebalance(servers, n_stages, policy), peer_id)


# ------------------------------------------------------------------- the remembered stage

STAGE_CLAIM_VERSION: Final = 1
MAX_STAGE_CLAIM_BYTES = 256


class StageClaim(BaseModel):
    """The stage a server last claimed in a run: ``{"v": 1, "run_id": ..., "stage": ...}``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    v: Literal[1] = STAGE_CLAIM_VERSION
    run_id: str = Field(pattern=r"^[0-9a-f]{16}$", description="The run spec's hash.")
    stage: int = Field(ge=0, lt=4096, description="The stage claimed.")


def encode_stage_claim(run_id: str, stage: int) -> bytes:
    """The claim's stored form (compact JSON). ValueError for an invalid run id or stage."""
    try:
        return StageClaim(run_id=run_id, stage=stage).model_dump_json().encode()
    except ValidationError as exc:
        raise ValueError(f"invalid stage claim: {exc.errors()[0]['msg']}") from None


def decode_stage_claim(raw: bytes) -> StageClaim | None:
    """The claim in ``raw``, or None when it is not one this version understands.

    The file may be truncated (a crash mid-write on a filesystem without atomic rename),
    edited by hand or written by a newer version: all of those mean "choose anew", never
    a crash.
    """
    if len(raw) > MAX_STAGE_CLAIM_BYTES:
        return None
    try:
        return StageClaim.model_validate_json(raw)
    except ValidationError:
        return None


def resume_stage(raw: bytes | None, run_id: str, n_stages: int) -> int | None:
    """The stage to claim again from a stored claim, or None to choose as a newcomer.

    Only a claim of the same run (``run_id``, the spec's hash) whose stage exists counts:
    a claim of another run, or of a stage the spec no longer has, is ignored.
    """
    if raw is None:
        return None
    claim = decode_stage_claim(raw)
    if claim is None or claim.run_id != run_id or claim.stage >= n_stages:
        return None
    return claim.stage


def keep_resumed_stage(
    servers: Iterable[ServerLoad], n_stages: int, resumed: int, *, exclude_peer: str | None = None
) -> bool:
    """Whether a restarted server should serve its stored stage ``resumed`` again.

    Yes, unless others now serve ``resumed`` while some other stage has no server at all:
    the swarm filled the gap our death left (a server moved there), and claiming it back
    would leave the mover's old stage short and start a second move. ``exclude_peer`` drops
    our own record from before the restart, which the DHT still holds until it expires.
    """
    totals = stage_totals((s for s in servers if s.peer_id != exclude_peer), n_stages)
    return totals[resumed] <= 0.0 or all(total > 0.0 for total in totals)
