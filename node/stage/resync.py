"""A replica that fell behind its stage catches up through our transport, not hivemind's.

hivemind's collaborative Optimizer notices, inside ``step``, that this replica's epoch is
behind the collaboration's, and calls its own ``load_state_from_peers``: a download of the
whole state from one donor over libp2p, on the stage's device thread, retried forever if it
raises (a timeout does) and tried again at the next ``step`` if it fails quietly. Between
two hosts behind home NATs that download goes through a libp2p relay, and in the network
lab (docs/nat.md) it failed every time (the stream ended after its first 64 KiB part); an
attempt at every micro-batch's step held the device thread, and the stage answered
``busy`` to every trainer for minutes. Our own state transfer (state_transfer.py) already
reaches every replica, punched or relayed over QUIC, checks the manifest against the
stage's layout and takes only a state that a quorum of donors agrees on.

``catch_up_through`` therefore replaces that method on the hivemind Optimizer instance with
the same sequence hivemind runs (tag along with a pre-scheduled round at zero weight,
finish delayed updates, pause the progress tracker, install a state, catch the epoch up,
report progress) as one bounded call to ``fetch`` (``StageStateSharing.resync``): our
download, then its install on this thread (``import_state`` runs that sequence). Where
most of the stage's replicas that answered hold a state that is not ahead of ours (a
quorum's, or the lower median of donors that agree on none), a progress record beyond it
made hivemind believe we are behind (the screen lets a record lead the others' median by
two epochs): nothing is downloaded, and the screen refuses records beyond that epoch + 1
for a while (progress_guard.py). Where donors answered but nothing ahead of ours could be
trusted or fetched, nothing else is tried at first: hivemind's download would take the
state of the one averager announcing the most, unchecked. Where the replicas ahead of us
still agreed on no state after ``refusals_before_stand_in`` refusals in a row (about
36 s), the next attempt takes a stand-in through our transport (``choose_stand_in``: the
state most donors hold at the lower median of their epochs, still only if ahead of ours,
its values checked like a quorum's): honest replicas whose bits drifted apart (a round
one of them missed) form no quorum again, and a replica left behind them for good would
serve a stale state forever; every replica behind them picks the same stand-in, so they
agree again after it. hivemind's own download is tried, once, never in its loop (which
retries forever on a timeout), only where our transport heard from no donor at all, and
what it installed is checked after it (``guard``: the per-step optimizer puts its own
state back where the values fail). Attempts are spaced by ``retry_after`` seconds
(``refused_retry_after`` after a refusal), and a call in between returns at once: the
replica serves on at its epoch (its gradients then count in no round) and the next
``step`` tries again.

It relies on hivemind 1.1.12's Optimizer attributes ``scheduled_grads``,
``_tag_along_with_zero_weight``, ``state_averager``, ``grad_averager``, ``tracker``,
``load_state_timeout``, ``client_mode`` and ``use_gradient_averaging``
(``HIVEMIND_OPTIMIZER_ATTRIBUTES``, checked when it is installed and in tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..logs import get_logger
from .optimizer import Caught
from .progress_guard import reparse

log = get_logger(__name__)

# a catch-up whose donors answered without a state to trust asks again this much sooner
# than the usual spacing: just past a donor's snapshot reuse (state transfer's
# snapshot_reuse_s, 10 s by default), so that it sees their states after their next step
REFUSED_RETRY_S = 12.0
# refusals in a row after which the next attempt takes a stand-in: replicas ahead of us
# that still agree on nothing after that long have drifted apart for good
REFUSALS_BEFORE_STAND_IN = 3

# runs a download (True if the epoch moved), checks what it installed, puts the previous
# state back if that fails; True only for a download that moved the epoch and passed
Guard = Callable[[Callable[[], bool]], bool]

HIVEMIND_OPTIMIZER_ATTRIBUTES = (
    "scheduled_grads",
    "_tag_along_with_zero_weight",
    "state_averager",
    "grad_averager",
    "tracker",
    "load_state_timeout",
    "client_mode",
    "use_gradient_averaging",
    "load_state_from_peers",
)


class CatchUp:
    """The replacement of ``hivemind.Optimizer.load_state_from_peers`` on one instance."""

    def __init__(
        self,
        opt: Any,  # hivemind.Optimizer
        fetch: Callable[..., Caught],  # CatchUpFetch: () or (stand_in=True)
        *,
        retry_after: float = 30.0,
        refused_retry_after: float = REFUSED_RETRY_S,
        refusals_before_stand_in: int = REFUSALS_BEFORE_STAND_IN,
        clock: Callable[[], float] = time.monotonic,
        installed: Callable[[], None] = lambda: None,
        guard: Guard = lambda download: download(),
    ) -> None:
        self._opt = opt
        self._fetch = fetch
        # runs hivemind's download, which installs one averager's state unchecked; puts
        # ours back if what arrived fails the checks (the per-step optimizer's)
        self._guard = guard
        self._installed = installed  # told when hivemind's download replaced the state
        self.retry_after = retry_after
        self.refused_retry_after = refused_retry_after
        self._clock = clock
        self._next_try: float | None = None  # no attempt before then
        self.refusals_before_stand_in = refusals_before_stand_in
        self._refusals = 0  # refusals in a row
        self.counts = {"ours": 0, "hivemind": 0, "failed": 0, "deferred": 0, "not_behind": 0,
                       "refused": 0, "stand_in": 0}

    def __call__(self, **kwargs: Any) -> None:
        now = self._clock()
        if self._next_try is not None and now < self._next_try:
            self.counts["deferred"] += 1
            return
        self._next_try = now + self.retry_after
        # most of the stage is ahead of us and its replicas held no state in common for
        # refusals_before_stand_in attempts in a row: honest ones whose bits drifted apart
        # (a round one of them missed), which no quorum will vouch for again. Serving on
        # behind them forever would help nobody: take the stand-in (the donors' lower median
        # epoch, the state most of them hold there), through our transport and checks
        stand_in = self._refusals >= self.refusals_before_stand_in
        if stand_in:
            log.warning("the stage's replicas ahead of this one agreed on no state %d times "
                        "in a row: taking a stand-in state", self._refusals)
        try:
            # our download; its install (import_state) runs hivemind's own sequence: tag
            # along, finish delayed updates, pause the tracker, set and report the epoch
            caught = self._fetch(stand_in=True) if stand_in else self._fetch()
        except Exception:  # a bug in our path must not stop the stage: hivemind's remains
            log.exception("catching up through our transport failed")
            caught = Caught.UNREACHED
        if caught is not Caught.REFUSED:
            self._refusals = 0
        if caught is Caught.INSTALLED:
            self.counts["stand_in" if stand_in else "ours"] += 1
            self._next_try = None  # caught up: a later fall-behind may try at once
            return
        if caught is Caught.NOT_BEHIND:
            # most of the stage's replicas that answered hold no state ahead of ours:
            # hivemind believed a progress record beyond them (within the screen's lead),
            # and its download would take the state of the one averager claiming the most.
            # The screen now refuses such records for a while (progress_guard.py): read
            # the stage's epoch again through it
            self.counts["not_behind"] += 1
            try:
                reparse(self._opt.tracker)
            except Exception as exc:  # a DHT read: hivemind's own errors
                log.warning("re-reading the stage's progress failed: %r", exc)
            return
        if caught is Caught.REFUSED:
            # donors answered, but what they offer ahead of us holds no quorum (or could
            # not be fetched, or failed the checks): one of them is no better. Serve on;
            # ask again once the donors' snapshots are renewed (honest replicas caught on
            # either side of a step agree by then)
            self._refusals = 0 if stand_in else self._refusals + 1
            self.counts["refused"] += 1
            self._next_try = now + self.refused_retry_after
            return
        # no donor answered ours: hivemind's download, once, its values checked after it
        if self._guard(lambda: self._hivemind_once(**kwargs)):
            self.counts["hivemind"] += 1
            self._installed()
            self._next_try = None
        else:
            self.counts["failed"] += 1

    def _hivemind_once(self, **kwargs: Any) -> bool:
        """hivemind's ``load_state_from_peers`` with one download attempt instead of a loop
        (its loop retries forever on a timeout); True if the epoch moved."""
        opt = self._opt
        if opt.scheduled_grads is not None and not opt.scheduled_grads.done():
            opt._tag_along_with_zero_weight(opt.scheduled_grads)
            opt.scheduled_grads = None
        opt.state_averager.step(wait_for_delayed_updates=True)
        epoch = opt.local_epoch
        with opt.tracker.pause_updates():
            try:
                # it returns None either way and logs its failures; success moves the epoch
                opt.state_averager.load_state_from_peers(
                    timeout=opt.load_state_timeout, **kwargs
                )
                loaded = opt.local_epoch > epoch
                if loaded and opt.grad_averager is not None:
                    opt.grad_averager.load_state_from_peers(
                        timeout=opt.load_state_timeout, **kwargs
                    )
            except Exception as exc:  # anything, raised from its averager process
                log.warning("catching up through hivemind's averager failed: %r", exc)
                loaded = False
            tracker = opt.tracker
            if tracker.global_epoch - 1 <= opt.local_epoch < tracker.global_epoch:
                opt.state_averager.local_epoch = tracker.global_epoch  # as hivemind does
            tracker.report_local_progress(local_epoch=opt.local_epoch, samples_accumulated=0)
            if not opt.client_mode:
                opt.state_averager.state_sharing_priority = opt.local_epoch
            if opt.use_gradient_averaging:
                opt.grad_averager.reset_accumulated_grads_()
                if not opt.client_mode:
                    opt.grad_averager.state_sharing_priority = opt.local_epoch
        return loaded


def catch_up_through(
    opt: Any,
    fetch: Callable[..., Caught],
    *,
    retry_after: float = 30.0,
    installed: Callable[[], None] = lambda: None,
    guard: Guard = lambda download: download(),
) -> CatchUp:
    """Replace ``opt.load_state_from_peers`` (a hivemind.Optimizer) with a :class:`CatchUp`
    around ``fetch``; returns it (its ``counts`` go into the stage's status). ``installed``
    is called after hivemind's own download moved the state (``fetch`` installs through
    the optimizer's ``import_state``, which knows it); ``guard`` runs that download and
    checks what it installed."""
    missing = [a for a in HIVEMIND_OPTIMIZER_ATTRIBUTES if not hasattr(opt, a)]
    if missing:
        raise TypeError(f"not a hivemind 1.1.12 Optimizer: it lacks {', '.join(missing)}")
    catch_up = CatchUp(opt, fetch, retry_after=retry_after, installed=installed, guard=guard)
    opt.load_state_from_peers = catch_up
    return catch_up


__all__ = ["HIVEMIND_OPTIMIZER_ATTRIBUTES", "CatchUp", "Guard", "catch_up_through"]
