"""The trainer: drives micro-batches through the swarm's stages (SWARM pipeline, client side).

Up to ``max_in_flight`` micro-batches move at once (one asyncio task each, bounded by a
semaphore) so that WAN latency is hidden behind other micro-batches' work. One micro-batch::

    forward       stage 0 (token ids) -> ... -> stage S-2        keep every stage's input
    forward_loss  stage S-1 (activations + targets)              loss and dL/dx in one trip
    backward      stage S-2 -> ... -> stage 0                    dL/dx back, stage by stage

Every hop picks a server of its stage with the router (routing.py: expected completion
time, stochastic wiring, bans with back-off). Because the trainer keeps each stage's input
(as the payload it sent), any hop can be retried on another server of the same stage: a
timeout, a lost connection or an error answer bans that server and the hop goes elsewhere,
at most ``max_attempts`` times. A backward goes by reference to the server that
ran the forward while it still caches the input (``cache_miss`` makes us resend it), and
carries the input to any other server. Hop ids (run, trainer, micro-batch, stage, attempt)
let servers drop duplicates, so a retried hop never accumulates twice on one server.

Payloads use the run's codecs. A stage's output (activations forward, ``dL/dx`` backward)
reaches the trainer already encoded with the run's codec by the server that computed it,
and goes on to the next stage as it came (the endpoint's ``ReceivedTensor``): never
decoded and re-encoded here, so quantized once. On receipt the trainer checks what the
headers say (shape, dtype, codec, payload length and codec header); the values are checked
by whoever decodes them, the next stage's endpoint, which refuses a bad payload before
computing on it. When a server refuses a relayed payload, the trainer decodes it itself:
if it is bad, its sender is banned and the micro-batch fails (the refusing server did
nothing wrong); if not, the refusing server is treated as failing. Only a reply in
another codec than the run's is decoded (with every check, on receipt) and re-encoded:
activations with the forward codec, gradients with the backward codec through error
feedback keyed by ``(stage, "grad_output")``. Codec work on large tensors runs in a worker
thread (``transport.tensors.THREAD_BYTES``), never on the event loop.

``evaluate`` runs validation windows through the swarm (``forward`` without caching, then
``eval_loss``, no gradients anywhere) and returns the mean loss in nats per token.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from ...transport.codecs import CodecSpec, EncodedTensor, encode, parse_codec
from ...transport.endpoint import PathStats, PeerAddress, Response
from ...transport.error_feedback import ErrorFeedback
from ...transport.errors import ProtocolError, RemoteError, TransportError
from ...transport.tensors import (
    PAYLOAD_ERROR_CODES,
    ReceivedTensor,
    Sendable,
    off_loop,
    sendable_nbytes,
)
from ..config.runspec import RunSpec
from ..errors import NodeError
from ..logs import get_logger
from ..protocol import (
    RETRY_ELSEWHERE,
    BackwardReply,
    BackwardRequest,
    BadReply,
    ErrorCode,
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
    to_header,
)
from ..timing import jittered
from .routing import Candidate, Router, RouterConfig

log = get_logger(__name__)

_RATE_WINDOW_S = 30.0  # tokens/s is measured over this trailing window
_R = TypeVar("_R")


class TrainerConfig(BaseModel):
    """How the trainer drives micro-batches through the swarm."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_in_flight: int = Field(
        default=8, ge=1, le=4096, description="Micro-batches moving through the swarm at once."
    )
    request_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description="Deadline of one hop attempt (request and reply), seconds.",
    )
    max_attempts: int = Field(
        default=5,
        ge=1,
        le=100,
        description=(
            "Attempts per hop (on different servers when possible) before the micro-batch fails."
        ),
    )
    no_server_wait_s: float = Field(
        default=2.0,
        gt=0.0,
        le=600.0,
        description="Back-off while a stage has no online server, seconds (jittered).",
    )
    loss_ewma_alpha: float = Field(
        default=0.05,
        gt=0.0,
        le=1.0,
        description="Weight of the newest loss in the loss moving average.",
    )
    data_seed: int | None = Field(
        default=None,
        ge=0,
        description="Seed of this trainer's data stream; unset: derived from the peer id.",
    )
    error_feedback: bool = Field(
        default=True, description="Send output gradients through error feedback (per stage)."
    )
    router: RouterConfig = Field(default=RouterConfig(), description="Server choice per hop.")


@dataclass(frozen=True)
class ServerInfo:
    """A live server as the daemon's peer table sees it."""

    peer_id: str
    host: str
    port: int
    throughput: float  # announced samples/s of forward+backward
    queue_len: int  # announced queued jobs
    state: str  # joining / online / draining
    rtt: float | None  # seconds, smoothed, None if never measured


ServerSource = Callable[[], Mapping[int, Sequence[ServerInfo]]]


class RequestSender(Protocol):
    """What the trainer needs from the endpoint."""

    @property
    def peer_id(self) -> str: ...

    async def request(
        self,
        peer: PeerAddress,
        kind: str,
        header: dict[str, Any],
        tensors: Sequence[Sendable] = (),
        *,
        codec: CodecSpec | None = None,
        timeout: float,
        allow_nonfinite: bool = False,
        lazy: bool = False,
    ) -> Response: ...

    def path_stats(self, peer_id: str) -> PathStats | None: ...


class HopFailed(NodeError):
    """A hop failed on every attempt; its micro-batch is abandoned."""


@dataclass
class TrainerCounters:
    """What the trainer did since start."""

    started: int = 0
    completed: int = 0
    failed: int = 0
    retried_hops: int = 0
    cache_misses: int = 0
    tokens: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    loss_ewma: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None
    hops: Counter[int] = field(default_factory=Counter)  # successful hops per stage
    errors: Counter[str] = field(default_factory=Counter)  # failed attempts by code/exception


class Trainer:
    """Keeps micro-batches moving through the swarm (see the module docstring). Also a daemon
    ``Component``: ``start`` spawns ``run``; ``drain`` stops it after in-flight work."""

    name = "trainer"

    def __init__(
        self,
        spec: RunSpec,
        config: TrainerConfig,
        *,
        endpoint: RequestSender,
        servers: ServerSource,
        rng: random.Random | None = None,
        data: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.spec, self.config = spec, config
        self.endpoint = endpoint
        self.servers = servers
        self.peer_id = endpoint.peer_id
        self.rng = rng if rng is not None else random.Random()
        self.router = Router(config.router)
        self.forward_codec = parse_codec(spec.codecs.forward_activations)
        self.backward_codec = parse_codec(spec.codecs.backward_gradients)
        self.counters = TrainerCounters()
        self._ef = ErrorFeedback(max_entries=max(4, 2 * spec.n_stages), max_bytes=1 << 32)
        self._data = data
        self._next_id = self.rng.getrandbits(62)  # ids stay unique across restarts
        self._stopping = False
        self._task: asyncio.Task[Any] | None = None
        self._started_at: float | None = None
        self._completions: deque[tuple[float, int]] = deque()
        self._live: dict[str, ServerInfo] = {}
        self._stage_of: dict[str, int] = {}  # the stage each server was last seen serving

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self, ctx: Any) -> None:
        """Component seam: run in the daemon's TaskGroup."""
        self._task = ctx.spawn(self.run(), "trainer")

    async def drain(self, deadline: float) -> None:
        """Start no new micro-batch; let in-flight ones finish until ``deadline``."""
        self._stopping = True
        if self._task is None or self._task.done():
            return
        remaining = deadline - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({self._task}, timeout=max(0.0, remaining))
        if not done:  # (a failure of the task is the daemon's TaskGroup's to report)
            self._task.cancel()
            log.warning("trainer: drain deadline reached; in-flight micro-batches abandoned")

    async def close(self) -> None:
        self._stopping = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def stop(self) -> None:
        """Start no new micro-batch (``run`` returns once in-flight ones are done)."""
        self._stopping = True

    def status(self) -> dict[str, Any]:
        c = self.counters
        elapsed = time.monotonic() - self._started_at if self._started_at is not None else 0.0
        return {
            "micro_batches": {"started": c.started, "completed": c.completed, "failed": c.failed},
            "retried_hops": c.retried_hops,
            "cache_misses": c.cache_misses,
            "tokens": c.tokens,
            "tokens_per_s": round(self.tokens_per_s(), 1),
            "tokens_per_s_overall": round(c.tokens / elapsed, 1) if elapsed > 0 else 0.0,
            "loss_ewma": c.loss_ewma,
            "val_loss": c.val_loss,
            "payload_bytes": {"sent": c.payload_bytes_sent, "received": c.payload_bytes_received},
            "hops": {str(k): v for k, v in sorted(c.hops.items())},
            "errors": dict(c.errors),
        }

    def tokens_per_s(self) -> float:
        """Tokens of completed micro-batches per second over the last 30 s."""
        now = time.monotonic()
        while self._completions and self._completions[0][0] < now - _RATE_WINDOW_S:
            self._completions.popleft()
        if not self._completions or self._started_at is None:
            return 0.0
        span = min(_RATE_WINDOW_S, now - self._started_at)
        return sum(n for _, n in self._completions) / span if span > 0 else 0.0

    # ---- training -----------------------------------------------------------------

    async def run(self, max_micro_batches: int | None = None) -> None:
        """Train until stopped (or ``max_micro_batches`` started and finished)."""
        if self._data is None:
            from .data import TrainStream  # reads the corpus: off the event loop

            seed = self.config.data_seed
            if seed is None:
                digest = hashlib.sha256(f"wanswarm-data:{self.peer_id}".encode()).digest()
                seed = int.from_bytes(digest[:8], "big") >> 1
            self._data = await asyncio.to_thread(TrainStream, self.spec, seed)
        data = self._data
        self._started_at = time.monotonic()
        slots = asyncio.Semaphore(self.config.max_in_flight)
        async with asyncio.TaskGroup() as tg:
            while not self._stopping and (
                max_micro_batches is None or self.counters.started < max_micro_batches
            ):
                await slots.acquire()
                await self._wait_for_every_stage()
                # None: a finite source ran out
                batch = None if self._stopping else next(data, None)
                if batch is None:
                    slots.release()
                    break
                inputs, targets = batch
                mb = self._new_id()
                self.counters.started += 1
                task = tg.create_task(
                    self._train_one(mb, inputs, targets), name=f"micro-batch {mb}"
                )
                task.add_done_callback(lambda _: slots.release())

    async def _wait_for_every_stage(self) -> None:
        while not self._stopping:
            view = self.servers()
            missing = [s for s in range(self.spec.n_stages) if not _online(view.get(s, ()))]
            if not missing:
                return
            log.info("trainer: waiting for servers of stage(s) %s", missing)
            await asyncio.sleep(jittered(self.config.no_server_wait_s, 0.2, self.rng))

    def _new_id(self) -> int:
        mb = self._next_id
        self._next_id = (self._next_id + 1) % (1 << 63)
        return mb

    async def _train_one(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        try:
            loss = await self._micro_batch(mb, inputs, targets)
        except HopFailed as exc:
            self.counters.failed += 1
            log.warning("trainer: micro-batch %d failed: %s", mb, exc)
            return
        c = self.counters
        tokens = inputs.numel()
        c.completed += 1
        c.tokens += tokens
        c.last_loss = loss
        a = self.config.loss_ewma_alpha
        c.loss_ewma = loss if c.loss_ewma is None else (1 - a) * c.loss_ewma + a * loss
        self._completions.append((time.monotonic(), tokens))

    async def _micro_batch(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One micro-batch forward through every stage and backward again; returns its loss."""
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

    def _hop_id(self, mb: int, stage: int, attempt: int) -> HopId:
        return HopId(
            run_id=self.spec.run_id,
            trainer=self.peer_id,
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

        (y, cached), peer = await self._call(
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
        result, _ = await self._call(stage, Kind.FORWARD_LOSS, make, lambda _: size, check)
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

        result, _ = await self._call(stage, Kind.BACKWARD, make, size, check, carry_to=carry_to)
        return result

    # ---- one hop, with retries --------------------------------------------------------

    def _candidates(self, stage: int) -> list[Candidate]:
        view = self.servers()
        live = [s for s in view.get(stage, ()) if s.state == "online"]
        self._live.update((s.peer_id, s) for s in live)
        for server in live:
            if self._stage_of.get(server.peer_id, stage) != stage:
                # it moved here from another stage (rebalancing): the refusals that banned it
                # while it drained the old stage say nothing about it as a server of this one
                self.router.clear_ban(server.peer_id)
            self._stage_of[server.peer_id] = stage
        out = []
        for server in live:
            stats = self.endpoint.path_stats(server.peer_id)
            rtt = stats.smoothed_rtt if stats is not None and stats.smoothed_rtt > 0 else server.rtt
            rate = stats.delivery_rate_bps if stats is not None else None
            out.append(Candidate(server.peer_id, server.throughput, server.queue_len, rtt, rate))
        return out

    async def _call(
        self,
        stage: int,
        kind: Kind,
        make: Callable[[str, int], tuple[BaseModel, list[Sendable]]],
        payload: Callable[[str], int],
        check: Callable[[Response], Awaitable[_R]],
        *,
        carry_to: set[str] | None = None,
    ) -> tuple[_R, str]:
        """Send one hop to a server of ``stage``, re-routing on failure; returns (result, peer).

        HopFailed at once when the server refused a payload that we relayed and that is
        bad indeed (``_check_relayed``): no other server would take it either.
        """
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        last = "no attempt"
        B = self.spec.batch.micro_batch_size
        for attempt in range(self.config.max_attempts):
            if attempt:
                self.counters.retried_hops += 1
            candidates = self._candidates(stage)
            if not candidates:
                last = f"no online server for stage {stage}"
                await asyncio.sleep(jittered(self.config.no_server_wait_s, 0.2, self.rng))
                continue
            sizes = {c.peer_id: payload(c.peer_id) for c in candidates}
            pick = self.router.choose(
                candidates,
                payload_bytes=sizes,
                batch_size=B,
                now=loop.time(),
                rng=self.rng,
                avoid=tried,
            )
            assert pick is not None  # candidates is not empty
            server = self._live[pick.peer_id]
            header, tensors = make(server.peer_id, attempt)
            self.router.started(server.peer_id)
            try:
                response = await self.endpoint.request(
                    PeerAddress(server.peer_id, server.host, server.port),
                    str(kind),
                    to_header(header),
                    tensors,
                    timeout=self.config.request_timeout_s,
                    lazy=True,
                )
                result = await check(response)
            except RemoteError as exc:
                self.counters.errors[exc.code] += 1
                last = f"{server.peer_id}: {exc}"
                if exc.code in PAYLOAD_ERROR_CODES:
                    await self._check_relayed(tensors, server.peer_id, f"{kind} on stage {stage}")
                if exc.code == ErrorCode.CACHE_MISS and carry_to is not None:
                    self.counters.cache_misses += 1
                    carry_to.add(server.peer_id)  # a healthy server that lost the input
                    self.router.finished(server.peer_id, ok=True, now=loop.time(), rng=self.rng)
                    continue
                if exc.code not in RETRY_ELSEWHERE:
                    log.warning("trainer: %s on stage %d refused: %s", kind, stage, exc)
                self._failed(server.peer_id, tried, loop.time())
                continue
            except (TransportError, BadReply) as exc:
                self.counters.errors[type(exc).__name__] += 1
                last = f"{server.peer_id}: {type(exc).__name__}: {exc}"
                self._failed(server.peer_id, tried, loop.time())
                continue
            self.router.finished(server.peer_id, ok=True, now=loop.time(), rng=self.rng)
            self.counters.hops[stage] += 1
            self.counters.payload_bytes_sent += sum(sendable_nbytes(t) for t in tensors)
            self.counters.payload_bytes_received += sum(
                sendable_nbytes(t) for t in response.tensors
            )
            return result, server.peer_id
        raise HopFailed(
            f"{kind} on stage {stage} failed {self.config.max_attempts} times; last: {last}"
        )

    def _failed(self, peer_id: str, tried: set[str], now: float) -> None:
        tried.add(peer_id)
        self.router.finished(peer_id, ok=False, now=now, rng=self.rng)

    async def _check_relayed(self, tensors: Sequence[Sendable], refuser: str, what: str) -> None:
        """``refuser`` refused a payload of ``tensors``: decode (and check) the ones we
        relayed undecoded. One that fails was bad when its sender produced it: the sender
        is banned, ``refuser`` did its job, and the micro-batch fails (HopFailed)."""
        loop = asyncio.get_running_loop()
        for t in tensors:
            if not isinstance(t, ReceivedTensor):
                continue
            try:
                await t.decode()
            except ProtocolError as exc:
                self.router.finished(refuser, ok=True, now=loop.time(), rng=self.rng)
                if t.sender:
                    self.router.ban(t.sender, now=loop.time(), rng=self.rng)
                raise HopFailed(
                    f"{what}: {refuser} refused the tensor relayed from {t.sender or '?'}, "
                    f"which is malformed indeed: {exc}"
                ) from None

    # ---- validation -------------------------------------------------------------------

    async def evaluate(self, windows: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Mean validation loss (nats/token) of ``windows`` = (inputs, targets), each (N, T).

        Runs micro-batches of ``micro_batch_size`` windows through the swarm with no
        gradients (``forward`` without caching, then ``eval_loss``), ``max_in_flight`` at a
        time. Raises HopFailed if any of them cannot be evaluated.
        """
        inputs, targets = windows
        B = self.spec.batch.micro_batch_size
        chunks = [
            (inputs[i : i + B], targets[i : i + B]) for i in range(0, int(inputs.shape[0]), B)
        ]
        if not chunks:
            raise ValueError("no validation windows")
        slots = asyncio.Semaphore(self.config.max_in_flight)

        async def one(x: torch.Tensor, y: torch.Tensor) -> float:
            async with slots:
                return await self._eval_one(self._new_id(), x, y)

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(x, y)) for x, y in chunks]
        total = sum(t.result() * int(x.shape[0]) for t, (x, _) in zip(tasks, chunks, strict=False))
        loss = total / int(inputs.shape[0])
        if not math.isfinite(loss):
            raise BadReply("validation loss is not finite")
        self.counters.val_loss = loss
        return loss

    async def _eval_one(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
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
        loss, _ = await self._call(stage, Kind.EVAL_LOSS, make, lambda _: size, check)
        return loss


def _online(servers: Sequence[ServerInfo]) -> bool:
    return any(s.state == "online" for s in servers)


def servers_from_peers(peers: Any) -> dict[int, list[ServerInfo]]:
    """The ``ServerSource`` view of the daemon's PeerTable: online-capable servers by stage."""
    out: dict[int, list[ServerInfo]] = {}
    for server in peers.servers():
        record = server.record
        out.setdefault(server.stage, []).append(
            ServerInfo(
                peer_id=record.peer_id,
                host=server.quic.host,
                port=server.quic.port,
                throughput=record.throughput,
                queue_len=record.queue,
                state=record.state,
                rtt=server.peer.rtt.srtt,
            )
        )
    return out
