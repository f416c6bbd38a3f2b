"""A replica behind its stage catches up through our transport first, tries hivemind's own
download once (never its retry loop) and only where no donor answered ours, takes a
stand-in through ours after refusals in a row, and spaces its
attempts (node/stage/resync.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import hivemind
import pytest
from wanswarm.node.stage.optimizer import Caught
from wanswarm.node.stage.resync import HIVEMIND_OPTIMIZER_ATTRIBUTES, catch_up_through


class _Tracker:
    def __init__(self, global_epoch: int) -> None:
        self.global_epoch = global_epoch
        self.lock = threading.Lock()  # hivemind's is not reentrant either
        self.reports: list[tuple[int, int]] = []
        # what progress_guard.reparse reads: the DHT's records, parsed (through the screen)
        self.training_progress_key = "run_progress"
        self.lock_global_progress = threading.Lock()
        self.dht = self
        self.parsed: list[Any] = []
        self.global_progress: Any = None

    def get(self, key: str, latest: bool) -> None:
        assert key == self.training_progress_key and latest
        return None  # nothing stored: hivemind parses None as no peers

    def _parse_swarm_progress_data(self, metadata: Any) -> str:
        self.parsed.append(metadata)
        return "parsed"

    @contextlib.contextmanager
    def pause_updates(self) -> Iterator[None]:
        with self.lock:
            yield

    def report_local_progress(self, local_epoch: int, samples_accumulated: int) -> None:
        self.reports.append((local_epoch, samples_accumulated))


class _StateAverager:
    def __init__(self, epoch: int, donor_epoch: int | None) -> None:
        self.local_epoch = epoch
        self.donor_epoch = donor_epoch
        self.loads = 0
        self.steps = 0
        self.state_sharing_priority = 0

    def step(self, wait_for_delayed_updates: bool) -> None:
        self.steps += 1

    def load_state_from_peers(self, timeout: float | None = None) -> None:
        self.loads += 1
        if self.donor_epoch is None:
            raise TimeoutError("no donor answered")  # hivemind's own loop would spin here
        self.local_epoch = self.donor_epoch


class _Opt:
    """The attributes of hivemind.Optimizer that the catch-up uses, nothing more."""

    def __init__(self, epoch: int, global_epoch: int, donor_epoch: int | None) -> None:
        self.state_averager = _StateAverager(epoch, donor_epoch)
        self.grad_averager = None
        self.tracker = _Tracker(global_epoch)
        self.scheduled_grads = None
        self.load_state_timeout = 1.0
        self.client_mode = False
        self.use_gradient_averaging = False

    @property
    def local_epoch(self) -> int:
        return self.state_averager.local_epoch

    def _tag_along_with_zero_weight(self, control: Any) -> None:
        raise AssertionError("no round was scheduled")

    def load_state_from_peers(self, **kwargs: Any) -> None:
        raise AssertionError("hivemind's own method must have been replaced")


def test_the_real_hivemind_optimizer_has_what_the_catch_up_uses() -> None:
    for name in HIVEMIND_OPTIMIZER_ATTRIBUTES:
        in_class = hasattr(hivemind.Optimizer, name)
        set_in_init = name in hivemind.Optimizer.__init__.__code__.co_names
        assert in_class or set_in_init, name


def test_ours_first_and_hivemind_never_called_when_ours_succeeds() -> None:
    opt = _Opt(epoch=3, global_epoch=9, donor_epoch=9)
    fetched: list[bool] = []

    def fetch() -> Caught:
        fetched.append(True)
        opt.state_averager.local_epoch = 9  # import_state sets the epoch
        return Caught.INSTALLED

    catch_up = catch_up_through(opt, fetch)
    opt.load_state_from_peers()
    assert fetched == [True]
    assert opt.state_averager.loads == 0
    assert catch_up.counts["ours"] == 1


def test_hivemind_once_when_no_donor_answered_ours_and_then_attempts_are_spaced() -> None:
    now = [100.0]
    opt = _Opt(epoch=3, global_epoch=9, donor_epoch=None)  # hivemind's download times out
    catch_up = catch_up_through(opt, lambda: Caught.UNREACHED, retry_after=30.0)
    catch_up._clock = lambda: now[0]
    opt.load_state_from_peers()  # returns: no endless retry on the timeout
    assert opt.state_averager.loads == 1
    assert catch_up.counts == {"ours": 0, "hivemind": 0, "failed": 1, "deferred": 0,
                               "not_behind": 0, "refused": 0, "stand_in": 0}
    assert opt.tracker.reports[-1] == (3, 0)  # behind by more than one: epoch kept
    now[0] += 10
    opt.load_state_from_peers()  # within retry_after: back at once, nothing tried
    assert opt.state_averager.loads == 1 and catch_up.counts["deferred"] == 1
    now[0] += 25
    opt.state_averager.donor_epoch = 9
    opt.load_state_from_peers()  # spaced enough: hivemind's download now works
    assert opt.state_averager.loads == 2
    assert catch_up.counts["hivemind"] == 1 and opt.local_epoch == 9


def test_a_quorum_not_ahead_of_us_is_believed_over_the_records_no_download() -> None:
    # hivemind's tracker believes a record two epochs ahead; the stage's replicas answered
    # with a state at our epoch: hivemind's one-donor download is not tried, and the
    # records are parsed again (through the screen, which the quorum now bounds)
    opt = _Opt(epoch=3, global_epoch=5, donor_epoch=5)
    catch_up = catch_up_through(opt, lambda: Caught.NOT_BEHIND)
    opt.load_state_from_peers()
    assert opt.state_averager.loads == 0 and opt.local_epoch == 3
    assert catch_up.counts["not_behind"] == 1 and catch_up.counts["hivemind"] == 0
    assert opt.tracker.parsed == [None] and opt.tracker.global_progress == "parsed"


def test_donors_that_answered_without_a_trusted_state_leave_hivemind_untried() -> None:
    # the stage's donors answered, but no state ahead of ours holds a quorum (or it could
    # not be fetched): hivemind's download would take the one averager claiming the most.
    # Nothing else is tried; the replica serves on and asks again after the spacing
    now = [0.0]
    opt = _Opt(epoch=3, global_epoch=5, donor_epoch=5)
    answers = [Caught.REFUSED, Caught.INSTALLED]

    def fetch() -> Caught:
        caught = answers.pop(0)
        if caught:
            opt.state_averager.local_epoch = 5
        return caught

    catch_up = catch_up_through(opt, fetch, retry_after=30.0)
    catch_up._clock = lambda: now[0]
    opt.load_state_from_peers()
    assert opt.state_averager.loads == 0 and opt.local_epoch == 3
    assert catch_up.counts["refused"] == 1 and catch_up.counts["hivemind"] == 0
    assert opt.tracker.parsed == []  # the records are not re-read: they may be right
    now[0] += 10
    opt.load_state_from_peers()
    assert catch_up.counts["deferred"] == 1 and answers == [Caught.INSTALLED]
    now[0] += 3  # past a refusal's spacing (the donors' snapshots renewed), not the usual
    assert catch_up.refused_retry_after < 13 < catch_up.retry_after
    opt.load_state_from_peers()  # the replicas agree by now: ours installs it
    assert catch_up.counts["ours"] == 1 and opt.local_epoch == 5
    assert opt.state_averager.loads == 0


def test_replicas_ahead_that_never_agree_get_a_stand_in_after_refusals_in_a_row() -> None:
    # honest replicas whose bits drifted apart (a round one of them missed) form no quorum
    # again: after refusals_before_stand_in refusals in a row, the next attempt asks our
    # transport for a stand-in (choose_stand_in), rather than leave this replica behind for
    # good; hivemind's unchecked one-donor download is never tried. An answer of another
    # kind in between starts the count again, and so does a stand-in that was refused
    now = [0.0]
    opt = _Opt(epoch=3, global_epoch=9, donor_epoch=9)
    answers = [Caught.REFUSED, Caught.REFUSED, Caught.NOT_BEHIND,
               Caught.REFUSED, Caught.REFUSED, Caught.REFUSED, Caught.REFUSED,  # stand-in
               Caught.REFUSED, Caught.REFUSED, Caught.REFUSED, Caught.INSTALLED]  # stand-in
    asked: list[bool] = []

    def fetch(stand_in: bool = False) -> Caught:
        asked.append(stand_in)
        caught = answers.pop(0)
        if caught:
            opt.state_averager.local_epoch = 9
        return caught

    catch_up = catch_up_through(opt, fetch)
    catch_up._clock = lambda: now[0]
    assert catch_up.refusals_before_stand_in == 3
    while answers:
        opt.load_state_from_peers()
        now[0] += catch_up.retry_after  # past either spacing
    assert asked == [False] * 6 + [True] + [False] * 3 + [True]
    assert catch_up.counts["refused"] == 9 and catch_up.counts["stand_in"] == 1
    assert opt.state_averager.loads == 0 and opt.local_epoch == 9


def test_only_an_installed_catch_up_is_true() -> None:
    assert [bool(c) for c in Caught] == [c is Caught.INSTALLED for c in Caught]
    assert sum(map(bool, Caught)) == 1


def test_a_bug_in_our_path_falls_back_and_one_epoch_behind_catches_up_as_hivemind() -> None:
    opt = _Opt(epoch=8, global_epoch=9, donor_epoch=8)  # the only donor is not ahead

    def broken() -> Caught:
        raise RuntimeError("a bug")

    catch_up = catch_up_through(opt, broken)
    opt.load_state_from_peers()
    assert catch_up.counts["failed"] == 1
    assert opt.local_epoch == 9  # hivemind's rule: one behind is taken as caught up
    assert opt.tracker.reports[-1] == (9, 0)
    assert not opt.tracker.lock.locked()


def test_refuses_an_object_that_is_not_a_hivemind_optimizer() -> None:
    with pytest.raises(TypeError, match="lacks"):
        catch_up_through(object(), lambda: Caught.INSTALLED)
