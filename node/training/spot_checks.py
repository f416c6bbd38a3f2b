"""Spot checks: the trainer re-runs a fraction of hops on another replica and compares.

No pipeline system checks that a server computed what it was asked. A server can answer
in-bounds garbage that the value limits (docs/hostile.md) cannot tell from an honest
reply. Replicas of a stage hold the same parameters between averaging rounds, so for a
random fraction (``fraction``) of its ``forward``, ``forward_loss`` and ``backward`` hops
the trainer sends the same input to a second replica and compares the two answers:

- ``forward`` (stages 0 .. S-2) is re-run with ``keep_input=False``: nothing is cached or
  accumulated on the second replica. The outputs are compared by relative L2 error,
  ``||a - b|| / max(||a||, ||b||)``, of their decoded values.
- ``forward_loss`` (the last stage) is re-run as a ``forward_loss`` with ``check``: the
  losses are compared by relative difference and, if they agree, the two answers' dL/dx
  like outputs (the second comparison reuses the same replicas' answers).
- ``backward`` on stages 1 .. S-2 (those that send dL/dx to the stage before) is re-run
  as a ``backward`` with ``check``: the input and dL/dy carried, dL/dx computed at the
  second replica's parameters. The dL/dx are compared like outputs.

A check accumulates nothing, caches nothing and is not counted as applied on the checking
replica. A convicted server's backward or forward_loss is redone on another replica,
which accumulates it.

Only answers computed with the same parameters are compared: each reply carries its
stage's epoch and ``params``, the epoch of the parameters that computed it when they are
the stage's shared ones (null when the server promises nothing: an update half copied in,
a local step since the last shared state, DiLoCo and gossip runs; stage/params_version.py).
The epoch alone does not say enough for the tight bound: a replica that stepped on its own
gradients, or that has not yet copied a delayed update in, holds other parameters than its
partner at the same epoch, and in demo runs honest replicas at the same epoch answered
6-26% apart (one optimizer step moves a stage's output by more than the tolerance early in
training).

Two answers whose ``params`` differ, or are null, are compared all the same when they come
from the same epoch, within a looser bound (``max_epoch_error``, 0.5; ``tier`` "epoch"):
otherwise a lying server could dodge every check by promising nothing. Honest replicas at
one epoch differ by at most an optimizer step and the drift of their moments (0.25 and
0.07 in the tiny run), a wrong answer by about its own size (0.92-0.98 for an output rolled
along the sequence in benchmarks/hostile.py). As that bound rests on how far honest
replicas drift rather than on a promise, an answer both others contradict there is banned
for a while (``outvoted``), and its server convicted only once ``outvotes_to_convict`` (3)
such answers were each contradicted by two witnesses that agreed within the tight bound.
DiLoCo and gossip runs, whose replicas drift apart within a round, compare only equal
promises. Answers from different epochs are not compared (``skipped``).

Two answers agree when the error is within ``max_relative_error`` (outputs) or
``max_loss_error`` (losses). The bound is calibrated to what two honest replicas can
differ by: both quantize their output once with the run's codec (int8: about 0.5%
relative L2 error per quantization) and their parameters, averaged by the same all-reduce,
are equal or nearly so; the default, 5%, is ten times that. An attack smaller than it is
not caught, but it also perturbs the model less than a few codec round trips do.

When the two disagree, who lied is decided by a third replica when the stage has one
(``confirm``): the one whose answer neither other replica shares is **convicted**: the
router never sends it anything again (``Router.convict``), the hop is redone elsewhere
(pipeline.py) and the evidence is logged: both (or all three) answers' peers, epochs,
payload digests, peak values and the pairwise errors. Without a third replica nobody is
convicted on the word of one against the other: the micro-batch is dropped (the reply is
not used), both peers get an ordinary timed ban, and the evidence is logged as
``unresolved``. An honest pair never disagrees (the bound is far above their difference),
so an honest server is never convicted.

Pure parts (``relative_error``, ``judge``) take values and return verdicts; ``SpotChecker``
only orders the requests.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..logs import get_logger
from .hops import HopFailed
from .routing import Router

log = get_logger(__name__)

VerdictKind = Literal["agree", "skipped", "first_lied", "second_lied", "unresolved"]
# why a check compared nothing: no other replica answered; one answer promised no
# parameters (params null) or both promised different ones, and the same-epoch tier was
# off; the answers came from different epochs (and promised no equal parameters)
SkipReason = Literal["no_other_replica", "unpromised", "other_params", "other_epoch"]
SKIP_REASONS: tuple[SkipReason, ...] = (
    "no_other_replica", "unpromised", "other_params", "other_epoch"
)
# which answers a check compared: equal promised parameters, or the same epoch
Tier = Literal["params", "epoch"]
OUTVOTES_KEPT = 1024  # peers whose outvotes are remembered (the oldest forgotten first)
# (epoch, params) of a reply: its stage's epoch and its parameters' version (Answer)
Stamp = tuple[int, int | None]


class SpotCheckConfig(BaseModel):
    """How often the trainer checks a hop on a second replica, and how close is honest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fraction: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description=(
            "Fraction of forward, forward_loss and backward hops re-run on a second replica of "
            "the stage and compared (0: no spot checks)."
        ),
    )
    max_relative_error: float = Field(
        default=0.05,
        gt=0.0,
        le=1.0,
        description=(
            "Two replicas' outputs agree when ||a - b|| / max(||a||, ||b||) is at most this "
            "(far above the codec's error: int8 is about 0.005)."
        ),
    )
    max_loss_error: float = Field(
        default=0.01,
        gt=0.0,
        le=1.0,
        description="Two replicas' losses agree when |a - b| / max(|a|, |b|) is at most this.",
    )
    compare_same_epoch: bool = Field(
        default=True,
        description=(
            "Compare two answers at the same epoch that do not promise equal parameters "
            "(params null or different) within max_epoch_error / max_epoch_loss_error "
            "instead of skipping them. Off in diloco and gossip runs whatever this says: "
            "their replicas drift apart within a round."
        ),
    )
    max_epoch_error: float = Field(
        default=0.5,
        gt=0.0,
        le=10.0,
        description=(
            "Two outputs at the same epoch without equal promised parameters agree when "
            "their relative L2 error is at most this (one optimizer step moved a stage's "
            "output by at most 0.25 in the tiny run; an output rolled along the sequence "
            "was 0.92-0.98 away)."
        ),
    )
    max_epoch_loss_error: float = Field(
        default=0.25,
        gt=0.0,
        le=10.0,
        description=(
            "Two losses at the same epoch without equal promised parameters agree when "
            "|a - b| / max(|a|, |b|) is at most this."
        ),
    )
    outvotes_to_convict: int = Field(
        default=3,
        ge=1,
        le=1000,
        description=(
            "Convict a replica whose answers were outvoted at the same epoch this many "
            "times (each time by two other replicas that agreed within "
            "max_relative_error / max_loss_error); before that each outvote is a timed ban."
        ),
    )
    confirm: bool = Field(
        default=True,
        description=(
            "On a disagreement, ask a third replica (when the stage has one) who is right; "
            "convict only the replica the other two contradict."
        ),
    )
    evidence_kept: int = Field(
        default=32, ge=0, le=4096, description="Evidence records kept for the status."
    )


@dataclass(frozen=True)
class Answer:
    """One replica's answer to the same hop."""

    peer: str
    epoch: int
    params: int | None  # the reply's parameters version (None: no promise; not compared)
    value: torch.Tensor | float  # the decoded output, or the loss
    digest: str  # SHA-256 (16 hex) of the reply's payload as it came (or of the loss)

    def summary(self) -> dict[str, object]:
        if isinstance(self.value, torch.Tensor):
            peak = float(self.value.abs().max()) if self.value.numel() else 0.0
        else:
            peak = abs(float(self.value))
        return {"peer": self.peer, "epoch": self.epoch, "params": self.params,
                "digest": self.digest, "peak": peak}

    def comparable(self, other: Answer) -> bool:
        """Whether both promise the same parameters (equal, non-null ``params``)."""
        return self.params is not None and self.params == other.params

    def why_not_comparable(self, other: Answer, *, by_epoch: bool = False) -> SkipReason:
        """Why two answers that ``judge`` did not compare were not (``by_epoch``: the
        same-epoch tier was on, so their epochs differed)."""
        if by_epoch:
            return "other_epoch"
        return "unpromised" if None in (self.params, other.params) else "other_params"


def payload_digest(data: bytes | bytearray | memoryview | float) -> str:
    """SHA-256 (16 hex) of a reply's payload bytes, or of a loss's repr."""
    raw = repr(data).encode() if isinstance(data, float) else bytes(data)
    return hashlib.sha256(raw).hexdigest()[:16]


def relative_error(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """``||a - b|| / max(||a||, ||b||)`` in float64 (0.0 for two zeros; inf for another
    shape or a non-finite value)."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return math.inf
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return math.inf
        x, y = a.detach().double(), b.detach().double()
        diff = float(torch.linalg.vector_norm(x - y))
        scale = max(float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y)))
    else:
        fa, fb = float(a), float(b)
        diff, scale = abs(fa - fb), max(abs(fa), abs(fb))
    if not (math.isfinite(diff) and math.isfinite(scale)):
        return math.inf
    if scale == 0.0:
        return 0.0
    return diff / scale


@dataclass(frozen=True)
class Verdict:
    """What a spot check concluded; ``errors`` are the pairwise relative errors, ``tier``
    which answers were compared (``params``: equal promised parameters, within
    ``tolerance``; ``epoch``: the same epoch without that promise, within the looser
    bound; None: nothing compared) and ``tolerance`` the bound applied."""

    kind: VerdictKind
    errors: dict[str, float]
    tier: Tier | None = None
    tolerance: float | None = None


def judge(
    first: Answer, second: Answer, third: Answer | None, tolerance: float,
    loose: float | None = None,
) -> Verdict:
    """Who lied, if anyone (pure). ``first`` is the answer the pipeline would use.

    Answers promising equal parameters (``Answer.comparable``) are compared within
    ``tolerance``. Others at the same epoch are compared within ``loose`` when it is given
    (the module docstring: two honest replicas at one epoch are at most an optimizer step
    apart), else not at all (``skipped``). A ``third`` that the tier does not admit
    (another promise, another epoch) counts as absent."""
    if first.comparable(second):
        tier: Tier = "params"
        bound = tolerance

        def admits(other: Answer) -> bool:
            return first.comparable(other)
    elif loose is not None and first.epoch == second.epoch:
        tier, bound = "epoch", loose

        def admits(other: Answer) -> bool:
            return other.epoch == first.epoch
    else:
        return Verdict("skipped", {})
    ab = relative_error(first.value, second.value)
    errors = {"first_second": ab}
    if ab <= bound:
        return Verdict("agree", errors, tier, bound)
    if third is None or not admits(third):
        return Verdict("unresolved", errors, tier, bound)
    ac = relative_error(first.value, third.value)
    bc = relative_error(second.value, third.value)
    errors |= {"first_third": ac, "second_third": bc}
    if bc <= bound < ac:
        return Verdict("first_lied", errors, tier, bound)
    if ac <= bound < bc:
        return Verdict("second_lied", errors, tier, bound)
    return Verdict("unresolved", errors, tier, bound)


class SpotCounts(Protocol):
    """The counters spot checks write (fields of the trainer's ``TrainerCounters``)."""

    spot_checks: int  # checks started
    spot_checks_skipped: int  # no second replica, or answers not comparable (params)
    spot_check_disagreements: int  # checks whose first two answers disagreed
    convicted: int  # peers convicted of lying


Recompute = Callable[[frozenset[str]], Awaitable[Answer]]


class SpotChecker:
    """Decides which hops to check and runs the checks (see the module docstring)."""

    def __init__(
        self,
        config: SpotCheckConfig,
        *,
        router: Router,
        counters: SpotCounts,
        rng: random.Random,
        clock: Callable[[], float],
        by_epoch: bool = True,
    ) -> None:
        """``by_epoch``: whether the run's replicas answer alike at the same epoch (the
        per-step all-reduce; not DiLoCo or gossip), so that ``compare_same_epoch`` applies."""
        self.config = config
        self.by_epoch = by_epoch and config.compare_same_epoch
        self.router = router
        self.counters = counters
        self.rng = rng
        self.clock = clock
        self.evidence: deque[dict[str, object]] = deque(maxlen=config.evidence_kept)
        # the skipped checks by reason (their sum is the counters' spot_checks_skipped)
        self.skipped: dict[SkipReason, int] = dict.fromkeys(SKIP_REASONS, 0)
        # the checks that compared answers, by tier
        self.compared: dict[Tier, int] = {"params": 0, "epoch": 0}
        # answers contradicted by both other replicas at the same epoch (banned for a while)
        self.outvoted = 0
        # per peer: outvotes whose two witnesses agreed within the tight bound (bounded: the
        # oldest peer is forgotten past OUTVOTES_KEPT peers)
        self._outvotes: dict[str, int] = {}

    def _skip(self, reason: SkipReason) -> None:
        self.counters.spot_checks_skipped += 1
        self.skipped[reason] += 1

    def due(self) -> bool:
        """Whether to check the hop just made (a ``fraction`` of them, at random)."""
        return self.config.fraction > 0.0 and self.rng.random() < self.config.fraction

    async def check(
        self, what: str, first: Answer, recompute: Recompute, *, loss: bool = False
    ) -> Verdict:
        """Re-run the hop answered by ``first`` on another replica (``recompute(exclude)``),
        and on a third when they disagree; convict or ban as the verdict says."""
        config = self.config
        tolerance = config.max_loss_error if loss else config.max_relative_error
        loose: float | None = None
        if self.by_epoch:
            loose = config.max_epoch_loss_error if loss else config.max_epoch_error
        self.counters.spot_checks += 1
        try:
            second = await recompute(frozenset({first.peer}))
        except HopFailed:  # NoOtherReplica included: nothing to compare with
            self._skip("no_other_replica")
            return Verdict("skipped", {})
        verdict = judge(first, second, None, tolerance, loose)
        if verdict.tier is None:
            self._skip(first.why_not_comparable(second, by_epoch=self.by_epoch))
        else:
            self.compared[verdict.tier] += 1
        if verdict.kind != "unresolved":
            return verdict
        self.counters.spot_check_disagreements += 1
        third: Answer | None = None
        if self.config.confirm:
            try:
                third = await recompute(frozenset({first.peer, second.peer}))
            except HopFailed:  # NoOtherReplica included: no third opinion
                third = None
            verdict = judge(first, second, third, tolerance, loose)
        answers = [first, second] if third is None else [first, second, third]
        now = self.clock()
        if verdict.kind in ("first_lied", "second_lied"):
            liar = first if verdict.kind == "first_lied" else second
            if verdict.tier == "params":
                self._convict(liar.peer)
            else:
                # the two witnesses' own error: the pair without the outvoted answer
                witnesses = "second_third" if liar is first else "first_third"
                self._outvote(liar.peer, verdict.errors.get(witnesses, math.inf)
                              <= tolerance, now)
        else:
            for answer in answers:
                self.router.ban(answer.peer, now=now, rng=self.rng)
        record: dict[str, object] = {
            "what": what,
            "verdict": verdict.kind,
            "tier": verdict.tier,
            "tolerance": verdict.tolerance,
            "errors": {k: _finite_or_str(v) for k, v in verdict.errors.items()},
            "answers": [a.summary() for a in answers],
        }
        self.evidence.append(record)
        log.warning("trainer: spot check of %s: %s; evidence %s", what, verdict.kind,
                    json.dumps(record, sort_keys=True))
        return verdict

    def _outvote(self, peer: str, witnesses_agree: bool, now: float) -> None:
        """An answer of ``peer`` outvoted at the same epoch: the bound there rests on how far
        honest replicas can drift apart, not on a promise, so one outvote is a timed ban (the
        hop is redone elsewhere all the same); ``outvotes_to_convict`` of them, each by two
        witnesses that agreed within the tight bound, convict."""
        self.outvoted += 1
        if witnesses_agree:
            count = self._outvotes.pop(peer, 0) + 1
            self._outvotes[peer] = count  # the most recent last
            while len(self._outvotes) > OUTVOTES_KEPT:
                del self._outvotes[next(iter(self._outvotes))]
            if count >= self.config.outvotes_to_convict:
                log.warning("trainer: %s outvoted %d times at the same epoch: convicted",
                            peer, count)
                self._convict(peer)
                return
        self.router.ban(peer, now=now, rng=self.rng)

    def _convict(self, peer: str) -> None:
        if not self.router.is_convicted(peer):
            self.counters.convicted += 1
        self.router.convict(peer)


def _finite_or_str(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


__all__ = [
    "SKIP_REASONS",
    "Answer",
    "SpotCheckConfig",
    "SkipReason",
    "SpotChecker",
    "Tier",
    "Verdict",
    "judge",
    "payload_digest",
    "relative_error",
]
