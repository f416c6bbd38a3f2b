"""Spot checks: the trainer re-runs a fraction of hops on another replica and compares.

No pipeline system checks that a server computed what it was asked. A server can answer
in-bounds garbage that the value limits (docs/hostile.md) cannot tell from an honest
reply. Replicas of a stage hold the same parameters between averaging rounds, so for a
random fraction (``fraction``) of its ``forward`` and ``forward_loss`` hops the trainer
sends the same input to a second replica and compares the two answers:

- ``forward`` (stages 0 .. S-2) is re-run with ``keep_input=False``: nothing is cached or
  accumulated on the second replica. The outputs are compared by relative L2 error,
  ``||a - b|| / max(||a||, ||b||)``, of their decoded values.
- ``forward_loss`` (the last stage) is re-run as ``eval_loss`` (no gradients anywhere);
  the losses are compared by relative difference. Its ``dL/dx`` is not checked (a
  ``backward`` or ``forward_loss`` cannot be re-run without accumulating twice).

Only answers computed with the same parameters are compared: each reply carries its
stage's epoch and ``params``, the epoch of the parameters that computed it when they are
the stage's shared ones (null when the server promises nothing: an update half copied in,
a local step since the last shared state, DiLoCo and gossip runs; stage/params_version.py).
Two answers whose ``params`` differ, or are null, are not compared (``skipped``). The epoch
alone did not say enough: a replica that stepped on its own gradients, or that has not yet
copied a delayed update in, holds other parameters than its partner at the same epoch, and
in demo runs honest replicas at the same epoch answered 6-26% apart (one optimizer step
moves a stage's output by more than the tolerance early in training).

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
# parameters (params null); both promised, different ones
SkipReason = Literal["no_other_replica", "unpromised", "other_params"]
SKIP_REASONS: tuple[SkipReason, ...] = ("no_other_replica", "unpromised", "other_params")
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
            "Fraction of forward and forward_loss hops re-run on a second replica of the "
            "stage and compared (0: no spot checks)."
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

    def why_not_comparable(self, other: Answer) -> SkipReason:
        """Why two answers that are not ``comparable`` are not."""
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
    """What a spot check concluded; ``errors`` are the pairwise relative errors."""

    kind: VerdictKind
    errors: dict[str, float]


def judge(
    first: Answer, second: Answer, third: Answer | None, tolerance: float
) -> Verdict:
    """Who lied, if anyone (pure). ``first`` is the answer the pipeline would use.

    Answers computed with parameters not promised equal are not compared (``skipped``:
    ``Answer.comparable``); a ``third`` not comparable with the first two counts as
    absent."""
    if not first.comparable(second):
        return Verdict("skipped", {})
    ab = relative_error(first.value, second.value)
    errors = {"first_second": ab}
    if ab <= tolerance:
        return Verdict("agree", errors)
    if third is None or not first.comparable(third):
        return Verdict("unresolved", errors)
    ac = relative_error(first.value, third.value)
    bc = relative_error(second.value, third.value)
    errors |= {"first_third": ac, "second_third": bc}
    if bc <= tolerance < ac:
        return Verdict("first_lied", errors)
    if ac <= tolerance < bc:
        return Verdict("second_lied", errors)
    return Verdict("unresolved", errors)


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
    ) -> None:
        self.config = config
        self.router = router
        self.counters = counters
        self.rng = rng
        self.clock = clock
        self.evidence: deque[dict[str, object]] = deque(maxlen=config.evidence_kept)
        # the skipped checks by reason (their sum is the counters' spot_checks_skipped)
        self.skipped: dict[SkipReason, int] = dict.fromkeys(SKIP_REASONS, 0)

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
        tolerance = self.config.max_loss_error if loss else self.config.max_relative_error
        self.counters.spot_checks += 1
        try:
            second = await recompute(frozenset({first.peer}))
        except HopFailed:  # NoOtherReplica included: nothing to compare with
            self._skip("no_other_replica")
            return Verdict("skipped", {})
        verdict = judge(first, second, None, tolerance)
        if verdict.kind == "skipped":
            self._skip(first.why_not_comparable(second))
        if verdict.kind != "unresolved":
            return verdict
        self.counters.spot_check_disagreements += 1
        third: Answer | None = None
        if self.config.confirm:
            try:
                third = await recompute(frozenset({first.peer, second.peer}))
            except HopFailed:  # NoOtherReplica included: no third opinion
                third = None
            verdict = judge(first, second, third, tolerance)
        answers = [first, second] if third is None else [first, second, third]
        now = self.clock()
        if verdict.kind == "first_lied":
            self._convict(first.peer)
        elif verdict.kind == "second_lied":
            self._convict(second.peer)
        else:
            for answer in answers:
                self.router.ban(answer.peer, now=now, rng=self.rng)
        record: dict[str, object] = {
            "what": what,
            "verdict": verdict.kind,
            "tolerance": tolerance,
            "errors": {k: _finite_or_str(v) for k, v in verdict.errors.items()},
            "answers": [a.summary() for a in answers],
        }
        self.evidence.append(record)
        log.warning("trainer: spot check of %s: %s; evidence %s", what, verdict.kind,
                    json.dumps(record, sort_keys=True))
        return verdict

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
    "Verdict",
    "judge",
    "payload_digest",
    "relative_error",
]
