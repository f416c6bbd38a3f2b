"""The epoch rule of ``averaging.exact_epochs`` (membership/dht.py's progress tracker).

hivemind sums the replicas' published progress records at each fetch, this replica's own
included, and adds this replica's samples accumulated after the fetch: what it accumulated
between publishing its record and the fetch is missing from the sum until the next one, so
the epoch ended up to a micro-batch late. The rule now takes the other replicas' records and
this replica's samples as they are. No DHT: the tracker's state is set by hand on an
instance built without hivemind's constructor. Also here: why an epoch ended, and the rule
that a replica behind every partner steps without a round (rounds meet only rounds of their
own epoch: exact_allreduce.py).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from wanswarm.node.membership.dht import others_samples, tidy_optimizer_class
from wanswarm.node.stage.averaging import CollaborativeOptimizer
from wanswarm.node.stage.params_version import ParamsLedger

OWN, OTHER, CLIENT = b"own", b"other", b"client"


def _record(peer: bytes, epoch: Any, samples: Any, client: bool = False) -> Any:
    return SimpleNamespace(value={"peer_id": peer, "epoch": epoch, "samples_accumulated": samples,
                                  "client_mode": client, "samples_per_second": 1.0, "time": 0.0})


def test_others_samples_sums_the_other_replicas_by_epoch_and_skips_the_rest() -> None:
    metadata = {
        b"a": _record(OWN, 3, 40),  # ours: taken from local progress instead
        b"b": _record(OTHER, 3, 16),
        b"c": _record(b"third", 3, 8.0),
        b"d": _record(b"late", 2, 56),
        b"e": _record(CLIENT, 3, 24, client=True),  # clients accumulate no gradients here
        b"f": _record(b"junk", "3", 8),
        b"g": _record(b"nan", 3, float("nan")),
        b"h": _record(b"bool", True, 8),
        b"i": SimpleNamespace(value=None),
    }
    assert others_samples(metadata, OWN) == {3: 24.0, 2: 56.0}
    assert others_samples(None, OWN) == {}


def _ready(local_epoch: int, local_samples: int, global_epoch: int, reported: int,
           others: dict[int, float]) -> bool:
    """The tracker's ``ready_to_update_epoch`` over a stand-in holding that state (a real
    tracker needs a DHT and a thread)."""
    rule = tidy_optimizer_class().tracker_class.ready_to_update_epoch.fget
    return bool(rule(_tracker_state(local_epoch, local_samples, global_epoch, reported, others)))


def _reason(local_epoch: int, local_samples: int, global_epoch: int, reported: int,
            others: dict[int, float]) -> str | None:
    state = _tracker_state(local_epoch, local_samples, global_epoch, reported, others)
    return state.epoch_end_reason()


def _tracker_state(local_epoch: int, local_samples: int, global_epoch: int, reported: int,
                   others: dict[int, float]) -> SimpleNamespace:
    reason = tidy_optimizer_class().tracker_class.epoch_end_reason
    state = SimpleNamespace(
        hold_epoch=None, exact_epochs=True, target_batch_size=64, global_epoch=global_epoch,
        local_progress=SimpleNamespace(epoch=local_epoch, samples_accumulated=local_samples),
        global_progress=SimpleNamespace(epoch=global_epoch, samples_accumulated=reported),
        others_samples=others,
    )
    state.epoch_end_reason = lambda: reason(state)
    due = tidy_optimizer_class().tracker_class.due_without_hold
    state.due_without_hold = lambda: due(state)
    return state


def test_the_reason_an_epoch_ended_is_named() -> None:
    assert _reason(5, 8, 6, 0, {5: 8.0}) == "global"
    assert _reason(5, 8, 5, 16, {6: 0.0}) == "ahead"
    assert _reason(5, 40, 5, 48, {5: 24.0}) == "target"
    assert _reason(5, 32, 5, 48, {5: 24.0}) is None


def test_an_epoch_ends_on_the_others_records_plus_our_samples_as_they_are() -> None:
    # our record said 24 at the fetch, we have 40 now; the other replica reported 24:
    # hivemind's sum is 48 (+ nothing since the fetch), the samples are 64
    assert _ready(5, 40, 5, 48, {5: 24.0})
    assert not _ready(5, 32, 5, 48, {5: 24.0})
    # a replica at a later epoch ends ours whatever the samples
    assert _ready(5, 0, 6, 0, {6: 8.0})
    # right after our step: the others' records of the epoch we left do not count
    assert not _ready(6, 8, 5, 0, {5: 64.0})
    # hivemind's sum still counts when it is the larger (never later than before)
    assert _ready(5, 0, 5, 64, {})


def test_a_replica_already_past_our_epoch_ends_it() -> None:
    # its push says epoch 6 before the DHT does (global epoch still 5): its samples left
    # epoch 5's count, and the epoch is over all the same
    assert _ready(5, 24, 5, 24, {6: 0.0})
    assert not _ready(5, 24, 5, 24, {5: 16.0, 4: 8.0})


class _Control:
    """Stands for hivemind's StepControl of a round formed early, not yet triggered."""

    triggered = False

    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True


def _stage_optimizer(local_epoch: int, others: dict[int, float]) -> CollaborativeOptimizer:
    """A CollaborativeOptimizer over a stand-in hivemind Optimizer in that state (a real
    one needs a DHT: tests/loopback/test_averaging.py)."""
    opt = CollaborativeOptimizer.__new__(CollaborativeOptimizer)
    opt._opt = SimpleNamespace(
        local_epoch=local_epoch, tracker=SimpleNamespace(others_samples=others),
        scheduled_grads=_Control(),
    )
    opt.rounds_skipped_behind = 0
    opt.local_gradient_steps = 0
    opt.state_rounds_abandoned = 0
    opt._round = {}
    opt._sync = True  # synchronous steps: where the rules for a replica left behind hold
    opt._opt.state_averager = SimpleNamespace(
        last_round=None, pending_updates=set(),
        finished_optimizer_step=threading.Event(), finished_averaging_round=threading.Event(),
    )
    opt._ledger = ParamsLedger(  # as the constructor builds it
        state_rounds=lambda epoch: getattr(opt._opt.state_averager, "rounds", {}).get(epoch),
    )
    opt._step_in_flight = None
    opt.parameter_rounds_landed = 0
    return opt


def test_a_replica_behind_every_partner_steps_without_a_round() -> None:
    assert _stage_optimizer(5, {6: 0.0})._behind_every_partner()
    assert _stage_optimizer(5, {6: 0.0, 7: 8.0})._behind_every_partner()
    # a partner at our epoch (or behind it, about to reach it) can still form our round
    assert not _stage_optimizer(5, {5: 8.0, 6: 0.0})._behind_every_partner()
    assert not _stage_optimizer(5, {4: 8.0})._behind_every_partner()
    # nobody known: hivemind's own rule
    assert not _stage_optimizer(5, {})._behind_every_partner()

    opt = _stage_optimizer(5, {6: 0.0})
    control = opt._opt.scheduled_grads
    assert opt._skip_round() is False  # hivemind: no round began, its own gradients
    assert control.cancelled and opt._opt.scheduled_grads is None
    assert opt.rounds_skipped_behind == 1
    assert opt.local_gradient_steps == 1  # counted with the steps on our own gradients


def test_a_slow_step_is_logged_with_why_the_epoch_ended(
    monkeypatch: Any, caplog: Any
) -> None:
    from wanswarm.node.stage import averaging

    monkeypatch.setattr(averaging, "SLOW_STEP_MARGIN_S", -1.0)  # every step is "slow"
    opt = _stage_optimizer(5, {6: 0.0})
    opt._opt.tracker.epoch_end_reason = lambda: "ahead"
    opt._opt.local_progress = SimpleNamespace(samples_accumulated=8)
    opt._opt.tracker.global_epoch = 5
    opt.config = SimpleNamespace(matchmaking_time=0.0)
    opt.run_id = "run_stage1"
    opt.slow_steps, opt.last_slow_step, opt.local_gradient_steps = 0, None, 0

    def update(_scaler: Any) -> None:  # hivemind's step, skipping its round
        opt._skip_round()
        opt._opt.local_epoch = 6

    with caplog.at_level("WARNING"):
        opt._timed_epoch_step(update, None)
    assert opt.slow_steps == 1
    slow = opt.last_slow_step
    assert slow is not None
    assert (slow["epoch"], slow["reason"], slow["ours"], slow["others"]) == (5, "ahead", 8,
                                                                           {"6": 0.0})
    assert slow["round"] == "skipped (behind)" and slow["formed_early"] is True
    assert "the step ending epoch 5 took" in caplog.text and "reason=ahead" in caplog.text


class _Finished(Future[Any]):
    """A round that finished (and was triggered) with ``group``: what each member gathered."""

    triggered = True

    def __init__(self, group: dict[str, int]) -> None:
        super().__init__()
        self.set_result(group)


def test_each_epoch_step_is_recorded_for_the_replies_params_version() -> None:
    """The epoch-step wrapper hands the ledger (params_version.py) what each step did: the
    gradient round hivemind began, the parameter round and the background work it
    started; a skipped round is a local step. The replies' version is withheld while the
    work runs and comes back only once a parameter round with a partner succeeded."""
    opt = _stage_optimizer(5, {5: 8.0})
    opt._opt.tracker.epoch_end_reason = lambda: "target"
    opt._opt.tracker.global_epoch = 5
    opt._opt.local_progress = SimpleNamespace(samples_accumulated=8)
    opt.config = SimpleNamespace(matchmaking_time=1e9)  # no step is slow
    opt.slow_steps, opt.last_slow_step, opt.local_gradient_steps = 0, None, 0
    averager = opt._opt.state_averager
    assert opt.params_version() == 5  # nothing stepped yet: the initial state, shared

    def hivemind_step(group: Future[Any], state: Future[Any] | None) -> Future[Any]:
        """hivemind's _update_global_epoch: begins the gradient round (through the
        wrapper), starts its background work and a parameter round, moves the epoch."""
        work: Future[Any] = Future()

        def update(_scaler: Any) -> None:
            opt._opt.scheduled_grads = group
            opt._begin_unless_behind(lambda _s: True, None)
            averager.pending_updates.add(work)
            opt._opt.local_epoch += 1
            if state is not None:  # hivemind's background work starts it for the new epoch
                averager.rounds = {opt._opt.local_epoch: state}

        opt._timed_epoch_step(update, None)
        return work

    # delayed updates: the optimizer step runs in the background, the epoch moves first
    opt._sync = False
    averaged = _Finished({"a": 1, "b": 1})
    work = hivemind_step(averaged, None)
    assert opt.params_version() is None  # the update runs in the background
    work.set_result(None)
    averager.finished_optimizer_step.set()
    assert opt.params_version() is None  # finished, not copied into the module yet
    averager.finished_optimizer_step.clear()
    assert opt.params_version() == 6

    # synchronous steps: the optimizer step ran before the step returned; only the
    # parameter round runs in the background, and the module serves what the step left
    # until the next step lands the round's result: the promise holds meanwhile
    opt._sync = True
    running: Future[Any] = Future()
    work = hivemind_step(averaged, running)
    assert opt.params_version() == 7
    running.set_result({"a": 1, "b": 1})
    work.set_result(None)
    averager.finished_averaging_round.set()  # finished, lands at the next step
    assert opt.params_version() == 7
    averager.finished_averaging_round.clear()

    # every partner moved past our epoch: no round, this replica's own gradients
    opt._opt.tracker.others_samples = {10: 0.0}
    hivemind_step(averaged, None).set_result(None)
    assert opt.params_version() is None
    # a later parameter round with a partner makes the parameters the stage's again once
    # it lands, at the next step; that step's optimizer step, on moments that stayed this
    # replica's own, takes them apart again (params_version.py)
    opt._opt.tracker.others_samples = {9: 8.0}
    hivemind_step(averaged, _Finished({"a": 8, "b": 8})).set_result(None)
    assert opt.params_version() is None and opt._ledger.unshared_epochs == 1
    hivemind_step(averaged, None).set_result(None)
    assert opt._ledger.shared and not opt._ledger.moments_shared
    assert opt.params_version() is None


class _Round(_Control):
    """A triggered round: looking for its group until ``finish_after`` polls, or for good."""

    triggered = True

    def __init__(self, finish_after: int | None) -> None:
        super().__init__()
        self.polls = 0
        self.finish_after = finish_after

    @property
    def stage(self) -> Any:
        from hivemind.averaging.control import AveragingStage

        return AveragingStage.LOOKING_FOR_GROUP

    def result(self, timeout: float | None = None) -> Any:
        self.polls += 1
        if self.finish_after is not None and self.polls > self.finish_after:
            return {}
        raise TimeoutError


def test_a_round_left_behind_by_every_partner_is_abandoned(monkeypatch: Any) -> None:
    from wanswarm.node.stage import averaging

    monkeypatch.setattr(averaging, "ROUND_POLL_S", 0.0)
    opt = _stage_optimizer(25, {25: 40.0})
    opt.config = SimpleNamespace(averaging_timeout=30.0)
    others = opt._opt.tracker.others_samples
    hopeless = _Round(finish_after=None)
    polls = 0

    def partner_moves_on(timeout: float | None = None) -> Any:
        nonlocal polls
        polls += 1
        if polls == 3:  # its side of the round failed: it stepped on (pushed: epoch 26)
            others.clear()
            others[26] = 0.0
        raise TimeoutError

    hopeless.result = partner_moves_on  # type: ignore[method-assign]
    assert opt._wait_unless_left_behind(hopeless) == "behind"
    assert hopeless.cancelled and polls == 3

    # a partner still at our epoch: the round is waited for until it is over
    opt = _stage_optimizer(25, {25: 40.0})
    opt.config = SimpleNamespace(averaging_timeout=30.0)
    finishing = _Round(finish_after=5)
    assert opt._wait_unless_left_behind(finishing) is None
    assert not finishing.cancelled and finishing.polls == 6


def test_a_round_whose_partners_are_all_gone_is_abandoned_after_the_grace(
    monkeypatch: Any,
) -> None:
    """The partner the round was formed with died: once no other replica has had a record
    or push for ALONE_GRACE_S the round is given up (hivemind retried until
    averaging_timeout); a partner that shows again within the grace restarts it."""
    from wanswarm.node.stage import averaging

    monkeypatch.setattr(averaging, "ROUND_POLL_S", 0.0)
    monkeypatch.setattr(averaging, "ALONE_GRACE_S", 0.05)
    opt = _stage_optimizer(25, {25: 40.0})
    opt.config = SimpleNamespace(averaging_timeout=30.0)
    others = opt._opt.tracker.others_samples
    lonely = _Round(finish_after=None)
    seen: list[float] = []

    def partner_flickers(timeout: float | None = None) -> Any:
        seen.append(time.monotonic())
        if len(seen) == 2:
            others.clear()  # its record expired
        elif len(seen) == 3:
            time.sleep(0.04)
            others[25] = 40.0  # one more read found it: the grace starts over
        elif len(seen) == 4:
            others.clear()
        raise TimeoutError

    lonely.result = partner_flickers  # type: ignore[method-assign]
    start = time.monotonic()
    assert opt._wait_unless_left_behind(lonely) == "alone"
    assert lonely.cancelled and len(seen) > 4
    assert time.monotonic() - seen[3] >= 0.05  # the grace ran from the last disappearance
    assert time.monotonic() - start < 5.0

    # with a partner known (even one epoch behind, alive or not) the round is waited for
    opt = _stage_optimizer(25, {24: 8.0})
    opt.config = SimpleNamespace(averaging_timeout=30.0)
    finishing = _Round(finish_after=40)
    assert opt._wait_unless_left_behind(finishing) is None
    assert not finishing.cancelled


def _stepping_optimizer(
    epoch: int, others: dict[int, float], reason: str, *, samples: int
) -> CollaborativeOptimizer:
    """``_stage_optimizer`` ready for ``_timed_epoch_step``: an epoch that ended for
    ``reason`` with ``samples`` of ours, every step fast enough not to be logged."""
    opt = _stage_optimizer(epoch, others)
    opt._opt.tracker.epoch_end_reason = lambda: reason
    opt._opt.local_progress = SimpleNamespace(samples_accumulated=samples)
    opt._opt.tracker.global_epoch = epoch
    opt.config = SimpleNamespace(matchmaking_time=2.0, averaging_timeout=30.0)
    opt.run_id = "run_stage"
    opt.slow_steps, opt.last_slow_step = 0, None
    return opt


def test_a_parameter_round_left_running_is_given_up_once_every_partner_moved_on(
    monkeypatch: Any,
) -> None:
    """The parameter round an earlier step left running in hivemind's one worker thread is
    waited for ahead of this step's optimizer step, given up while still matching when
    every partner is past our epoch, and its background work finished and applied."""
    from wanswarm.node.stage import averaging

    monkeypatch.setattr(averaging, "ROUND_POLL_S", 0.0)
    opt = _stepping_optimizer(45, {46: 0.0}, "ahead", samples=16)
    averager = opt._opt.state_averager
    stuck = _Round(finish_after=None)
    averager.last_round = stuck
    job: Future[Any] = Future()  # the background work the round belongs to
    averager.pending_updates = {job}
    landed: list[dict[str, Any]] = []

    def hivemind_flush(**kwargs: Any) -> None:  # TrainingStateAverager.step
        landed.append(kwargs)
        job.set_result(None)  # the cancelled round ends its job

    averager.step = hivemind_flush

    def update(_scaler: Any) -> None:  # hivemind's step, starting this epoch's round
        assert stuck.cancelled  # given up before hivemind's step waits behind it
        assert landed == [{"wait_for_delayed_updates": True, "apply_delayed_updates": True}]
        opt._skip_round()  # its gradient round's account joins the parameter round's
        opt._opt.local_epoch = 46

    opt._timed_epoch_step(update, None)
    assert opt.state_rounds_abandoned == 1 and opt.parameter_rounds_landed == 1
    # the account keeps the parameter round's fate beside the gradient round's
    assert opt._round == {"state_round": "abandoned (behind)", "round": "skipped (behind)"}


def test_a_parameter_round_lands_before_the_next_optimizer_step() -> None:
    """Synchronous steps. hivemind's worker thread says a parameter round finished a moment
    after the round's control completes; a step that went straight on ran its optimizer step
    on the parameters from before the round, and the step after copied the round's result
    over it: one optimizer step lost on that replica alone. The next epoch step now waits
    for the round and for the worker's background work, and copies the result in first; a
    round not yet triggered (one hivemind would start for this very step) is left alone."""
    opt = _stepping_optimizer(20, {20: 8.0}, "target", samples=32)
    averager = opt._opt.state_averager
    order: list[str] = []
    finishing = _Round(finish_after=2)  # triggered: epoch 20's step used it
    averager.last_round = finishing
    job: Future[Any] = Future()
    averager.pending_updates = {job}

    def hivemind_flush(**kwargs: Any) -> None:
        order.append("landed")
        job.set_result(None)

    averager.step = hivemind_flush

    def update(_scaler: Any) -> None:
        order.append("optimizer step")
        opt._opt.local_epoch = 21

    opt._timed_epoch_step(update, None)
    assert order == ["landed", "optimizer step"]
    assert finishing.polls == 3 and not finishing.cancelled  # waited out, not given up
    assert opt.parameter_rounds_landed == 1

    # a round for the coming step, not triggered yet: not
    # waited for (it waits for that step's trigger), and no background work is pending
    order.clear()
    upcoming = _Control()
    assert not upcoming.triggered
    averager.last_round = upcoming
    opt._timed_epoch_step(update, None)
    assert order == ["optimizer step"] and opt.parameter_rounds_landed == 1


def test_with_delayed_updates_a_partner_ahead_does_not_skip_our_round() -> None:
    """With delayed updates a partner moves to the next epoch as soon as its round starts
    in the background: its later epoch does not mean our round has nobody to meet."""
    began: list[Any] = []

    def begin(scaler: Any) -> bool:
        began.append(scaler)
        return True

    opt = _stage_optimizer(5, {6: 0.0})
    assert opt._begin_unless_behind(begin, None) is False  # synchronous: skipped
    assert began == [] and opt.rounds_skipped_behind == 1

    opt = _stage_optimizer(5, {6: 0.0})
    opt._sync = False
    assert opt._begin_unless_behind(begin, None) is True  # delayed: hivemind's round
    assert began == [None] and opt.rounds_skipped_behind == 0


def _starting_optimizer(listed: int | None, wait_s: float = 15.0) -> Any:
    """A stage optimizer at epoch 0 whose tracker counts only itself and whose epoch is
    due (its own samples reached the target); ``listed``: the stage's other servers in the
    membership (None: no membership callable)."""
    opt = _stage_optimizer(0, {})
    tracker = opt._opt.tracker
    tracker.global_progress = SimpleNamespace(num_peers=1)
    tracker.due_without_hold = lambda: True
    opt.config = SimpleNamespace(partner_wait_s=wait_s, delayed_updates=False)
    opt.run_id = "run_stage0"
    opt._partners = None if listed is None else (lambda: listed)
    opt._partner_hold, opt._partner_wait_since, opt.partner_hold_s = "open", None, 0.0
    opt.now = 100.0
    opt._clock = lambda: opt.now
    return opt


def test_a_replica_holds_its_first_epoch_until_hivemind_sees_a_listed_partner() -> None:
    """Replicas that start together: the membership lists the partner before hivemind's
    progress records show it. Stepping then would be a step on this replica's own
    gradients, and the replicas' moments would differ for good (params_version.py)."""
    opt = _starting_optimizer(listed=1)
    assert opt._hold_epoch() and opt._partner_hold == "open"
    opt.now += 10.0
    assert opt._hold_epoch() and opt.partner_hold_s == 10.0
    opt._opt.tracker.global_progress.num_peers = 2  # hivemind counts the partner: a round
    assert not opt._hold_epoch() and opt._partner_hold == "seen"
    # once seen, never again: a partner that later vanishes is hivemind's business
    opt._opt.tracker.global_progress.num_peers = 1
    assert not opt._hold_epoch()


def test_the_hold_starts_when_the_epoch_is_due_and_ends_after_partner_wait_s() -> None:
    opt = _starting_optimizer(listed=2, wait_s=15.0)
    opt._opt.tracker.due_without_hold = lambda: False  # not due: nothing to hold, no clock
    opt.now = 50.0
    assert not opt._hold_epoch() and opt._partner_wait_since is None
    opt._opt.tracker.due_without_hold = lambda: True
    opt.now = 100.0
    assert opt._hold_epoch()
    opt.now = 114.9
    assert opt._hold_epoch()
    opt.now = 115.0  # a listed server whose progress never comes costs this once
    assert not opt._hold_epoch() and opt._partner_hold == "spent"
    opt.now = 500.0
    assert not opt._hold_epoch()


def test_no_hold_without_a_listed_partner() -> None:
    # alone in the stage: step alone (a newcomer later installs this replica's state)
    assert not _starting_optimizer(listed=0)._hold_epoch()
    assert not _starting_optimizer(listed=None)._hold_epoch()
    assert not _starting_optimizer(listed=1, wait_s=0.0)._hold_epoch()
    opt = _starting_optimizer(listed=1)

    def broken() -> int:
        raise RuntimeError("dictionary changed size during iteration")

    opt._partners = broken
    assert not opt._hold_epoch() and opt._partner_hold == "open"
