"""The stage server: one pipeline stage's parameters, served to trainers over the endpoint.

Serves the training protocol (protocol.py) for stage ``s`` of the run:

- ``forward`` (no grad): runs the stage on ``x`` and, unless asked not to, keeps ``x`` in a
  bounded cache keyed by ``(trainer, micro_batch)`` so that the backward can reference it
  instead of resending it;
- ``forward_loss`` (last stage): loss and ``dL/dx`` in one round trip, accumulating the
  parameter gradients;
- ``backward`` (stateless): recomputes the forward from the carried or cached ``x``
  (``cache_miss`` if the reference is gone: the trainer resends), accumulates the parameter
  gradients and returns ``dL/dx`` (nothing on stage 0);
- ``eval_loss`` (last stage, no grad) and ``stage_info``.

All tensor work (validation of values, compute, reply encoding) runs on ONE device thread,
a dedicated single-worker executor; the event loop only parses headers and queues jobs. The
queue is bounded: when ``queue_size`` jobs are queued or running the server answers ``busy``
so that the trainer goes elsewhere. A job whose requester gave up (the endpoint cancels the
handler when the request stream is reset) or whose ``budget_s`` ran out before it reached
the device is dropped unrun.

Idempotency: the device thread remembers which ``(trainer, micro_batch, stage)`` it applied
(a bounded log). A duplicate ``backward``/``forward_loss`` (a retry after a lost reply)
returns the cached reply when it is still held, else recomputes ``dL/dx`` without touching
the parameter gradients. Gradients of the backward leg are encoded with the run's backward
codec through error feedback keyed by ``(trainer, stage, "grad_input")``; activations with
the forward codec.

After each applied micro-batch the device thread calls ``optimizer.step(batch_size)`` (the
averaging adapter): it steps when the stage's collaboration reaches ``target_batch_size``.
Every ``step_check_period_s`` a check job on the device thread calls
``optimizer.step_if_due()`` as well: a synchronous all-reduce needs every replica of the
stage, and a replica that no micro-batch reaches (trainers route around the one stalled in
the all-reduce) would otherwise join only when its next request arrives, leaving the other
blocked until the round times out.

The throughput announced in the DHT record is measured at start by a short local
benchmark (forward+backward of one micro-batch) and cached in the state directory by
``(run_id, stage, device)``.

With a state directory the server checkpoints its stage (docs/checkpoints.md) every
``checkpoint_period_s``, checked after an optimizer step on the device thread (never on a
half-updated state; a writer thread does the disk work), and in ``drain`` after the flush.
``open`` resumes from our newest checkpoint when it is newer than what the stage's peers
gave, or when no peer answered; ``status()`` says which source won.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ...transport.codecs import CodecSpec, encode, parse_codec
from ...transport.endpoint import Handler, Request, Response
from ...transport.error_feedback import ErrorFeedback
from ...transport.errors import RemoteError
from ...transport.tensors import Sendable
from ..config.runspec import RunSpec
from ..logs import get_logger
from ..membership.records import ServerState
from ..protocol import (
    BackwardReply,
    BackwardRequest,
    ErrorCode,
    EvalLossRequest,
    EvalReply,
    ForwardLossRequest,
    ForwardReply,
    ForwardRequest,
    HopId,
    InfoReply,
    InfoRequest,
    Kind,
    LossReply,
    StageContract,
    parse_request,
    refuse,
    to_header,
)
from ..training.model import StageModule, build_stage
from .averaging import StageOptimizer
from .checkpoint import Checkpointer, ResumeSource
from .memory import AppliedLog, InputCache
from .state import DonorSource, StageStateSharing
from .state_plan import StateTransferConfig
from .throughput import cached_throughput

log = get_logger(__name__)


class StageServerConfig(BaseModel):
    """How a stage server queues, caches and measures its work."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="'auto' (CUDA if present), 'cpu' or 'cuda[:N]'.",
    )
    queue_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Jobs queued or running on the device; beyond it we answer 'busy'.",
    )
    cache_entries: int = Field(
        default=256,
        ge=0,
        le=1_000_000,
        description="Forward inputs kept for backward references (0 disables).",
    )
    cache_bytes: int = Field(
        default=256 * 2**20, ge=0, description="Byte budget of the forward-input cache."
    )
    cache_ttl_s: float = Field(
        default=120.0,
        gt=0.0,
        le=86400.0,
        description="Seconds a cached forward input stays referenceable.",
    )
    applied_entries: int = Field(
        default=200_000,
        ge=1,
        le=10_000_000,
        description=(
            "Applied (trainer, micro-batch) keys remembered to suppress duplicate gradients."
        ),
    )
    reply_cache_entries: int = Field(
        default=64,
        ge=0,
        le=100_000,
        description="Recent backward replies kept to answer a retried hop exactly.",
    )
    error_feedback: bool = Field(
        default=True,
        description="Encode returned input gradients through error feedback (per trainer).",
    )
    error_feedback_bytes: int = Field(
        default=512 * 2**20, ge=0, description="Memory bound of the error-feedback residuals."
    )
    benchmark_iterations: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Timed forward+backward passes of the start-up benchmark.",
    )
    checkpoint_period_s: float = Field(
        default=300.0,
        ge=0.0,
        le=7 * 86400.0,
        description=(
            "Seconds between checkpoints of the stage in <state_dir>/checkpoints (taken after an "
            "optimizer step once the epoch has moved); 0 disables periodic ones (leaving still "
            "saves one)."
        ),
    )
    checkpoint_keep: int = Field(
        default=2,
        ge=1,
        le=1000,
        description="Newest checkpoints of the stage kept on disk; older ones are deleted.",
    )
    step_check_period_s: float = Field(
        default=0.5,
        gt=0.0,
        le=60.0,
        description=(
            "Seconds between checks, on the device thread, whether the stage's epoch step is due "
            "without a micro-batch arriving here (the replica then joins the all-reduce)."
        ),
    )
    state_transfer: StateTransferConfig = Field(
        default=StateTransferConfig(),
        description="Downloading the stage's state from its replicas on open, and donating ours.",
    )


@dataclass
class StageServerCounters:
    """What the server did since start (the device thread and the event loop write disjoint
    fields)."""

    forward: int = 0
    forward_loss: int = 0
    backward: int = 0
    eval_loss: int = 0
    info: int = 0
    applied: int = 0  # micro-batches whose gradients were accumulated
    samples_accumulated: int = 0
    duplicates: int = 0  # retried hops answered without accumulating again
    cache_misses: int = 0
    expired: int = 0  # dropped before running: out of budget or abandoned
    failed: int = 0  # refused (bad_request) or failed (internal) on the device
    busy: int = 0  # event loop: refused because the queue was full
    refused: int = 0  # event loop: wrong run/stage, malformed header, not ready, draining
    compute_s: float = 0.0
    # device thread: inside the optimizer (accumulating; at an epoch's end, a synchronous
    # step also waits there for the stage's all-reduce, and every queued request with it)
    optimizer_s: float = 0.0
    optimizer_max_s: float = 0.0
    idle_steps: int = 0  # epoch steps joined by the periodic check, no micro-batch at hand
    export_failures: int = 0  # device thread: the state could not be exported for a checkpoint


@dataclass
class _Job:
    deadline: float  # time.monotonic()
    cancelled: bool = False  # the requester gave up (set from the event loop)
    result: Any = field(default=None)


# ---------------------------------------------------------------------------- the server


class HandlerRegistry(Protocol):
    """Where the server registers its request kinds (``transport.endpoint.Endpoint``)."""

    def register(self, kind: str, handler: Handler, *, allow_nonfinite: bool = False) -> None: ...


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class StageServer:
    """Serves one stage (see the module docstring). Also a daemon ``Component``."""

    name = "stage_server"

    def __init__(
        self,
        spec: RunSpec,
        stage: int,
        config: StageServerConfig,
        *,
        endpoint: HandlerRegistry,
        make_optimizer: Callable[[nn.Module], StageOptimizer],
        state_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        donors: DonorSource | None = None,
    ) -> None:
        """Build the stage and its optimizer. Call on the main thread: hivemind's Optimizer
        (inside ``make_optimizer``) installs signal handlers."""
        self.spec, self.stage, self.config = spec, stage, config
        self.contract = StageContract.from_spec(spec, stage)
        self.device = resolve_device(config.device)
        self.module: StageModule = build_stage(spec, stage).to(self.device)
        self.optimizer = make_optimizer(self.module)
        self.state_dir = state_dir
        self.clock = clock
        self.forward_codec: CodecSpec = parse_codec(spec.codecs.forward_activations)
        self.backward_codec: CodecSpec = parse_codec(spec.codecs.backward_gradients)
        self.counters = StageServerCounters()
        self.state: ServerState = "joining"
        self.throughput = 0.0
        self._cache = InputCache(config.cache_entries, config.cache_bytes, config.cache_ttl_s)
        self._applied = AppliedLog(config.applied_entries, config.reply_cache_entries)
        self._ef = ErrorFeedback(max_entries=1 << 16, max_bytes=config.error_feedback_bytes)
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"stage{stage}-device"
        )
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._membership: Any = None
        self._closed = False
        self._checker: asyncio.Task[None] | None = None
        self._digest: tuple[int, str] = (-1, "")  # (epoch, param_digest) after the epoch's step
        self.resumed_from: ResumeSource = "fresh"
        self._state_settled = False  # open() has decided where the state comes from
        self._checkpoints = (
            None
            if state_dir is None
            else Checkpointer(
                state_dir,
                spec.run_id,
                stage,
                period_s=config.checkpoint_period_s,
                keep=config.checkpoint_keep,
            )
        )
        # ``donors``: the stage's online replicas, to download from (then ``endpoint`` must send
        # requests too, i.e. be a transport Endpoint); every server donates its own state
        self._sharing = StageStateSharing(
            endpoint, stage, self.optimizer, self._executor, config.state_transfer,
            donors=donors, serving=lambda: self.state == "online",
        )
        for kind, handler in (
            (Kind.FORWARD, self._on_forward),
            (Kind.FORWARD_LOSS, self._on_forward_loss),
            (Kind.BACKWARD, self._on_backward),
            (Kind.EVAL_LOSS, self._on_eval_loss),
            (Kind.STAGE_INFO, self._on_info),
        ):
            endpoint.register(str(kind), handler)

    # ---- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        """Load the stage's state from its peers or our checkpoint, measure throughput, then
        serve."""
        loop = asyncio.get_running_loop()
        loaded = await self._sharing.load()
        peer_epoch = self.optimizer.local_epoch
        log.info("stage %d: %s, epoch %d", self.stage,
                 "state loaded from peers" if loaded else "no peers to load state from", peer_epoch)
        self.resumed_from = "peers" if loaded else "fresh"
        if self._checkpoints is not None:
            self.resumed_from = await loop.run_in_executor(
                self._executor,
                self._checkpoints.resume,
                # the method is looked up only when a checkpoint is found
                lambda *state: self.optimizer.import_state(*state),
                loaded,
                peer_epoch,
            )
            self._checkpoints.schedule.mark(self.clock(), self.optimizer.local_epoch)
        self._state_settled = True
        self.throughput = await loop.run_in_executor(
            self._executor,
            cached_throughput,
            self.module,
            self.spec,
            self.stage,
            self.device,
            self.state_dir,
            self.config.benchmark_iterations,
        )
        self.state = "online"
        self._checker = asyncio.create_task(
            self._check_step_loop(), name=f"stage{self.stage}-step-check"
        )
        log.info("stage %d online: %.1f samples/s on %s", self.stage, self.throughput, self.device)

    async def start(self, ctx: Any) -> None:
        """Component seam: ``open`` then announce our stage and throughput."""
        self._membership = ctx.membership
        # (the throughput announced so far, if any, stands until the benchmark replaces it:
        # servers choosing their stage meanwhile count this one)
        ctx.membership.update(stage=self.stage, queue=0)
        await self.open()
        ctx.membership.update(throughput=self.throughput, queue=self._pending)

    async def drain(self, deadline: float) -> None:
        """Refuse new work, finish queued jobs, apply pending averaging and save a checkpoint,
        by ``deadline``."""
        self.state = "draining"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                await self._idle.wait()
                await loop.run_in_executor(self._executor, self.optimizer.flush)
                # a server that never settled its state (open failed) must not save a fresh one
                if self._checkpoints is not None and self._state_settled:
                    written = await loop.run_in_executor(self._executor, self._checkpoint)
                    if written is not None:
                        await asyncio.wrap_future(written)
        except TimeoutError:
            log.warning(
                "stage %d: drain deadline reached with %d jobs queued%s",
                self.stage,
                self._pending,
                "" if self._checkpoints is None else " (the final checkpoint may be missing)",
            )

    async def close(self) -> None:
        """Leave the collaboration and stop the device thread."""
        if self._closed:
            return
        self._closed = True
        self.state = "draining"
        if self._checker is not None:
            self._checker.cancel()
        self._sharing.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.optimizer.shutdown)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._checkpoints is not None:
            await asyncio.to_thread(self._checkpoints.close)  # a write in flight finishes

    def status(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "state": self.state,
            "queue": self._pending,
            "throughput": round(self.throughput, 2),
            "epoch": self.optimizer.local_epoch,
            "samples_accumulated": self.optimizer.samples_accumulated,
            "synchronized": self.optimizer.is_synchronized(),
            "replicas_seen": self.optimizer.num_peers,
            "cache": len(self._cache),
            "digest_epoch": self._digest[0],
            "param_digest": self._digest[1],
            "resumed_from": self.resumed_from,
            "state_download": self._sharing.last_download,
            "state_donated": {
                "manifests": self._sharing.donor.counts["manifests"],
                "chunks": self._sharing.donor.counts["chunks"],
            },
            **(
                Checkpointer.EMPTY_STATUS
                if self._checkpoints is None
                else self._checkpoints.status()
            ),
            **asdict(self.counters),
        }

    def applied_keys(self) -> frozenset[Hashable]:
        """``(trainer, micro_batch, stage)`` of the micro-batches applied here (recent ones)."""
        return self._applied.keys()

    @property
    def queue_len(self) -> int:
        """Jobs queued or running on the device thread."""
        return self._pending

    # ---- queueing -----------------------------------------------------------------

    def _admit(self, hop: HopId, sender: str) -> None:
        try:
            self.contract.check_hop(hop, sender)
            if self.state == "joining":
                raise refuse(ErrorCode.NOT_READY, "still loading the stage's state")
            if self.state == "draining":
                raise refuse(ErrorCode.DRAINING, "leaving: send elsewhere")
        except RemoteError:
            self.counters.refused += 1
            raise
        if self._pending >= self.config.queue_size:
            self.counters.busy += 1
            raise refuse(ErrorCode.BUSY, f"{self._pending} jobs queued")

    async def _run(self, budget_s: float, work: Callable[[], Response]) -> Response:
        """Queue ``work`` on the device thread; the slot is held until it really finishes."""
        job = _Job(deadline=self.clock() + budget_s)
        self._pending += 1
        self._idle.clear()
        self._announce_queue()
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._device, job, work)
        future.add_done_callback(self._job_done)
        try:
            # shielded: a cancelled handler must not free the slot of a job that still runs
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    async def _check_step_loop(self) -> None:
        """While online: every step_check_period_s, a device-thread job joins a due epoch step
        (one job at a time: it waits behind queued requests)."""
        loop = asyncio.get_running_loop()
        while self.state == "online":
            await asyncio.sleep(self.config.step_check_period_s)
            if self.state != "online":
                return
            try:
                await loop.run_in_executor(self._executor, self._step_if_due)
            except RuntimeError:  # the executor was shut down
                return

    def _job_done(self, future: asyncio.Future[Response]) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()
        self._announce_queue()
        if not future.cancelled():
            future.exception()  # retrieved: a shielded job whose requester left is not an error

    def _announce_queue(self) -> None:
        if self._membership is not None:
            self._membership.update(queue=self._pending)

    def _device(self, job: _Job, work: Callable[[], Response]) -> Response:
        """Runs on the device thread."""
        if job.cancelled or self.clock() > job.deadline:
            self.counters.expired += 1
            raise refuse(ErrorCode.EXPIRED, "the request's budget ran out in the queue")
        started = time.perf_counter()
        try:
            return work()
        except RemoteError:
            self.counters.failed += 1
            raise
        except Exception as exc:  # a bug or a torch failure: answer 'internal', keep serving
            self.counters.failed += 1
            log.exception("stage %d: job failed", self.stage)
            raise refuse(ErrorCode.INTERNAL, type(exc).__name__) from exc
        finally:
            self.counters.compute_s += time.perf_counter() - started

    def _reply_fields(self, started: float) -> dict[str, Any]:
        return {
            "queue_len": max(0, self._pending - 1),
            "epoch": self.optimizer.local_epoch,
            "compute_s": max(0.0, time.perf_counter() - started),
        }

    # ---- handlers (event loop) ----------------------------------------------------

    async def _on_forward(self, request: Request) -> Response:
        msg = parse_request(ForwardRequest, request.header)
        self._admit(msg.hop, request.peer_id)
        if self.contract.last:
            self.counters.refused += 1
            raise refuse(ErrorCode.BAD_REQUEST, "the last stage answers forward_loss and eval_loss")
        return await self._run(msg.budget_s, lambda: self._forward(msg, request.tensors))

    async def _on_forward_loss(self, request: Request) -> Response:
        msg = parse_request(ForwardLossRequest, request.header)
        self._admit(msg.hop, request.peer_id)
        self._require_last("forward_loss")
        return await self._run(msg.budget_s, lambda: self._forward_loss(msg, request.tensors))

    async def _on_backward(self, request: Request) -> Response:
        msg = parse_request(BackwardRequest, request.header)
        self._admit(msg.hop, request.peer_id)
        if self.contract.last:
            self.counters.refused += 1
            raise refuse(ErrorCode.BAD_REQUEST, "the last stage's backward is forward_loss")
        return await self._run(msg.budget_s, lambda: self._backward(msg, request.tensors))

    async def _on_eval_loss(self, request: Request) -> Response:
        msg = parse_request(EvalLossRequest, request.header)
        self._admit(msg.hop, request.peer_id)
        self._require_last("eval_loss")
        return await self._run(msg.budget_s, lambda: self._eval_loss(msg, request.tensors))

    async def _on_info(self, request: Request) -> Response:
        msg = parse_request(InfoRequest, request.header)
        if msg.run_id != self.contract.run_id:
            self.counters.refused += 1
            raise refuse(ErrorCode.WRONG_RUN, f"this server trains run {self.contract.run_id}")
        self.counters.info += 1
        reply = InfoReply(
            run_id=self.contract.run_id,
            stage=self.stage,
            state=self.state,
            queue_len=self._pending,
            queue_capacity=self.config.queue_size,
            throughput=self.throughput,
            epoch=self.optimizer.local_epoch,
            samples_accumulated=self.optimizer.samples_accumulated,
        )
        return Response(to_header(reply))

    def _require_last(self, kind: str) -> None:
        if not self.contract.last:
            self.counters.refused += 1
            raise refuse(ErrorCode.BAD_REQUEST, f"only the last stage answers {kind}")

    # ---- jobs (device thread) -----------------------------------------------------

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        self.contract.check_input(x)
        return x.to(self.device)

    def _forward(self, msg: ForwardRequest, tensors: list[torch.Tensor]) -> Response:
        started = time.perf_counter()
        self.contract.check_count(tensors, 1, "forward")
        x = self._input(tensors[0])
        with torch.no_grad():
            y = self.module(x)  # (B, T, C)
        cached = msg.keep_input and self._cache.put(
            (msg.hop.trainer, msg.hop.micro_batch), x, self.clock()
        )
        self.counters.forward += 1
        out = encode(y, self.forward_codec)
        return Response(
            to_header(ForwardReply(cached=cached, **self._reply_fields(started))), [out]
        )

    def _forward_loss(self, msg: ForwardLossRequest, tensors: list[torch.Tensor]) -> Response:
        started = time.perf_counter()
        self.contract.check_count(tensors, 2, "forward_loss")
        x = self._input(tensors[0])
        batch, length = int(x.shape[0]), int(x.shape[1])
        self.contract.check_targets(tensors[1], batch, length)
        targets = tensors[1].to(self.device)
        key = msg.hop.key
        self.counters.forward_loss += 1
        if key in self._applied:
            return self._duplicate(
                key, started, lambda: self._loss_and_grad(x, targets, accumulate=False)
            )
        loss, grad_x = self._loss_and_grad(x, targets, accumulate=True)
        out = self._encode_grad(msg.hop, grad_x)
        header = LossReply(loss=loss, duplicate=False, **self._reply_fields(started))
        return self._apply(key, batch, Response(to_header(header), out))

    def _loss_and_grad(
        self, x: torch.Tensor, targets: torch.Tensor, *, accumulate: bool
    ) -> tuple[float, torch.Tensor | None]:
        x = x if self.contract.first else x.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = self.module.forward_loss(x, targets)  # ()
            grad_x = self._grads(loss, x, None, accumulate=accumulate)
        return float(loss.detach()), grad_x

    def _backward(self, msg: BackwardRequest, tensors: list[torch.Tensor]) -> Response:
        started = time.perf_counter()
        hop = msg.hop
        ref = (hop.trainer, hop.micro_batch)
        if msg.input_carried:
            self.contract.check_count(tensors, 2, "backward with its input")
            x = self._input(tensors[0])
        else:
            self.contract.check_count(tensors, 1, "backward by reference")
            cached = self._cache.get(ref, self.clock())
            if cached is None:
                self.counters.cache_misses += 1
                raise refuse(
                    ErrorCode.CACHE_MISS, "the forward input is no longer cached: resend it"
                )
            x = cached
        batch, length = int(x.shape[0]), int(x.shape[1])
        self.contract.check_output_grad(tensors[-1], batch, length)
        grad_y = tensors[-1].to(self.device)
        self.counters.backward += 1
        if hop.key in self._applied:
            return self._duplicate(
                hop.key, started, lambda: (None, self._recompute(x, grad_y, accumulate=False))
            )
        grad_x = self._recompute(x, grad_y, accumulate=True)
        self._cache.pop(ref)
        out = self._encode_grad(hop, grad_x)
        header = BackwardReply(duplicate=False, **self._reply_fields(started))
        return self._apply(hop.key, batch, Response(to_header(header), out))

    def _recompute(
        self, x: torch.Tensor, grad_y: torch.Tensor, *, accumulate: bool
    ) -> torch.Tensor | None:
        x = x if self.contract.first else x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = self.module(x)  # (B, T, C)
            return self._grads(y, x, grad_y, accumulate=accumulate)

    def _grads(
        self, out: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor | None, *, accumulate: bool
    ) -> torch.Tensor | None:
        """dL/dx; with ``accumulate`` also add dL/dtheta into the parameters' ``.grad``."""
        if accumulate:
            out.backward(grad_out)
            return None if self.contract.first else x.grad
        if self.contract.first:
            return None  # nothing to return and nothing to accumulate
        (grad_x,) = torch.autograd.grad(out, [x], grad_out)
        return grad_x

    def _duplicate(
        self,
        key: Hashable,
        started: float,
        recompute: Callable[[], tuple[float | None, torch.Tensor | None]],
    ) -> Response:
        """A retried hop we already applied: the same answer, no second accumulation."""
        self.counters.duplicates += 1
        cached = self._applied.reply(key)
        if cached is not None:
            header = dict(cached.header, **self._reply_fields(started), duplicate=True)
            return Response(header, cached.tensors)
        loss, grad_x = recompute()
        out = [] if grad_x is None else [encode(grad_x, self.backward_codec)]  # not through EF
        fields = self._reply_fields(started)
        if loss is not None:
            return Response(to_header(LossReply(loss=loss, duplicate=True, **fields)), list(out))
        return Response(to_header(BackwardReply(duplicate=True, **fields)), list(out))

    def _encode_grad(self, hop: HopId, grad_x: torch.Tensor | None) -> list[Sendable]:
        if grad_x is None:
            return []
        if self.config.error_feedback:
            key = (hop.trainer, self.stage, "grad_input")
            return [self._ef.encode(key, grad_x, self.backward_codec)]
        return [encode(grad_x, self.backward_codec)]

    def _apply(self, key: Hashable, batch: int, reply: Response) -> Response:
        """Record the micro-batch as applied, then let the optimizer take its gradients."""
        self._applied.add(key, reply)
        self.counters.applied += 1
        self.counters.samples_accumulated += batch
        self._in_optimizer(lambda: self.optimizer.step(batch))
        if (
            self._checkpoints is not None
            and self._checkpoints.due(self.clock(), self.optimizer.local_epoch)
            and not self.optimizer.background_busy()  # its export would wait for that work
        ):
            self._checkpoint()
        return reply

    def _in_optimizer(self, call: Callable[[], object]) -> object:
        """Device thread: ``call`` into the optimizer, timed; refresh the digest after a step."""
        started = time.perf_counter()
        try:
            return call()
        finally:
            took = time.perf_counter() - started
            self.counters.optimizer_s += took
            self.counters.optimizer_max_s = max(self.counters.optimizer_max_s, took)
            if self.optimizer.local_epoch != self._digest[0]:
                self._digest = (self.optimizer.local_epoch, self.param_digest())

    def _step_if_due(self) -> None:
        """Device thread (the periodic check): join the stage's epoch step if it is due."""
        if self.state != "online":
            return
        try:
            if self._in_optimizer(self.optimizer.step_if_due):
                self.counters.idle_steps += 1
        except Exception:  # keep serving: the next micro-batch's step tries again
            log.exception("stage %d: the periodic step check failed", self.stage)

    # ---- checkpoints (device thread) ------------------------------------------------

    def _checkpoint(self) -> Future[None] | None:
        """Copy the state and hand it to the writer (device thread); None if the export failed."""
        assert self._checkpoints is not None
        try:
            epoch, tensors, meta = self.optimizer.export_state()
        except Exception:  # a bug or a torch failure: the checkpoint is skipped, serving goes on
            self.counters.export_failures += 1
            log.exception("stage %d: exporting the state for a checkpoint failed", self.stage)
            return None
        return self._checkpoints.submit(self.clock(), epoch, tensors, meta)

    def param_digest(self) -> str:
        """SHA-256 (16 hex) of the stage's parameters and buffers, in state_dict order.

        Call on the device thread (or while no job runs): replicas of a stage at the same
        epoch hold equal digests when averaging leaves them bit-identical."""
        h = hashlib.sha256()
        for name, tensor in self.module.state_dict().items():
            h.update(name.encode())
            h.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def _eval_loss(self, msg: EvalLossRequest, tensors: list[torch.Tensor]) -> Response:
        started = time.perf_counter()
        self.contract.check_count(tensors, 2, "eval_loss")
        x = self._input(tensors[0])
        self.contract.check_targets(tensors[1], int(x.shape[0]), int(x.shape[1]))
        with torch.no_grad():
            loss = float(self.module.forward_loss(x, tensors[1].to(self.device)))
        if not math.isfinite(loss):
            raise refuse(ErrorCode.INTERNAL, "the loss is not finite")
        self.counters.eval_loss += 1
        return Response(to_header(EvalReply(loss=loss, **self._reply_fields(started))))
