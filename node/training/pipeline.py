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
headers say (shape, dtype, codec, payload length and codec header); the values are checked
by whoever decodes them, the next stage's endpoint, which refuses a bad payload before
computing on it (hops.py says whom that blames). Only a reply in another codec than the
run's is decoded (with every check, on receipt) and re-encoded: activations with the
forward codec, gradients with the backward codec through error feedback keyed by
``(stage, "grad_output")``. Codec work on large tensors runs in a worker thread
(``transport.tensors.THREAD_BYTES``), never on the event loop.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel

from ...transport.codecs import CodecSpec, EncodedTensor, encode, parse_codec
from ...transport.endpoint import Response
from ...transport.error_feedback import ErrorFeedback
from ...transport.tensors import ReceivedTensor, Sendable, off_loop, sendable_nbytes
from ..config.runspec import RunSpec
from ..protocol import (
    BackwardReply,
    BackwardRequest,
    BadReply,
    EvalLossRequest,
    EvalReply,
    ForwardLossRequest,
    ForwardReply,
    ForwardRequest,
    HopId,
    Kind,
    LossReply,
    check_relayed,
    parse_reply,
)
from .hops import HopSender
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
    ) -> None:
        self.spec, self.config = spec, config
        self.trainer_id = trainer_id
        self.hops = hops
        self.forward_codec = parse_codec(spec.codecs.forward_activations)
        self.backward_codec = parse_codec(spec.codecs.backward_gradients)
        self._ef = ef

    async def forward_backward(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Micro-batch ``mb`` forward through every stage and backward again; returns its
        loss. Raises HopFailed if a hop failed on every attempt."""
        S = self.spec.n_stages
        B, T = int(inputs.shape[0]), int(inputs.shape[1])
        stage_inputs: list[Sendable] = [inputs]
        holders: list[str | None] = []
        for s in range(S - 1):
            y, holder = await self._forward(mb, s, stage_inputs[s], keep_input=True, shape=(B, T))
            holders.append(holder)
            stage_inputs.append(await self._relay(y, self.forward_codec))
        loss, grad = await self._forward_loss(mb, S - 1, stage_inputs[S - 1], targets, shape=(B, T))
        for s in reversed(range(S - 1)):
            assert grad is not None  # stages after 0 always return dL/dx
            ef_key = (s, "grad_output") if self.config.error_feedback else None
            sent = await self._relay(grad, self.backward_codec, ef_key)
            grad = await self._backward(mb, s, stage_inputs[s], sent, holders[s], shape=(B, T))
        return loss

    async def eval_loss(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Micro-batch ``mb``'s loss, with no gradients anywhere. Raises HopFailed if a hop
        failed on every attempt."""
        S = self.spec.n_stages
        shape = (int(inputs.shape[0]), int(inputs.shape[1]))
        x: Sendable = inputs
        for s in range(S - 1):
            y, _ = await self._forward(mb, s, x, keep_input=False, shape=shape)
            x = await self._relay(y, self.forward_codec)
        stage = S - 1
        x_last = x

        def make(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            msg = EvalLossRequest(hop=hop, budget_s=self.config.request_timeout_s)
            return msg, [x_last, targets]

        async def check(response: Response) -> float:
            if response.tensors:
                raise BadReply("eval_loss returns no tensor")
            return parse_reply(EvalReply, response.header).loss

        size = sendable_nbytes(x_last) + sendable_nbytes(targets)
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
        self, mb: int, stage: int, x: Sendable, *, keep_input: bool, shape: tuple[int, int]
    ) -> tuple[ReceivedTensor, str | None]:
        """``forward`` on ``stage``; returns the output and who caches the input (if anyone)."""

        def make(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            budget = self.config.request_timeout_s
            return ForwardRequest(hop=hop, budget_s=budget, keep_input=keep_input), [x]

        async def check(response: Response) -> tuple[ReceivedTensor, bool]:
            reply = parse_reply(ForwardReply, response.header)
            y = await self._stage_output(response, shape, self.forward_codec, f"forward {stage}")
            return y, reply.cached

        (y, cached), peer = await self.hops.send(
            stage, Kind.FORWARD, make, lambda _: sendable_nbytes(x), check
        )
        return y, peer if cached else None

    async def _forward_loss(
        self, mb: int, stage: int, x: Sendable, targets: torch.Tensor, *, shape: tuple[int, int]
    ) -> tuple[float, ReceivedTensor | None]:
        def make(peer: str, attempt: int) -> tuple[BaseModel, list[Sendable]]:
            hop = self._hop_id(mb, stage, attempt)
            return ForwardLossRequest(hop=hop, budget_s=self.config.request_timeout_s), [x, targets]

        async def check(response: Response) -> tuple[float, ReceivedTensor | None]:
            reply = parse_reply(LossReply, response.header)
            if stage == 0:
                if response.tensors:
                    raise BadReply("forward_loss on stage 0 returns no tensor")
                return reply.loss, None
            return reply.loss, await self._stage_output(
                response, shape, self.backward_codec, "forward_loss"
            )

        size = sendable_nbytes(x) + sendable_nbytes(targets)
        result, _ = await self.hops.send(stage, Kind.FORWARD_LOSS, make, lambda _: size, check)
        return result

    async def _backward(
        self,
        mb: int,
        stage: int,
        x: Sendable,
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
            return msg, [grad] if ref else [x, grad]

        async def check(response: Response) -> ReceivedTensor | None:
            parse_reply(BackwardReply, response.header)
            if stage == 0:
                if response.tensors:
                    raise BadReply("backward on stage 0 returns no tensor")
                return None
            return await self._stage_output(
                response, shape, self.backward_codec, f"backward {stage}"
            )

        def size(peer: str) -> int:
            return sendable_nbytes(grad) + (0 if by_reference(peer) else sendable_nbytes(x))

        result, _ = await self.hops.send(stage, Kind.BACKWARD, make, size, check, carry_to=carry_to)
        return result

    # ---- stage outputs ------------------------------------------------------------------

    async def _stage_output(
        self, response: Response, shape: tuple[int, int], codec: CodecSpec, what: str
    ) -> ReceivedTensor:
        """The reply's one tensor: float32 (B, T, C) by its header, to relay to the next
        stage. One in another codec than the run's ``codec`` is decoded now (every check of
        its values: a bad one fails this attempt) to be re-encoded by ``_relay``."""
        t = check_relayed(response.tensors, (*shape, self.spec.model.d_model), torch.float32, what)
        if t.codec != codec:
            await t.decode()
        return t

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
