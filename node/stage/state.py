"""A stage server's state in the swarm: it donates it, and a newcomer downloads it.

Every stage server runs a :class:`~.state_donor.StateDonor` under its stage's request
kinds. Its snapshot is the stage optimizer's ``export_state`` (parameters, optimizer
buffers, epoch), taken on the server's device thread so that it never sees a half-applied
step, and only while the server is ``online``: a server still loading answers
``not_ready`` instead of handing out a fresh, untrained state. It is never taken while an
averaging round or delayed step runs in the background: the export would wait for it on
the device thread and hold the stage's forwards and backwards meanwhile. The snapshot
waits off that thread instead, and downloaders are told ``preparing`` and ask again.

A server that opens (a join, a restart, a move to another stage) downloads the state from
every online replica of its stage at once (``download_state``: chunks spread over the
donors, a donor that fails part-way is replaced without losing the chunks already
verified) and installs it with ``import_state`` before it announces ``online``.

What it installs must be trustworthy (docs/hostile.md, "State"): every manifest is checked
against the layout of this server's own freshly built stage (names, dtypes, shapes: from
the run spec) before anything is allocated; only a state held by a quorum of the
reachable replicas is used; its epoch is bounded; its values must be finite and its step
counters whole numbers no larger than its epoch; hyperparameters always come from the run
spec. Donors that answered with states no quorum holds are asked again, ``open_refusals``
times, after their snapshots are renewed (replicas caught on either side of a step agree
by then); the server stays ``joining`` meanwhile, so it serves no fresh, untrained state
that a catch-up would replace at its first step. When no donor is known, or every donor
failed to deliver, it falls back to hivemind's own ``load_state_from_peers`` (one donor at
a time), which also covers peers that are in the averaging group but not yet in our peer
table. When donors answered but none could be trusted it does not: hivemind would pick
the donor claiming the highest epoch, unchecked, the very thing refused. After the
refusals it takes a stand-in through our transport (``choose_stand_in``: the state most
donors hold at the lower median of their epochs, its values checked as a quorum's are),
as the per-step catch-up does after as many refusals in a row (resync.py); if not even
that can be taken, it opens without the stage's state (a catch-up, or DiLoCo's first
round, settles it later). A gossip optimizer (``replicas_differ``) skips the wait: its
replicas hold different parameters between rounds, so donors that disagree are expected,
and it asks one of the stage's gossip averagers, trusting one partner as each gossip
round does (gossip_optimizer.py). The checkpoint decision (checkpointer.py) comes after
all of these.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor
from typing import Any

import torch

from ...transport.endpoint import PeerAddress
from ..logs import get_logger
from .averaging import AveragingError
from .checkpoint import CheckpointError, check_finite
from .optimizer import Caught, StageOptimizer
from .state_donor import (
    StateDonor,
)
from .state_plan import (
    QuorumDecision,
    Snapshot,
    StateTransferConfig,
    StateTransferError,
    UntrustedStateError,
    stage_kind_prefix,
    state_layout,
)
from .state_tensors import check_counters
from .state_transfer import (
    StateDownload,
    download_wanted_state,
)

log = get_logger(__name__)

DonorSource = Callable[[], Sequence[PeerAddress]]

BUSY_POLL_S = 0.25  # how often a snapshot waiting for a background round asks again
RESYNC_GRACE_S = 5.0  # a catch-up's wait beyond its download's own deadline


class StageStateSharing:
    """Donates ``optimizer``'s state under ``stage``'s kinds; downloads it on open."""

    def __init__(
        self,
        endpoint: Any,  # registers the donor's kinds; with ``donors``, also sends requests
        stage: int,
        optimizer: StageOptimizer,
        executor: Executor,
        config: StateTransferConfig,
        *,
        donors: DonorSource | None,
        serving: Callable[[], bool],
    ) -> None:
        self.stage = stage
        self._endpoint = endpoint
        self._optimizer = optimizer
        self._executor = executor
        self._config = config
        self._donors = donors
        self._serving = serving
        self.prefix = stage_kind_prefix(stage)
        self.donor = StateDonor(endpoint, self._snapshot, kind_prefix=self.prefix, config=config)
        self.last_download: dict[str, Any] | None = None
        self.catch_ups = 0  # states installed by resync() after the open
        self.download_progress: dict[str, Any] | None = None  # while a download runs
        # while an opening server waits for donors that offered no state to trust
        self.waiting: dict[str, Any] | None = None
        self.stand_in: str | None = None  # the group the open took without a quorum
        self._layout: Any = None  # the stage's own state layout, once known

    async def _snapshot(self) -> Snapshot:
        """The state for a downloader, exported on the device thread once no averaging round
        or delayed step runs in the background. ``export_state`` waits for such work to
        apply it (else the epoch would be counted and the parameters old), and on the
        device thread that wait holds every forward and backward, up to
        ``averaging_timeout`` when a partner vanished. So it is waited for here instead:
        asked on the device thread (whether busy, and the export, in one job, so no step
        slips in between), again every ``BUSY_POLL_S`` up to ``snapshot_prepare_timeout_s``;
        meanwhile the optimizer holds its epoch (``hold_for_snapshot``), so that the round
        that ends is not followed by the next epoch's before this job's turn.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.snapshot_prepare_timeout_s
        try:
            while True:
                if not self._serving():
                    raise RuntimeError("this server is not online")
                exported = await loop.run_in_executor(self._executor, self._export_when_idle)
                if exported is not None:
                    return Snapshot(*exported)
                if loop.time() >= deadline:
                    raise TimeoutError(
                        f"the stage's background round ran for over "
                        f"{self._config.snapshot_prepare_timeout_s:g} s"
                    )
                # no new epoch's round may start meanwhile, or this could wait for round
                # after round (the next step may come before this poll on the device thread)
                self._optimizer.hold_for_snapshot(True)
                await asyncio.sleep(BUSY_POLL_S)
        finally:
            self._optimizer.hold_for_snapshot(False)

    def _export_when_idle(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        """Device thread: the optimizer's export, or None while background work runs."""
        if self._optimizer.background_busy():
            return None
        return self._optimizer.export_state()

    async def load(self) -> bool:
        """Install the stage's state from its replicas; True if some peer supplied it.

        Donors that answered without a state we can trust (no quorum holds one, or their
        manifests do not fit the stage) are asked again, ``open_refusals`` times, once their
        snapshots are renewed (``snapshot_reuse_s + preparing_retry_s`` apart): replicas
        caught on either side of a step agree by then. The server stays ``joining``
        meanwhile (``waiting`` says so in its status). If they still agree on nothing, the
        next attempt takes a stand-in (``choose_stand_in``, ``stand_in`` in the status), as
        the per-step catch-up does after as many refusals; where that fails too, or a
        quorum's state failed the value checks (not asked again: it would be fetched again),
        it opens without the stage's state. Gossip replicas differ by design: one of the
        stage's gossip averagers is asked at once. No donor known, or none delivered: the
        averaging library's own download (``load_state_from_peers``)."""
        try:
            return await self._load()
        finally:
            self.waiting = None

    async def _load(self) -> bool:
        loop = asyncio.get_running_loop()
        refusals = 0
        stand_in = False  # the last attempt: choose_stand_in's group where no quorum agrees
        while donors := list(self._donors()) if self._donors is not None else []:
            started = time.monotonic()
            try:
                layout = await loop.run_in_executor(self._executor, self._own_layout)
                download = StateDownload(
                    self._endpoint, donors, kind_prefix=self.prefix, config=self._config,
                    expected=layout, progress=self._progress(len(donors), started),
                    stand_in=stand_in,
                )
                snap = await download.run()
                assert snap is not None  # only a ``wanted`` declines
                await loop.run_in_executor(self._executor, self._install, snap)
            except CheckpointError as exc:
                # values that fail the checks, held by a quorum (or the stand-in): no honest
                # replicas agree on them, and asking again would fetch the same state again
                log.warning("stage %d: not installing the state offered by %d donor(s): %s; "
                            "opening without it", self.stage, len(donors), exc)
                return False
            except UntrustedStateError as exc:
                # gossip: replicas hold different parameters between rounds, no quorum can
                # agree; one partner's parameters are what a gossip round trusts anyway
                if getattr(self._optimizer, "replicas_differ", False):
                    log.info("stage %d: the %d donors' gossip states differ (%s); asking one "
                             "of the stage's gossip averagers", self.stage, len(donors), exc)
                    break
                if stand_in:
                    log.warning("stage %d: no state of the %d donors could be taken, not even "
                                "a stand-in (%s); opening without it: a catch-up takes the "
                                "state its replicas agree on once they do", self.stage,
                                len(donors), exc)
                    return False
                refusals += 1
                if refusals > self._config.open_refusals:
                    log.warning("stage %d: the %d donors offered no state to trust %d times "
                                "(%s); taking a stand-in: the state most of them hold at "
                                "the lower median of their epochs", self.stage, len(donors),
                                refusals, exc)
                    stand_in = True
                    self.waiting = None  # the stand-in's download shows its own progress
                    continue
                wait = self._config.snapshot_reuse_s + self._config.preparing_retry_s
                log.warning("stage %d: not installing the state offered by %d donor(s): %s; "
                            "asking again in %.0f s (%d of %d), once their snapshots are "
                            "renewed", self.stage, len(donors), exc, wait, refusals,
                            self._config.open_refusals)
                self.waiting = {"refusals": refusals, "of": self._config.open_refusals,
                                "reason": str(exc)[:200],
                                "next_try_unix": round(time.time() + wait, 1)}
                await asyncio.sleep(wait)
                continue
            except (StateTransferError, AveragingError) as exc:
                log.warning("stage %d: downloading the state from %d donor(s) failed (%s); "
                            "asking hivemind's averagers instead", self.stage, len(donors), exc)
                break
            else:
                self.stand_in = download.report.stand_in
                self._downloaded(snap, len(donors), started)
                return True
            finally:
                self.download_progress = None
        return bool(
            await loop.run_in_executor(self._executor, self._optimizer.load_state_from_peers)
        )

    def resync(self, loop: asyncio.AbstractEventLoop, timeout: float,
               only: Collection[str] | None = None, stand_in: bool = False) -> Caught:
        """Device thread, inside the optimizer's step (resync.py, and DiLoCo's rounds):
        download the stage's state from its online replicas through ``loop`` and install it
        here, if the optimizer finds it ahead of its own (``is_behind``: asked of the
        quorum's manifest, so a state that is not ahead costs no chunk). ``only``: the
        donors to ask, by peer id, among the stage's online replicas (DiLoCo: the members of
        a round group's majority that holds another state than ours); None asks all of them.
        ``stand_in``: where no quorum agrees, take choose_stand_in's group if it is ahead of
        ours (the per-step catch-up's backstop after refusals in a row, resync.py).

        How it ended (:class:`Caught`, logged unless installed): ``NOT_BEHIND`` when the
        quorum's state is not ahead of ours, and also when no quorum agrees but the lower
        median of the answering donors' epochs is not (``is_behind`` is asked of it: one
        donor claiming more is one vote, as in a quorum); ``REFUSED`` when donors answered
        but no state ahead of ours could be trusted, fetched within ``timeout`` seconds or
        installed; ``UNREACHED`` when there is no donor, or none answered."""
        if self._donors is None:
            return Caught.UNREACHED
        layout = self._own_layout()  # this thread is the device thread
        started = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(
            self._fetch(layout, only, timeout, stand_in), loop)
        try:
            # the download ends itself at ``timeout`` (saying whether donors answered); the
            # grace only covers a loop too busy to run it
            snap, donors = future.result(timeout + RESYNC_GRACE_S)
        except TimeoutError:
            future.cancel()
            log.warning("stage %d: catching up: no state within %.0fs", self.stage, timeout)
            return Caught.UNREACHED
        except StateTransferError as exc:  # UntrustedStateError too
            log.warning("stage %d: catching up: %s", self.stage, exc)
            return self._without_state(exc.quorum, isinstance(exc, UntrustedStateError))
        if snap is None:
            return Caught.UNREACHED if donors == 0 else Caught.NOT_BEHIND  # declined: not ahead
        if not self._optimizer.is_behind(snap.epoch, dict(snap.meta)):
            return Caught.NOT_BEHIND
        try:
            self._install(snap)
        except (CheckpointError, AveragingError) as exc:
            log.warning("stage %d: catching up: not installing epoch %d: %s",
                        self.stage, snap.epoch, exc)
            return Caught.REFUSED
        self.catch_ups += 1
        self._downloaded(snap, donors, started, "caught up: ")
        return Caught.INSTALLED

    def _without_state(self, quorum: QuorumDecision | None, untrusted: bool) -> Caught:
        """Device thread: how a catch-up that installed nothing ended, from what the donors'
        manifests decided (``quorum``; None: none answered) and whether what they offered
        was refused (``untrusted``: no quorum, or no manifest that fits the stage)."""
        if not untrusted and (quorum is None or quorum.reachable == 0):
            return Caught.UNREACHED
        if quorum is None:
            return Caught.REFUSED
        if quorum.group is None and quorum.median_epoch is not None:
            # no quorum agrees: the donor at the lower median stands for most of them
            median = next(g for g in quorum.outvoted if g.manifest.epoch == quorum.median_epoch)
            if not self._optimizer.is_behind(median.manifest.epoch, dict(median.manifest.meta)):
                log.info("stage %d: catching up: most donors that answered hold nothing ahead "
                         "of ours (their lower median: epoch %d)", self.stage,
                         quorum.median_epoch)
                return Caught.NOT_BEHIND
        return Caught.REFUSED

    def _own_layout(self) -> Any:
        """Device thread: the layout of our own stage as built from the run spec (a copy of
        the fresh state, exported once): every manifest must match it."""
        if self._layout is None:
            _, own, _ = self._optimizer.export_state()
            self._layout = state_layout(own)
        return self._layout

    def _progress(self, donors: int, started: float) -> Callable[[int, int], None]:
        """The download's progress callback: ``download_progress`` for status while it runs
        (bytes verified so far, of how many, from how many donors, and the ETA at the rate
        so far)."""

        def report(done: int, total: int) -> None:
            elapsed = time.monotonic() - started
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = (total - done) / rate if rate > 0 else None
            self.download_progress = {
                "done_bytes": done,
                "total_bytes": total,
                "donors": donors,
                "eta_s": None if eta is None else round(eta, 1),
            }

        return report

    async def _fetch(self, expected: Any, only: Collection[str] | None, timeout: float,
                     stand_in: bool = False) -> tuple[Snapshot | None, int]:
        assert self._donors is not None
        donors = [d for d in self._donors() if only is None or d.peer_id in only]
        if not donors:
            return None, 0
        config = self._config.model_copy(
            update={"timeout_s": min(self._config.timeout_s, timeout)})
        try:
            # read while the device thread waits for this download (the optimizer is idle)
            snap = await download_wanted_state(
                self._endpoint, donors, self._optimizer.is_behind, kind_prefix=self.prefix,
                config=config, expected=expected,
                progress=self._progress(len(donors), time.monotonic()), stand_in=stand_in,
            )
        finally:
            self.download_progress = None
        return snap, len(donors)

    def _downloaded(self, snap: Snapshot, donors: int, started: float, what: str = "") -> None:
        seconds = time.monotonic() - started
        nbytes = sum(t.numel() * t.element_size() for t in snap.tensors.values())
        self.last_download = {"epoch": snap.epoch, "donors": donors, "bytes": nbytes,
                              "seconds": round(seconds, 2), "catch_ups": self.catch_ups}
        log.info("stage %d: %sstate of epoch %d downloaded from %d donor(s): %.1f MB in %.1fs",
                 self.stage, what, snap.epoch, donors, nbytes / 1e6, seconds)

    def _install(self, snap: Snapshot) -> None:
        """Device thread: check the downloaded values, then install them (all or nothing)."""
        tensors = dict(snap.tensors)
        check_finite(tensors, f"the state of epoch {snap.epoch}")
        check_counters(snap.epoch, tensors)
        self._optimizer.import_state(snap.epoch, tensors, dict(snap.meta))

    def close(self) -> None:
        self.donor.close()


__all__ = ["DonorSource", "StageStateSharing"]
