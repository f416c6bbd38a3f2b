"""What a stage server holds in memory: between the hops of a micro-batch, and in all.

Between hops (pure, takes ``now``):

- ``InputCache``: forward inputs by ``(trainer, micro_batch)``, so that a backward may name
  its input instead of carrying it; LRU, bounded by entries and bytes, entries expire.
- ``GraphCache``: the forward's autograd graph of up to ``max_in_flight`` micro-batches, so
  that their backward need not recompute the forward; LRU, entries expire.
- ``AppliedLog``: the ``(trainer, micro_batch, stage)`` keys whose gradients were applied,
  oldest forgotten first, with the replies of the most recent ones, so that a retried hop
  gets the same answer and never accumulates twice.

In all: :func:`stage_footprint` estimates what serving a stage takes on its device
(parameters, their gradients, the optimizer's state, the activations of ``max_in_flight``
micro-batches, the input cache) and :func:`check_fits` compares it with the device's free
memory, capped by ``max_device_memory_mb``, before the stage is claimed; when it does
not fit, :class:`StageMemoryError` says which stages of the run would.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final

import torch

from ...transport.endpoint import Response
from ..config.runspec import RunSpec
from ..errors import NodeError
from ..training.model import expected_stage_parameters
from .precision import resolve_precision
from .server_config import StageServerConfig

MIB: Final[int] = 1 << 20


@dataclass
class _CacheEntry:
    tensor: torch.Tensor
    nbytes: int
    expires: float


class InputCache:
    """Forward inputs by key: LRU, bounded by entries and bytes, entries expire (pure)."""

    def __init__(self, max_entries: int, max_bytes: int, ttl: float) -> None:
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        self._entries: OrderedDict[Hashable, _CacheEntry] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, tensor: torch.Tensor, now: float) -> bool:
        """Keep ``tensor`` until ``now + ttl``; False if it cannot fit at all."""
        self.pop(key)
        nbytes = tensor.numel() * tensor.element_size()
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return False
        self._expire(now)
        self._entries[key] = _CacheEntry(tensor, nbytes, now + self.ttl)
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, key: Hashable, now: float) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= now:
            self.pop(key)
            return None
        self._entries.move_to_end(key)
        return entry.tensor

    def pop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            self.pop(key)


class AppliedLog:
    """Keys whose gradients were applied, oldest forgotten first, with a few cached replies."""

    def __init__(self, max_keys: int, max_replies: int) -> None:
        self.max_keys, self.max_replies = max_keys, max_replies
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._replies: OrderedDict[Hashable, Response] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable, reply: Response | None) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            old, _ = self._keys.popitem(last=False)
            self._replies.pop(old, None)
        if reply is not None and self.max_replies > 0:
            self._replies[key] = reply
            while len(self._replies) > self.max_replies:
                self._replies.popitem(last=False)

    def reply(self, key: Hashable) -> Response | None:
        return self._replies.get(key)

    def keys(self) -> frozenset[Hashable]:
        """The remembered keys (at most ``max_keys``, the most recent)."""
        return frozenset(self._keys)


@dataclass
class _Graph:
    output: torch.Tensor  # carries the autograd graph back to the parameters (and the input)
    input: torch.Tensor
    epoch: int  # the optimizer epoch of the parameters it was computed with
    expires: float


class GraphCache:
    """Forward graphs by key: LRU, at most ``max_entries``, entries expire (pure).

    An entry holds the forward's output, whose autograd graph keeps the activations that
    the backward needs alive, and the input it was computed from (a leaf that requires
    grad, except on stage 0). ``take`` removes the entry: a graph serves one backward.
    """

    def __init__(self, max_entries: int, ttl: float) -> None:
        self.max_entries, self.ttl = max_entries, ttl
        self._entries: OrderedDict[Hashable, _Graph] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, key: Hashable, output: torch.Tensor, inputs: torch.Tensor, epoch: int, now: float
    ) -> bool:
        """Keep the graph until ``now + ttl``; False when no graph is kept at all."""
        self._entries.pop(key, None)
        if self.max_entries == 0:
            return False
        for old in [k for k, e in self._entries.items() if e.expires <= now]:
            del self._entries[old]
        self._entries[key] = _Graph(output, inputs, epoch, now + self.ttl)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return True

    def take(
        self, key: Hashable, epoch: int, now: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(output, input)`` of the key's forward, computed at ``epoch``; None when it is
        gone, expired or from another epoch (the parameters changed since)."""
        entry = self._entries.pop(key, None)
        if entry is None or entry.expires <= now or entry.epoch != epoch:
            return None
        return entry.output, entry.input

    def pop(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()


# -- the footprint of a stage -----------------------------------------------------------


class StageMemoryError(NodeError):
    """A stage does not fit the device's memory (the message says which would)."""


@dataclass(frozen=True)
class StageFootprint:
    """Bytes a stage needs on its device, by part (an estimate, see :func:`stage_footprint`)."""

    stage: int
    parameters: int  # float32 master weights
    gradients: int  # accumulated .grad and the optimizer's accumulator, float32
    optimizer: int  # AdamW's two moments, float32
    activations: int  # the forward graphs of max_in_flight micro-batches
    input_cache: int  # forward inputs kept for backward references
    workspace: int  # one micro-batch's forward and backward in flight, plus its payloads
    per_micro_batch: int  # activations of one micro-batch (what max_in_flight multiplies)

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer + self.activations
            + self.input_cache + self.workspace
        )

    def describe(self) -> str:
        parts = (
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer),
            ("activations", self.activations),
            ("input cache", self.input_cache),
            ("workspace", self.workspace),
        )
        inner = ", ".join(f"{name} {_mib(n)}" for name, n in parts)
        return f"stage {self.stage}: {_mib(self.total)} ({inner})"


def _mib(n: int | float) -> str:
    return f"{n / MIB:.0f} MiB" if n >= 10 * MIB else f"{n / MIB:.1f} MiB"


def activation_bytes(spec: RunSpec, stage: int, dtype_bytes: int) -> int:
    """Activations one micro-batch's forward keeps for its backward on ``stage``.

    Per block, after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", Table 2) without dropout: ``s*b*h*(16 + 4*r)`` elements for the
    LayerNorms, attention projections and an MLP ``r`` times as wide, plus ``4*a*s*s*b``
    for attention scores (what an unfused attention keeps; a fused kernel keeps less, so
    this errs high). The first stage adds its embedding output, the last one its logits
    (float32 for the loss, kept twice: logits and their softmax).
    """
    cfg = spec.model
    b, s, h, a = spec.batch.micro_batch_size, cfg.seq_len, cfg.d_model, cfg.n_heads
    r = cfg.mlp_hidden / cfg.d_model
    per_block = s * b * h * (16 + 4 * r) * dtype_bytes + 4 * a * s * s * b * dtype_bytes
    blocks = spec.stages.blocks_per_stage[stage]
    total = blocks * per_block
    if stage == 0:
        total += s * b * h * 4
    if stage == spec.n_stages - 1:
        total += 2 * s * b * cfg.vocab_size * 4 + s * b * h * 4
    return int(math.ceil(total))


def stage_footprint(
    spec: RunSpec, stage: int, config: StageServerConfig, device: torch.device
) -> StageFootprint:
    """The estimate of what serving ``stage`` takes on ``device`` (see StageFootprint)."""
    precision = resolve_precision(spec.precision.compute, device)
    act = precision.activation_dtype().itemsize
    params = expected_stage_parameters(spec, stage) * 4
    cfg = spec.model
    b, s, h = spec.batch.micro_batch_size, cfg.seq_len, cfg.d_model
    one = activation_bytes(spec, stage, act)
    input_bytes = b * s * (8 if stage == 0 else h * act)
    cache = min(config.cache_bytes, config.cache_entries * input_bytes)
    io = 4 * b * s * h * 4  # the input, output and gradients decoded and encoded, float32
    return StageFootprint(
        stage=stage,
        parameters=params,
        gradients=2 * params,
        optimizer=2 * params,
        activations=config.max_in_flight * one,
        input_cache=cache,
        workspace=one + io,
        per_micro_batch=one,
    )


def free_device_memory(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's own figure, else the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def memory_budget(config: StageServerConfig, free: int) -> int:
    """What the stage may use: the free memory, capped by ``max_device_memory_mb``."""
    if config.max_device_memory_mb is None:
        return free
    return min(free, config.max_device_memory_mb * MIB)


def limit_device_memory(config: StageServerConfig, device: torch.device) -> None:
    """Enforce ``max_device_memory_mb`` on a CUDA device (the caching allocator then raises
    out-of-memory past it); on the CPU the limit is what the memory check counts against."""
    if config.max_device_memory_mb is None or device.type != "cuda":
        return
    # an index is required: 'cuda' alone is the current device
    index = torch.cuda.current_device() if device.index is None else device.index
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, config.max_device_memory_mb * MIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def check_fits(
    spec: RunSpec,
    stage: int,
    config: StageServerConfig,
    device: torch.device,
    *,
    free: int | None = None,
) -> StageFootprint:
    """The stage's footprint when it fits the budget; StageMemoryError naming what would
    fit otherwise (other stages of the run, fewer micro-batches in flight).

    ``free``: the device's free bytes (default: asked of the device now).
    """
    budget = memory_budget(config, free_device_memory(device) if free is None else free)
    need = stage_footprint(spec, stage, config, device)
    if need.total <= budget:
        return need
    others = [stage_footprint(spec, s, config, device) for s in range(spec.n_stages)]
    fitting = [f"{f.stage} ({_mib(f.total)})" for f in others if f.total <= budget]
    fewer = _in_flight_that_fits(need, budget)
    limit = "" if config.max_device_memory_mb is None else (
        f", capped by stage_server.max_device_memory_mb = {config.max_device_memory_mb}"
    )
    advice = [
        f"stages of this run that fit: {', '.join(fitting)}" if fitting
        else "no stage of this run fits",
    ]
    if fewer is not None:
        advice.append(f"stage {stage} fits with stage_server.max_in_flight = {fewer}")
    advice.append("a smaller batch.micro_batch_size or more stages make each stage smaller")
    raise StageMemoryError(
        f"{need.describe()} does not fit the {_mib(budget)} available on {device}{limit}; "
        + "; ".join(advice)
    )


def _in_flight_that_fits(need: StageFootprint, budget: int) -> int | None:
    """The most micro-batches in flight (below the configured number) that fit, if any."""
    base = need.total - need.activations
    if need.activations == 0 or base > budget or need.per_micro_batch <= 0:
        return None
    return (budget - base) // need.per_micro_batch
