"""The parameters' version a stage's replies carry (node/stage/params_version.py): pure
bookkeeping over each epoch's round outcomes, with futures standing for hivemind's."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from wanswarm.node.stage.exact_allreduce import Gathered
from wanswarm.node.stage.params_version import (
    MAX_OPEN_EPOCHS,
    EpochStep,
    ParamsLedger,
    averaged_with_a_partner,
)


def _round(group: int | None = None, error: BaseException | None = None,
           cancelled: bool = False) -> Future[Any]:
    """A finished round: a group of ``group`` peers, or an error, or cancelled; pending when
    all three are left out."""
    f: Future[Any] = Future()
    if cancelled:
        f.cancel()
    elif error is not None:
        f.set_exception(error)
    elif group is not None:
        f.set_result({f"peer{i}": i for i in range(group)})
    return f


def _done() -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(None)
    return f


def test_a_round_counts_only_when_it_finished_with_a_partner() -> None:
    assert averaged_with_a_partner(_round(group=2))
    assert not averaged_with_a_partner(_round(group=1))  # alone: nobody to agree with
    assert not averaged_with_a_partner(_round(error=TimeoutError("no group")))
    assert not averaged_with_a_partner(_round(cancelled=True))
    assert not averaged_with_a_partner(_round())  # still running
    assert not averaged_with_a_partner(None)
    odd: Future[Any] = Future()
    odd.set_result(7)  # not a group: no promise, no exception
    assert not averaged_with_a_partner(odd)
    # hivemind calls a round whose reducer of some part failed a success; the member kept
    # its own values for that part (exact_allreduce.py marks it)
    partial: Future[Any] = Future()
    partial.set_result(Gathered({"a": 1, "b": 1}, complete=False))
    assert not averaged_with_a_partner(partial)
    whole: Future[Any] = Future()
    whole.set_result(Gathered({"a": 1, "b": 1}))
    assert averaged_with_a_partner(whole)


def test_a_steps_parameter_round_is_found_by_its_epoch() -> None:
    """hivemind starts the parameter round in the background: the step looks it up by the
    epoch it moved to."""
    rounds = {7: _round(group=2)}
    ledger = ParamsLedger(state_rounds=rounds.get)
    ledger.stepped(EpochStep(None, _done(), epoch=6))  # local, no round for 6
    assert ledger.version(6, applied=True) is None
    ledger.stepped(EpochStep(None, _done(), epoch=7))  # local, but 7's round averaged
    assert ledger.version(7, applied=True) == 7


def test_the_version_is_withheld_while_an_update_is_on_its_way() -> None:
    """Delayed updates: the epoch moves when the step begins; the module holds the previous
    parameters until the background work finishes and the next step copies it in."""
    ledger = ParamsLedger()
    assert ledger.version(0, applied=True) == 0  # the seed's parameters: every replica's
    work: Future[Any] = Future()
    ledger.stepped(EpochStep(grad_round=_round(group=2), work=work))
    assert ledger.version(1, applied=True) is None  # running in the background
    work.set_result(None)
    assert ledger.version(1, applied=False) is None  # finished, not copied in yet
    assert ledger.version(1, applied=True) == 1


def test_a_local_step_sets_the_replica_apart_until_a_parameter_round() -> None:
    """A parameter round brings the parameters back, not AdamW's moments: the promise holds
    until the next optimizer step takes the replicas apart again, and comes back with each
    parameter round, for good only with an installed state."""
    changes: list[tuple[bool, str]] = []
    rounds = {3: _round(group=2), 5: _round(group=2)}  # the parameter rounds, by epoch
    ledger = ParamsLedger(state_rounds=rounds.get,
                          on_change=lambda shared, why: changes.append((shared, why)))
    # the gradient round failed: hivemind stepped on this replica's gradients
    ledger.stepped(EpochStep(_round(error=TimeoutError()), _done(), epoch=1))
    assert ledger.version(1, applied=True) is None
    assert not ledger.shared and not ledger.moments_shared and ledger.unshared_epochs == 1
    # an averaged gradient applied to parameters that differ keeps them different
    ledger.stepped(EpochStep(_round(group=2), _done(), epoch=2))
    assert ledger.version(2, applied=True) is None
    # a parameter round with a partner makes the parameters the stage's again
    ledger.stepped(EpochStep(_round(group=2), _done(), epoch=3))
    assert ledger.version(3, applied=True) == 3 and not ledger.moments_shared
    # ... until the next optimizer step, taken with this replica's own moments
    ledger.stepped(EpochStep(_round(group=2), _done(), epoch=4))
    assert ledger.version(4, applied=True) is None
    # where every step averages parameters, the promise holds after each one
    ledger.stepped(EpochStep(_round(group=2), _done(), epoch=5))
    assert ledger.version(5, applied=True) == 5
    # an installed state brings the moments too: averaged steps keep the promise
    ledger.installed()
    ledger.stepped(EpochStep(_round(group=2), _done(), epoch=6))
    assert ledger.version(6, applied=True) == 6 and ledger.moments_shared
    # the fallback after a round that reported success counts as a local step
    ledger.stepped(EpochStep(_round(group=2), _done(), local=True, epoch=7))
    assert ledger.version(7, applied=True) is None
    # no round at all (skipped, no partner known): local gradients
    ledger.installed()
    ledger.stepped(EpochStep(None, None, epoch=8))
    assert ledger.version(8, applied=True) is None
    assert changes == [
        (False, "a gradient round that failed or lost parts at epoch 1"),
        (True, "parameter round of epoch 3"),
        (False, "the optimizer step of epoch 4, with this replica's own moments"),
        (True, "parameter round of epoch 5"),
        (False, "local gradients at epoch 7"),
        (True, "a state installed"),
        (False, "local gradients at epoch 8"),
    ]


def test_a_failed_parameter_round_after_an_averaged_step_keeps_the_promise() -> None:
    ledger = ParamsLedger(state_rounds={1: _round(error=TimeoutError())}.get)
    ledger.stepped(EpochStep(_round(group=3), _done(), epoch=1))
    assert ledger.version(1, applied=True) == 1


def test_an_installed_state_is_shared_and_drops_what_was_open() -> None:
    ledger = ParamsLedger()
    ledger.stepped(EpochStep(None, _done()))
    assert ledger.version(1, applied=True) is None
    ledger.stepped(EpochStep(_round(group=2), Future()))  # never finishes
    ledger.installed()  # a catch-up replaced everything, the open step included
    assert ledger.version(9, applied=True) == 9


def test_epochs_fold_in_order_even_when_nobody_asks_in_between() -> None:
    """Replies may not come for many epochs: every finished epoch is folded as the next one
    begins, so a local step in the middle is not lost, and the ledger stays bounded."""
    ledger = ParamsLedger()
    ledger.stepped(EpochStep(_round(group=2), _done()))
    ledger.stepped(EpochStep(None, _done()))  # local
    ledger.stepped(EpochStep(_round(group=2), _done()))
    assert ledger.version(3, applied=True) is None
    assert ledger.unshared_epochs == 2
    # work that never finishes: the oldest are given up as not shared, the ledger bounded
    stuck = ParamsLedger()
    for _ in range(MAX_OPEN_EPOCHS + 5):
        stuck.stepped(EpochStep(_round(group=2), Future()))
    assert len(stuck._open) == MAX_OPEN_EPOCHS
    assert stuck.unshared_epochs == 5 and stuck.version(70, applied=True) is None


def test_with_synchronous_steps_the_promise_holds_while_a_parameter_round_runs() -> None:
    """A ``stepped`` epoch (synchronous steps): its optimizer step ran before the step
    returned, and the module keeps what it left until the next step lands the parameter
    round. The promise follows the optimizer step's gradient round meanwhile; the round is
    folded in only at that landing, so a round that finished early does not vouch for
    parameters the module does not hold yet."""
    running = _round()  # the parameter round, still running
    ledger = ParamsLedger(state_rounds=lambda e: running if e == 5 else None)
    ledger.stepped(EpochStep(grad_round=_round(group=2), work=running, epoch=5, stepped=True))
    assert ledger.version(5, applied=True) == 5
    running.set_result({"a": 1, "b": 1})
    assert ledger.version(5, applied=True) == 5
    assert len(ledger._open) == 1  # not folded before it lands
    # a local step: set apart at once, while its (complete) round waits to land
    after_local = _round()
    ledger = ParamsLedger(state_rounds=lambda e: after_local)
    ledger.stepped(EpochStep(grad_round=None, work=after_local, epoch=5, stepped=True))
    after_local.set_result({"a": 1, "b": 1})
    assert ledger.version(5, applied=True) is None
    assert ledger.shared  # the state before the step: nothing folded yet
    # the next step lands it: shared parameters, this replica's own moments
    ledger.stepped(EpochStep(grad_round=_round(group=2), work=None, epoch=6, stepped=True))
    assert ledger.shared and not ledger.moments_shared
    assert ledger.version(6, applied=True) is None  # its optimizer step, own moments
    assert ledger.unshared_epochs == 0  # the round made them the stage's again
