"""How a stage's replicas step together: the hivemind.Optimizer adapter.

Every server of stage ``s`` accumulates gradients from the micro-batches it serves; when the
whole collaboration of that stage has accumulated ``target_batch_size`` samples, the
replicas average their gradients (all-reduce), take one AdamW step and, every
``average_state_every`` epochs, average parameters too, so that replicas stay in sync. This
is hivemind's collaborative Optimizer, with ``run_id = f"{run_name}_{run_id}_stage{s}"``
(hivemind run ids may not contain '.'). A peer that falls behind, or joins, downloads the
stage's parameters and optimizer state from the others (``load_state_from_peers``).

Threads and signals. ``hivemind.Optimizer`` touches signal handlers, so it must be
constructed on the main thread (we restore the SIGINT disposition it overwrites); ``step``
then runs on the stage server's device thread, after each backward. Its averagers are
forked processes (hivemind's design), started by the constructor.

Blocking or delayed steps. A blocking step stalls the device thread for matchmaking plus
the all-reduce at every epoch boundary (seconds over the WAN; docs/averaging.md), during
which every trainer's requests to this server queue up or go elsewhere. We therefore
default to hivemind's delayed parameter updates (``delay_optimizer_step`` +
``delay_grad_averaging``, i.e. DPU, arXiv:2101.06840): at an epoch boundary ``step`` hands
the accumulated gradients to a background all-reduce and optimizer step and returns at
once; the new parameters are copied into the served module by the first ``step`` after they
are ready, on the device thread, so forward and backward never see a half-written tensor.
The price is one epoch of staleness (gradients computed at ``theta_k`` are applied to
``theta_{k+1}``), which DPU shows to be harmless at the large batches this targets. One
wait is left in hivemind's delayed step: an epoch that ends while the previous epoch's
round still runs (a slow or vanished partner: up to ``averaging_timeout``) waits for that
round inside ``step``, on the device thread; the stage's queue filled and it answered
``busy`` to every trainer for as long (50 s in the lab, a stage-1 replica behind a
symmetric NAT). So the epoch is held while a round runs (the tracker's ``hold_epoch``,
membership/dht.py): the micro-batches that arrive meanwhile accumulate into the epoch,
which ends at the first ``step`` after the round finished (``epochs_held`` counts the
steps that found it due and held it). A round still running after twice
``averaging_timeout`` (hung) is no longer waited out this way: hivemind's wait, which
times out and cancels it, takes over.
``delayed_updates = false`` gives exactly synchronous training (equivalent to one big
batch) at the cost of the stall.

Forming the group ahead of time. hivemind pre-schedules an epoch's gradient round when, at
a ``step`` call, the epoch is estimated to end within ``matchmaking_time``; but ``step``
only runs once per micro-batch (seconds apart over a WAN), so the check usually misses and
the whole matchmaking lands in the stall at the epoch boundary. With synchronous steps,
``form_group_early`` schedules the round when the estimated end is within
``matchmaking_time`` plus two intervals between this replica's ``step`` or ``step_if_due``
calls (at least a second): the group is formed by the time the epoch ends and waits for the
trigger (up to ``averaging_timeout``), leaving only the all-reduce in the stall. A
pre-scheduled round that failed before being used (no group in time) is dropped before the
step: hivemind would otherwise take the epoch's step with this replica's local gradients
alone, and the replicas would drift apart. Both happen in ``_prepare_round``, which runs
with synchronous steps only: with delayed updates no step waits for a missing replica, and
a failed pre-scheduled round is left to hivemind (docs/averaging.md says what that means
for the replicas).

Epochs of ``target_batch_size`` samples. hivemind ends an epoch when its *estimate* of the
samples the replicas accumulated reaches the target: each replica's reported count plus its
samples per second times the age of its report. The estimate runs ahead (a replica's rate
is an average over its idle time too): in the tiny run on two replicas per stage a step
held 51.5 samples of 64 on average, and the swarm took 25 steps where the reference took
18 at the same tokens. The tracker here ends an epoch on the reported counts
(``averaging.exact_epochs``, membership/dht.py); the estimate still decides when
matchmaking starts. A step then holds the target plus what the replicas accumulate
between the first one's trigger and the last one's (73.5 samples on average in the same
run: 17 steps where the reference took 18), and the target when the replicas push their
counts to each other as they change (``averaging.push_progress``, the default,
progress_push.py: 64.0-65.0 samples, 18 steps). Each replica records the samples it
brought to each step (``step_samples`` in the status); the demo and the swarm benchmark
sum them over a stage's replicas and print the mean step size beside the target.

Rounds of one epoch. A gradient round meets only rounds of the same epoch (its group key
carries the epoch: exact_allreduce.py). With synchronous steps, a replica whose partners
have all moved past its epoch (their pushes or records say so) steps on its own gradients
without looking for a round (``rounds_skipped_behind``), and gives up a round still looking
for its group once that happens while it waits, or once no other replica has had a progress
record for ``ALONE_GRACE_S`` (its partner died: ``rounds_abandoned_alone``): hivemind would
retry matchmaking until ``averaging_timeout``. (With delayed updates a partner moves to the
next epoch as soon as its round starts in the background, so its later epoch says nothing
about that round: there the epoch in the key alone applies, and ``hold_epoch`` bounds the
wait.)
Without these, a replica one epoch ahead met the other's round of the epoch before, and the
pair stayed one epoch apart, the one behind waiting in every step (docs/averaging.md).
A round whose group formed on the leader's side only (its follower stopped waiting for
``BEGIN_ALLREDUCE`` a moment too early) is looked for again rather than run alone and
called a success: exact_allreduce.py.
Every epoch's step is timed; one longer than ``matchmaking_time + SLOW_STEP_MARGIN_S`` is
logged with why the epoch ended, the counts it ended on and what its round did
(``slow_steps``, ``last_slow_step``).

Gradient clipping (``optimizer.grad_clip``) happens inside the optimizer, on the averaged
gradients of the stage, right before AdamW; the learning rate follows
``OptimizerSpec.lr_multiplier(local_epoch)``. The AdamW, the schedule and the
:class:`~.optimizer.StageOptimizer` contract this class keeps are optimizer.py's, shared with
the solo ``LocalOptimizer``.

Modes and hostile records. This is the run spec's ``[averaging] mode = "allreduce"`` (the
default); the constructor refuses another mode (diloco.py's ``make_stage_optimizer`` builds
the right optimizer). The progress records of the stage's replicas, which hivemind's tracker
reads from the DHT, are screened first (progress_guard.py): an absurd epoch, sample count,
rate or timestamp is ignored and counted (``progress_screen``), so that one forged record
cannot make every replica resync in a loop.

Checkpoints. ``export_state`` and ``import_state`` behave as optimizer.py describes, on
hivemind's offloaded main parameters and optimizer state. ``import_state`` mirrors
``hivemind.Optimizer.load_state_from_peers``: those tensors are written under the
averager's lock, copied into the served module, and the tracker reports the imported epoch
so that the replica counts (and shares its state) as being at that epoch.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from ..config.runspec import RunSpec
from ..errors import NodeError
from ..training.model import param_groups
from .checkpoint import CheckpointError, check_finite
from .constraint import SubspaceConstraint
from .exact_allreduce import ExactGradientAverager
from .optimizer import CatchUpFetch, make_adamw, make_schedule, set_schedule_epoch
from .params_version import EpochStep, ParamsLedger
from .progress_guard import ProgressBounds, guard_tracker
from .progress_push import PushBook
from .resync import CatchUp, catch_up_through
from .state_tensors import (
    MODEL_PREFIX,
    check_counters,
    check_fits,
    checked_epoch,
    checked_param_groups,
    module_tensors,
    optimizer_meta,
    optimizer_tensors,
    snapshot,
)

logger = logging.getLogger(__name__)

CompressionName = Literal["none", "fp16", "scaled_fp16", "uint8", "quantile8"]


# bytes a value of each hivemind wire compression (8-bit ones: fp16 below 2^16 values, ignored)
_BYTES_PER_VALUE: dict[str, float] = {
    "none": 4.0, "fp16": 2.0, "scaled_fp16": 2.0, "uint8": 1.0, "quantile8": 1.0,
}

# the averaging weight of a replica that joins an epoch's round without a sample (step_if_due)
IDLE_ROUND_WEIGHT = 1e-3
STEP_SAMPLES_KEPT = 16  # epochs whose samples the status shows
ROUND_POLL_S = 0.25  # while waiting for a round: how often to look whether it is hopeless
# how long a quorum's epoch bounds the progress records believed (a catch-up's spacing)
QUORUM_CAP_S = 30.0
SLOW_STEP_MARGIN_S = 5.0  # a step longer than matchmaking_time plus this is logged
# Longest wait between two reads of the stage's progress (hivemind: 10 s, shorter as its
# estimate of the epoch's end nears). A replica learns that another ended the epoch only at a
# read; the round formed early for that epoch starts its all-reduce at each member's own
# trigger, and a member whose parts have not started within next_chunk_timeout of another's
# is left out: the round ends with half its parts on each side (seen in the swarm benchmark's
# logs, "Reducer: received 50.0% of input tensors") and the replicas step apart.
MAX_PROGRESS_REFRESH_S = 1.0
# A round still looking for its group is given up once no other replica of the stage has
# had a progress record (or push) for this long: five reads of the progress in a row.
ALONE_GRACE_S = 5.0


class AveragingError(NodeError):
    """The collaborative optimizer could not be built or failed (hivemind's errors, translated)."""


class AveragingConfig(BaseModel):
    """How a stage server's optimizer averages with the other replicas of its stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    matchmaking_time: float = Field(
        default=5.0,
        gt=0.0,
        le=600.0,
        description=(
            "Seconds to wait for the stage's peers to join an averaging round (hivemind suggests "
            "3-5 on a LAN, 10-15 over the internet)."
        ),
    )
    averaging_timeout: float = Field(
        default=60.0,
        gt=0.0,
        le=3600.0,
        description=(
            "Give up on an averaging round after this many seconds (about 2x an all-reduce)."
        ),
    )
    next_chunk_timeout: float | None = Field(
        default=None,
        gt=0.0,
        le=3600.0,
        description=(
            "Seconds an all-reduce waits for a peer's next chunk before averaging without it; "
            "unset: matchmaking_time (hivemind's default). Raise it on a loaded machine: a peer "
            "dropped mid-round leaves the replicas with different averages."
        ),
    )
    load_state_timeout: float = Field(
        default=120.0,
        gt=0.0,
        le=3600.0,
        description="Deadline of one download of the stage's state, seconds.",
    )
    shutdown_timeout: float = Field(
        default=5.0,
        gt=0.0,
        le=600.0,
        description="Seconds to say goodbye to averaging peers on leave.",
    )
    delayed_updates: bool = Field(
        default=True,
        description=(
            "Average and step in the background and apply the result at the next step (DPU: "
            "one epoch of staleness, no stall); false blocks the device thread at every epoch."
        ),
    )
    average_state_every: int = Field(
        default=1,
        ge=1,
        le=1_000_000,
        description="Average parameters with the stage's peers every this many epochs.",
    )
    grad_compression: CompressionName = Field(
        default="fp16",
        description=(
            "Compression of gradient all-reduce: none, fp16, scaled_fp16, uint8 (8-bit uniform "
            "for tensors of 64k elements or more, fp16 below), quantile8 (likewise)."
        ),
    )
    state_compression: CompressionName = Field(
        default="fp16", description="Compression of parameter averaging (same choices)."
    )
    load_state_compression: CompressionName = Field(
        default="none",
        description="Compression of a newcomer's state download; 'none' makes it an exact copy.",
    )
    form_group_early: bool = Field(
        default=True,
        description=(
            "With synchronous steps (delayed_updates false): start matchmaking for an epoch's "
            "gradient round when the epoch is estimated to end within matchmaking_time plus two "
            "check intervals, so the group is ready at the boundary; false: only hivemind's own "
            "pre-scheduling (matchmaking_time ahead)."
        ),
    )
    exact_epochs: bool = Field(
        default=True,
        description=(
            "End an epoch when the samples the replicas reported reach target_batch_size; "
            "false: when hivemind's extrapolated estimate does (earlier, smaller steps)."
        ),
    )
    partner_wait_s: float = Field(
        default=15.0,
        ge=0.0,
        le=600.0,
        description=(
            "Once per start: while the membership lists another server of the stage but "
            "hivemind's progress records show none, hold the epoch open for up to this many "
            "seconds, so that the first step averages with that replica instead of both "
            "stepping alone and holding different optimizer moments from then on (0: never)."
        ),
    )
    push_progress: bool = Field(
        default=True,
        description=(
            "With exact_epochs: the replicas of a stage push their sample counts to each "
            "other over libp2p as they change (stage/progress_push.py), so that an epoch ends "
            "at the target rather than up to a micro-batch per replica later (the DHT alone "
            "carries the counts 0.5-1 s late), and a replica left behind by every partner "
            "learns it while its round still waits (docs/averaging.md); false: the DHT's "
            "counts only."
        ),
    )
    outer_fetches_at_once: int = Field(
        default=7,
        ge=1,
        le=16,
        description=(
            "DiLoCo over QUIC: the other members' payloads this replica fetches at once (7: "
            "all of a group of 8). Every member fetches in the same rotation (the k-th fetch "
            "of the member at position i goes to position i + k), so with a smaller number "
            "each member's uplink serves about that many fetches at a time, and holds that "
            "many transfers' buffers, instead of every other member's at once."
        ),
    )
    verbose: bool = Field(default=False, description="Log hivemind's progress messages at INFO.")

    @model_validator(mode="after")
    def _timeouts(self) -> AveragingConfig:
        if self.averaging_timeout <= self.matchmaking_time:
            raise ValueError(
                f"averaging_timeout ({self.averaging_timeout}) must exceed matchmaking_time "
                f"({self.matchmaking_time}); raise averaging.averaging_timeout"
            )
        return self


class OptimizerHost(Protocol):
    """Where a collaborative optimizer's ``hivemind.Optimizer`` comes from: the node's DHT
    adapter (dht.Dht) builds it on the DHT it runs, which no other module touches."""

    def hivemind_optimizer(self, **options: Any) -> Any:
        """A ``hivemind.Optimizer`` on this DHT; ``options`` are its arguments but ``dht``."""


def _due(tracker: Any) -> bool:
    """Whether hivemind's tracker, left to itself, would end the epoch now."""
    from hivemind.optim.progress_tracker import ProgressTracker

    return bool(ProgressTracker.ready_to_update_epoch.fget(tracker))


def averaging_run_id(spec: RunSpec, stage: int) -> str:
    """hivemind run id of a stage's collaboration: ``{name}_{run_id}_stage{s}`` (no dots)."""
    return f"{spec.name}_{spec.run_id}_stage{stage}"


def _compression(name: CompressionName) -> Any:
    from hivemind import compression as hc

    if name == "none":
        return hc.NoCompression()
    if name == "fp16":
        return hc.Float16Compression()
    if name == "scaled_fp16":
        return hc.ScaledFloat16Compression()
    # 8-bit for the big matrices, fp16 for norms and small tensors (hivemind's ALBERT recipe)
    big = hc.Uniform8BitQuantization() if name == "uint8" else hc.Quantile8BitQuantization()
    return hc.SizeAdaptiveCompression(
        threshold=2**16, less=hc.Float16Compression(), greater_equal=big
    )


class CollaborativeOptimizer:
    """``hivemind.Optimizer`` for one stage of the run (see the module docstring).

    Construct on the main thread (hivemind installs signal handlers), then call ``step``
    from the device thread only.
    """

    def __init__(
        self,
        module: nn.Module,
        spec: RunSpec,
        stage: int,
        dht: OptimizerHost,
        config: AveragingConfig,
        departed: Callable[[], Collection[bytes]] | None = None,
        partners: Callable[[], int] | None = None,
    ) -> None:
        """``departed``: the peer ids (bytes) of the replicas known to have stopped serving
        the stage (membership/peers.py ``gone_from``); their progress records do not count.
        ``partners``: how many other servers of the stage the membership lists (the start-up
        hold, ``_waiting_for_a_partner``). Both are called off the event loop (the progress
        tracker's thread, the device thread)."""
        if threading.current_thread() is not threading.main_thread():
            raise AveragingError(
                "construct CollaborativeOptimizer on the main thread "
                "(hivemind installs signal handlers)"
            )
        if spec.averaging.mode != "allreduce":
            raise AveragingError(
                f"averaging.mode = {spec.averaging.mode!r}: build the stage's optimizer with "
                "diloco.make_stage_optimizer (CollaborativeOptimizer is the 'allreduce' mode)"
            )
        self.run_id = averaging_run_id(spec, stage)
        self.config = config
        self._module = module
        delayed = config.delayed_updates
        # hivemind's averagers set SIGINT to SIG_IGN in *this* process before forking their
        # workers (averager.run_in_background); the daemon's own SIGINT handling must survive
        sigint = signal.getsignal(signal.SIGINT)
        try:
            self._opt = dht.hivemind_optimizer(
                run_id=self.run_id,
                target_batch_size=spec.batch.target_batch_size,
                batch_size_per_step=spec.batch.micro_batch_size,
                params=param_groups(module, spec.optimizer.weight_decay),
                # in a subspace run each step ends inside the subspace (constraint.py)
                optimizer=partial(
                    make_adamw, spec.optimizer,
                    constraint=SubspaceConstraint.for_stage(module, spec.optimizer.weight_decay),
                ),
                scheduler=partial(make_schedule, spec.optimizer),
                matchmaking_time=config.matchmaking_time,
                averaging_timeout=config.averaging_timeout,
                next_chunk_timeout=config.next_chunk_timeout,
                load_state_timeout=config.load_state_timeout,
                shutdown_timeout=config.shutdown_timeout,
                # every member of a round gets the same averaged gradients, bit for bit, so
                # replicas stay identical (exact_allreduce.py). hivemind 1.1.12 hands
                # averager_opts (below) to its state averager only: the gradient averager's
                # matchmaking kept its default request_timeout (3 s), not shorter than a
                # matchmaking_time of 2 s (the demo's), and two replicas of a stage looked for
                # each other's round for 40 s without meeting (hivemind warns of such deadlocks)
                grad_averager_factory=partial(
                    ExactGradientAverager, request_timeout=config.matchmaking_time / 2
                ),
                offload_optimizer=True,
                delay_optimizer_step=delayed,
                delay_grad_averaging=delayed,
                average_state_every=config.average_state_every,
                grad_compression=_compression(config.grad_compression),
                state_averaging_compression=_compression(config.state_compression),
                load_state_compression=_compression(config.load_state_compression),
                verbose=config.verbose,
                # progress records are signed with one key per DHT (membership/dht.py:
                # progress_signing_key), set by the Optimizer class itself
                tracker_opts={
                    "max_refresh_period": MAX_PROGRESS_REFRESH_S,
                    # the replicas' counts pushed over libp2p as well (progress_push.py)
                    "push_book": (
                        PushBook(target_batch_size=spec.batch.target_batch_size)
                        if config.exact_epochs and config.push_progress else None
                    ),
                    # a dead replica's record lives on for 60 s: not waited for
                    "departed": departed,
                },
                # hivemind warns that a matchmaking request_timeout (its default: 3 s) not
                # shorter than min_matchmaking_time can deadlock matchmaking in rare cases
                # (the state averager's; the gradient averager's is set above)
                averager_opts={"request_timeout": config.matchmaking_time / 2},
            )
        except (ValueError, RuntimeError, OSError, TimeoutError) as exc:
            raise AveragingError(f"cannot start the optimizer of {self.run_id}: {exc}") from exc
        finally:
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)
        try:
            # hostile progress records (an epoch of 10^15, absurd sample counts) are screened
            # before hivemind's tracker reads them (progress_guard.py)
            self.progress_screen = guard_tracker(
                self._opt.tracker, ProgressBounds(target_batch_size=spec.batch.target_batch_size)
            )
        except (RuntimeError, OSError, TimeoutError) as exc:
            self._opt.shutdown()
            raise AveragingError(f"cannot screen the progress of {self.run_id}: {exc}") from exc
        # the start-up hold (_waiting_for_a_partner): once, until hivemind's records show
        # another replica or partner_wait_s has passed since the epoch was first due
        self._partners = partners
        self._partner_hold: Literal["open", "seen", "spent"] = "open"
        self._partner_wait_since: float | None = None
        self.partner_hold_s = 0.0  # how long the start-up hold held the epoch
        self._clock = time.monotonic
        self._opt.tracker.hold_epoch = self._hold_epoch
        # steps taken with this replica's own gradients, not the stage's average (hivemind
        # falls back to them when a round fails or finds nobody; _skip_round takes them on
        # purpose): each one sets the replicas apart until parameters are averaged again
        self.local_gradient_steps = 0
        fallback = self._opt._load_local_gradients_into_optimizer
        # whether the served parameters are the stage's shared ones, for the replies' params
        # (params_version.py); _step_in_flight: the epoch step whose rounds are being set up
        self._ledger = ParamsLedger(
            state_rounds=lambda epoch: getattr(self._opt.state_averager, "rounds", {}).get(epoch),
            on_change=self._shared_changed,
        )
        self._step_in_flight: EpochStep | None = None

        def counted_fallback() -> None:
            self.local_gradient_steps += 1
            if self._step_in_flight is not None:
                self._step_in_flight.local = True  # its round's outcome does not count
            fallback()

        self._opt._load_local_gradients_into_optimizer = counted_fallback
        # every epoch's step timed; a slow one is logged with what it waited for
        self.slow_steps = 0
        self.last_slow_step: dict[str, Any] | None = None
        self._round: dict[str, Any] = {}
        update = self._opt._update_global_epoch
        average = self._opt._average_gradients_and_load_into_optimizer

        def timed_update(grad_scaler: Any) -> None:
            self._timed_epoch_step(update, grad_scaler)

        def timed_average(control: Any) -> None:
            self._timed_round(average, control)

        self._opt._update_global_epoch = timed_update
        self._opt._average_gradients_and_load_into_optimizer = timed_average
        # rounds meet only rounds of the same epoch (exact_allreduce.py); a replica whose
        # partners have all moved past its epoch steps without a round
        self._opt.grad_averager.round_epoch = lambda: int(self._opt.local_epoch)
        self.rounds_skipped_behind = 0
        self.rounds_abandoned_alone = 0
        self.state_rounds_abandoned = 0
        # the rules for a replica left behind hold with synchronous steps only: there a
        # partner at a later epoch has finished its round of ours (its step waited for it);
        # with delayed updates it moves on at once and its round runs in the background
        self._sync = not config.delayed_updates
        self.parameter_rounds_landed = 0  # _land_parameter_round
        self._opt._begin_averaging_gradients = partial(
            self._begin_unless_behind, self._opt._begin_averaging_gradients
        )
        # a round that outlives this is left to hivemind's own wait (which times out)
        self.hold_limit_s = 2 * config.averaging_timeout
        self._snapshot_waiting_since: float | None = None  # hold_for_snapshot
        self._running_since: dict[int, float] = {}  # id of a running update -> first seen
        # epochs end at the samples the spec says, not at hivemind's estimate (module docstring)
        self._opt.tracker.exact_epochs = config.exact_epochs
        self.epochs_held = 0
        # (epoch, samples this replica brought to its step), the last few epochs
        self.step_samples: deque[tuple[int, int]] = deque(maxlen=STEP_SAMPLES_KEPT)
        for p in module.parameters():
            p.grad = None
        self._shut = False
        self.catch_up: CatchUp | None = None  # catch_up_with() installs it
        self.downloads_refused = 0  # hivemind's downloads whose values failed the checks
        self._last_call: float | None = None
        self.call_interval_s = 0.0  # EMA of the time between step / step_if_due calls
        self.idle_steps = 0  # epoch steps joined from step_if_due (no micro-batch at hand)
        self.rounds_formed_early = 0
        self.failed_rounds_dropped = 0
        self.epochs_ended_before_a_batch = 0  # _end_epoch_before_this_batch

    def step(self, batch_size: int) -> None:
        if not self.config.delayed_updates:
            self._prepare_round()
            if self.config.exact_epochs and self._due_without_us():
                self._end_epoch_before_this_batch()
        elif self._background_hold() and _due(self._opt.tracker):
            self.epochs_held += 1  # the tracker holds it (module docstring)
        epoch, before, resyncs = self.local_epoch, self.samples_accumulated, self._resyncs()
        try:
            self._opt.step(batch_size=batch_size)
        finally:
            # hivemind copied the gradients into its accumulators (or dropped them when this
            # replica had to resync): either way they must not count again
            self._opt.zero_grad(set_to_none=False)
        if self.local_epoch == epoch + 1 and self._resyncs() == resyncs:
            self.step_samples.append((epoch, before + batch_size))

    def _resyncs(self) -> int:
        return sum(self.catch_up.counts.values()) if self.catch_up is not None else 0

    def step_if_due(self) -> bool:
        if self.config.delayed_updates:
            return False  # the step runs in the background: nobody blocks waiting for this replica
        self._prepare_round()
        if not self._due_without_us():
            return False
        self.idle_steps += 1
        return self._step_without_a_batch()

    def _due_without_us(self) -> bool:
        """The stage's epoch is due as the replicas' samples stand, without another
        micro-batch of ours (and we are not behind it)."""
        opt = self._opt
        progress = opt.tracker.global_progress
        # samples_accumulated: what the replicas reported for this epoch (no extrapolation);
        # hivemind's ETA alone can pass with nothing accumulated anywhere
        if (
            progress.num_peers <= 1
            or progress.samples_accumulated <= 0
            or not opt.tracker.ready_to_update_epoch
        ):
            return False
        # behind the stage: the next micro-batch's step resyncs first
        return self.local_epoch >= opt.tracker.global_epoch

    @torch.no_grad()
    def _end_epoch_before_this_batch(self) -> None:
        """A micro-batch whose gradient is in ``.grad`` arrived after the epoch was already
        full (the others' samples and ours reached the target while it was computed): the
        epoch's step runs first, without it, and it then goes to the next epoch. Otherwise
        hivemind would add it to the full epoch, and the step would hold up to one more
        micro-batch per replica than the spec says. Its gradient is set aside meanwhile:
        hivemind swaps the averaged gradients into ``.grad`` during the step."""
        params = list(self._module.parameters())
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            self._step_without_a_batch()
        finally:
            for p, grad in zip(params, kept, strict=True):
                p.grad = grad
        self.epochs_ended_before_a_batch += 1

    def _step_without_a_batch(self) -> bool:
        """The epoch's step, as hivemind's ``step`` takes it once due, without accumulating a
        micro-batch; True if this replica stepped."""
        opt = self._opt
        epoch = self.local_epoch
        averager = opt.grad_averager
        if averager.local_samples_accumulated == 0:
            # the round is weighted by samples: with every part that reaches us weighing 0 (the
            # busy replica's chunks late or lost) hivemind's average would be 0/0, NaN. A token
            # weight keeps it finite; its zero gradient shifts the others' mean by 1e-3 / 64
            averager.local_samples_accumulated = IDLE_ROUND_WEIGHT
        # what hivemind's step does once due, without accumulating a (zero) micro-batch: its
        # mean gradient divides by the number of accumulations, which that would inflate
        before = self.samples_accumulated
        opt._update_global_epoch(None)
        if self.local_epoch == epoch + 1:
            self.step_samples.append((epoch, before))
        return self.local_epoch != epoch

    def _begin_unless_behind(self, begin: Callable[[Any], bool], grad_scaler: Any) -> bool:
        """hivemind's ``_begin_averaging_gradients``, or no round at all when, with
        synchronous steps, every partner is past our epoch (``_skip_round``). hivemind
        calls it once per epoch step, after waiting for the previous step's background work:
        the step's record (``_step_in_flight``) starts here."""
        step = self._step_in_flight = EpochStep(grad_round=None, work=None, stepped=self._sync)
        if self._sync and self._behind_every_partner():
            return self._skip_round()
        began = bool(begin(grad_scaler))
        if began:
            step.grad_round = self._opt.scheduled_grads
        return began

    def _others(self) -> dict[int, float] | None:
        """The other replicas' samples by epoch, from their records and pushes (the
        tracker's ``others_samples``, computed at each read), or None if it has none."""
        others = getattr(self._opt.tracker, "others_samples", None)
        return others if isinstance(others, dict) else None

    def _behind_every_partner(self, others: dict[int, float] | None = None) -> bool:
        """Every other replica with a record (or push) is at a later epoch than ours: no
        round of our epoch can form (rounds meet only their epoch's), and hivemind would
        look for one until ``averaging_timeout``. ``others``: ``_others()``, if already read."""
        if others is None:
            others = self._others()
        if not others:
            return False  # nobody known: hivemind's own rule (no peers: no round)
        return min(others) > self.local_epoch

    def _skip_round(self) -> bool:
        """hivemind's step without a round: this replica's own gradients (the return value
        of ``_begin_averaging_gradients``: no round began). A round scheduled for the epoch
        is cancelled: it can only wait for partners that are not coming."""
        opt = self._opt
        control = opt.scheduled_grads
        if control is not None and not control.done():
            control.cancel()
        opt.scheduled_grads = None
        self.rounds_skipped_behind += 1
        self.local_gradient_steps += 1  # hivemind steps on the accumulators: ours alone
        self._round["round"] = "skipped (behind)"
        return False

    def _wait_unless_left_behind(self, control: Any) -> str | None:
        """Wait for the epoch's round as hivemind would (up to ``averaging_timeout``), but
        give up on a round still looking for its group once no partner can join it:
        hivemind retries matchmaking until its deadline. Returns why the round was
        abandoned (cancelled: hivemind then steps on this replica's own gradients), or None:

        - ``behind``: every partner has moved past our epoch, and no round of our epoch can
          form any more (a partner whose side of the round failed under load stepped on);
        - ``alone``: no other replica has had a progress record or push for
          ``ALONE_GRACE_S`` (the partner the round was formed with died: its record
          expired). Without this the last replica of a stage whose partner was killed
          waited out ``averaging_timeout`` (58 s in a ``demo --chaos`` run) in each of its
          steps while the partner's record lived and one more with the parameter round,
          refusing its trainers' micro-batches as busy all that time."""
        from hivemind.averaging.control import AveragingStage

        deadline = time.monotonic() + self.config.averaging_timeout
        alone_since: float | None = None
        while time.monotonic() < deadline:
            try:
                control.result(timeout=ROUND_POLL_S)
                return None
            except TimeoutError:
                pass
            except Exception:  # the round failed or was cancelled: hivemind's wait says so
                return None
            if control.stage not in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
                alone_since = None
                continue  # the group formed: the round is hivemind's to finish
            others = self._others()  # one read for both rules
            if self._behind_every_partner(others):
                control.cancel()
                return "behind"
            if others is None or others:  # a partner is known (or the tracker cannot say)
                alone_since = None
            elif alone_since is None:
                alone_since = time.monotonic()
            elif time.monotonic() - alone_since >= ALONE_GRACE_S:
                control.cancel()
                return "alone"
        return None

    def _timed_epoch_step(self, update: Callable[[Any], None], grad_scaler: Any) -> None:
        """hivemind's ``_update_global_epoch``, timed: a step longer than
        ``matchmaking_time + SLOW_STEP_MARGIN_S`` is logged and counted with why the epoch
        ended, the counts it ended on and what its gradient round did."""
        opt, tracker = self._opt, self._opt.tracker
        reason = getattr(tracker, "epoch_end_reason", lambda: None)()
        others = getattr(tracker, "others_samples", {})
        control = opt.scheduled_grads
        seen = {
            "epoch": self.local_epoch,
            "reason": reason or "estimate",
            "ours": self.samples_accumulated,
            "others": {str(e): round(n, 1) for e, n in others.items()},
            "global_epoch": self.global_epoch,
            "formed_early": control is not None and not control.triggered,
        }
        self._round = {}
        start = time.monotonic()
        state_averager = opt.state_averager
        if self._sync:
            self._land_parameter_round(state_averager)
        epoch, work_before = self.local_epoch, set(state_averager.pending_updates)
        previous = self._step_in_flight  # the last step's: its fallback may still run
        try:
            update(grad_scaler)
        finally:
            step = self._step_in_flight
            if self.local_epoch != epoch:
                if step is None or step is previous:  # the epoch moved without a gradient round
                    step = EpochStep(grad_round=None, work=None, stepped=self._sync)
                step.epoch = self.local_epoch  # its parameter round gathers this epoch
                work = [u for u in state_averager.pending_updates if u not in work_before]
                step.work = work[-1] if work else None
                self._ledger.stepped(step)
            seconds = time.monotonic() - start
            if seconds > self.config.matchmaking_time + SLOW_STEP_MARGIN_S:
                self.slow_steps += 1
                self.last_slow_step = {**seen, "seconds": round(seconds, 2), **self._round}
                logger.warning(
                    "%s: the step ending epoch %d took %.1f s (%s)", self.run_id,
                    seen["epoch"], seconds,
                    ", ".join(f"{k}={v}" for k, v in self.last_slow_step.items()
                              if k not in ("epoch", "seconds")),
                )

    def _shared_changed(self, shared: bool, why: str) -> None:
        """The served parameters stopped or started being the stage's shared ones: replies
        carry ``params`` null meanwhile, and trainers do not spot-check them."""
        logger.info(
            "%s: parameters %s the stage's (%s), epoch %d", self.run_id,
            "are again" if shared else "set apart from", why, self.local_epoch,
        )

    def _land_parameter_round(self, averager: Any) -> None:
        """Synchronous steps: the parameter round an earlier step left running in the
        background lands before this step's optimizer step.

        hivemind copies a finished round's result over the parameters at its next step, if
        its worker thread has said the round finished by then. The wait for a round ends
        when the round's control does (or when it is given up: ``_wait_unless_left_behind``
        cancels it); the worker thread says so a moment later. A step that went straight on
        (a skipped gradient round takes microseconds) missed that, ran its optimizer step
        on the parameters from before the round, and the step after copied the round's
        result over it: that replica lost an optimizer step, and with a given-up round the
        result was its own parameters from before. Its partner, which did not lose the
        step, then held parameters one optimizer step away (3.6-25% of a stage's output
        early in the tiny run). hivemind waits for its background work itself only when
        the step averages parameters too, or with delayed updates. So the round is waited
        for here, given up while still matching once every partner has moved on (as
        hivemind's optimizer step would queue behind it anyway: one worker thread), and
        the background work is finished and its result copied in before hivemind's step
        (``parameter_rounds_landed`` counts the steps that found it unfinished)."""
        running = getattr(averager, "last_round", None)
        if running is not None and getattr(running, "triggered", False) and not running.done():
            why = self._wait_unless_left_behind(running)
            if why is not None:
                self.state_rounds_abandoned += 1
                self._round["state_round"] = f"abandoned ({why})"
        if any(not update.done() for update in averager.pending_updates):
            self.parameter_rounds_landed += 1
            averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)

    def _timed_round(self, average: Callable[[Any], None], control: Any) -> None:
        """hivemind's wait for the epoch's gradient round, timed (``_timed_epoch_step``)."""
        start = time.monotonic()
        fallbacks = self.local_gradient_steps
        abandoned = (
            self._wait_unless_left_behind(control) if self._sync and control is not None
            else None
        )
        if abandoned == "behind":
            self.rounds_skipped_behind += 1
        elif abandoned == "alone":
            self.rounds_abandoned_alone += 1
        try:
            average(control)  # at once when the round is over (or abandoned)
        finally:
            # added to the step's account (which may already hold its parameter round's)
            self._round.update({
                "round_s": round(time.monotonic() - start, 2),
                "round": "none" if control is None
                else f"abandoned ({abandoned})" if abandoned
                else "local" if self.local_gradient_steps > fallbacks else "averaged",
            })
            if self._round["round"] == "averaged":
                # hivemind's result: what each member of the group gathered, by peer
                with contextlib.suppress(Exception):
                    self._round["group"] = len(control.result(0))

    def _prepare_round(self) -> None:
        """Drop a failed pre-scheduled round; schedule the next one early (module docstring)."""
        from hivemind.utils.timed_storage import get_dht_time

        now = time.monotonic()
        if self._last_call is not None:
            gap = now - self._last_call
            previous = self.call_interval_s
            self.call_interval_s = gap if previous == 0.0 else 0.7 * previous + 0.3 * gap
        self._last_call = now
        opt = self._opt
        control = opt.scheduled_grads
        if control is not None and control.done() and not control.triggered:
            logger.info("%s: a pre-scheduled averaging round failed before the epoch ended; "
                        "a new one starts at the boundary", self.run_id)
            control.cancel()  # marks it used: hivemind warns about an unused control's deletion
            opt.scheduled_grads = control = None
            self.failed_rounds_dropped += 1
        if not self.config.form_group_early or opt.tracker.global_progress.num_peers <= 1:
            return
        if control is not None and not control.triggered:
            return  # a round is already being formed for this epoch
        eta = opt.tracker.estimated_next_update_time - get_dht_time()
        if eta > self.config.matchmaking_time + max(1.0, 2 * self.call_interval_s):
            return
        try:
            opt.scheduled_grads = opt.grad_averager.schedule_step(timeout=opt.averaging_timeout)
        except (RuntimeError, OSError, ValueError) as exc:  # the averager is shutting down
            logger.debug("%s: cannot schedule an averaging round: %s", self.run_id, exc)
            return
        self.rounds_formed_early += 1

    def catch_up_with(self, fetch: CatchUpFetch) -> None:
        # hivemind calls its Optimizer's load_state_from_peers inside step when this replica
        # is behind: our transport instead; hivemind's download once where no donor
        # answered ours (a stand-in of ours where the donors ahead kept disagreeing,
        # resync.py), attempts spaced
        self.catch_up = catch_up_through(self._opt, fetch, installed=self._ledger.installed,
                                         guard=self._checked_download)

    def _checked_download(self, download: Callable[[], bool]) -> bool:
        """Device thread: hivemind's download (``download``) copies one averager's state into
        ours without a look at its values. Ours is kept (a CPU copy, only on this rare path:
        our transport reached no donor) and put back if what arrived holds a NaN or an
        infinity, or step counters that are not whole numbers within its epoch: the checks
        a state from our own transport passes (state.py)."""
        epoch, saved, meta = self.export_state()
        moved = download()
        try:
            with torch.no_grad(), self._opt.state_averager.lock_averaged_tensors:
                live = self._live_tensors()  # read in place: no second copy of the state
                check_finite(live, "the state hivemind's download installed "
                             f"(epoch {self.local_epoch})")
                check_counters(self.local_epoch, live)
        except CheckpointError as exc:
            logger.warning("%s: %s; putting our state of epoch %d back", self.run_id, exc, epoch)
            self.import_state(epoch, saved, meta)
            self.downloads_refused += 1
            return False
        return moved

    def is_behind(self, epoch: int, meta: dict[str, Any]) -> bool:
        """Asked of the state a quorum of the stage's replicas holds (a catch-up), or of the
        lower median of the donors' epochs where they agree on none. When it is not ahead
        of ours, a progress record claiming more than one epoch beyond it is not
        believed for ``QUORUM_CAP_S`` (progress_guard.py): hivemind took such a record (a
        lie within the screen's lead, or a stale one) for the stage's epoch."""
        if epoch > self.local_epoch:
            return True
        from hivemind.utils.timed_storage import get_dht_time

        self.progress_screen.believe_at_most(epoch + 1, get_dht_time() + QUORUM_CAP_S)
        return False

    def load_state_from_peers(self) -> bool:
        epoch = self.local_epoch
        try:
            self._opt.load_state_from_peers()
        except (RuntimeError, OSError, TimeoutError) as exc:
            raise AveragingError(f"{self.run_id}: loading state from peers failed: {exc}") from exc
        if self.local_epoch != epoch:
            self._ledger.installed()  # a peer's state, exactly
        return self.local_epoch != epoch or self._opt.tracker.global_progress.num_peers > 1

    @property
    def local_epoch(self) -> int:
        return int(self._opt.local_epoch)

    @property
    def global_epoch(self) -> int:
        """The collaboration's epoch as this replica last saw it in the DHT."""
        return int(self._opt.tracker.global_epoch)

    @property
    def samples_accumulated(self) -> int:
        return int(self._opt.local_progress.samples_accumulated)

    @property
    def num_peers(self) -> int:
        """Replicas of the stage that reported progress recently (this one included)."""
        return int(self._opt.tracker.global_progress.num_peers)

    def is_synchronized(self) -> bool:
        return bool(self._opt.is_synchronized_with_peers())

    def flush(self) -> None:
        self._opt.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)

    def hold_for_snapshot(self, waiting: bool) -> None:
        if not waiting:
            self._snapshot_waiting_since = None
        elif self._snapshot_waiting_since is None:  # hold_limit_s runs from the first call
            self._snapshot_waiting_since = time.monotonic()

    def _hold_epoch(self) -> bool:
        """The tracker's hold (membership/dht.py): the start-up hold for a partner, or, with
        delayed updates, a background round still running (``_background_hold``)."""
        if self._waiting_for_a_partner():
            return True
        return self.config.delayed_updates and self._background_hold()

    def _waiting_for_a_partner(self) -> bool:
        """The start-up hold: whether to keep the epoch open because the membership lists
        another server of the stage that hivemind's progress records do not show yet.

        hivemind looks for a gradient round only when its tracker counts another replica;
        otherwise it steps on this replica's own gradients. Replicas that start together
        see each other's server records before their progress records (hivemind fetches
        those every 3 s while it sees nobody, and a record is stored a moment after the
        first micro-batch): in demo runs both replicas of two stages out of three reached
        the first epoch's target alone, each stepped on its own gradients, and from then on
        their AdamW moments differed, so they never again held equal parameters for longer
        than from a parameter round to the next step (params_version.py; spot checks
        compared a third of the hops they drew). The hold makes that first step an averaged
        one. It runs once per optimizer: from the moment the epoch would end until
        hivemind counts another replica (``seen``: it never holds again) or
        ``partner_wait_s`` has passed (``spent``: a listed server whose records never come,
        a hostile record included, costs this wait once). Without another listed server
        nothing is held: a replica alone in its stage steps alone, and a newcomer installs
        its state."""
        if self._partner_hold != "open" or self._partners is None:
            return False
        tracker = self._opt.tracker
        if tracker.global_progress.num_peers > 1:
            if self._partner_wait_since is not None:
                self.partner_hold_s = self._clock() - self._partner_wait_since
                logger.info(
                    "%s: another replica's progress is visible after holding the epoch %.1f s: "
                    "stepping together", self.run_id, self.partner_hold_s,
                )
            self._partner_hold = "seen"
            return False
        try:
            listed = self._partners()
        except Exception as exc:  # the peer table changed under us: no hold this time
            logger.debug("%s: counting the stage's servers failed: %r", self.run_id, exc)
            return False
        # the wait runs from the moment the epoch would end without the hold
        if listed <= 0 or not tracker.due_without_hold():
            return False
        now = self._clock()
        if self._partner_wait_since is None:
            self._partner_wait_since = now
            logger.info(
                "%s: epoch %d is due but hivemind counts no other replica while the membership "
                "lists %d other server(s) of the stage: holding it for up to %.0f s so that the "
                "step averages with them", self.run_id, self.local_epoch, listed,
                self.config.partner_wait_s,
            )
        self.partner_hold_s = now - self._partner_wait_since
        if self.partner_hold_s < self.config.partner_wait_s:
            return True
        self._partner_hold = "spent"
        logger.warning(
            "%s: no other replica's progress appeared within %.0f s although the membership "
            "lists %d other server(s) of the stage: stepping alone (the replicas' optimizer "
            "moments will differ)", self.run_id, self.config.partner_wait_s, listed,
        )
        return False

    def _background_hold(self) -> bool:
        """Whether to hold the epoch open: a background round runs, and has run for less
        than ``hold_limit_s`` (one that hangs past it is hivemind's to wait for and cancel);
        or a state donor's snapshot waits for the round to end (``hold_for_snapshot``), for
        as long: a new epoch's round would start before the snapshot's turn on the device
        thread came, and the snapshot could wait through round after round."""
        now = time.monotonic()
        waiting = self._snapshot_waiting_since
        if waiting is not None and now - waiting < self.hold_limit_s:
            return True
        running = [u for u in self._opt.state_averager.pending_updates if not u.done()]
        if not running:
            self._running_since.clear()
            return False
        self._running_since = {id(u): self._running_since.get(id(u), now) for u in running}
        return now - min(self._running_since.values()) < self.hold_limit_s

    def background_busy(self) -> bool:
        return any(not update.done() for update in self._opt.state_averager.pending_updates)

    def params_version(self) -> int | None:
        averager = self._opt.state_averager
        # a finished background result not yet copied into the served module: with
        # synchronous steps only a parameter round runs there, and the ledger knows what
        # the module serves until its result lands (params_version.py)
        waiting = averager.finished_optimizer_step.is_set() or (
            not self._sync and averager.finished_averaging_round.is_set()
        )
        return self._ledger.version(self.local_epoch, applied=not waiting)

    def _live_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint names -> the tensors that hold them: hivemind's offloaded (CPU, float32)
        main parameters, which its optimizer steps and its peers download, in place of the
        served module's copies; the module's buffers; the offloaded optimizer's state."""
        averager = self._opt.state_averager
        offloaded = [p for group in averager.optimizer.param_groups for p in group["params"]]
        names = {id(p): name for name, p in self._module.named_parameters()}
        live = module_tensors(self._module)
        for main, off in zip(averager.main_parameters, offloaded, strict=True):
            live[MODEL_PREFIX + names[id(main)]] = off
        return live | optimizer_tensors(averager.optimizer)

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        # a delayed step still running would leave the epoch counted but the parameters old
        self.flush()
        averager = self._opt.state_averager
        with torch.no_grad(), averager.lock_averaged_tensors:
            tensors = snapshot(self._live_tensors())
            return self.local_epoch, tensors, optimizer_meta(averager.optimizer)

    def export_checkpoint(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        return self.export_state()

    def averaging_status(self) -> dict[str, Any]:
        """The per-step all-reduce's fields for ``wanswarm status``: the last round is the
        last epoch (hivemind reports neither its group nor its bytes: ``bytes_sent`` is what
        a butterfly all-reduce of the stage's gradients sends per replica and round,
        ``2 (n - 1) / n`` of them at the compression's bytes a value), the progress records
        refused."""
        n = max(1, self.num_peers)
        per_value = _BYTES_PER_VALUE[self.config.grad_compression]
        numel = sum(p.numel() for p in self._module.parameters())
        return {
            "mode": "allreduce",
            "last_round": self.local_epoch,
            "participants": n,
            "bytes_sent": int(2 * (n - 1) / n * per_value * numel),
            "grad_compression": self.config.grad_compression,
            "rounds_formed_early": self.rounds_formed_early,
            # progress records of replicas that stopped serving the stage, ignored at the
            # last read of the stage's progress
            "departed_records": int(getattr(self._opt.tracker, "departed_records", 0)),
            "failed_rounds_dropped": self.failed_rounds_dropped,
            "epochs_held": self.epochs_held,
            # the start-up hold for a partner (_waiting_for_a_partner): open, seen or
            # spent, and how long it held the epoch
            "partner_hold": {"state": self._partner_hold, "held_s": round(self.partner_hold_s, 1)},
            # epochs already full when a micro-batch of ours arrived: stepped without it
            "epochs_ended_before_a_batch": self.epochs_ended_before_a_batch,
            "local_gradient_steps": self.local_gradient_steps,
            # epochs that ended, or whose round was still looking for a group, with every
            # partner already past them: stepped without a round
            "rounds_skipped_behind": self.rounds_skipped_behind,
            # gradient rounds given up while still matching, no other replica left
            "rounds_abandoned_alone": self.rounds_abandoned_alone,
            # parameter rounds given up while still matching: every partner past our epoch,
            # or none left
            "state_rounds_abandoned": self.state_rounds_abandoned,
            # synchronous steps that waited for an earlier parameter round to land
            "parameter_rounds_landed": self.parameter_rounds_landed,
            # epochs after which the served parameters were not the stage's shared ones (a
            # local step, a round that missed parts): the replies' params are null until a
            # parameter round with a partner (params_version.py)
            "unshared_epochs": self._ledger.unshared_epochs,
            # steps that took over matchmaking_time + SLOW_STEP_MARGIN_S, the last one's account
            "slow_steps": self.slow_steps,
            "last_slow_step": self.last_slow_step,
            # the samples this replica brought to each of its last steps; summed over a
            # stage's replicas, a step's samples (demo_figures.step_size)
            "step_samples": {str(e): n for e, n in self.step_samples},
            "progress_records_refused": self.progress_screen.refused,
            # kept with a count above the screen's bound, counted as the bound
            "progress_records_clamped": self.progress_screen.clamped,
            # catch-ups whose quorum was not ahead of us bounded the records believed
            "progress_records_capped": self.progress_screen.capped,
            # the replicas' counts pushed over libp2p (progress_push.py): sent, failed,
            # received, refused by reason
            "progress_pushes": self._push_status(),
            # fell behind and caught up: through our transport, hivemind's, failed, deferred
            "catch_ups": dict(self.catch_up.counts) if self.catch_up is not None else None,
            # hivemind's downloads whose values failed the checks (our state put back)
            "downloads_refused": self.downloads_refused,
        }

    def _push_status(self) -> dict[str, Any] | None:
        channel = self._opt.tracker.channel  # set once the tracker runs with a push book
        return None if channel is None else dict(channel.status())

    def import_state(
        self, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> None:
        epoch = checked_epoch(epoch)
        opt, averager = self._opt, self._opt.state_averager
        live = self._live_tensors()
        check_fits(live, tensors)
        groups = checked_param_groups(averager.optimizer, meta)
        try:
            # as hivemind's load_state_from_peers: join a pre-scheduled gradient round with zero
            # weight (cancelling it would stall the peers' matchmaking), and let a background
            # step land now rather than on top of the imported state
            if opt.scheduled_grads is not None and not opt.scheduled_grads.done():
                opt._tag_along_with_zero_weight(opt.scheduled_grads)
                opt.scheduled_grads = None
            averager.step(wait_for_delayed_updates=True)
            with opt.tracker.pause_updates():
                with torch.no_grad(), averager.lock_averaged_tensors:
                    for name, tensor in live.items():
                        tensor.copy_(tensors[name])
                    for group, values in zip(averager.optimizer.param_groups, groups, strict=True):
                        group.update(values)
                averager._apply_optimizer_parameters_()  # offloaded -> served module
                if not averager.reuse_tensors:
                    averager._load_local_tensors_into_averager_()
                averager.local_epoch = epoch
                set_schedule_epoch(averager.scheduler, averager.optimizer, epoch)
                opt.tracker.update_epoch(new_epoch=epoch)  # reports (epoch, 0 samples)
                opt._should_check_synchronization_on_update = True
                if not opt.client_mode:
                    averager.state_sharing_priority = epoch
                if opt.use_gradient_averaging:
                    opt.grad_averager.reset_accumulated_grads_()
                    if not opt.client_mode:
                        opt.grad_averager.state_sharing_priority = epoch
        except (RuntimeError, OSError, TimeoutError) as exc:
            raise AveragingError(f"{self.run_id}: installing a checkpoint failed: {exc}") from exc
        self._ledger.installed()
        for p in self._module.parameters():
            p.grad = None

    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        try:
            self._opt.shutdown()
        except (RuntimeError, OSError, TimeoutError, ValueError) as exc:
            logger.warning("%s: optimizer shutdown failed: %s", self.run_id, exc)
