"""A stage's gossip optimizer: local inner steps, a parameter average with a few peers every H.

The run spec's ``[averaging] mode = "gossip"`` (config/averaging_spec.py) makes every server
of a stage train on its own micro-batches with the run's AdamW (:class:`~.optimizer.
LocalOptimizer`, one inner step per ``target_batch_size`` samples of this replica) and, every
``inner_steps`` inner steps, average its parameters with ``gossip_neighbours`` other replicas
(Decent-DP, ICLR 2025; randomized gossip, Boyd et al. 2006), not with the whole stage:

1. the parameters go into a hivemind ``DecentralizedAverager`` whose groups hold
   ``1 + gossip_neighbours`` members (``min_group_size`` 2): matchmaking pairs this replica
   with whichever replicas of the stage look for a group at the same time, so the topology
   changes every round by itself;
2. the group's all-reduce (hivemind's butterfly, float32, streamed: no message-size cap)
   hands each member the group's uniform mean, which preserves the mean over the stage
   (Metropolis weights of a group of equals);
3. the mean is screened (finite; no further from our parameters than our parameters'
   own norm: a partner's NaN or 10^30 is refused, the round counts as missed) and set as the
   parameters, plus the inner steps this replica took while the all-reduce ran (the
   device thread trains on meanwhile, as in DiLoCo).

Why random groups and not Decent-DP's alternating exponential graph (gossip.py): that graph
pairs replica ``i`` with ``i XOR 2^(r mod log2 n)``, which needs every replica to agree on
the round ``r`` and on the ordered member list; volunteers join, leave and miss rounds, and
a replica whose view differs would wait for a partner that looks for someone else. hivemind's
matchmaking forms groups among the replicas that are ready, which is randomized pairwise
gossip: it mixes more slowly in expectation than the exponential graph's exact mean after
``log2 n`` rounds, and never waits for a partner that is not there.

What is not shared: replicas hold different parameters between rounds, so there is no
state that a quorum of donors agrees on. :meth:`export_state` is this replica's own
(parameters and AdamW state); a newcomer whose state transfer finds no quorum falls back to
:meth:`load_state_from_peers`, which downloads one replica's parameters from the stage's
gossip averagers (trusted as one gossip partner is: names, shapes and finiteness checked).
``replicas_differ`` tells the state sharing (state.py) to do that.

The inner optimizer is the run spec's ``averaging.inner_optimizer``: AdamW, or Decent-DP's
AccumAdam (``optimizer.AccumAdamW``), for replicas whose inner steps see few samples.
Not built: compression of the exchanged parameters (the spec refuses ``compression`` with
``gossip``: parameters, unlike pseudo-gradients, do not
survive 8-bit rounding; CHOCO-style compressed gossip needs per-neighbour copies that a
changing topology does not keep).

Threads: construct on the main thread (the averager forks a process); ``step`` and the rest on
the device thread; state requests arrive on hivemind's thread and read under a lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..config.runspec import RunSpec
from ..logs import get_logger
from .averager_carrier import AveragerCarrier
from .averaging import AveragingConfig, AveragingError, averaging_run_id
from .checkpoint import CheckpointError
from .inner_rounds import InnerStepsOptimizer
from .optimizer import CatchUpFetch
from .state_tensors import check_fits, checked_epoch, tensors_digest

log = get_logger(__name__)

MAX_ROUND = 10**9


class PendingAverage(Protocol):
    """An all-reduce under way: :meth:`done` without blocking, then :meth:`result` once."""

    def done(self) -> bool: ...

    def result(self) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
        """The group's mean (CPU float32, in parameter order) and each member's metadata by
        peer id, or None when the round failed. Untrusted: the caller screens it."""


class GossipCarrier(Protocol):
    """What a gossip round needs from its transport (hivemind's averager, or a test's)."""

    def start_average(self, tensors: list[torch.Tensor], meta: dict[str, Any],
                      timeout: float) -> PendingAverage:
        """Average ``tensors`` (CPU float32 copies) with a group, in the background."""

    def newer_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """One replica's shared parameters (metadata, tensors), or None."""

    def shutdown(self) -> None:
        """Leave; the carrier is unusable afterwards."""


class _Failed:
    def done(self) -> bool:
        return True

    def result(self) -> None:
        return None


class HivemindGossipCarrier(AveragerCarrier):
    """Gossip rounds over hivemind's DecentralizedAverager (module docstring)."""

    def __init__(
        self, host: Any, prefix: str, shapes: list[tuple[int, ...]],
        state: Callable[[], tuple[Any, list[torch.Tensor]]], config: AveragingConfig,
        group_size: int, round_timeout: float, others: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(
            host, prefix, [torch.zeros(s, dtype=torch.float32) for s in shapes], state, config,
            group_size=group_size, round_timeout=round_timeout, what="gossip", others=others,
        )

    def start_average(self, tensors: list[torch.Tensor], meta: dict[str, Any],
                      timeout: float) -> PendingAverage:
        try:
            with self._averager.get_tensors() as shared:
                for dst, src in zip(shared, tensors, strict=True):
                    dst.copy_(src)
            self.size_next_round()
            control = self._averager.step(gather=meta, weight=1.0, timeout=timeout, wait=False)
        except Exception as exc:  # hivemind raises its own errors, and asyncio's
            log.info("gossip round failed: %r", exc)
            return _Failed()
        return _HivemindAverage(self._averager, control)


class _HivemindAverage:
    """hivemind's StepControl of an all-reduce started with ``wait=False``."""

    def __init__(self, averager: Any, control: Any) -> None:
        self._averager, self._control = averager, control

    def done(self) -> bool:
        return bool(self._control.done())

    def result(self) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
        try:
            gathered = self._control.result(timeout=0)
        except Exception as exc:  # as in start_average
            log.info("gossip round failed: %r", exc)
            return None
        if not isinstance(gathered, dict) or len(gathered) < 2:
            return None
        with self._averager.get_tensors() as shared:
            mean = [t.clone() for t in shared]
        return mean, {str(peer): value for peer, value in gathered.items()}


@dataclass
class _Round:
    """A gossip round whose all-reduce is under way: what it started from."""

    pending: PendingAverage
    started: float
    params: dict[str, torch.Tensor]  # the parameters it sent
    epoch: int  # the inner epoch then


class GossipOptimizer(InnerStepsOptimizer):
    """The :class:`~.optimizer.StageOptimizer` of ``[averaging] mode = "gossip"``."""

    # replicas hold different parameters between rounds: no quorum of donors agrees on a
    # state, so a newcomer asks one gossip partner (state.py)
    replicas_differ = True

    def __init__(
        self,
        module: nn.Module,
        spec: RunSpec,
        stage: int,
        config: AveragingConfig,
        carrier: Callable[[Callable[[], tuple[Any, list[torch.Tensor]]]], GossipCarrier],
        others: Callable[[], int] | None = None,
    ) -> None:
        """``carrier(state)`` builds the transport; ``state`` gives the parameters it shares.
        ``others`` counts the stage's other replicas the node knows of: with none, a round
        is skipped (nobody to average with)."""
        if spec.averaging.compression != "none":
            raise AveragingError(
                "averaging.compression must be 'none' with mode = 'gossip' (gossip averages "
                "float32 parameters)"
            )
        super().__init__(module, spec, others)
        self.run_id = averaging_run_id(spec, stage) + "_gossip"
        params = self._params()
        self._shapes = [tuple(params[n].shape) for n in self._names]
        self.numel = sum(params[n].numel() for n in self._names)
        self.group_size = 1 + self.averaging.gossip_neighbours
        self.round = 0  # rounds taken (the largest round of any group we were in, plus one)
        self.rounds_refused = 0
        self.rounds_adopted = 0
        self.rounds_alone = 0  # rounds due while this replica knew no other replica
        self.bytes_sent_total = 0
        self._current: _Round | None = None
        self._carrier = carrier(self._shared_state)

    # ---- the StageOptimizer contract -----------------------------------------------------

    def catch_up_with(self, fetch: CatchUpFetch) -> None:
        pass  # nobody is "behind" in gossip: every round mixes toward the stage's mean

    def load_state_from_peers(self) -> bool:
        """Adopt one replica's parameters (a newcomer: state.py falls back to this when no
        quorum of donors agrees on a state, as happens between gossip rounds)."""
        found = self._carrier.newer_state(self.averaging.round_timeout_s)
        return found is not None and self._adopt(*found)

    @property
    def num_peers(self) -> int:
        return int(self.last_round.get("participants", 1) or 1)

    @property
    def round_in_progress(self) -> bool:
        return self._current is not None

    def is_synchronized(self) -> bool:
        return True  # no shared epoch to be behind of

    def averaging_status(self) -> dict[str, Any]:
        return {
            "mode": "gossip",
            **self._round_status(),
            "neighbours": self.averaging.gossip_neighbours,
            "last_round": self.round,
            "parameter_digest": self.last_round.get("parameter_digest"),
            "bytes_sent_total": self.bytes_sent_total,
            "rounds_refused": self.rounds_refused,
            "rounds_adopted": self.rounds_adopted,
            "rounds_alone": self.rounds_alone,
        }

    # ---- rounds ---------------------------------------------------------------------------

    def _shared_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """This replica's parameters for a newcomer that asks (hivemind's thread)."""
        with self._lock:
            params = self._params()
            tensors = [params[n].detach().to("cpu", torch.float32, copy=True)
                       for n in self._names]
            return {"round": self.round, "epoch": self._inner.local_epoch}, tensors

    @torch.no_grad()
    def _start_round(self) -> None:
        started = time.monotonic()
        if self._alone():
            self.rounds_alone += 1  # nobody to average with: nothing to wait for
            self._record(started, 1, 0, ok=False)
            return
        params = self._params()
        sent = [params[n].detach().to("cpu", torch.float32, copy=True) for n in self._names]
        pending = self._carrier.start_average(sent, {"round": self.round},
                                              self.averaging.round_timeout_s)
        self._current = _Round(pending, started, dict(zip(self._names, sent, strict=True)),
                               self._inner.local_epoch)
        self._poll_round()

    @torch.no_grad()
    def _poll_round(self) -> None:
        current = self._current
        if current is None or not current.pending.done():
            return
        self._current = None
        outcome = current.pending.result()
        if outcome is None:
            self._round_missed(current.started)
            return
        mean, members = outcome
        group = len(members)
        sent = int(2 * (group - 1) / group * 4 * self.numel)  # a butterfly's share, float32
        self.bytes_sent_total += sent
        problem = self._screen(mean, current.params)
        if problem:
            self.rounds_refused += 1
            log.warning("%s: refusing a gossip round's mean (%d members): %s",
                        self.run_id, group, problem)
            self._round_missed(current.started, participants=group, sent=sent)
            return
        rounds = [m.get("round") for m in members.values() if isinstance(m, dict)]
        newest = max((r for r in rounds if type(r) is int and 0 <= r <= MAX_ROUND),
                     default=self.round)
        params = self._params()
        with self._lock:
            for name, avg in zip(self._names, mean, strict=True):
                p = params[name]
                # the mean, plus the inner steps taken while the all-reduce ran: none is lost
                moved = p.detach().to("cpu", torch.float32) - current.params[name]
                p.copy_((avg + moved).to(p.device, p.dtype))
            self.round = max(self.round, newest) + 1
        self._missed_in_a_row = 0
        self._record(current.started, group, sent, ok=True)

    def _screen(self, mean: list[torch.Tensor], sent: dict[str, torch.Tensor]) -> str:
        """Why the group's mean is not to be taken, or "" (untrusted input: never raises)."""
        if len(mean) != len(self._names):
            return f"{len(mean)} tensors, expected {len(self._names)}"
        dist = own = 0.0
        for name, shape, avg in zip(self._names, self._shapes, mean, strict=True):
            if tuple(avg.shape) != shape or avg.dtype != torch.float32:
                return f"{name}: {tuple(avg.shape)}/{avg.dtype}, expected {shape}/float32"
            if not bool(torch.isfinite(avg).all()):
                return f"{name} holds NaN or infinity"
            dist += float((avg - sent[name]).pow(2).sum())
            own += float(sent[name].pow(2).sum())
        # a group mean moves us half-way (a pair) to the partner: a partner further from us
        # than twice our own norm is not training the same model
        if math.sqrt(dist) > max(math.sqrt(own), 1e-6):
            return (f"it is {math.sqrt(dist):.3g} away from our parameters, whose norm is "
                    f"{math.sqrt(own):.3g}")
        return ""

    def _round_missed(self, started: float, participants: int = 1, sent: int = 0) -> None:
        self._missed()  # retried after one more inner step (inner_rounds.py)
        self._record(started, participants, sent, ok=False)

    def _record(self, started: float, group: int, sent: int, *, ok: bool) -> None:
        self.last_round = {
            "round": self.round, "ok": ok, "participants": group, "bytes_sent": sent,
            "seconds": round(time.monotonic() - started, 3),
            "parameter_digest": self.parameter_digest(),
        }
        setter = getattr(self._carrier, "set_priority", None)
        if setter is not None:
            setter(float(self.round))

    def parameter_digest(self) -> str:
        """SHA-256 (16 hex) of the parameters in name order (equal on the members of a
        group right after their round when neither trained meanwhile)."""
        return tensors_digest(self._params().items())

    @torch.no_grad()
    def _adopt(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
        """Install another replica's parameters (checked: names, shapes, finiteness)."""
        round_, epoch = meta.get("round"), meta.get("epoch")
        if (isinstance(round_, bool) or not isinstance(round_, int)
                or not 0 <= round_ <= MAX_ROUND or len(tensors) != len(self._names)):
            log.warning("%s: refusing a gossip replica's state: round %r, %d tensors",
                        self.run_id, round_, len(tensors))
            return False
        params = self._params()
        expected = {n: params[n].detach().to("cpu", torch.float32) for n in self._names}
        offered = dict(zip(self._names, tensors, strict=True))
        try:
            check_fits(expected, offered)
            epoch = checked_epoch(epoch)
        except CheckpointError as exc:
            log.warning("%s: refusing a gossip replica's state: %s", self.run_id, exc)
            return False
        with self._lock:
            for name in self._names:
                params[name].copy_(offered[name].to(params[name].device, params[name].dtype))
            self.round = max(self.round, round_)
        self._inner.set_epoch(max(self._inner.local_epoch, epoch))
        self._since_round = 0
        self.rounds_adopted += 1
        return True

    # ---- state: this replica's own --------------------------------------------------------

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """This replica's parameters and AdamW state (replicas differ between rounds)."""
        with self._lock:
            epoch, tensors, meta = self._inner.export_state()
            return epoch, tensors, meta | {"gossip_round": self.round}

    def export_checkpoint(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        return self.export_state()

    def import_state(
        self, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> None:
        round_ = meta.get("gossip_round", 0)
        if isinstance(round_, bool) or not isinstance(round_, int) or not 0 <= round_ <= MAX_ROUND:
            raise CheckpointError(f"gossip_round must be an integer in [0, {MAX_ROUND}], "
                                  f"got {round_!r}")
        inner_meta = {k: v for k, v in meta.items() if k != "gossip_round"}
        with self._lock:
            self._inner.import_state(epoch, tensors, inner_meta)
            self.round = round_
        self._since_round = 0


def make_gossip_optimizer(
    module: nn.Module, spec: RunSpec, stage: int, host: Any, config: AveragingConfig,
    others: Callable[[], int] | None = None,
) -> GossipOptimizer:
    """A gossip optimizer whose rounds run over hivemind's averager on ``host``'s DHT."""
    if threading.current_thread() is not threading.main_thread():
        raise AveragingError("construct the gossip optimizer on the main thread (hivemind forks)")
    prefix = averaging_run_id(spec, stage) + "_gossip"
    group = 1 + spec.averaging.gossip_neighbours
    shapes = [tuple(p.shape) for p in module.parameters() if p.requires_grad]

    def carrier(state: Callable[[], tuple[Any, list[torch.Tensor]]]) -> GossipCarrier:
        return HivemindGossipCarrier(host, prefix, shapes, state, config, group,
                                     spec.averaging.round_timeout_s, others)

    return GossipOptimizer(module, spec, stage, config, carrier, others)
