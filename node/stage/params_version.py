"""Which parameters answered: the version a stage's reply carries for spot checks.

A trainer's spot check (training/spot_checks.py) compares two replicas' answers to the same
input, which is fair only when both computed with the same parameters. The stage's epoch
does not say that:

- with delayed updates (averaging.py, the default), an epoch's step starts its gradient
  round, optimizer step and parameter round in the background and moves the epoch at once;
  the served module keeps the previous parameters until a later ``step`` copies the result
  in (hivemind copies it in two writes: after the optimizer step, then after the parameter
  round). Two replicas at the same epoch answer one optimizer step apart while one has
  copied the update in and the other not yet (tests/loopback/test_averaging.py);
- with either kind of step, a replica whose gradient round failed steps on its own
  gradients, and one whose round lost parts keeps its own values there: at the same epoch
  its parameters differ from its partner's.

One optimizer step moves a stage's output by 3.6-25% in the tiny run's first 40 steps (the
reference loop, same input), against the spot checks' 5% tolerance. In demo runs
(synchronous steps) honest replicas at the same epoch answered 6-26% apart; each check
failed its micro-batch and banned both servers.

So each reply carries ``params``: the epoch of the parameters that computed it when this
replica's parameters are the stage's shared ones, or None when they may not be:

- with delayed updates, while an epoch's background work runs or waits to be copied into
  the module (the transition: the module holds one state or the other). With synchronous
  steps the optimizer step has run when the step returns, and only the parameter round
  runs in the background; the module keeps what the optimizer step left until the next
  step lands the round's result (``EpochStep.stepped``), so the promise follows that
  optimizer step meanwhile, and the round is folded in when it lands (in the demo,
  parameter rounds every 5th epoch withheld the promise for one epoch in five before);
- after an epoch whose gradient round did not average with a partner (a local step), or
  whose round lost some part's average (hivemind calls such a round a success and keeps
  the member's own values there; exact_allreduce.py marks the result), until a complete
  parameter round with a partner;
- and then again from the next optimizer step on, until the next parameter round: a
  parameter round averages parameters, not AdamW's moments, so a replica that once
  stepped apart keeps its own moments, and equal averaged gradients take the replicas
  apart again (6.9% of a stage's output four epochs after such a round in a demo run).
  Installing a peer's state (a catch-up) ends that. Where every step averages parameters
  (``average_state_every = 1``, the node's default) the promise holds after every step;
- in DiLoCo and gossip runs, always: replicas take their inner steps on their own data
  (diloco.py, gossip_optimizer.py), so two replicas never promise equal parameters.

A state installed from a peer or a checkpoint (catch-up, ``import_state``) is the donor's
exactly: shared again, at its epoch. Trainers hold two answers to the spot checks' tight
bound only when both carry the same ``params`` (other answers of one epoch only to a looser
one). A round that split the replicas into two groups that each succeeded
leaves each group agreeing within itself but not across; hivemind forms one group per
round, so this needs a matchmaking failure at the same moment, and the check then reports
``unresolved`` as before.

:class:`ParamsLedger` is pure bookkeeping over the outcomes of each epoch's rounds: it
takes futures (anything with ``done``/``cancelled``/``exception``/``result``) and answers
on the device thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# more epochs than this waiting on unfinished background work: something is stuck; the
# oldest are folded in as not shared (a bounded ledger, and no promise made on them)
MAX_OPEN_EPOCHS = 64


class Outcome(Protocol):
    """A round's or background job's future (concurrent.futures-like)."""

    def done(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def result(self, timeout: float | None = None) -> Any: ...


def averaged_with_a_partner(round_: Outcome | None) -> bool:
    """Whether a round finished, without error, in a group of two or more (hivemind's
    result: what each member gathered, by peer), with every part's average received
    (exact_allreduce.py's ``Gathered.complete``: hivemind calls a round whose reducer of
    some part failed a success, and the member keeps its own values for that part)."""
    if round_ is None or not round_.done() or round_.cancelled():
        return False
    try:
        if round_.exception(0) is not None:
            return False
        result = round_.result(0)
        return len(result) > 1 and getattr(result, "complete", True) is True
    except Exception:  # a result that is not a group: no promise
        return False


@dataclass
class EpochStep:
    """One epoch's step: its gradient round (None: none began, local gradients),
    hivemind's background job (None: nothing ran in the background), whether the optimizer
    stepped on this replica's own gradients all the same (``local``: hivemind's fallback
    after a failed round), and the epoch it moved to, by which its parameter round is found
    (hivemind starts that round in the background, after the step returned)."""

    grad_round: Outcome | None
    work: Outcome | None
    local: bool = False
    epoch: int | None = None
    # the optimizer step ran on the served module before the step returned (synchronous
    # steps): what runs in the background is only the parameter round, whose result the
    # module takes at the next epoch step (or a flush), not before
    stepped: bool = False

    def finished(self) -> bool:
        return self.work is None or self.work.done()


class ParamsLedger:
    """Whether this replica's parameters are the stage's shared ones (module docstring).

    Two things are tracked: the parameters, and AdamW's moments, which decide where equal
    gradients take equal parameters next. An optimizer step with the stage's averaged
    gradients keeps the parameters equal only if the moments are; a parameter round makes
    the parameters equal but leaves each replica its own moments (hivemind averages none
    of them by default); an installed state brings both."""

    def __init__(
        self,
        state_rounds: Callable[[int], Outcome | None] = lambda _e: None,
        on_change: Callable[[bool, str], None] = lambda _shared, _why: None,
    ) -> None:
        # told (shared or not, why) when the parameters stop or start being the stage's
        self._on_change = on_change
        # a step's parameter round (None: none), by the epoch the step moved to
        self._state_rounds = state_rounds
        # every replica builds the same initial parameters (the seed) and empty moments
        self._params = self._moments = True
        self._open: deque[EpochStep] = deque()
        self.unshared_epochs = 0  # epochs after which the parameters were not the shared ones

    def stepped(self, step: EpochStep) -> None:
        """An epoch's step began (its background work may still run). The steps before it
        have landed: their parameter rounds' results are in the module."""
        self._settle(landing=True)
        self._open.append(step)
        while len(self._open) > MAX_OPEN_EPOCHS:
            self._open.popleft()
            self._fold(False, False, "background work unfinished for too many epochs")

    def installed(self) -> None:
        """A state from a peer or a checkpoint replaced this one: the donor's exactly,
        parameters and moments."""
        self._open.clear()
        if not self._params:
            self._on_change(True, "a state installed")
        self._params = self._moments = True

    def version(self, epoch: int, *, applied: bool) -> int | None:
        """``epoch`` if the module's parameters are the stage's shared ones at it, else
        None. ``applied``: no finished background result waits to be copied into the
        module."""
        self._settle()
        if not applied:
            return None
        params, moments = self._params, self._moments
        for step in self._open:
            if not step.stepped or not _settled(step.grad_round):
                return None  # the module holds one state or the other
            # only its parameter round is pending: the module serves what the optimizer
            # step left, which is shared as that step's gradient round says
            params, moments, _ = _optimizer_step(step, params, moments)
        return epoch if params else None

    @property
    def shared(self) -> bool:
        """Whether the parameters were the stage's shared ones after the last finished epoch."""
        self._settle()
        return self._params

    @property
    def moments_shared(self) -> bool:
        """Whether AdamW's moments are the stage's (none of this replica's steps was local
        since it last installed a state)."""
        self._settle()
        return self._moments

    def _settle(self, *, landing: bool = False) -> None:
        """Fold in the epochs whose background work finished, oldest first: the optimizer
        step (equal averaged gradients keep equal parameters equal if the moments are equal
        too; local ones set both apart), then the parameter round (equal parameters). A
        ``stepped`` epoch (synchronous steps) is folded only once it landed (``landing``:
        the next epoch step began): until then the module holds what its optimizer step
        left, not its round's result."""
        while self._open and self._open[0].finished():
            if self._open[0].stepped and not landing:
                return
            step = self._open.popleft()
            params, moments, why = _optimizer_step(step, self._params, self._moments)
            state = None if step.epoch is None else self._state_rounds(step.epoch)
            if averaged_with_a_partner(state):
                params = True
                why = f"parameter round of epoch {step.epoch}"
            self._fold(params, moments, why)

    def _fold(self, params: bool, moments: bool, why: str) -> None:
        was = self._params
        self._params, self._moments = params, moments
        if not self._params:
            self.unshared_epochs += 1
        if self._params != was:
            self._on_change(self._params, why)


def _settled(round_: Outcome | None) -> bool:
    """Whether a gradient round's outcome is known (none began, or it ended)."""
    return round_ is None or round_.done()


def _optimizer_step(step: EpochStep, params: bool, moments: bool) -> tuple[bool, bool, str]:
    """Whether the parameters and the moments are the stage's after ``step``'s optimizer
    step, from what they were before it, and why."""
    if not step.local and averaged_with_a_partner(step.grad_round):
        why = (f"gradient round of epoch {step.epoch}" if moments else
               f"the optimizer step of epoch {step.epoch}, with this replica's own moments")
        return params and moments, moments, why
    why = ("local gradients" if step.grad_round is None or step.local
           else "a gradient round that failed or lost parts")
    return False, False, f"{why} at epoch {step.epoch}"
