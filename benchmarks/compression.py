"""Boundary compression side by side: bytes per token per boundary against validation loss.

Trains, in this one process, the same stage-split byte-level GPT to the same number of tokens
with each boundary configuration, and prints a table and then (with ``--json``) one final line::

    {"results": [{"codec", "bytes_per_token_per_boundary", "compression_vs_bf16",
                  "val_loss", "gap_vs_uncompressed", ...}], ...}

Configurations (``--configs`` picks any list; the default is the acceptance set):

- ``none``: float32 activations and gradients (the uncompressed reference; 4 bytes a value);
- ``bf16``, ``int8``, ``int4``: the whole activation and its gradient through that codec;
- ``k<K>`` / ``k<K>+<codec>``: the subspace method (node/training/subspace.py) with ``K``
  coefficients per token, sent in bf16 (``k32``) or through a codec (``k32+int4``), plus the
  token ids; ``k16/32+int4`` gives each boundary its own (nested) width; a suffix
  ``@std<x>`` sets ``subspace.embedding_std`` (the scale of E_fixed).

What crosses each boundary is computed by the swarm's own code: the subspace's ``to_wire``,
``from_wire``, ``grad_to_wire`` and ``grad_from_wire``, and transport/codecs.py's
``encode_roundtrip`` on the activations forward and on the gradients backward (a
``torch.autograd.Function`` per boundary). The model is ``build_stage``'s (the subspace
projection of a fresh stage included), the optimizer ``make_adamw`` / ``make_schedule``
(AdamW, per-stage clipping, warmup and cosine over the run), the data ``TrainStream`` on the
embedded stdlib corpus; after every optimizer step each stage is projected back into its
subspace (``Subspace.project_``), as every replica does in the swarm.

``bytes_per_token_per_boundary``: the forward payloads' actual sizes (header included) plus
the token ids at ``token_id_dtype``'s width for the subspace rows, over the tokens that
crossed, averaged over the boundaries; the gradients going back are the same size less the
ids (``grad_bytes_per_token_per_boundary``). ``compression_vs_bf16 = 2 d_model / bytes``.
``gap_vs_uncompressed = val_loss / val_loss(none) - 1`` (positive when worse), the
validation loss measured through the same boundaries (the swarm evaluates through the wire).

Defaults: d_model 256, 3 stages of one block, 128-byte windows, 64 windows a step, 1.5M
tokens (184 steps) per configuration, 12 configurations. On 2 cores (``--threads 2``) a
configuration trains in 150-160 s on an idle machine, about 31 minutes for the default set
(measured: 2145 s wall, with other work sharing the machine for part of it). That 30-minute
budget, not 20M tokens nor a flat reference curve, bounds the run: the reference is still
falling at the end (2.29, 1.97, 1.81, 1.74 nats/byte at 0.38, 0.75, 1.13, 1.5M tokens;
docs/compression.md). ``--quick`` is a smoke run of a few seconds.

Run with ``nice``: ``nice -n 10 python benchmarks/compression.py --json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the kernels' reference paths

import torch  # noqa: E402
from wanswarm.node.config.runspec import (  # noqa: E402
    BatchSpec,
    DataSpec,
    ModelSpec,
    OptimizerSpec,
    RunSpec,
    StagesSpec,
)
from wanswarm.node.config.subspace_spec import SubspaceSpec  # noqa: E402
from wanswarm.node.stage.optimizer import make_adamw, make_schedule  # noqa: E402
from wanswarm.node.training.data import Corpus, TrainStream, load_corpus, validation_set  # noqa: E402
from wanswarm.node.training.model import StageModule, build_stage, param_groups  # noqa: E402
from wanswarm.node.training.subspace import Subspace, token_id_dtype  # noqa: E402
from wanswarm.transport.codecs import CodecSpec, encode_roundtrip, parse_codec  # noqa: E402

_CONFIG_RE = re.compile(
    r"^k(?P<k>[0-9]+(?:/[0-9]+)*)(?:\+(?P<codec>[a-z0-9:_-]+))?(?:@std(?P<std>[0-9.]+))?$"
)


class BenchmarkError(ValueError):
    """A bad option or configuration name."""


@dataclass(frozen=True)
class Config:
    """One boundary configuration: a codec, and a subspace or none."""

    name: str
    codec: CodecSpec
    k: tuple[int, ...] | None = None
    embedding_std: float | None = None  # None: the section's default


def parse_config(name: str) -> Config:
    """``none``, ``int8``, ``k32``, ``k32+int4``, ``k16/32+int8``, ``k32+int4@std0.5``."""
    m = _CONFIG_RE.fullmatch(name)
    try:
        if m is None:
            return Config(name, parse_codec(name))
        widths = tuple(int(w) for w in m["k"].split("/"))
        std = None if m["std"] is None else float(m["std"])
        return Config(name, parse_codec(m["codec"] or "bf16"), widths, std)
    except ValueError as exc:  # CodecError is a ValueError
        raise BenchmarkError(f"bad configuration {name!r}: {exc}") from None


@dataclass
class WireMeter:
    """Bytes and tokens that crossed the boundaries, forward and backward."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_tokens: int = 0  # summed over boundaries
    backward_tokens: int = 0
    counting: bool = True


class Boundary(torch.autograd.Function):
    """One stage boundary: what the sender puts on the wire and the receiver rebuilds.

    Forward: ``c = to_wire(h)`` (or ``h`` itself without a subspace), through the codec,
    ``from_wire``. Backward: ``grad_to_wire(g)``, through the codec, ``grad_from_wire``."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        tokens: torch.Tensor,
        boundary: int,
        subspace: Subspace | None,
        codec: CodecSpec,
        meter: WireMeter,
    ) -> torch.Tensor:
        ctx.boundary, ctx.subspace, ctx.codec, ctx.meter = boundary, subspace, codec, meter
        c = h if subspace is None else subspace.to_wire(h, tokens, boundary)  # (B, T, k)
        encoded, received = encode_roundtrip(c.detach(), codec)
        if meter.counting:
            meter.forward_bytes += len(encoded.payload)
            meter.forward_tokens += tokens.numel()
            if subspace is not None:  # the ids travel with the coefficients
                meter.forward_bytes += tokens.numel() * token_id_dtype(
                    subspace.vocab_size
                ).itemsize
        if subspace is None:
            return received
        return subspace.from_wire(received, tokens, boundary)  # (B, T, C)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        subspace: Subspace | None = ctx.subspace
        gc = g if subspace is None else subspace.grad_to_wire(g, ctx.boundary)  # (B, T, k)
        encoded, received = encode_roundtrip(gc.contiguous(), ctx.codec)
        ctx.meter.backward_bytes += len(encoded.payload)
        ctx.meter.backward_tokens += g.shape[0] * g.shape[1]
        lifted = received if subspace is None else subspace.grad_from_wire(received, ctx.boundary)
        return lifted, None, None, None, None, None


@dataclass
class Run:
    """The stages of one configuration, their optimizers and what crossed."""

    config: Config
    spec: RunSpec
    stages: list[StageModule]
    subspace: Subspace | None
    meter: WireMeter = field(default_factory=WireMeter)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = x  # (B, T) token ids
        for s, stage in enumerate(self.stages[:-1]):
            h = stage(h)  # (B, T, C)
            h = Boundary.apply(h, x, s, self.subspace, self.config.codec, self.meter)
        return self.stages[-1].forward_loss(h, y)

    @torch.no_grad()
    def evaluate(self, val_x: torch.Tensor, val_y: torch.Tensor, batch: int) -> float:
        self.meter.counting = False
        total = 0.0
        for i in range(0, val_x.shape[0], batch):
            x, y = val_x[i : i + batch], val_y[i : i + batch]  # (b, T)
            total += float(self.loss(x, y)) * y.numel()
        self.meter.counting = True
        return total / val_y.numel()


def bench_spec(args: argparse.Namespace, steps: int) -> RunSpec:
    """The benchmark's run: a 3-stage byte-level GPT, cosine over exactly ``steps`` steps."""
    blocks = tuple(args.blocks)
    return RunSpec(
        name="compression",
        seed=args.seed,
        model=ModelSpec(
            d_model=args.d_model, n_heads=args.heads, n_layers=sum(blocks), seq_len=args.seq_len
        ),
        stages=StagesSpec(blocks_per_stage=blocks),
        batch=BatchSpec(micro_batch_size=args.micro_batch, target_batch_size=args.batch),
        optimizer=OptimizerSpec(
            lr=args.lr,
            warmup_steps=max(1, steps // 20),
            schedule="cosine",
            decay_steps=max(2, steps),
            min_lr_ratio=0.1,
        ),
        data=DataSpec(validation_windows=args.val_windows),
    )


def with_config(spec: RunSpec, config: Config) -> RunSpec:
    """The run spec of a configuration (its subspace section, checked as a spec loads)."""
    if config.k is None:
        return spec
    k: int | tuple[int, ...] = config.k[0] if len(config.k) == 1 else config.k
    section = SubspaceSpec(k=k)
    if config.embedding_std is not None:
        section = SubspaceSpec(k=k, embedding_std=config.embedding_std)
    return RunSpec.model_validate({**spec.model_dump(), "subspace": section.model_dump()})


def train(
    config: Config, base: RunSpec, steps: int, args: argparse.Namespace, corpus: Corpus
) -> dict[str, Any]:
    """Train one configuration for ``steps`` optimizer steps; its result row."""
    spec = with_config(base, config)
    stages = [build_stage(spec, s) for s in range(spec.n_stages)]
    run = Run(config, spec, stages, Subspace.for_run(spec))
    decay = spec.optimizer.weight_decay
    opts = [make_adamw(spec.optimizer, param_groups(m, decay)) for m in stages]
    schedules = [make_schedule(spec.optimizer, opt) for opt in opts]
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    stream = TrainStream(spec, seed=args.seed, corpus=corpus)
    val_x, val_y = validation_set(spec, corpus)  # (N, T) each
    micro_per_step = spec.batch.micro_batches_per_step
    eval_at = {round(steps * i / args.curve_points) for i in range(1, args.curve_points + 1)}
    curve: list[tuple[int, float]] = []
    tokens_per_step = spec.batch.target_batch_size * spec.model.seq_len
    started = time.perf_counter()
    eval_seconds = 0.0
    for step in range(1, steps + 1):
        for _ in range(micro_per_step):
            x, y = next(stream)  # (B, T) each
            (run.loss(x, y) / micro_per_step).backward()
        for stage, opt, schedule in zip(stages, opts, schedules, strict=True):
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            if run.subspace is not None:
                run.subspace.project_(stage)  # every replica, after every step
        if step in eval_at:
            began = time.perf_counter()
            curve.append((step * tokens_per_step, run.evaluate(val_x, val_y, args.eval_batch)))
            eval_seconds += time.perf_counter() - began
    seconds = time.perf_counter() - started
    meter = run.meter
    n_boundaries = spec.n_stages - 1
    forward = meter.forward_bytes / max(1, meter.forward_tokens)  # per token per boundary
    backward = meter.backward_bytes / max(1, meter.backward_tokens)
    constraint = (
        max(run.subspace.constraint_error(s) for s in stages) if run.subspace is not None else 0.0
    )
    return {
        "codec": config.name,
        "wire_codec": config.codec.to_wire(),
        "k": list(config.k) if config.k is not None else None,
        "bytes_per_token_per_boundary": forward,
        "grad_bytes_per_token_per_boundary": backward,
        "compression_vs_bf16": 2 * spec.model.d_model / forward,
        "val_loss": curve[-1][1],
        "curve": [[t, round(v, 5)] for t, v in curve],
        "tokens": steps * tokens_per_step,
        "boundaries": n_boundaries,
        "constraint_error": constraint,
        "train_seconds": round(seconds - eval_seconds, 1),
    }


INT4 = "int4:b32:f16"  # int4 with a fp16 scale per 32 values: int4/b64/f32's size, less error


def sixteenth_width(d_model: int, id_bytes: int = 1) -> int:
    """The widest subspace whose bf16 coefficients plus the token id take at most 1/16 of a
    bf16 activation's bytes (``d_model`` 256, 1-byte ids: 15 coefficients, 31 bytes)."""
    return max(1, (2 * d_model // 16 - id_bytes) // 2)


def default_configs(ks: list[int], d_model: int = 256) -> list[str]:
    """The acceptance set for widths ``ks`` (default 16, 32, 64).

    No compression, int8 and int4 on the whole activation; the subspace in bf16 for every
    width but the largest, and at the widest width that is 16x smaller than bf16
    (:func:`sixteenth_width`: k16 misses it by its id byte); the middle width with int8 and
    int4 (b64, f32 scales: the project's default int4); every width with int4 at a scale
    per 32 values (fp16), the same bytes as b64/f32; and the gap-closing variant: nested
    widths half and 1.5 times the smallest (the same mean width, so the same bytes, as the
    smallest alone).
    """
    ks = sorted(set(ks))
    mid = ks[len(ks) // 2]
    names = ["none", "int8", "int4"]
    bf16_widths = sorted({*(ks[:-1] or ks), sixteenth_width(d_model)})
    names += [f"k{k}" for k in bf16_widths]
    names += [f"k{mid}+int8", f"k{mid}+int4"]
    names += [f"k{k}+{INT4}" for k in ks]
    low, high = max(1, ks[0] // 2), ks[0] + ks[0] // 2
    if low < high:
        names.append(f"k{low}/{high}+{INT4}")
    return names


def table(rows: list[dict[str, Any]]) -> str:
    """The human-readable side-by-side table."""
    lines = [
        f"{'codec':<22} {'B/tok/bnd':>10} {'grad B':>8} {'vs bf16':>8} {'val loss':>9} "
        f"{'gap':>8} {'train s':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['codec']:<22} {r['bytes_per_token_per_boundary']:>10.2f} "
            f"{r['grad_bytes_per_token_per_boundary']:>8.2f} {r['compression_vs_bf16']:>7.1f}x "
            f"{r['val_loss']:>9.4f} {100 * r['gap_vs_uncompressed']:>+7.2f}% "
            f"{r['train_seconds']:>8.1f}"
        )
    return "\n".join(lines)


def best_at(rows: list[dict[str, Any]], max_gap: float) -> dict[str, Any] | None:
    """The row with the largest compression whose gap is at most ``max_gap``."""
    fits = [r for r in rows if r["gap_vs_uncompressed"] <= max_gap and r["codec"] != "none"]
    return max(fits, key=lambda r: r["compression_vs_bf16"], default=None)


def build_parser() -> argparse.ArgumentParser:
    """The command line's options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one final JSON line")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument(
        "--tokens", type=int, default=1_500_000, help="training tokens per configuration"
    )
    parser.add_argument(
        "--k", type=int, nargs="+", default=[16, 32, 64], help="subspace widths of the default set"
    )
    parser.add_argument(
        "--configs", nargs="+", default=None, help="configurations (default: the acceptance set)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 1, 1], help="per stage")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="windows per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--val-windows", type=int, default=256)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--curve-points", type=int, default=4, help="evaluations per run")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.quick:
        args.tokens = min(args.tokens, 4 * 8 * 32)
        args.d_model, args.seq_len, args.micro_batch, args.batch = 32, 32, 4, 8
        args.val_windows, args.curve_points = 8, 1
        args.k = [4, 8]
    torch.set_num_threads(args.threads)
    names = args.configs if args.configs is not None else default_configs(args.k, args.d_model)
    if "none" not in names:
        names = ["none", *names]
    configs = [parse_config(n) for n in names]
    tokens_per_step = args.batch * args.seq_len
    steps = max(1, math.ceil(args.tokens / tokens_per_step))
    base = bench_spec(args, steps)
    for c in configs:
        try:
            with_config(base, c)
        except ValueError as exc:
            raise BenchmarkError(f"configuration {c.name!r} cannot run: {exc}") from None
    corpus = load_corpus(base.data)
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for config in configs:
        row = train(config, base, steps, args, corpus)
        rows.append(row)
        print(  # progress, on stderr: stdout is the table and the JSON line
            f"{config.name}: val {row['val_loss']:.4f} ({row['train_seconds']} s)",
            file=sys.stderr,
            flush=True,
        )
    reference = next(r for r in rows if r["codec"] == "none")["val_loss"]
    for r in rows:
        r["gap_vs_uncompressed"] = r["val_loss"] / reference - 1.0
    print(
        f"d_model {args.d_model}, stages {args.blocks}, {steps} steps x {tokens_per_step} "
        f"tokens = {steps * tokens_per_step} tokens per configuration, "
        f"{time.perf_counter() - began:.0f} s in all"
    )
    print(table(rows))
    one, three = best_at(rows, 0.01), best_at(rows, 0.03)
    for label, best in (("gap <= 1%", one), ("gap <= 3%", three)):
        if best is not None:
            gap = 100 * best["gap_vs_uncompressed"]
            print(
                f"largest compression at {label}: {best['codec']} "
                f"({best['compression_vs_bf16']:.1f}x, gap {gap:+.2f}%)"
            )
    if args.json:
        summary = {
            "results": rows,
            "d_model": args.d_model,
            "tokens_per_configuration": steps * tokens_per_step,
            "best_at_1pct": None if one is None else one["codec"],
            "best_at_3pct": None if three is None else three["codec"],
            "seconds": round(time.perf_counter() - began, 1),
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
