"""A stage's DiLoCo optimizer: local inner steps, an outer Nesterov round every H of them.

The run spec's ``[averaging] mode = "diloco"`` (config/averaging_spec.py) makes every
server of a stage train on its own micro-batches with the run's AdamW
(:class:`~.optimizer.LocalOptimizer`: one inner step per ``target_batch_size`` samples of
this replica) and, every ``inner_steps`` inner steps, run an outer round with the stage's
other replicas (outer.py):

1. pseudo-gradient ``anchor - params``, compressed with error feedback
   (pseudo_gradient.py; the residual stays with this replica);
2. every replica's payload to every other: hivemind's ``DecentralizedAverager``'s
   matchmaking forms the round's group (full, and formed at once, when every replica of
   the stage this node knows of joined: averager_carrier.py) and its ``gather`` hands
   each member the others' data (round number, anchor digest, weight, and the payload's
   length and SHA-256); each member fetches the others' payloads over the node's QUIC
   endpoint and checks them against those digests (outer_payloads.py); each replica
   decodes every payload and takes the mean weighted by the samples each trained on since
   the last round, in peer-id order, so that every replica computes it from the same
   bytes in the same order;
3. the outer Nesterov step on the anchor, and the parameters set to it, plus the inner steps
   this replica took while the gather ran: the gather runs in the averager's process and the
   device thread trains on meanwhile (``_outer_round`` starts it, ``_poll_round`` finishes
   it from ``step`` or the server's periodic ``step_if_due``).

Streaming (``[averaging] fragments`` = F > 1, Streaming DiLoCo, arXiv:2501.18512): the
stage's parameters are split into F fragments of about equal size (outer.split_fragments,
the same split on every replica) and a round comes every H / F inner steps, carrying the
fragment ``round % F`` only: its pseudo-gradient since that fragment's last round, weighted
by the samples trained since then, and the outer step on that fragment's anchor and
momentum. Each fragment is still averaged every H inner steps, a round sends 1 / F of the
stage (so stages F times larger fit a round's payload), and the rounds overlap inner steps
as above (the paper mixes the outer result with the local parameters by a factor; here the
inner steps taken during the round are added on top of the new anchor, as without
fragments). The round number counts every fragment's round: a state of round r is at inner
epoch r H / F.

Why the all-gather and not hivemind's all-reduce of ``averaged_tensors``: its butterfly hands
a peer back ``x + (mean - x)`` for its own ``x``, which differs from the mean in the last
bits from peer to peer, so replicas would drift apart by rounding; and its wire compressions
are a fixed protobuf enum (no 4-bit, no sign, no top-k). Gathered payloads are exact and
travel as compressed as the codec makes them. Why not in the gather itself: gathered data
rides in matchmaking messages, bounded by libp2p's 4 MiB message size and relayed through
the group's leader, which caps a replica's payload at ``MAX_PAYLOAD_BYTES``; that carrier
(``HivemindCarrier`` alone) is what runs without a QUIC endpoint (tests of the rounds);
a daemon's payloads go over QUIC, bounded by the transport's ``max_message_bytes``. A
group holds at most ``MAX_GROUP`` replicas when the payloads ride in the gather (the
leader relays every payload to every member), ``MAX_GROUP_QUIC`` when they travel over QUIC
(the gather carries descriptors; each member's uplink sends its payload to every other,
``group - 1`` times). A stage with more replicas than that splits into groups that average
apart (docs/averaging.md).

Missed rounds. A round waits at most ``round_timeout_s``. A replica that got no group (slow,
joining, or alone) keeps its parameters, restores its residual (nothing was sent), catches
up if the stage is ahead of it, else tries again after one more inner step
(inner_rounds.py); the others do not wait for it. A replica that knows no other replica of
its stage takes its rounds alone, without matchmaking. Where more than half of a round's
group holds one outer state (round and anchor) other than ours, the stage's replicas split
and we are the smaller part: we take that majority's state from its members (even an
earlier round's) instead of stepping. Where more than half of the others report later
rounds but no state is held by most, we catch up from the whole stage. Members at another
state that are fewer are left out of the mean (``members_ahead_left_out``,
``members_at_another_anchor``): a round number and an anchor digest are their member's
word, and a minority of liars must neither make the group skip rounds nor hand it their
state. Catching up installs the outer state a quorum of the donors asked holds, through
the stage server's state transfer (state.py's ``resync``; nothing is downloaded unless the
quorum's round is one we want: ``is_behind``), never the state of the one averager that
claims the highest round (hivemind's ``load_state_from_peers``: without a stage server,
in tests and tools, at most one round ahead; a newcomer that found no donor still falls
back to it, as state.py says). A newly joined replica starts from the latest outer state
through state transfer: :meth:`export_state` is the shared outer state (anchor as the
stage's parameters, outer momentum, epoch ``round * H``), identical on every replica that
took the same rounds, so that the donors' quorum by digest (state.py) agrees on it.
:meth:`export_checkpoint` adds what is this replica's own (its current parameters, inner
AdamW state, residuals) for its checkpoints; :meth:`import_state` takes either.

Threads: construct on the main thread (the averager forks a process and hivemind touches
SIGINT); ``step`` and the rest on the device thread; the averager's state requests arrive on
hivemind's thread and read the outer state under a lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
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
from .outer import (
    ANCHOR_PREFIX,
    MOMENTUM_PREFIX,
    RESIDUAL_PREFIX,
    OuterState,
    fragment_view,
    load_anchor,
    nesterov_step,
    pseudo_gradient,
    split_fragments,
    weighted_mean,
)
from .outer_payloads import PayloadLink, QuicOuterCarrier
from .pseudo_gradient import ErrorFeedback, PseudoGradientCodec, PseudoGradientError
from .state_tensors import MODEL_PREFIX, check_fits, checked_epoch, snapshot, tensors_digest

log = get_logger(__name__)

# without a stage server (tests, tools), a replica that missed rounds adopts one averager's
# outer state only this many rounds ahead of its own: a forged round number is bounded
MAX_ROUNDS_BEHIND = 1
# gathered payloads ride in hivemind's matchmaking messages (libp2p: 4 MiB a message)
MAX_PAYLOAD_BYTES = 768 * 1024
MAX_GROUP = 4
# with the payloads over QUIC: a round costs each member ``group - 1`` payloads up and down
# and holds as many in memory (docs/averaging.md: why 8)
MAX_GROUP_QUIC = 8
GROUP_PAYLOADS_BUDGET = 1 << 30  # bytes of other members' payloads a round may hold at once
MAX_WEIGHT = 1e12


class AveragerHost(Protocol):
    """Where the outer averager's hivemind DHT comes from (membership.dht.Dht)."""

    def hivemind_averager(self, factory: Callable[..., Any], **options: Any) -> Any:
        """``factory(dht=<the node's hivemind DHT>, **options)``."""


class PendingGather(Protocol):
    """A gather under way: :meth:`done` without blocking, then :meth:`result` once."""

    def done(self) -> bool: ...

    def result(self) -> dict[str, Any] | None:
        """What :meth:`OuterCarrier.gather` returns; called only once ``done()``."""


class _Finished:
    """A gather that already ended (a carrier that gathers synchronously)."""

    def __init__(self, gathered: dict[str, Any] | None) -> None:
        self._gathered = gathered

    def done(self) -> bool:
        return True

    def result(self) -> dict[str, Any] | None:
        return self._gathered


class OuterCarrier(Protocol):
    """What an outer round needs from its transport (hivemind's averager, or a test's).

    A carrier may also offer ``start_gather(data, timeout) -> PendingGather``, the same
    gather in the background; without it :meth:`gather` runs on the device thread."""

    def gather(self, data: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Every group member's ``data`` by peer id (ours included), or None when no group
        formed within ``timeout``. What the others sent is untrusted."""

    def newer_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """The outer state another replica shares (metadata, tensors), or None."""

    def shutdown(self) -> None:
        """Leave; the carrier is unusable afterwards."""


class HivemindCarrier(AveragerCarrier):
    """Outer rounds over hivemind's DecentralizedAverager (module docstring)."""

    name = "gather"  # the payloads travel in the gather (outer_payloads.py: over QUIC)

    def __init__(
        self, host: AveragerHost, prefix: str,
        state: Callable[[], tuple[Any, list[torch.Tensor]]], config: AveragingConfig,
        round_timeout: float, group_size: int = MAX_GROUP,
        others: Callable[[], int] | None = None,
    ) -> None:
        """``group_size``: ``MAX_GROUP`` when the payloads ride in the gather, up to
        ``MAX_GROUP_QUIC`` when it carries only their descriptors; ``others``: the stage's
        other replicas known (a round's group is full when all joined)."""
        super().__init__(
            host, prefix, [torch.zeros(1)],  # the payloads travel in the gather
            state, config, group_size=group_size, round_timeout=round_timeout, what="outer",
            others=others,
        )

    def gather(self, data: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        def step() -> Any:
            self.size_next_round()
            return self._averager.step(gather=data, weight=1.0, timeout=timeout)

        return _by_peer(step)

    def start_gather(self, data: dict[str, Any], timeout: float) -> PendingGather:
        """The gather in hivemind's averager process; the device thread goes on training."""
        try:
            self.size_next_round()
            control = self._averager.step(gather=data, weight=1.0, timeout=timeout, wait=False)
        except Exception as exc:  # as in gather
            log.info("outer round failed: %r", exc)
            return _Finished(None)
        return _HivemindPending(control)


class _HivemindPending:
    """hivemind's StepControl of a gather started with ``wait=False``."""

    def __init__(self, control: Any) -> None:
        self._control = control

    def done(self) -> bool:
        return bool(self._control.done())

    def result(self) -> dict[str, Any] | None:
        return _by_peer(lambda: self._control.result(timeout=0))


def _by_peer(outcome: Callable[[], Any]) -> dict[str, Any] | None:
    """A gather's outcome as the members' data by peer id; None when it failed."""
    try:
        gathered = outcome()
    except Exception as exc:  # hivemind raises its own errors, and asyncio's, from a round
        log.info("outer round failed: %r", exc)
        return None
    if not isinstance(gathered, dict) or not gathered:
        return None
    return {str(peer): value for peer, value in gathered.items()}


@dataclass
class _Round:
    """An outer round whose gather is under way: what it started from."""

    pending: PendingGather
    started: float
    round: int  # the outer round it belongs to
    fragment: int  # the fragment it averages (0 without streaming)
    digest: str
    payload_len: int
    samples: float  # the weight it sent: samples since the fragment's last completed round
    saved: dict[str, torch.Tensor]  # residuals before its encode, restored if it fails
    params: dict[str, torch.Tensor]  # the fragment's parameters its pseudo-gradient came from
    epoch: int  # the inner epoch then


def anchor_digest(state: OuterState) -> str:
    """SHA-256 (16 hex) of the anchor, in name order: equal on replicas after the same rounds."""
    return tensors_digest(sorted(state.anchor.items()))


class DilocoOptimizer(InnerStepsOptimizer):
    """The :class:`~.optimizer.StageOptimizer` of ``[averaging] mode = "diloco"``."""

    def __init__(
        self,
        module: nn.Module,
        spec: RunSpec,
        stage: int,
        config: AveragingConfig,
        carrier: Callable[[Callable[[], tuple[Any, list[torch.Tensor]]], int], OuterCarrier],
        others: Callable[[], int] | None = None,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        """``carrier(state, payload_nbytes)`` builds the transport of the rounds; ``state``
        gives the outer state it shares, ``payload_nbytes`` is the largest round's payload.
        :func:`make_diloco_optimizer` passes hivemind's, or the QUIC carrier. ``others``
        counts the stage's other replicas the node knows of: with none, a round is taken
        alone, without matchmaking (which would hold the device thread for the round's
        timeout and find nobody). ``max_payload_bytes``: the largest payload a
        round of that carrier carries (a stage whose payload is larger is refused)."""
        super().__init__(module, spec, others)
        self.run_id = averaging_run_id(spec, stage) + "_outer"
        self.outer = OuterState.start(self._params())
        self.codec = PseudoGradientCodec(
            self.averaging.compression, self.averaging.block_size, self.averaging.topk_density
        )
        self.feedback = ErrorFeedback(self.codec)
        sizes = {n: self.outer.anchor[n].numel() for n in self._names}
        n_fragments = self.averaging.fragments
        if n_fragments > len(sizes):
            raise AveragingError(
                f"stage {stage} has {len(sizes)} parameter tensors, fewer than "
                f"averaging.fragments ({n_fragments}): lower averaging.fragments"
            )
        self._fragments = split_fragments(sizes, n_fragments)
        self._every = self.averaging.inner_steps // n_fragments
        # samples trained on since each fragment's last completed round
        self._samples = [0.0] * len(self._fragments)
        self._group = 1
        self.rounds_adopted = 0
        self.members_at_another_anchor = 0  # group members seen at our round, other anchor
        self.members_ahead_left_out = 0  # members at a later round, fewer than half a group
        self._fetch: CatchUpFetch | None = None  # the stage server's catch-up
        self._least: int | None = None  # a catch-up from a majority: its round or later
        self.payload_bytes_sent = 0
        self._shapes = {n: tuple(self.outer.anchor[n].shape) for n in self._names}
        self._fragment_nbytes = [
            sum(self.codec.payload_nbytes(sizes[n]) for n in names) for names in self._fragments
        ]
        self.payload_nbytes = max(self._fragment_nbytes)  # the largest round's payload
        if self.payload_nbytes > max_payload_bytes:
            raise AveragingError(
                f"stage {stage}'s {self.averaging.compression} pseudo-gradient is "
                f"{self.payload_nbytes} bytes a round, over the {max_payload_bytes} an outer "
                "round carries: set averaging.compression to a smaller codec (int8, int4, "
                "sign, topk) or raise averaging.fragments (each round carries one fragment)"
            )
        self._carrier = carrier(self._shared_state, self.payload_nbytes)
        self._round: _Round | None = None  # the round whose gather is under way

    # ---- the StageOptimizer contract -----------------------------------------------------

    def _accumulated(self, batch_size: int) -> None:
        for f in range(len(self._samples)):
            self._samples[f] += batch_size

    @property
    def round_every(self) -> int:
        return self._every

    def _start_round(self) -> None:
        self._outer_round()

    def catch_up_with(self, fetch: CatchUpFetch) -> None:
        # a replica behind installs the outer state a quorum of the stage's replicas holds
        # (state.py's resync over our transport) at its next round, never one averager's
        self._fetch = fetch

    def is_behind(self, epoch: int, meta: dict[str, Any]) -> bool:
        round_ = meta.get("outer_round")
        if type(round_) is not int:
            return False
        least = self._least
        return round_ > self.outer.round if least is None else round_ >= least

    def load_state_from_peers(self) -> bool:
        """A newcomer's fallback (state.py: no donor known, or none delivered): one of the
        stage's averagers' outer state, any round ahead."""
        found = self._carrier.newer_state(self.spec.averaging.round_timeout_s)
        return found is not None and self._adopt(*found, any_round=True)

    def _catch_up(self, only: Collection[str] | None = None, least: int | None = None) -> bool:
        """After a missed round, or one in which we stood behind (:meth:`_standing`):
        install the stage's newer outer state if there is one. A stage server's catch-up
        (``fetch``) takes the state a quorum of the stage's replicas (or of ``only`` those,
        by transport id: a majority of our group) holds, of a later round than ours, or of
        round ``least`` or later when given (a majority's state may be an earlier round's:
        our smaller part of a split went on without it); without a server (tests, tools),
        one averager's, at most ``MAX_ROUNDS_BEHIND`` rounds ahead."""
        if self._fetch is not None:
            self._least = least  # is_behind, asked while fetch runs on this thread's behalf
            try:
                adopted = bool(self._fetch(only))
            finally:
                self._least = None
            self.rounds_adopted += adopted
            return adopted
        found = self._carrier.newer_state(self.spec.averaging.round_timeout_s)
        return found is not None and self._adopt(*found, any_round=False)

    @property
    def num_peers(self) -> int:
        return self._group

    @property
    def round_in_progress(self) -> bool:
        """An outer round's gather is under way (finished by ``step`` or ``step_if_due``)."""
        return self._round is not None

    def is_synchronized(self) -> bool:
        """False after a round this replica missed without catching up (until the next)."""
        last = self.last_round
        return bool(last.get("ok", True) or last.get("adopted_newer_state", False))

    def averaging_status(self) -> dict[str, Any]:
        """What ``wanswarm status`` shows of this stage's averaging (flat fields)."""
        return {
            "mode": "diloco",
            **self._round_status(),
            "compression": self.averaging.compression,
            "fragments": len(self._fragments),
            "next_fragment": self.outer.round % len(self._fragments),
            "last_round": self.outer.round,
            "anchor_digest": self.last_round.get("anchor_digest"),
            "payload_bytes": self.payload_nbytes,
            "carrier": getattr(self._carrier, "name", "gather"),
            **{f"payloads_{k}": v for k, v in sorted(getattr(self._carrier, "counts", {}).items())},
            "bytes_sent_total": self.payload_bytes_sent,
            "rounds_adopted": self.rounds_adopted,
            "members_at_another_anchor": self.members_at_another_anchor,
            "members_ahead_left_out": self.members_ahead_left_out,
        }

    # ---- rounds ---------------------------------------------------------------------------

    def _shared_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The outer state the averager hands to a replica that asks (hivemind's thread)."""
        with self._lock:
            tensors = [self.outer.anchor[n].clone() for n in self._names]
            tensors += [self.outer.momentum[n].clone() for n in self._names]
            return {"round": self.outer.round, "names": len(self._names)}, tensors

    @torch.no_grad()
    def _outer_round(self) -> None:
        """Start a round: the pseudo-gradient's payload goes to the carrier, which gathers
        the group's in the background when it can; the device thread goes on training, and
        :meth:`_poll_round` finishes the round once the gather ended. A replica whose
        device thread waited for matchmaking would stall the trainers routed through it,
        and with them its partners' inner steps: two replicas then take turns in rounds
        that never meet."""
        started = time.monotonic()
        fragment = self.outer.round % len(self._fragments)
        names = self._fragments[fragment]
        every = self._params()
        params = {n: every[n] for n in names}
        saved = {n: r.clone() for n, r in self.feedback.residuals.items()}
        try:
            delta = pseudo_gradient({n: self.outer.anchor[n] for n in names}, params)
            payload = b"".join(self.feedback.encode(n, delta[n])[0] for n in names)
        except PseudoGradientError as exc:
            self.feedback.residuals = saved
            log.warning("%s: no outer round: %s", self.run_id, exc)
            return
        digest = anchor_digest(self.outer)
        weight = max(self._samples[fragment], 1e-3)
        data = {"round": self.outer.round, "anchor": digest, "weight": weight,
                "payload": payload}
        if self._alone():
            pending: PendingGather = _Finished({"": data})
        else:
            start = getattr(self._carrier, "start_gather", None)
            if start is not None:
                pending = start(data, self.averaging.round_timeout_s)
            else:
                pending = _Finished(self._carrier.gather(data, self.averaging.round_timeout_s))
        self._round = _Round(
            pending, started, self.outer.round, fragment, digest, len(payload),
            self._samples[fragment], saved,
            {n: p.detach().clone() for n, p in params.items()}, self._inner.local_epoch,
        )
        self._poll_round()

    @torch.no_grad()
    def _poll_round(self) -> None:
        """Finish the round under way if its gather ended (device thread)."""
        current = self._round
        if current is None or not current.pending.done():
            return
        self._round = None
        gathered = current.pending.result()
        if current.round != self.outer.round:  # a newer outer state was adopted meanwhile
            self._record(current.started, 1, 0, ok=False, adopted=True)
            return
        if gathered is None:
            self.feedback.residuals = current.saved  # nothing was sent: the debt stays
            self._missed()  # retried after one more inner step (inner_rounds.py)
            adopted = self._catch_up()
            self._record(current.started, 1, 0, ok=False, adopted=adopted)
            return
        group = len(gathered)
        self._group = group
        sent = current.payload_len * (group - 1)  # what an all-gather sends of ours
        self.payload_bytes_sent += sent
        ahead, most, majority = self._standing(gathered, current.digest)
        if majority is not None or most:
            # a strict majority of the group holds another outer state (round and anchor):
            # the stage's replicas split and we are in the smaller part; take the
            # majority's state from its members (even an earlier round's), not a step. Or
            # most of the others took rounds without us (no state held by most): take
            # the state a quorum of the stage's replicas holds. Fewer members ahead are
            # left out below (a round number is its member's word: a minority of liars
            # must not make the group skip its rounds, nor hand it their state)
            self.feedback.residuals = current.saved
            only, least = majority if majority is not None else (None, None)
            adopted = self._catch_up(only, least)
            self._record(current.started, group, sent, ok=False, adopted=adopted)
            return
        self.members_ahead_left_out += ahead
        names = self._fragments[current.fragment]
        contributions = []
        for peer in sorted(gathered):
            decoded = self._contribution(peer, gathered[peer], current.digest, names,
                                         self._fragment_nbytes[current.fragment])
            if decoded is not None:
                contributions.append(decoded)
        if not contributions:  # not even ours: cannot happen unless the carrier lost it
            self.feedback.residuals = current.saved
            self._record(current.started, group, sent, ok=False, adopted=False)
            return
        mean = weighted_mean(contributions)
        every = self._params()
        params = {n: every[n] for n in names}
        view = fragment_view(self.outer, names)  # the whole state without fragments
        with self._lock:
            nesterov_step(view, mean, self.averaging.outer_lr, self.averaging.outer_momentum)
            self.outer.round += 1
            if self._inner.local_epoch == current.epoch:  # no inner step while it ran
                load_anchor(params, view)
            else:
                # the new anchor plus the inner steps this replica took while the gather
                # ran: they enter the next pseudo-gradient, so no sample's update is lost
                for name, p in params.items():
                    moved = p - current.params[name]
                    p.copy_(self.outer.anchor[name]).add_(moved)
        f = current.fragment
        self._samples[f] = max(self._samples[f] - current.samples, 0.0)
        self._group = len(contributions)
        self._record(current.started, len(contributions), sent, ok=True, adopted=False)

    def _standing(self, gathered: dict[str, Any], digest: str
                  ) -> tuple[int, bool, tuple[set[str] | None, int] | None]:
        """Where we stand in the group, from the gathered data alone (every member at our
        outer state decides alike): how many members are at a later round; whether they
        are more than half of the others; and, when more than half of the whole group holds
        one outer state (round and anchor digest) other than ours (``digest``), its
        members' transport ids (None where the descriptors carry none: payloads in the
        gather) and its round."""
        members = [g for g in gathered.values() if isinstance(g, dict)]
        states = [(g["round"], g["anchor"]) for g in members
                  if type(g.get("round")) is int and isinstance(g.get("anchor"), str)]
        ahead = sum(1 for r, _ in states if r > self.outer.round)
        majority = None
        held = Counter(states).most_common(1)
        if held and 2 * held[0][1] > len(gathered) and held[0][0] != (self.outer.round, digest):
            key = held[0][0]
            ids = {g["transport_id"] for g in members
                   if (g.get("round"), g.get("anchor")) == key
                   and isinstance(g.get("transport_id"), str)}
            majority = (ids or None, key[0])
        return ahead, 2 * ahead > len(gathered) - 1, majority

    def _contribution(
        self, peer: str, data: Any, digest: str, names: list[str], nbytes: int
    ) -> tuple[dict[str, torch.Tensor], float] | None:
        """A group member's decoded pseudo-gradient and weight, or None (logged) when it is
        not one of this round's: another anchor, an absurd weight, a payload that does not
        decode. Untrusted input: never raises."""
        if not isinstance(data, dict):
            return None
        weight = data.get("weight")
        payload = data.get("payload")
        if data.get("round") != self.outer.round or data.get("anchor") != digest:
            if data.get("round") == self.outer.round:
                # replicas that took one round in different groups (docs/averaging.md: more
                # replicas than a group holds), or a liar: either way the operator should see it
                self.members_at_another_anchor += 1
                log.warning("%s: %s is at our round %d with another anchor; left out (the "
                            "stage's replicas may have split into groups that average apart)",
                            self.run_id, peer[:12], self.outer.round)
            else:
                log.info("%s: %s is not at our round; left out", self.run_id, peer[:12])
            return None
        if (isinstance(weight, bool) or not isinstance(weight, (int, float))
                or not 0 < weight <= MAX_WEIGHT or not isinstance(payload, bytes)
                or len(payload) != nbytes):
            log.warning("%s: %s sent a malformed contribution; left out", self.run_id, peer[:12])
            return None
        out, offset = {}, 0
        try:
            for name in names:
                shape = self._shapes[name]
                size = self.codec.payload_nbytes(math.prod(shape))
                out[name] = self.codec.decode(payload[offset : offset + size], shape)
                offset += size
        except PseudoGradientError as exc:
            log.warning("%s: %s sent an undecodable payload (%s); left out",
                        self.run_id, peer[:12], exc)
            return None
        return out, float(weight)

    def _record(self, started: float, group: int, sent: int, *, ok: bool, adopted: bool) -> None:
        if ok or adopted:
            self._missed_in_a_row = 0
        self.last_round = {
            "round": self.outer.round, "ok": ok, "participants": group,
            "bytes_sent": sent, "adopted_newer_state": adopted,
            "seconds": round(time.monotonic() - started, 3),
            # the outer state after the round: equal on every replica that took the same
            # rounds (what a swarm test compares)
            "anchor_digest": anchor_digest(self.outer),
        }
        setter = getattr(self._carrier, "set_priority", None)
        if setter is not None:
            setter(float(self.outer.round))

    @torch.no_grad()
    def _adopt(self, meta: dict[str, Any], tensors: list[torch.Tensor], *, any_round: bool) -> bool:
        """Install another replica's outer state if it is newer (and plausible)."""
        n = len(self._names)
        round_ = meta.get("round")
        if (
            isinstance(round_, bool) or not isinstance(round_, int)
            or round_ <= self.outer.round
            or (not any_round and round_ > self.outer.round + MAX_ROUNDS_BEHIND)
            or len(tensors) != 2 * n
        ):
            return False
        expected = {n: self.outer.anchor[n] for n in self._names}
        try:
            anchor = dict(zip(self._names, tensors[:n], strict=True))
            momentum = dict(zip(self._names, tensors[n:], strict=True))
            check_fits(expected, anchor)
            check_fits(expected, momentum)
            epoch = checked_epoch(round_ * self._every)
        except CheckpointError as exc:
            log.warning("%s: refusing an outer state from peers: %s", self.run_id, exc)
            return False
        self._install_outer(round_, anchor, momentum)
        self._inner.set_epoch(max(self._inner.local_epoch, epoch))
        self.rounds_adopted += 1
        return True

    def _install_outer(self, round_: int, anchor: dict[str, torch.Tensor],
                       momentum: dict[str, torch.Tensor]) -> None:
        with self._lock:
            for name in self._names:
                self.outer.anchor[name].copy_(anchor[name])
                self.outer.momentum[name].copy_(momentum[name])
            self.outer.round = round_
            load_anchor(self._params(), self.outer)
        self.feedback.reset()  # residuals toward an anchor that is gone
        self._since_round = 0
        self._samples = [0.0] * len(self._fragments)

    # ---- state: shared (transfer) and own (checkpoints) --------------------------------------

    def _shared_live(self) -> dict[str, torch.Tensor]:
        out = {MODEL_PREFIX + n: self.outer.anchor[n] for n in self._names}
        return out | {MOMENTUM_PREFIX + n: self.outer.momentum[n] for n in self._names}

    def _own_live(self) -> dict[str, torch.Tensor]:
        _, inner, _ = self._inner.export_state()  # model.* (current) and opt.state.*
        out = inner | {ANCHOR_PREFIX + n: self.outer.anchor[n] for n in self._names}
        out |= {MOMENTUM_PREFIX + n: self.outer.momentum[n] for n in self._names}
        if self.codec.kind != "none":
            out |= {
                RESIDUAL_PREFIX + n: self.feedback.residuals.get(
                    n, torch.zeros_like(self.outer.anchor[n])
                )
                for n in self._names
            }
        return out

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """The shared outer state: what every replica after the same rounds holds bit for bit."""
        with self._lock:
            tensors = snapshot(self._shared_live())
            round_ = self.outer.round
        return round_ * self._every, tensors, {"outer_round": round_}

    def export_checkpoint(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        """This replica's whole state: current parameters, inner AdamW, outer state, residuals."""
        _, _, inner_meta = self._inner.export_state()
        with self._lock:
            tensors = snapshot(self._own_live())
            round_ = self.outer.round
        meta = inner_meta | {"outer_round": round_, "since_round": self._since_round}
        return self.local_epoch, tensors, meta

    @torch.no_grad()
    def import_state(
        self, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> None:
        epoch = checked_epoch(epoch)
        round_ = meta.get("outer_round")
        if isinstance(round_, bool) or not isinstance(round_, int) or not 0 <= round_ <= epoch:
            raise CheckpointError(f"outer_round must be an integer in [0, {epoch}], got {round_!r}")
        if not any(name.startswith(ANCHOR_PREFIX) for name in tensors):
            # the shared outer state (state transfer): the anchor is the stage's parameters
            check_fits(self._shared_live(), tensors)
            anchor = {n: tensors[MODEL_PREFIX + n] for n in self._names}
            momentum = {n: tensors[MOMENTUM_PREFIX + n] for n in self._names}
            self._install_outer(round_, anchor, momentum)
            # a catch-up keeps the inner steps it counted (as _adopt does)
            self._inner.set_epoch(max(self._inner.local_epoch, epoch))
            return
        live = self._own_live()
        check_fits(live, tensors)
        since = meta.get("since_round", 0)
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise CheckpointError(f"since_round must be a non-negative integer, got {since!r}")
        inner = {k: v for k, v in tensors.items() if k.startswith(("model.", "opt.state."))}
        self._inner.import_state(epoch, inner, meta)
        with self._lock:
            for name in self._names:
                self.outer.anchor[name].copy_(tensors[ANCHOR_PREFIX + name])
                self.outer.momentum[name].copy_(tensors[MOMENTUM_PREFIX + name])
            self.outer.round = round_
        if self.codec.kind != "none":
            self.feedback.residuals = {
                n: tensors[RESIDUAL_PREFIX + n].clone() for n in self._names
            }
        self._since_round = min(since, self._every)
        self._samples = [0.0] * len(self._fragments)


def quic_group_size(payload_nbytes: int) -> int:
    """The largest group of an outer round over QUIC for payloads of ``payload_nbytes``:
    ``MAX_GROUP_QUIC``, less where the other members' payloads would hold more than
    ``GROUP_PAYLOADS_BUDGET`` at once, never less than ``MAX_GROUP`` (the gather's). Every
    replica of a stage computes the same from the run spec."""
    fits = 1 + GROUP_PAYLOADS_BUDGET // max(1, payload_nbytes)
    return max(MAX_GROUP, min(MAX_GROUP_QUIC, fits))


def make_diloco_optimizer(
    module: nn.Module, spec: RunSpec, stage: int, host: AveragerHost, config: AveragingConfig,
    others: Callable[[], int] | None = None, payloads: PayloadLink | None = None,
) -> DilocoOptimizer:
    """A DiLoCo optimizer whose rounds run over hivemind's averager on ``host``'s DHT;
    ``others`` counts the stage's other replicas (rounds alone skip matchmaking). With
    ``payloads`` (the node's QUIC endpoint; a daemon always passes it) the gather carries
    descriptors and the payloads travel over QUIC (outer_payloads.py), else in the gather
    (``MAX_PAYLOAD_BYTES`` a replica)."""
    if threading.current_thread() is not threading.main_thread():
        raise AveragingError("construct the DiLoCo optimizer on the main thread (hivemind forks)")
    prefix = averaging_run_id(spec, stage) + "_outer"
    timeout = spec.averaging.round_timeout_s

    def carrier(state: Callable[[], tuple[Any, list[torch.Tensor]]], nbytes: int) -> OuterCarrier:
        if payloads is None:
            return HivemindCarrier(host, prefix, state, config, timeout, others=others)
        gather = HivemindCarrier(host, prefix, state, config, timeout, quic_group_size(nbytes),
                                 others=others)
        return QuicOuterCarrier(gather, payloads, stage, prefix, config, round_timeout=timeout)

    cap = MAX_PAYLOAD_BYTES if payloads is None else payloads.max_payload_bytes
    return DilocoOptimizer(module, spec, stage, config, carrier, others, max_payload_bytes=cap)


def make_stage_optimizer(
    module: nn.Module, spec: RunSpec, stage: int, dht: Any, config: AveragingConfig,
    others: Callable[[], int] | None = None,
    departed: Callable[[], Collection[bytes]] | None = None,
    payloads: PayloadLink | None = None,
) -> Any:
    """The stage optimizer the run spec's ``[averaging] mode`` asks for, on the node's DHT:
    hivemind's collaborative Optimizer (``allreduce``), :class:`DilocoOptimizer` or
    gossip_optimizer's ``GossipOptimizer``. ``others`` counts the stage's other servers
    (``allreduce``: its start-up hold for a partner); ``departed`` names the replicas that
    stopped serving it (``allreduce`` only); ``payloads`` carries DiLoCo's outer payloads
    over QUIC (``diloco`` only)."""
    mode = spec.averaging.mode
    if mode == "allreduce":
        from .averaging import CollaborativeOptimizer

        return CollaborativeOptimizer(module, spec, stage, dht, config, departed, others)
    if mode == "diloco":
        return make_diloco_optimizer(module, spec, stage, dht, config, others, payloads)
    if mode == "gossip":
        from .gossip_optimizer import make_gossip_optimizer

        return make_gossip_optimizer(module, spec, stage, dht, config, others)
    raise AveragingError(f"averaging.mode = {mode!r} is not one the daemon serves")
