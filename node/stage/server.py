"""The stage server: one pipeline stage's parameters, served to trainers over the endpoint.

Serves the training protocol (protocol.py) for stage ``s`` of the run: ``forward``,
``forward_loss`` (last stage), ``backward``, ``eval_loss`` (last stage) and
``stage_info``. This module is the event-loop side and the daemon ``Component``: it parses
each request's header, admits it (run, stage and trainer id match; the server is online;
the device queue has room) and queues its job. The pieces:

- device_queue.py: the one device thread and its bounded queue (``busy``, expiry, backwards
  first);
- jobs.py: what each request computes there, applied once, and the optimizer steps;
- server_config.py: the ``[stage_server]`` config.

Values are checked where the tensors are: the endpoint refuses NaN/Inf on receipt, the
jobs refuse values beyond the run spec's ``[limits]`` (``out_of_range``, docs/hostile.md)
on the device thread before computing on them, and their own results before accumulating.

Every ``step_check_period_s`` a check job on the device thread calls
``optimizer.step_if_due()`` as well: a synchronous all-reduce needs every replica of the
stage, and a replica that no micro-batch reaches (trainers route around the one stalled in
the all-reduce) would otherwise join only when its next request arrives, leaving the other
blocked until the round times out.

The throughput announced in the DHT record is measured at start by a short local
benchmark (forward+backward of one micro-batch) and cached in the state directory by
``(run_id, stage, device)``.

With a state directory the server checkpoints its stage (docs/checkpoints.md) every
``checkpoint_period_s``, checked after an optimizer step on the device thread (jobs.py),
and in ``drain`` after the flush. ``open`` resumes from our newest checkpoint when it is
newer than what the stage's peers gave, or when no peer answered; ``status()`` says which
source won.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ...transport.endpoint import Handler, Request, Response
from ...transport.errors import RemoteError
from ..config.runspec import RunSpec
from ..logs import get_logger
from ..membership.records import ServerState
from ..protocol import (
    BackwardRequest,
    ErrorCode,
    EvalLossRequest,
    ForwardLossRequest,
    ForwardRequest,
    HopId,
    InfoReply,
    InfoRequest,
    Kind,
    StageContract,
    parse_request,
    refuse,
    to_header,
)
from ..training.model import StageModule, build_stage
from .checkpointer import Checkpointer, ResumeSource
from .device_queue import DeviceQueue, Lane
from .jobs import StageJobs, StageServerCounters
from .memory import StageFootprint, check_fits, limit_device_memory
from .optimizer import Caught, StageOptimizer
from .precision import ComputePrecision
from .server_config import StageServerConfig
from .state import DonorSource, StageStateSharing
from .throughput import cached_throughput

log = get_logger(__name__)


class HandlerRegistry(Protocol):
    """Where the server registers its request kinds (``transport.endpoint.Endpoint``)."""

    def register(
        self,
        kind: str,
        handler: Handler,
        *,
        allow_nonfinite: bool = False,
        device: str | None = None,
    ) -> None: ...


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
        # before anything is allocated: StageMemoryError names the stages that would fit
        self.footprint: StageFootprint = check_fits(spec, stage, config, self.device)
        limit_device_memory(config, self.device)
        self.module: StageModule = build_stage(spec, stage).to(self.device)
        self.optimizer = make_optimizer(self.module)
        self.state_dir = state_dir
        self.clock = clock
        self.counters = StageServerCounters()
        self.state: ServerState = "joining"
        self.throughput = 0.0
        self.paused = False  # wanswarm pause: refuse work, stay in the swarm
        self._queue = DeviceQueue(
            stage, config.queue_size, self.counters, clock=clock, on_change=self._announce_queue
        )
        self._membership: Any = None
        self._closed = False
        self._checker: asyncio.Task[None] | None = None
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
                max_epoch_lead=config.state_transfer.max_epoch_lead,
            )
        )
        self._jobs = StageJobs(
            spec,
            config,
            contract=self.contract,
            module=self.module,
            optimizer=self.optimizer,
            device=self.device,
            counters=self.counters,
            checkpoints=self._checkpoints,
            clock=clock,
            queue_len=lambda: self._queue.pending,
        )
        # ``donors``: the stage's online replicas, to download from (then ``endpoint`` must send
        # requests too, i.e. be a transport Endpoint); every server donates its own state
        self._sharing = StageStateSharing(
            endpoint, stage, self.optimizer, self._queue.executor, config.state_transfer,
            donors=donors, serving=lambda: self.state == "online",
        )
        for kind, handler in (
            (Kind.FORWARD, self._on_forward),
            (Kind.FORWARD_LOSS, self._on_forward_loss),
            (Kind.BACKWARD, self._on_backward),
            (Kind.EVAL_LOSS, self._on_eval_loss),
            (Kind.STAGE_INFO, self._on_info),
        ):
            if self.device.type == "cuda":  # requests dequantized straight into GPU memory
                endpoint.register(str(kind), handler, device=str(self.device))
            else:
                endpoint.register(str(kind), handler)

    # ---- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        """Load the stage's state from its peers or our checkpoint, measure throughput, then
        serve."""
        loop = asyncio.get_running_loop()
        # a replica that falls behind later catches up through our transport (resync.py)
        timeout = self.config.state_transfer.timeout_s
        def catch_up(only: Collection[str] | None = None, stand_in: bool = False) -> Caught:
            return self._sharing.resync(loop, timeout, only, stand_in)

        self.optimizer.catch_up_with(catch_up)
        loaded = await self._sharing.load()
        peer_epoch = self.optimizer.local_epoch
        log.info("stage %d: %s, epoch %d", self.stage,
                 "state loaded from peers" if loaded else "no peers to load state from", peer_epoch)
        self.resumed_from = "peers" if loaded else "fresh"
        if self._checkpoints is not None:
            self.resumed_from = await loop.run_in_executor(
                self._queue.executor,
                self._checkpoints.resume,
                # the method is looked up only when a checkpoint is found
                lambda *state: self.optimizer.import_state(*state),
                loaded,
                peer_epoch,
            )
            self._checkpoints.schedule.mark(self.clock(), self.optimizer.local_epoch)
        self._state_settled = True
        self.throughput = await loop.run_in_executor(
            self._queue.executor,
            cached_throughput,
            self.module,
            self.spec,
            self.stage,
            self.device,
            self.state_dir,
            self.config.benchmark_iterations,
            self._jobs.precision,
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
        ctx.membership.update(
            throughput=0.0 if self.paused else self.throughput, queue=self._queue.pending
        )

    def pause(self) -> None:
        """``wanswarm pause``: refuse new work (``busy``), announce no throughput so that
        trainers and stage selection look elsewhere; keep the state, the stage and the
        epoch steps (averaging goes on with what was accumulated)."""
        self.paused = True
        if self._membership is not None:
            self._membership.update(throughput=0.0)

    def resume(self) -> None:
        """``wanswarm resume``: take work again, announce the measured throughput."""
        self.paused = False
        if self._membership is not None:
            self._membership.update(throughput=self.throughput)

    async def drain(self, deadline: float) -> None:
        """Refuse new work, finish queued jobs, apply pending averaging and save a checkpoint,
        by ``deadline``."""
        self.state = "draining"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                await self._queue.wait_idle()
                await loop.run_in_executor(self._queue.executor, self.optimizer.flush)
                # a server that never settled its state (open failed) must not save a fresh one
                if self._checkpoints is not None and self._state_settled:
                    written = await loop.run_in_executor(
                        self._queue.executor, self._jobs.checkpoint
                    )
                    if written is not None:
                        await asyncio.wrap_future(written)
        except TimeoutError:
            log.warning(
                "stage %d: drain deadline reached with %d jobs queued%s",
                self.stage,
                self._queue.pending,
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
        await loop.run_in_executor(self._queue.executor, self.optimizer.shutdown)
        self._queue.shutdown()
        self._jobs.fingerprints.close()
        if self._checkpoints is not None:
            await asyncio.to_thread(self._checkpoints.close)  # a write in flight finishes

    def _fingerprint_fields(self) -> dict[str, Any]:
        epoch, digest, sketch = self._jobs.fingerprints.latest
        return {
            "digest_epoch": epoch,
            "param_digest": digest,
            "param_sketch": sketch,  # same epoch: relative_distance of two replicas
            "fingerprints_skipped": self._jobs.fingerprints.skipped,
        }

    def status(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "state": self.state,
            "paused": self.paused,
            "queue": self._queue.pending,
            "throughput": round(self.throughput, 2),
            "epoch": self.optimizer.local_epoch,
            "samples_accumulated": self.optimizer.samples_accumulated,
            "synchronized": self.optimizer.is_synchronized(),
            "replicas_seen": self.optimizer.num_peers,
            "averaging": self.optimizer.averaging_status(),
            "cache": self._jobs.cached_inputs,
            **self._fingerprint_fields(),
            "resumed_from": self.resumed_from,
            "device": str(self.device),
            "precision": self.precision.describe(),
            "memory_estimate_mb": round(self.footprint.total / 2**20, 1),
            "memory_limit_mb": self.config.max_device_memory_mb,
            "graphs_kept": self._jobs.kept_graphs,
            "state_download": self._sharing.last_download,
            "state_download_progress": self._sharing.download_progress,
            "state_wait": self._sharing.waiting,
            "state_stand_in": self._sharing.stand_in,
            "state_donated": {
                "manifests": self._sharing.donor.counts["manifests"],
                "chunks": self._sharing.donor.counts["chunks"],
                # manifest requests answered 'preparing' (a snapshot waited for a round)
                "preparing": self._sharing.donor.counts["preparing"],
            },
            **(
                Checkpointer.EMPTY_STATUS
                if self._checkpoints is None
                else self._checkpoints.status()
            ),
            **asdict(self.counters),
        }

    @property
    def precision(self) -> ComputePrecision:
        """The arithmetic the stage computes in on its device (precision.py)."""
        return self._jobs.precision

    def applied_keys(self) -> frozenset[Hashable]:
        """``(trainer, micro_batch, stage)`` of the micro-batches applied here (recent ones)."""
        return self._jobs.applied_keys()

    @property
    def queue_len(self) -> int:
        """Jobs queued or running on the device thread."""
        return self._queue.pending

    def param_digest(self) -> str:
        """SHA-256 (16 hex) of the stage's parameters and buffers, in state_dict order.

        Call on the device thread (or while no job runs): replicas of a stage at the same
        epoch hold equal digests when averaging leaves them bit-identical."""
        return self._jobs.param_digest()

    # ---- admission and the periodic step check --------------------------------------

    def _admit(self, hop: HopId, sender: str, lane: Lane = Lane.START) -> None:
        try:
            self.contract.check_hop(hop, sender)
            if self.state == "joining":
                raise refuse(ErrorCode.NOT_READY, "still loading the stage's state")
            if self.state == "draining":
                raise refuse(ErrorCode.DRAINING, "leaving: send elsewhere")
            if self.paused:
                raise refuse(ErrorCode.BUSY, "paused: send elsewhere")
        except RemoteError:
            self.counters.refused += 1
            raise
        self._queue.admit(sender, lane)

    async def _check_step_loop(self) -> None:
        """While online: every step_check_period_s, a device-thread job joins a due epoch step
        (one job at a time: it waits behind queued requests)."""
        loop = asyncio.get_running_loop()
        while self.state == "online":
            await asyncio.sleep(self.config.step_check_period_s)
            if self.state != "online":
                return
            try:
                await loop.run_in_executor(self._queue.executor, self._step_if_due)
            except RuntimeError:  # the executor was shut down
                return

    def _step_if_due(self) -> None:
        """Device thread (the periodic check): join the stage's epoch step if it is due."""
        if self.state != "online":
            return
        self._jobs.step_if_due()

    def _announce_queue(self, pending: int) -> None:
        if self._membership is not None:
            self._membership.update(queue=pending)

    # ---- handlers (event loop) ----------------------------------------------------

    async def _on_forward(self, request: Request) -> Response:
        msg = parse_request(ForwardRequest, request.header)
        self._admit(msg.hop, request.peer_id)
        if self.contract.last:
            self.counters.refused += 1
            raise refuse(ErrorCode.BAD_REQUEST, "the last stage answers forward_loss and eval_loss")
        return await self._queue.run(
            request.peer_id, msg.budget_s,
            lambda: self._jobs.forward(msg, request.tensors, request.peaks()),
        )

    async def _on_forward_loss(self, request: Request) -> Response:
        msg = parse_request(ForwardLossRequest, request.header)
        lane = Lane.START if msg.check else Lane.FINISH  # a check finishes no micro-batch
        self._admit(msg.hop, request.peer_id, lane)
        self._require_last("forward_loss")
        return await self._queue.run(
            request.peer_id, msg.budget_s,
            lambda: self._jobs.forward_loss(msg, request.tensors, request.peaks()),
            lane,
        )

    async def _on_backward(self, request: Request) -> Response:
        msg = parse_request(BackwardRequest, request.header)
        # a spot check completes nobody's micro-batch here: it waits with the forwards
        lane = Lane.START if msg.check else Lane.FINISH
        self._admit(msg.hop, request.peer_id, lane)
        if self.contract.last:
            self.counters.refused += 1
            raise refuse(ErrorCode.BAD_REQUEST, "the last stage's backward is forward_loss")
        return await self._queue.run(
            request.peer_id, msg.budget_s,
            lambda: self._jobs.backward(msg, request.tensors, request.peaks()),
            lane,
        )

    async def _on_eval_loss(self, request: Request) -> Response:
        msg = parse_request(EvalLossRequest, request.header)
        self._admit(msg.hop, request.peer_id)
        self._require_last("eval_loss")
        return await self._queue.run(
            request.peer_id, msg.budget_s,
            lambda: self._jobs.eval_loss(msg, request.tensors, request.peaks()),
        )

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
            queue_len=self._queue.pending,
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
