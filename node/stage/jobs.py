"""The stage's jobs: what a stage server computes on its device thread, and what it counts.

One method per request kind, each run as one job of the device queue (device_queue.py):

- ``forward`` (no grad): runs the stage on ``x`` and, unless asked not to, keeps ``x`` in a
  bounded cache keyed by ``(trainer, micro_batch)`` so that the backward can reference it
  instead of resending it. On a GPU its reply is deferred (device_queue.Deferred): the
  output's copy to the host, and the check of its payload, finish off the device thread
  while the next job computes; a refused output's cache entries are forgotten by the
  device thread before its next forward or backward;
- ``forward_loss`` (last stage): loss and ``dL/dx`` in one round trip, accumulating the
  parameter gradients;
- ``backward``: runs from the autograd graph the forward kept (up to ``max_in_flight``
  micro-batches, memory.GraphCache), else recomputes the forward from the carried or
  cached ``x`` (``cache_miss`` if the reference is gone: the trainer resends), accumulates
  the parameter gradients and returns ``dL/dx`` (nothing on stage 0);
- ``eval_loss`` (last stage, no grad).

Every job computes in the run's precision (precision.py: fp32, or bf16/fp16 autocast over
float32 parameters; activations of any float dtype are accepted and cast to it) and sends
its activations and gradients as float32 payloads, quantized from their own dtype.

In a subspace run (docs/compression.md) a job computes ``_run``: it rebuilds its input
``U x + E_fixed[ids]`` from the boundary's coefficients and the token ids that follow them
in the request (cached with the input for a backward by reference), runs the module, and
answers the output's coefficients ``U^T (y - E_fixed[ids])``; autograd carries the gradient
through both transforms, so ``dL/dx`` leaves at the previous boundary's width.

Every job checks its tensors against the stage's contract before computing on them: shape,
dtype and the run's value bounds (``[limits]`` of the run spec; docs/hostile.md). Its own
results are checked too, before anything is kept: an output beyond ``max_activation``, a
loss, ``dL/dx`` or parameter-gradient norm that is not finite or beyond its bound answers
``out_of_range``. Parameter gradients are computed into scratch tensors
(``torch.autograd.grad``) and added to ``.grad`` only after every check passed, so a
refused micro-batch leaves the accumulated gradients exactly as they were: one hostile
request cannot poison what every replica of the stage averages. Non-finite gradients are
refused, never clipped into NaN.

Idempotency: the jobs remember which ``(trainer, micro_batch, stage)`` they applied (a
bounded log). A duplicate ``backward``/``forward_loss`` (a retry after a lost reply)
returns the cached reply when it is still held, else recomputes ``dL/dx`` without touching
the parameter gradients. Gradients of the backward leg are encoded with the run's backward
codec through error feedback keyed by ``(trainer, stage, "grad_input")``; activations with
the forward codec.

After each applied micro-batch the job calls ``optimizer.step(batch_size)`` (the averaging
adapter): it steps when the stage's collaboration reaches ``target_batch_size``. With a
checkpointer, a checkpoint that is due is taken right after that call (never on a
half-updated state; the checkpointer's writer thread does the disk work).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...transport import staging
from ...transport.codecs import (
    CodecSpec,
    EncodedTensor,
    PendingEncode,
    encode_start,
    parse_codec,
    payload_peak,
)
from ...transport.endpoint import Response
from ...transport.error_feedback import ErrorFeedback
from ...transport.errors import PayloadError, RemoteError
from ...transport.tensors import Sendable
from ..config.runspec import RunSpec
from ..logs import get_logger
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
    LossReply,
    StageContract,
    check_result,
    refuse,
    to_header,
)
from ..training.model import StageModule
from .checkpointer import Checkpointer
from .device_queue import Deferred
from .fingerprint import Fingerprinter
from .memory import AppliedLog, GraphCache, InputCache
from .optimizer import StageOptimizer
from .precision import ComputePrecision, resolve_precision
from .server_config import StageServerConfig
from .state_tensors import tensors_digest

log = get_logger(__name__)

# Activations and gradients travel as float32 payloads (what the protocol's contract
# checks); a bf16/fp16 tensor is quantized from its own dtype into such a payload.
WIRE_DTYPE = torch.float32

# Each request tensor's largest |value| as its payload told it on the host (Request.peaks),
# None where unknown; empty for a request built in-process.
Peaks = Sequence[float | None]
# Encodes and checks dL/dx (None on stage 0) into the reply's tensors; the callable is
# the micro-batch's other checks, run first once dL/dx's payload is on the host.
Emit = Callable[[torch.Tensor | None, Callable[[], None]], list[Sendable]]


@dataclass
class StageServerCounters:
    """What the server did since start (the device thread and the event loop write disjoint
    fields)."""

    forward: int = 0  # computed (an output refused after its copy included)
    forward_loss: int = 0
    backward: int = 0
    backward_checks: int = 0  # spot checks of another replica's backward (nothing kept)
    forward_loss_checks: int = 0  # the same for forward_loss
    eval_loss: int = 0
    info: int = 0
    applied: int = 0  # micro-batches whose gradients were accumulated
    samples_accumulated: int = 0
    duplicates: int = 0  # retried hops answered without accumulating again
    cache_misses: int = 0
    expired: int = 0  # dropped before running: out of budget or abandoned
    failed: int = 0  # refused (bad_request) or failed (internal) on the device
    # of those: a value beyond the run's limits; nothing was accumulated (the device thread
    # and the finishing thread write it, under StageJobs' lock)
    out_of_range: int = 0
    busy: int = 0  # event loop: refused because the queue was full
    refused: int = 0  # event loop: wrong run/stage, malformed header, not ready, draining
    compute_s: float = 0.0
    # device thread: inside the optimizer (accumulating; at an epoch's end, a synchronous
    # step also waits there for the stage's all-reduce, and every queued request with it)
    optimizer_s: float = 0.0
    optimizer_max_s: float = 0.0
    idle_steps: int = 0  # epoch steps joined by the periodic check, no micro-batch at hand
    export_failures: int = 0  # device thread: the state could not be exported for a checkpoint


class StageJobs:
    """The device-thread work of one stage (see the module docstring). Call its methods on
    the device thread, or while no job runs.

    ``queue_len`` is the number of jobs queued or running, this one included (replies
    report the others)."""

    def __init__(
        self,
        spec: RunSpec,
        config: StageServerConfig,
        *,
        contract: StageContract,
        module: StageModule,
        optimizer: StageOptimizer,
        device: torch.device,
        counters: StageServerCounters,
        checkpoints: Checkpointer | None,
        clock: Callable[[], float],
        queue_len: Callable[[], int],
    ) -> None:
        self.config = config
        self.contract = contract
        self.stage = contract.stage
        self.module = module
        self.optimizer = optimizer
        self.device = device
        self.counters = counters
        self.clock = clock
        self.limits = spec.limits
        self.precision: ComputePrecision = resolve_precision(spec.precision.compute, device)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.forward_codec: CodecSpec = parse_codec(spec.codecs.forward_activations)
        self.backward_codec: CodecSpec = parse_codec(spec.codecs.backward_gradients)
        # (epoch, param_digest, count sketch) after an epoch's step, computed off this
        # thread; the sketch tells how far replicas are apart (fingerprint.py)
        self.fingerprints = Fingerprinter()
        self._fingerprinted_epoch = -1
        self._checkpoints = checkpoints
        self._queue_len = queue_len
        self._cache = InputCache(config.cache_entries, config.cache_bytes, config.cache_ttl_s)
        # a subspace run's token ids of the cached inputs (same keys, same bounds)
        self._ids_cache = InputCache(config.cache_entries, config.cache_bytes, config.cache_ttl_s)
        self._graphs = GraphCache(config.max_in_flight, config.cache_ttl_s)
        self._applied = AppliedLog(config.applied_entries, config.reply_cache_entries)
        self._ef = ErrorFeedback(max_entries=1 << 16, max_bytes=config.error_feedback_bytes)
        # forwards whose deferred output was refused: their cache entries, to forget (the
        # finishing thread appends, the device thread takes)
        self._refused: deque[tuple[str, int]] = deque()
        self._count_lock = threading.Lock()

    @property
    def cached_inputs(self) -> int:
        """Forward inputs held for backward references."""
        return len(self._cache)

    @property
    def kept_graphs(self) -> int:
        """Forward graphs held for their backward (at most ``max_in_flight``)."""
        return len(self._graphs)

    def applied_keys(self) -> frozenset[Hashable]:
        """``(trainer, micro_batch, stage)`` of the micro-batches applied here (recent ones)."""
        return self._applied.keys()

    def _reply_fields(self, started: float) -> dict[str, Any]:
        return {
            "queue_len": max(0, self._queue_len() - 1),
            "epoch": self.optimizer.local_epoch,
            # the parameters that computed this answer (the device thread: none changed since)
            "params": self.optimizer.params_version(),
            "compute_s": max(0.0, time.perf_counter() - started),
        }

    # ---- the request kinds ----------------------------------------------------------

    @contextmanager
    def _counting(self) -> Iterator[None]:
        """Count an ``out_of_range`` refusal raised inside."""
        try:
            yield
        except RemoteError as exc:
            if exc.code == ErrorCode.OUT_OF_RANGE:
                with self._count_lock:
                    self.counters.out_of_range += 1
            raise

    def _input(self, x: torch.Tensor, peak: float | None) -> torch.Tensor:
        """A checked input on the device: token ids (checked on the host, where the
        endpoint leaves them), or activations of any float dtype (checked as float32) in
        the stage's activation dtype. ``peak``: the input's largest |value| as its payload
        told it (None: computed here)."""
        if self.contract.first:
            with self._counting():
                self.contract.check_input(x)
            return self._on_device(x)
        x = _as_float32(x)
        with self._counting():
            self.contract.check_input(x, peak)
        return self._to_device(x)

    def _ids(self, tensors: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor | None:
        """The token ids that follow ``x`` in a subspace run's request (checked, on the
        device), else None."""
        if self.contract.ids_dtype is None:
            return None
        with self._counting():
            self.contract.check_ids(tensors[1], int(x.shape[0]), int(x.shape[1]))
        return self._on_device(tensors[1])

    def _run(self, x: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """The stage's output as it goes on the wire: the module's, or in a subspace run
        (docs/compression.md) its coefficients ``U^T (y - E_fixed[tokens])``, computed from
        the rebuilt input ``U x + E_fixed[tokens]``; autograd then carries the gradients
        through both transforms (``U^T g`` back to the previous stage)."""
        subspace = self.module.subspace
        if subspace is None:
            return self.module(x)  # (B, T, C)
        tokens = x if self.contract.first else ids
        assert tokens is not None  # the contract requires ids after stage 0
        h = x if self.contract.first else subspace.from_wire(x, tokens, self.stage - 1)
        y = self.module(h)  # (B, T, C)
        return y if self.contract.last else subspace.to_wire(y, tokens, self.stage)  # (B, T, k)

    def _run_loss(
        self, x: torch.Tensor, ids: torch.Tensor | None, targets: torch.Tensor
    ) -> torch.Tensor:
        """The last stage's loss, from its input as ``_run`` rebuilds it."""
        subspace = self.module.subspace
        if subspace is not None and not self.contract.first:
            assert ids is not None
            x = subspace.from_wire(x, ids, self.stage - 1)  # (B, T, C)
        return self.module.forward_loss(x, targets)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """An activation or gradient on the device, in the stage's activation dtype (a
        cast there, after the copy: only the narrower of the two dtypes crosses the bus
        when they differ)."""
        dtype = self.precision.activation_dtype()
        if t.dtype.itemsize > dtype.itemsize:
            t = t.to(dtype)
        return self._on_device(t).to(dtype)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the stage's device: a host tensor goes through pinned memory on the copy
        stream (staging.py), which never makes the host wait for the GPU."""
        if t.device.type == "cpu" and self.device.type != "cpu":
            return staging.to_device(t, self.device)
        return t.to(self.device)

    def _check(self, value: float, bound: float, what: str) -> None:
        """One of our results against its bound (``out_of_range``)."""
        with self._counting():
            check_result(value, bound, what)

    def _accept(
        self, payload: EncodedTensor, bound: float, what: str,
        before: Callable[[], None] | None = None,
    ) -> None:
        """One of our results, encoded, against its bound (``out_of_range``): the largest
        |value| its receiver will decode, from the payload's scales on the host
        (codecs.payload_peak), so the device is not asked for the tensor's maximum.
        ``before`` (the micro-batch's other checks) runs first."""
        if before is not None:
            before()
        peak = payload_peak(payload)
        self._check(0.0 if peak is None else peak, bound, what)

    def _encode_checked(
        self, t: torch.Tensor, codec: CodecSpec, bound: float, what: str,
        ef_key: Hashable | None = None, before: Callable[[], None] | None = None,
    ) -> EncodedTensor:
        """``t`` encoded as a float32 payload (through error feedback under ``ef_key``),
        refused as ``out_of_range`` when it holds NaN/Inf or decodes beyond ``bound``;
        a refused tensor leaves its error-feedback residual as it was. ``before`` (other
        checks of the same micro-batch) runs first, once the payload is on the host: on a
        GPU one wait serves them all."""
        try:
            if ef_key is None:
                pending = encode_start(t, codec, dtype=WIRE_DTYPE)
                return self._finish_checked(pending, bound, what, before)
            accept = functools.partial(self._accept, bound=bound, what=what, before=before)
            return self._ef.encode(ef_key, t.to(WIRE_DTYPE), codec, accept=accept)
        except PayloadError:  # the quantizer met NaN/Inf
            raise self._not_finite(what) from None

    def _finish_checked(
        self, pending: PendingEncode, bound: float, what: str,
        before: Callable[[], None] | None = None,
    ) -> EncodedTensor:
        """A launched encoding's payload, once on the host, checked as ``_encode_checked``
        checks it. Safe on the finishing thread (without ``before``): it reads only the
        payload."""
        try:
            out = pending.result()
        except PayloadError:  # a device quantizer met NaN/Inf
            raise self._not_finite(what) from None
        self._accept(out, bound, what, before)
        return out

    def _not_finite(self, what: str) -> RemoteError:
        """The ``out_of_range`` refusal of a result that holds NaN/Inf, counted."""
        with self._count_lock:
            self.counters.out_of_range += 1
        return refuse(ErrorCode.OUT_OF_RANGE, f"{what} is not finite")

    def forward(
        self, msg: ForwardRequest, tensors: list[torch.Tensor], peaks: Peaks = ()
    ) -> Response | Deferred:
        """The stage's output; deferred (its copy and check finish off the device thread)
        when encoding left a copy to the host under way."""
        started = time.perf_counter()
        self._forget_refused()
        self.contract.check_count(tensors, self.contract.n_inputs, "forward")
        x = self._input(tensors[0], _peak(peaks, 0))
        ids = self._ids(tensors, x)
        ref = (msg.hop.trainer, msg.hop.micro_batch)
        keep_graph = msg.keep_input and self.config.max_in_flight > 0
        leaf = x if self.contract.first or not keep_graph else x.detach().requires_grad_(True)
        with torch.set_grad_enabled(keep_graph), self.precision.autocast():
            y = self._run(leaf, ids)  # (B, T, C) or (B, T, k), in the compute dtype
        what = f"stage {self.stage}'s output"
        try:
            pending = encode_start(y, self.forward_codec, dtype=WIRE_DTYPE)
        except PayloadError:  # the CPU quantizer met NaN/Inf
            raise self._not_finite(what) from None
        now = self.clock()
        cached = msg.keep_input and self._cache.put(ref, x, now)
        if cached and ids is not None:
            cached = self._ids_cache.put(ref, ids, now)
            if not cached:
                self._cache.pop(ref)
        if cached and keep_graph:  # its backward then starts from this graph
            self._graphs.put(ref, y, leaf, self.optimizer.local_epoch, now)
        else:
            self._graphs.pop(ref)
        self.counters.forward += 1
        header = to_header(ForwardReply(cached=cached, **self._reply_fields(started)))

        def finish(deferred: bool) -> Response:
            try:
                out = self._finish_checked(pending, self.limits.max_activation, what)
            except RemoteError:  # nothing of a refused forward is kept
                if deferred:
                    self._refused.append(ref)
                else:
                    self._forget(ref)
                raise
            return Response(header, [out])

        if pending.copying:
            return Deferred(functools.partial(finish, True))
        return finish(False)

    def _forget(self, ref: tuple[str, int]) -> None:
        """Drop what a forward kept for its backward."""
        self._cache.pop(ref)
        self._ids_cache.pop(ref)
        self._graphs.pop(ref)

    def _forget_refused(self) -> None:
        """Forget what the forwards refused after their copy had kept (device thread)."""
        while self._refused:
            self._forget(self._refused.popleft())

    def forward_loss(
        self, msg: ForwardLossRequest, tensors: list[torch.Tensor], peaks: Peaks = ()
    ) -> Response:
        started = time.perf_counter()
        n_in = self.contract.n_inputs
        self.contract.check_count(tensors, n_in + 1, "forward_loss")
        x = self._input(tensors[0], _peak(peaks, 0))
        ids = self._ids(tensors, x)
        batch, length = int(x.shape[0]), int(x.shape[1])
        self.contract.check_targets(tensors[n_in], batch, length)
        targets = self._on_device(tensors[n_in])
        if msg.check:  # another replica's answer checked: nothing of ours is touched
            self.counters.forward_loss_checks += 1
            plain = functools.partial(self._emit_grad, None)
            value, checked = self._loss_and_grad(x, ids, targets, plain, accumulate=False)
            reply = LossReply(loss=value, duplicate=False, **self._reply_fields(started))
            return Response(to_header(reply), checked)
        key = msg.hop.key
        self.counters.forward_loss += 1
        if key in self._applied:
            plain = functools.partial(self._emit_grad, None)
            return self._duplicate(
                key, started,
                lambda: self._loss_and_grad(x, ids, targets, plain, accumulate=False),
            )
        emit = functools.partial(self._emit_grad, self._ef_key(msg.hop))
        loss, out = self._loss_and_grad(x, ids, targets, emit, accumulate=True)
        header = LossReply(loss=loss, duplicate=False, **self._reply_fields(started))
        return self._apply(key, batch, Response(to_header(header), out))

    def _loss_and_grad(
        self, x: torch.Tensor, ids: torch.Tensor | None, targets: torch.Tensor, emit: Emit, *,
        accumulate: bool,
    ) -> tuple[float, list[Sendable]]:
        x = x if self.contract.first else x.detach().requires_grad_(True)
        with torch.enable_grad():
            with self.precision.autocast():
                loss = self._run_loss(x, ids, targets)  # (), float32
            grads = self._autograd(loss, x, None, accumulate=accumulate)
        value, out = self._finish(grads, emit, accumulate=accumulate, loss=loss.detach())
        assert value is not None  # read with the loss given
        return value, out

    def backward(
        self, msg: BackwardRequest, tensors: list[torch.Tensor], peaks: Peaks = ()
    ) -> Response:
        started = time.perf_counter()
        self._forget_refused()
        hop = msg.hop
        ref = (hop.trainer, hop.micro_batch)
        ids: torch.Tensor | None = None
        if msg.input_carried:
            n_in = self.contract.n_inputs
            self.contract.check_count(tensors, n_in + 1, "backward with its input")
            x = self._input(tensors[0], _peak(peaks, 0))
            ids = self._ids(tensors, x)
        else:
            self.contract.check_count(tensors, 1, "backward by reference")
            now = self.clock()
            cached = self._cache.get(ref, now)
            if self.contract.ids_dtype is not None and cached is not None:
                ids = self._ids_cache.get(ref, now)
                cached = None if ids is None else cached
            if cached is None:
                self.counters.cache_misses += 1
                raise refuse(
                    ErrorCode.CACHE_MISS, "the forward input is no longer cached: resend it"
                )
            x = cached
        batch, length = int(x.shape[0]), int(x.shape[1])
        grad_peak = _peak(peaks, len(tensors) - 1)
        with self._counting():
            self.contract.check_output_grad(_as_float32(tensors[-1]), batch, length, grad_peak)
        grad_y = self._to_device(_as_float32(tensors[-1]))
        if msg.check:  # another replica's answer checked: nothing of ours is touched
            self.counters.backward_checks += 1
            plain = functools.partial(self._emit_grad, None)
            checked = self._recompute(x, ids, grad_y, plain, accumulate=False)
            header = BackwardReply(duplicate=False, **self._reply_fields(started))
            return Response(to_header(header), checked)
        self.counters.backward += 1
        graph = None
        if not msg.input_carried:
            graph = self._graphs.take(ref, self.optimizer.local_epoch, self.clock())
        else:
            self._graphs.pop(ref)
        if hop.key in self._applied:
            plain = functools.partial(self._emit_grad, None)
            return self._duplicate(
                hop.key, started,
                lambda: (
                    None, self._recompute(x, ids, grad_y, plain, accumulate=False)
                ),
            )
        emit = functools.partial(self._emit_grad, self._ef_key(hop))
        out = None if graph is None else self._from_graph(graph, grad_y, emit)
        if out is None:
            out = self._recompute(x, ids, grad_y, emit, accumulate=True)
        self._cache.pop(ref)
        self._ids_cache.pop(ref)
        header = BackwardReply(duplicate=False, **self._reply_fields(started))
        return self._apply(hop.key, batch, Response(to_header(header), out))

    def _from_graph(
        self, graph: tuple[torch.Tensor, torch.Tensor], grad_y: torch.Tensor, emit: Emit
    ) -> list[Sendable] | None:
        """dL/dx as sent, accumulating dL/dtheta, through the graph the forward kept; None
        when it cannot serve (its parameters were changed in place since: an optimizer
        step that did not move the epoch yet), and the forward is recomputed."""
        y, leaf = graph
        try:
            with torch.enable_grad():
                grads = self._autograd(y, leaf, grad_y.to(y.dtype), accumulate=True)
        except RuntimeError as exc:  # autograd's check of the saved tensors' versions
            log.debug("stage %d: kept graph unusable (%s); recomputing", self.stage, exc)
            return None
        return self._finish(grads, emit, accumulate=True)[1]

    def _recompute(
        self, x: torch.Tensor, ids: torch.Tensor | None, grad_y: torch.Tensor, emit: Emit, *,
        accumulate: bool,
    ) -> list[Sendable]:
        x = x if self.contract.first else x.detach().requires_grad_(True)
        with torch.enable_grad():
            with self.precision.autocast():
                y = self._run(x, ids)  # (B, T, C) or (B, T, k), in the compute dtype
            grads = self._autograd(y, x, grad_y.to(y.dtype), accumulate=accumulate)
        return self._finish(grads, emit, accumulate=accumulate)[1]

    def _autograd(
        self, out: torch.Tensor, x: torch.Tensor, grad_out: torch.Tensor | None, *, accumulate: bool
    ) -> tuple[torch.Tensor | None, ...] | None:
        """``(dL/dx, *dL/dtheta)`` (no dL/dx on stage 0; dL/dtheta only with
        ``accumulate``) into scratch tensors, not ``.grad``: a refused micro-batch must
        leave no trace there. None when there is nothing to compute (stage 0's
        duplicate)."""
        inputs = [] if self.contract.first else [x]
        params = self._params if accumulate else []
        if not inputs and not params:
            return None
        if self.precision.scaler is None:
            return torch.autograd.grad(out, [*inputs, *params], grad_out, allow_unused=True)
        return self._scaled_grads(out, [*inputs, *params], grad_out)

    def _finish(
        self, grads: tuple[torch.Tensor | None, ...] | None, emit: Emit, *, accumulate: bool,
        loss: torch.Tensor | None = None,
    ) -> tuple[float | None, list[Sendable]]:
        """(the loss, dL/dx as sent): ``emit`` encodes and checks dL/dx, and with
        ``accumulate`` dL/dtheta is added to the parameters' ``.grad``, only once the loss,
        the parameter-gradient norm and then dL/dx passed their checks (error feedback
        keeps dL/dx's residual only then). The loss (given on the last stage) and the norm
        are copied to the host with dL/dx's payload: on a GPU the micro-batch waits for
        the device once, not once for each."""
        n_in = 0 if self.contract.first else 1
        param_grads = () if grads is None else grads[n_in:]
        scalars: list[torch.Tensor] = []  # (), float32 each, still on the device
        if loss is not None:
            scalars.append(loss.float().reshape(()))
        norm_at = len(scalars)
        if accumulate and any(g is not None for g in param_grads):
            scalars.append(_norm32(param_grads))
        copy = staging.start_to_host(torch.stack(scalars)) if scalars else None
        read: list[float] = []

        def check() -> None:
            """The loss and the norm against their bounds (once; first, the loss)."""
            if read or copy is None:
                return
            read.extend(float(v) for v in copy.wait())
            if loss is not None:
                self._check(read[0], self.limits.max_loss, "the loss")
            if norm_at < len(read):
                norm = read[norm_at]
                if not math.isfinite(norm):  # overflowed float32, or Inf/NaN: in float64
                    norm = _norm64(param_grads)
                self._check(norm, self.limits.max_grad_norm, "the parameter-gradient norm")

        grad_x = grads[0] if grads is not None and n_in else None
        out = emit(grad_x, check)
        check()  # when there was no dL/dx to emit
        if accumulate and grads is not None:
            with torch.no_grad():
                for p, g in zip(self._params, param_grads, strict=True):
                    if g is None:
                        continue  # not on this micro-batch's path
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)  # in place: an averager may hold .grad's buffers
        return (read[0] if loss is not None else None), out

    def _scaled_grads(
        self, out: torch.Tensor, wrt: list[torch.Tensor], grad_out: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        """fp16: the gradients through the loss scaler (precision.py), unscaled in float32.

        A scale that overflows is halved and the backward redone; at the scale's floor the
        gradients are returned as they are, and the checks refuse what is not finite."""
        scaler = self.precision.scaler
        assert scaler is not None
        seed = torch.ones_like(out) if grad_out is None else grad_out
        while True:
            scale = scaler.scale
            grads = torch.autograd.grad(
                out, wrt, seed * scale, allow_unused=True, retain_graph=True
            )
            found_inf = any(g is not None and not bool(torch.isfinite(g).all()) for g in grads)
            last = scaler.exhausted
            scaler.update(found_inf)
            if not found_inf or last:
                return tuple(None if g is None else g.float().div_(scale) for g in grads)

    def eval_loss(
        self, msg: EvalLossRequest, tensors: list[torch.Tensor], peaks: Peaks = ()
    ) -> Response:
        started = time.perf_counter()
        n_in = self.contract.n_inputs
        self.contract.check_count(tensors, n_in + 1, "eval_loss")
        x = self._input(tensors[0], _peak(peaks, 0))
        ids = self._ids(tensors, x)
        self.contract.check_targets(tensors[n_in], int(x.shape[0]), int(x.shape[1]))
        targets = self._on_device(tensors[n_in])
        with torch.no_grad(), self.precision.autocast():
            loss = float(self._run_loss(x, ids, targets))
        self._check(loss, self.limits.max_loss, "the loss")
        self.counters.eval_loss += 1
        return Response(to_header(EvalReply(loss=loss, **self._reply_fields(started))))

    # ---- applied once ---------------------------------------------------------------

    def _duplicate(
        self,
        key: Hashable,
        started: float,
        recompute: Callable[[], tuple[float | None, list[Sendable]]],
    ) -> Response:
        """A retried hop we already applied: the same answer, no second accumulation."""
        self.counters.duplicates += 1
        cached = self._applied.reply(key)
        if cached is not None:
            fields = self._reply_fields(started)
            if cached.header.get("params") != fields["params"]:
                fields["params"] = None  # answered with parameters that have changed since
            header = dict(cached.header, **fields, duplicate=True)
            return Response(header, cached.tensors)
        loss, out = recompute()  # dL/dx not through error feedback
        fields = self._reply_fields(started)
        if loss is not None:
            return Response(to_header(LossReply(loss=loss, duplicate=True, **fields)), out)
        return Response(to_header(BackwardReply(duplicate=True, **fields)), out)

    def _emit_grad(
        self, ef_key: Hashable | None, grad_x: torch.Tensor | None,
        before: Callable[[], None] | None = None,
    ) -> list[Sendable]:
        """dL/dx as sent, checked after ``before``: through error feedback under ``ef_key``
        (an applied hop's, :meth:`_ef_key`), or not (None: a duplicate's recomputed
        dL/dx)."""
        if grad_x is None:
            return []
        bound = self.limits.max_gradient
        return [self._encode_checked(grad_x, self.backward_codec, bound, "dL/dx", ef_key, before)]

    def _ef_key(self, hop: HopId) -> Hashable | None:
        """The error-feedback key of an applied hop's dL/dx (its residual arithmetic is
        float32 anyway); None when the server turned error feedback off."""
        return (hop.trainer, self.stage, "grad_input") if self.config.error_feedback else None

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
            self.checkpoint()
        return reply

    # ---- the optimizer and the stage's state ------------------------------------------

    def _in_optimizer(self, call: Callable[[], object]) -> object:
        """``call`` into the optimizer, timed; refresh the digest after a step."""
        started = time.perf_counter()
        try:
            return call()
        finally:
            took = time.perf_counter() - started
            self.counters.optimizer_s += took
            self.counters.optimizer_max_s = max(self.counters.optimizer_max_s, took)
            epoch = self.optimizer.local_epoch
            if epoch != self._fingerprinted_epoch:
                self._fingerprinted_epoch = epoch
                self.fingerprints.submit(epoch, self.module.state_dict())

    def step_if_due(self) -> None:
        """Join the stage's epoch step if it is due (the server's periodic check)."""
        try:
            if self._in_optimizer(self.optimizer.step_if_due):
                self.counters.idle_steps += 1
        except Exception:  # keep serving: the next micro-batch's step tries again
            log.exception("stage %d: the periodic step check failed", self.stage)

    def checkpoint(self) -> Future[None] | None:
        """Copy the state and hand it to the checkpointer's writer; None if the export failed.

        Only with a checkpointer."""
        assert self._checkpoints is not None
        try:
            epoch, tensors, meta = self.optimizer.export_checkpoint()
        except Exception:  # a bug or a torch failure: the checkpoint is skipped, serving goes on
            self.counters.export_failures += 1
            log.exception("stage %d: exporting the state for a checkpoint failed", self.stage)
            return None
        return self._checkpoints.submit(self.clock(), epoch, tensors, meta)

    def param_digest(self) -> str:
        """SHA-256 (16 hex) of the stage's parameters and buffers, in state_dict order.

        Replicas of a stage at the same epoch hold equal digests when averaging leaves them
        bit-identical."""
        return tensors_digest(self.module.state_dict().items())


def _peak(peaks: Peaks, i: int) -> float | None:
    """The ``i``-th tensor's peak, None when the request did not tell it."""
    return peaks[i] if 0 <= i < len(peaks) else None


def _as_float32(t: torch.Tensor) -> torch.Tensor:
    """A float tensor of another dtype as float32 (exact for bf16/fp16), for the contract's
    checks; anything else as it is (the checks refuse it)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32:
        return t.float()
    return t


def _norm32(grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """L2 norm of all the gradients together, a float32 scalar on their device (not read
    back: the caller copies it to the host with the reply). inf or NaN when one of them
    holds an Inf or a NaN, or when float32 overflows (a norm beyond ~1e19): then
    :func:`_norm64` decides. float32 is exact enough for a bound and needs no float64
    copy of every gradient."""
    per_tensor = [torch.linalg.vector_norm(g) for g in grads if g is not None]  # float32
    return torch.linalg.vector_norm(torch.stack(per_tensor)).float()


def _norm64(grads: Sequence[torch.Tensor | None]) -> float:
    """The norm of :func:`_norm32` computed in float64, so that no bound a run spec allows is
    misjudged by a float32 overflow."""
    present = [g for g in grads if g is not None]
    if not present:
        return 0.0
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in present]
    return float(torch.linalg.vector_norm(torch.stack(norms)))
