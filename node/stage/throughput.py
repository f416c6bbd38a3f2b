"""How fast this device runs a stage: a short benchmark, cached in the state directory.

The stage server announces samples/s of forward+backward of one micro-batch in its DHT
record; routers divide queued work by it. Measuring takes a few passes, so the figure is
cached in ``{state_dir}/throughput.json`` by ``(run_id, stage, device)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..config.runspec import RunSpec
from ..training.model import StageModule
from .precision import ComputePrecision

logger = logging.getLogger(__name__)

THROUGHPUT_CACHE = "throughput.json"


def cached_throughput(
    module: StageModule,
    spec: RunSpec,
    stage: int,
    device: torch.device,
    state_dir: Path | None,
    iterations: int,
    precision: ComputePrecision | None = None,
) -> float:
    """The cached figure for ``(run_id, stage, device, precision)``, else a fresh measurement
    (then cached)."""
    key = f"{spec.run_id}/{stage}/{device}"
    if precision is not None and precision.autocast_enabled:
        key += f"/{precision.mode}"  # fp32 keeps the key it always had
    cache = state_dir / THROUGHPUT_CACHE if state_dir is not None else None
    known = _read_json(cache) if cache is not None else {}
    value = known.get(key)
    if isinstance(value, int | float) and math.isfinite(value) and value > 0:
        return float(value)
    measured = benchmark_stage(module, spec, iterations, precision)
    if cache is not None:
        known[key] = measured
        _write_json(cache, known)
    return measured


def benchmark_stage(
    module: StageModule,
    spec: RunSpec,
    iterations: int,
    precision: ComputePrecision | None = None,
) -> float:
    """Samples/s of forward+backward of one micro-batch through ``module`` (median pass; no
    side effects), in the stage's compute precision (``precision``: its autocast, as the
    stage serves; None: fp32).

    Gradients go through ``torch.autograd.grad``, so nothing accumulates into ``.grad``.
    """
    device = next(module.parameters()).device
    gen = torch.Generator().manual_seed(0)
    B, T, C = spec.batch.micro_batch_size, spec.model.seq_len, spec.model.d_model
    if module.is_first:
        x = torch.randint(0, spec.model.vocab_size, (B, T), generator=gen).to(device)
    else:
        x = torch.randn(B, T, C, generator=gen).to(device).requires_grad_(True)
    targets = torch.randint(0, spec.model.vocab_size, (B, T), generator=gen).to(device)
    grad_y = torch.randn(B, T, C, generator=gen).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    inputs = params if module.is_first else [*params, x]

    autocast = precision.autocast if precision is not None else contextlib.nullcontext

    def once() -> None:
        with torch.enable_grad(), autocast():
            if module.is_last:
                torch.autograd.grad(module.forward_loss(x, targets), inputs)
            else:
                y = module(x)  # (B, T, C), in the compute dtype under autocast
                torch.autograd.grad(y, inputs, grad_y.to(y.dtype))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    once()  # warm-up: allocator, kernels, lazy imports
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        once()
        times.append(time.perf_counter() - started)
    # the median pass: robust to a transient stall of a shared machine
    return B / max(statistics.median(times), 1e-9)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot cache the throughput in %s: %s", path, exc)
