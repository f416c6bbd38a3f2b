"""The pipeline walk: one micro-batch through every stage of the swarm and back.

One training micro-batch::

    forward       stage 0 (token ids) -> ... -> stage S-2        keep every stage's input
    forward_loss  stage S-1 (activations + targets)              loss and dL/dx in one trip
    backward      stage S-2 -> ... -> stage 0                    dL/dx back, stage by stage

Each hop goes to a server of its stage through the hop sender (hops.py), which re-routes a
failed one. Because the walk keeps each stage's input (as the payload it sent), any hop
can be retried on another server of the same stage. A backward goes by reference to the
server that ran the forward while it still caches the input (``cache_miss`` makes us
resend it), and carries the input to any other server. Hop ids (run, trainer, micro-batch,
stage, attempt) let servers drop duplicates, so a retried hop never accumulates twice on
one server. An evaluation micro-batch goes ``forward`` without caching, then
``eval_loss``: no gradients anywhere.

Payloads use the run's codecs. A stage's output (activations forward, ``dL/dx`` backward)
reaches the trainer already encoded with the run's codec by the server that computed it,
and goes on to the next stage as it came (the endpoint's ``ReceivedTensor``): never
decoded and re-encoded here, so quantized once. On receipt the walk checks what the
headers say (shape, dtype, codec, payload length and codec header) and the values: every
stage output is decoded into a scratch copy (dropped at once: the payload goes on as it
came) and refused unless finite and within the run's ``[limits]``, activations within
``max_activation``, gradients within ``max_gradient``, a loss within ``max_loss``. An
absurd reply (``BadValues``) is that server's fault: hops.py bans it and the hop is redone
on another server of the stage, so a lying server's huge ``dL/dx`` never reaches an
honest one (docs/hostile.md). The next stage's endpoint and contract check the values
again before computing on them (hops.py says whom a refusal blames). Only a reply in
another codec than the run's is kept decoded and re-encoded: activations with the forward
codec, gradients with the backward codec through error feedback keyed by ``(stage,
"grad_output")``. Codec work on large tensors runs in a worker thread
(``transport.tensors.THREAD_BYTES``), never on the event loop.

In a subspace run (run spec ``[subspace]``, docs/compression.md) the stages' outputs are the
boundary's ``k_b`` coefficients per token (their shapes are checked at that width), and
every input after stage 0 goes with the micro-batch's token ids (uint8 for byte-level runs):
``[x, ids]``. ``wire_bytes_per_token`` reports what crossed each boundary per token, the
figure the compression benchmark predicts.

Spot checks (spot_checks.py): a random fraction of ``forward`` hops is re-run on a second
replica of the stage (``keep_input=False``: nothing cached or accumulated there), of
``forward_loss`` hops as a ``forward_loss`` with ``check`` (the loss compared, then its
dL/dx), and of ``backward`` hops that return dL/dx (stages 1 .. S-2) as a ``backward``
with ``check`` (the input carried); nothing is accumulated on the checking replica. A
server convicted of lying is never used again and its hop is redone on another server
before the walk goes on; a disagreement nobody can settle drops the micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import BaseModel

from ...transport.codecs import CodecSpec, EncodedTensor, decode, encode, parse_codec
from ...transport.endpoint import Response
from ...transport.error_feedback import ErrorFeedback
from ...transport.errors import ProtocolError
from ...transport.tensors import ReceivedTensor, Sendable, off_loop, sendable_nbytes
from ..config.runspec import RunSpec
from ..protocol import (
    BackwardReply,
    BackwardRequest,
    BadReply,
    BadValues,
    EvalLossRequest,
    EvalReply,
    ForwardLossRequest,
    ForwardReply,
    ForwardRequest,
    HopId,
    Kind,
    LossReply,
    boundary_widths,
    check_relayed,
    describe_excess,
    parse_reply,
    within,
)
from .hops import HopFailed, HopSender
from .spot_checks import Answer, SpotChecker, Stamp, Verdict, payload_digest
from .subspace import token_id_dtype
from .trainer_config import TrainerConfig


class Pipeline:
    """Walks micro-batches of trainer ``trainer_id`` through the stages (see the module
    docstring). ``ef`` holds the error feedback of gradients re-encoded here."""

    def __init__(
        self,
        spec: RunSpec,
        config: TrainerConfig,
        *,
        trainer_id: str,
        hops: HopSender,
        ef: ErrorFeedback,
        spot: SpotChecker | None = None,
    ) -> None:
        self.spec, self.config = spec, config
        self.trainer_id = trainer_id
        self.hops = hops
        self.forward_codec = parse_codec(spec.codecs.forward_activations)
        self.backward_codec = parse_codec(spec.codecs.backward_gradients)
        self.limits = spec.limits
        self._ef = ef
        self.spot = spot
        # activations per token at each boundary (d_model, or a subspace run's k_b); a
        # subspace run sends the token ids along with every input after stage 0
        self.widths = boundary_widths(spec)
        self.ids_dtype = token_id_dtype(spec.model.vocab_size) if spec.subspace.enabled else None
        # what crossed each boundary in training micro-batches: forward (the activations or
        # coefficients as relayed, plus the token ids) and backward (the gradients as relayed)
        self.boundary_bytes = [[0, 0] for _ in self.widths]
        self.boundary_tokens = 0

    def wire_bytes_per_token(self) -> list[dict[str, float]]:
        """Per boundary, payload bytes per token forward and backward (training hops as the
        trainer relayed them; retries not counted)."""
        n = max(self.boundary_tokens, 1)
        return [
            {"forward": round(f / n, 3), "backward": round(b / n, 3)}
            for f, b in self.boundary_bytes
        ]

    def _with_ids(self, inputs: torch.Tensor) -> list[Sendable]:
        """What follows a stage's input after stage 0: the token ids in a subspace run."""
        return [] if self.ids_dtype is None else [inputs.to(self.ids_dtype)]

    async def forward_backward(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Micro-batch ``mb`` forward through every stage and backward again; returns its
        loss. Raises HopFailed if a hop failed on every attempt."""
        S = self.spec.n_stages
        B, T = int(inputs.shape[0]), int(inputs.shape[1])
        ids = self._with_ids(inputs)
        stage_inputs: list[list[Sendable]] = [[inputs]]
        holders: list[str | None] = []
        for s in range(S - 1):
            y, holder = await self._forward(mb, s, stage_inputs[s], keep_input=True, shape=(B, T))
            holders.append(holder)
            stage_inputs.append([await self._relay(y, self.forward_codec), *ids])
        loss, grad = await self._forward_loss(mb, S - 1, stage_inputs[S - 1], targets, shape=(B, T))
        backward = [0] * (S - 1)
        for s in reversed(range(S - 1)):
            assert grad is not None  # stages after 0 always return dL/dx
            ef_key = (s, "grad_output") if self.config.error_feedback else None
            sent = await self._relay(grad, self.backward_codec, ef_key)
            backward[s] = sendable_nbytes(sent)
            grad = await self._backward(mb, s, stage_inputs[s], sent, holders[s], shape=(B, T))
        for s in range(S - 1):
            self.boundary_bytes[s][0] += _nbytes(stage_inputs[s + 1])
            self.boundary_bytes[s][1] += backward[s]
        self.boundary_tokens += B * T
        return loss

    async def eval_loss(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Micro-batch ``mb``'s loss, with no gradients anywhere. Raises HopFailed if a hop
        failed on every attempt."""
        S = self.spec.n_stages
        shape = (int(inputs.shape[0]), int(inputs.shape[1]))
        ids = self._with_ids(inputs)
        x: list[Sendable] = [inputs]
        for s in range(S - 1):
            y, _ = await self._forward(mb, s, x, keep_input=False, shape=shape)
            x = [await self._relay(y, self.forward_codec), *ids]
        stage = S - 1
        x_last = x

        def make(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            msg = EvalLossRequest(hop=hop, budget_s=self.config.request_timeout_s)
            return msg, [*x_last, targets]

        async def check(response: Response) -> float:
            if response.tensors:
                raise BadReply("eval_loss returns no tensor")
            return self._loss(parse_reply(EvalReply, response.header).loss, "eval_loss")

        size = _nbytes(x_last) + sendable_nbytes(targets)
        loss, _ = await self.hops.send(stage, Kind.EVAL_LOSS, make, lambda _: size, check)
        return loss

    # ---- the hops -----------------------------------------------------------------------

    def _hop_id(self, mb: int, stage: int, attempt: int) -> HopId:
        return HopId(
            run_id=self.spec.run_id,
            trainer=self.trainer_id,
            micro_batch=mb,
            stage=stage,
            attempt=attempt,
        )

    async def _forward(
        self, mb: int, stage: int, x: list[Sendable], *, keep_input: bool, shape: tuple[int, int]
    ) -> tuple[ReceivedTensor, str | None]:
        """``forward`` on ``stage``; returns the output and who caches the input (if anyone).

        A training hop (``keep_input``) may be spot-checked: redone when its server is
        convicted of lying, HopFailed when the replicas disagree and nobody can tell who
        lied."""

        def make_for(keep: bool) -> Callable[[str, int], tuple[BaseModel, list[Sendable]]]:
            def make(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
                hop = self._hop_id(mb, stage, attempt)
                budget = self.config.request_timeout_s
                return ForwardRequest(hop=hop, budget_s=budget, keep_input=keep), list(x)

            return make

        async def check(response: Response) -> tuple[ReceivedTensor, bool, Stamp]:
            reply = parse_reply(ForwardReply, response.header)
            y = await self._stage_output(
                response, (*shape, self.widths[stage]), self.forward_codec,
                self.limits.max_activation, f"forward {stage}",
            )
            return y, reply.cached, (reply.epoch, reply.params)

        async def recompute(exclude: frozenset[str]) -> Answer:
            (y2, _, stamp2), peer2 = await self.hops.send(
                stage, Kind.FORWARD, make_for(False), lambda _: _nbytes(x), check,
                exclude=exclude, spot_check=True,
            )
            return await _answer(peer2, stamp2, y2)

        for _ in range(self.config.max_attempts):
            (y, cached, stamp), peer = await self.hops.send(
                stage, Kind.FORWARD, make_for(keep_input), lambda _: _nbytes(x), check
            )
            if not keep_input or self.spot is None or not self.spot.due():
                return y, peer if cached else None
            what = f"forward of micro-batch {mb} on stage {stage}"
            verdict = await self.spot.check(what, await _answer(peer, stamp, y), recompute)
            if _redo(verdict, what):
                continue
            return y, peer if cached else None
        raise HopFailed(f"forward on stage {stage}: every answer was convicted of lying")

    async def _forward_loss(
        self, mb: int, stage: int, x: list[Sendable], targets: torch.Tensor, *,
        shape: tuple[int, int],
    ) -> tuple[float, ReceivedTensor | None]:
        def make(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            msg = ForwardLossRequest(hop=hop, budget_s=self.config.request_timeout_s)
            return msg, [*x, targets]

        async def check(response: Response) -> tuple[float, ReceivedTensor | None, Stamp]:
            reply = parse_reply(LossReply, response.header)
            loss = self._loss(reply.loss, "forward_loss")
            if stage == 0:
                if response.tensors:
                    raise BadReply("forward_loss on stage 0 returns no tensor")
                return loss, None, (reply.epoch, reply.params)
            return loss, await self._stage_output(
                response, (*shape, self.widths[stage - 1]), self.backward_codec,
                self.limits.max_gradient, "forward_loss",
            ), (reply.epoch, reply.params)

        def make_check(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            msg = ForwardLossRequest(hop=hop, budget_s=self.config.request_timeout_s, check=True)
            return msg, [*x, targets]

        # a checking replica's dL/dx, by peer: one forward_loss check serves both comparisons
        grads_seen: dict[str, Answer] = {}

        async def recompute(exclude: frozenset[str]) -> Answer:
            (loss2, grad2, stamp2), peer2 = await self.hops.send(
                stage, Kind.FORWARD_LOSS, make_check, lambda _: size, check,
                exclude=exclude, spot_check=True,
            )
            if grad2 is not None:
                grads_seen[peer2] = await _answer(peer2, stamp2, grad2)
            return Answer(peer2, *stamp2, loss2, payload_digest(loss2))

        async def recompute_grad(exclude: frozenset[str]) -> Answer:
            seen = [p for p in grads_seen if p not in exclude]
            if not seen:
                peer2 = (await recompute(exclude)).peer
                if peer2 not in grads_seen:
                    raise BadReply(f"forward_loss spot check on stage {stage}: no dL/dx")
                seen = [peer2]
            return grads_seen.pop(seen[0])

        size = _nbytes(x) + sendable_nbytes(targets)
        for _ in range(self.config.max_attempts):
            (loss, grad, stamp), peer = await self.hops.send(
                stage, Kind.FORWARD_LOSS, make, lambda _: size, check
            )
            if self.spot is None or not self.spot.due():
                return loss, grad
            grads_seen.clear()
            what = f"forward_loss of micro-batch {mb} on stage {stage}"
            first = Answer(peer, *stamp, loss, payload_digest(loss))
            verdict = await self.spot.check(what, first, recompute, loss=True)
            if verdict.kind == "agree" and grad is not None:  # the loss agreed: its dL/dx
                verdict = await self.spot.check(
                    f"dL/dx of {what}", await _answer(peer, stamp, grad), recompute_grad
                )
            if _redo(verdict, what):
                continue
            return loss, grad
        raise HopFailed(f"forward_loss on stage {stage}: every answer was convicted of lying")

    async def _backward(
        self,
        mb: int,
        stage: int,
        x: list[Sendable],
        grad: Sendable,
        holder: str | None,
        *,
        shape: tuple[int, int],
    ) -> ReceivedTensor | None:
        carry_to: set[str] = set()  # peers that answered cache_miss: send them the input

        def by_reference(peer: str) -> bool:
            return peer == holder and peer not in carry_to

        def make(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            ref = by_reference(peer)
            msg = BackwardRequest(
                hop=hop, budget_s=self.config.request_timeout_s, input_carried=not ref
            )
            return msg, [grad] if ref else [*x, grad]

        async def check(response: Response) -> tuple[ReceivedTensor | None, Stamp]:
            reply = parse_reply(BackwardReply, response.header)
            stamp = (reply.epoch, reply.params)
            if stage == 0:
                if response.tensors:
                    raise BadReply("backward on stage 0 returns no tensor")
                return None, stamp
            return await self._stage_output(
                response, (*shape, self.widths[stage - 1]), self.backward_codec,
                self.limits.max_gradient, f"backward {stage}",
            ), stamp

        def size(peer: str) -> int:
            return sendable_nbytes(grad) + (0 if by_reference(peer) else _nbytes(x))

        def make_check(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            msg = BackwardRequest(hop=hop, budget_s=self.config.request_timeout_s,
                                  input_carried=True, check=True)
            return msg, [*x, grad]

        async def recompute(exclude: frozenset[str]) -> Answer:
            (g2, stamp2), peer2 = await self.hops.send(
                stage, Kind.BACKWARD, make_check, lambda _: sendable_nbytes(grad) + _nbytes(x),
                check, exclude=exclude, spot_check=True,
            )
            if g2 is None:
                raise BadReply(f"backward spot check on stage {stage} returned no dL/dx")
            return await _answer(peer2, stamp2, g2)

        for _ in range(self.config.max_attempts):
            (result, stamp), peer = await self.hops.send(
                stage, Kind.BACKWARD, make, size, check, carry_to=carry_to
            )
            # stage 0 sends no dL/dx back: nothing there to compare
            if result is None or self.spot is None or not self.spot.due():
                return result
            what = f"backward of micro-batch {mb} on stage {stage}"
            verdict = await self.spot.check(what, await _answer(peer, stamp, result), recompute)
            if _redo(verdict, what):
                continue  # the next server gets the input carried, and accumulates
            return result
        raise HopFailed(f"backward on stage {stage}: every answer was convicted of lying")

    # ---- stage outputs ------------------------------------------------------------------

    async def _stage_output(
        self,
        response: Response,
        shape: tuple[int, int, int],
        codec: CodecSpec,
        bound: float,
        what: str,
    ) -> ReceivedTensor:
        """The reply's one tensor: float32 ``shape`` (B, T, C) by its header (C: the
        boundary's wire width), finite and within ``bound`` (else BadValues), to relay to the
        next stage. One in another codec than the run's ``codec`` is kept decoded, to be
        re-encoded by ``_relay``."""
        t = check_relayed(response.tensors, shape, torch.float32, what)
        keep = t.codec != codec

        def peak() -> float | None:
            if keep:  # decoded for good: _relay re-encodes it
                t.tensor()
            # a relayed payload is not kept decoded (it would hold 4x the payload's bytes for
            # the micro-batch's lifetime): an int8/int4 one is checked from its scales alone,
            # others through a scratch copy
            return t.checked_peak()

        try:
            value = await off_loop(t.decoded_nbytes, peak)
        except ProtocolError as exc:
            raise BadValues(f"{what}: {exc}") from None
        assert value is not None  # a float32 tensor, by check_relayed
        if not within(value, bound):
            raise BadValues(f"{what}: " + describe_excess(value, bound, "the output's |value|"))
        return t

    def _loss(self, loss: float, what: str) -> float:
        """A loss a server reported (finite by the header's model): within ``max_loss``."""
        if not within(loss, self.limits.max_loss):
            raise BadValues(f"{what}: " + describe_excess(loss, self.limits.max_loss, "the loss"))
        return loss

    async def _relay(
        self, t: ReceivedTensor, codec: CodecSpec, ef_key: tuple[int, str] | None = None
    ) -> Sendable:
        """What goes on to the next stage for the stage output ``t``: ``t`` itself, as it
        came, when it is in the run's ``codec``; else its tensor (decoded and checked by
        ``_stage_output``) encoded with ``codec``, through error feedback under ``ef_key``."""
        if t.codec == codec:
            return t
        x = t.tensor()

        def run() -> EncodedTensor:
            return encode(x, codec) if ef_key is None else self._ef.encode(ef_key, x, codec)

        return await off_loop(t.decoded_nbytes, run)


def _redo(verdict: Verdict, what: str) -> bool:
    """Whether a spot-checked hop must be redone: its server was convicted of lying (the
    router never picks it again). HopFailed when the replicas disagree and none can be
    trusted (the micro-batch is dropped)."""
    if verdict.kind == "unresolved":
        raise HopFailed(f"{what}: replicas disagree and none can be trusted")
    return verdict.kind == "first_lied"


def _nbytes(tensors: list[Sendable]) -> int:
    return sum(sendable_nbytes(t) for t in tensors)


async def _answer(peer: str, stamp: Stamp, t: ReceivedTensor) -> Answer:
    """A replica's forward output as a spot check compares it: decoded into a scratch copy
    (the relayed payload stays as it came), with the digest of its payload bytes."""
    value = await off_loop(
        t.decoded_nbytes, lambda: t.tensor() if t.is_decoded else decode(t.encoded)
    )
    return Answer(peer, *stamp, value, payload_digest(t.payload))
