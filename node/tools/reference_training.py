"""Single-process reference: train the whole model the way the swarm would.

Same model and init as the stages (``build_full_model``), same data (``TrainStream``),
same micro-batch size, same step of ``target_batch_size`` samples (the gradient is the mean
over the step's samples, as hivemind's gradient averaging gives), same AdamW, schedule and
weight decay, and gradient clipping per stage (each stage steps on its own in the swarm).
What it does not model: codec quantization on the wire and stale parameters in flight.

Used to tune the default run and as the baseline of ``benchmarks/swarm.py``:
``python -m wanswarm.node.tools.reference_training --tokens 600000 --target 2.5``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config.runspec import RunSpec, default_run_spec, load_run_spec
from ..stage.precision import ComputePrecision, resolve_precision
from ..training.data import Corpus, TrainStream, load_corpus, validation_set
from ..training.model import PipelineModel, build_full_model, param_groups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurvePoint:
    """Validation loss after ``tokens`` training tokens (``step`` optimizer steps)."""

    tokens: int
    step: int
    train_seconds: float  # training compute so far, evaluation excluded
    val_loss: float  # mean cross-entropy over the validation set, nats per byte
    train_loss: float  # mean training loss of the steps since the previous point
    # val loss with the update still in flight landed (on a copy; training goes on without it),
    # when train_reference(landed_val=True); equal to val_loss when no update is in flight
    val_loss_landed: float | None = None


@dataclass(frozen=True)
class ReferenceResult:
    """Outcome of ``train_reference``."""

    val_loss_start: float
    val_loss_end: float
    tokens: int  # training tokens processed
    steps: int  # optimizer steps taken
    seconds: float  # training compute time (evaluation excluded)
    tokens_per_second: float
    tokens_to_target: int | None  # first evaluated point with val loss < target, if any
    curve: tuple[CurvePoint, ...]


@torch.no_grad()
def evaluate(
    model: PipelineModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batch_size: int,
    compute: ComputePrecision | None = None,
) -> float:
    """Mean cross-entropy (nats per token) of ``model`` over ``(N, T)`` windows, under
    ``compute``'s autocast when given."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, inputs.shape[0], batch_size):
        x, y = inputs[i : i + batch_size], targets[i : i + batch_size]  # (b, T)
        with contextlib.nullcontext() if compute is None else compute.autocast():
            loss = model.forward_loss(x, y)
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


def clip_per_stage(model: PipelineModel, max_norm: float) -> None:
    """Clip each stage's gradient to ``max_norm`` separately, as each stage server does."""
    if max_norm <= 0:
        return
    for stage in model.stages:
        torch.nn.utils.clip_grad_norm_(stage.parameters(), max_norm)


def train_reference(
    spec: RunSpec,
    tokens: int,
    seed: int = 0,
    *,
    log_every: int | None = None,
    target_val_loss: float | None = None,
    corpus: Corpus | None = None,
    on_point: Callable[[CurvePoint], None] | None = None,
    update_lag: float = 0.0,
    val_windows: int | None = None,
    landed_val: bool = False,
    device: torch.device | str = "cpu",
) -> ReferenceResult:
    """Train the full model for at least ``tokens`` training tokens (whole steps).

    A step is ``target_batch_size`` samples (one collaborative epoch). ``log_every``
    (tokens, rounded to whole steps; default: about 20 points) sets how often the
    validation loss is measured; training stops early at the first measured point below
    ``target_val_loss`` when given. ``seed`` selects the trainer's data stream.

    ``update_lag`` models the swarm's delayed parameter updates (hivemind's DPU): the update
    computed from step k's gradient lands after this fraction of step k + 1's micro-batches
    has run on the old parameters. 0 is synchronous training; 1 is the most stale (the
    update lands at the end of step k + 1); in the swarm it is about the all-reduce time
    over the epoch time.

    ``val_windows`` evaluates only the first that many validation windows (all by default),
    e.g. to match a swarm evaluation that used that many.

    ``landed_val`` also measures, at every point, the validation loss of a copy of the model
    with the update still in flight (``update_lag`` > 0) applied: the state a swarm with
    delayed updates reaches once step k's averaging lands, which is what an evaluation that
    starts a moment after step k sees. Training itself is unchanged (``val_loss_landed``).

    ``device`` trains there in the precision the run spec's ``[precision] compute`` gives a
    stage on that device (bf16 autocast on CUDA by default, fp32 on the CPU), with float32
    master weights and AdamW state, as the stage servers do; so a swarm of GPU stages is
    compared with a reference on the same GPU. fp16 (a loss scaler) and subspace runs are
    refused off the CPU.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be positive, got {tokens}")
    if not 0.0 <= update_lag <= 1.0:
        raise ValueError(f"update_lag must be in [0, 1], got {update_lag}")
    if val_windows is not None and val_windows < 1:
        raise ValueError(f"val_windows must be positive, got {val_windows}")
    device = torch.device(device)
    compute = resolve_precision(spec.precision.compute, device)
    if device.type != "cpu" and (compute.scaler is not None or spec.subspace.k is not None):
        raise ValueError(
            f"the reference trains on {device} only in fp32 or bf16 and without [subspace] "
            f"(precision {compute.describe()}, subspace k {spec.subspace.k})"
        )
    corpus = load_corpus(spec.data) if corpus is None else corpus
    stream = TrainStream(spec, seed, corpus)
    val_x, val_y = validation_set(spec, corpus)  # (N, T) each
    if val_windows is not None:
        val_x, val_y = val_x[:val_windows], val_y[:val_windows]
    val_x, val_y = val_x.to(device), val_y.to(device)
    eval_batch = max(spec.batch.micro_batch_size, 32)

    model = build_full_model(spec).to(device)
    model.train()
    opt_spec = spec.optimizer
    optimizer = torch.optim.AdamW(
        param_groups(model, opt_spec.weight_decay), **opt_spec.adamw_kwargs()
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, opt_spec.lr_multiplier)

    micro_per_step = spec.batch.micro_batches_per_step
    tokens_per_step = spec.batch.target_batch_size * spec.model.seq_len
    total_steps = math.ceil(tokens / tokens_per_step)
    every = total_steps // 20 if log_every is None else log_every // tokens_per_step
    every = max(1, every)

    start_loss = evaluate(model, val_x, val_y, eval_batch, compute)
    curve = [CurvePoint(0, 0, 0.0, start_loss, float("nan"), start_loss if landed_val else None)]
    if on_point is not None:
        on_point(curve[0])
    reached: int | None = None
    train_seconds = 0.0
    losses: list[float] = []
    params = list(model.parameters())
    pending: list[torch.Tensor | None] | None = None  # gradient whose update has not landed
    lag_micro = round(update_lag * micro_per_step)  # micro-batches run before it lands

    def project(m: PipelineModel) -> None:
        """A subspace run's constraint after each step, as the stages' optimizers keep it
        (node/stage/constraint.py)."""
        if m.subspace is not None:
            for stage in m.stages:
                m.subspace.project_(stage)  # type: ignore[arg-type]

    def landed_loss(val_loss: float) -> float:
        if pending is None:
            return val_loss
        shadow = copy.deepcopy(model)
        shadow_opt = torch.optim.AdamW(
            param_groups(shadow, opt_spec.weight_decay), **opt_spec.adamw_kwargs()
        )
        # a deep copy: load_state_dict keeps the very tensors it is given when dtype and device
        # match, and the shadow's step would then move the real optimizer's moments
        shadow_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # and its lr
        for p, grad in zip(shadow.parameters(), pending, strict=True):
            p.grad = None if grad is None else grad.clone()
        clip_per_stage(shadow, opt_spec.grad_clip)
        shadow_opt.step()
        project(shadow)
        return evaluate(shadow, val_x, val_y, eval_batch, compute)

    def apply(grads: list[torch.Tensor | None]) -> None:
        accumulating = [p.grad for p in params]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        clip_per_stage(model, opt_spec.grad_clip)
        optimizer.step()
        project(model)
        scheduler.step()
        for p, grad in zip(params, accumulating, strict=True):
            p.grad = grad

    step = 0
    while step < total_steps:
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for i in range(micro_per_step):
            if pending is not None and i == lag_micro:
                apply(pending)
                pending = None
            x, y = next(stream)  # (B, T) each
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with compute.autocast():
                loss = model.forward_loss(x, y) / micro_per_step  # mean over the step's samples
            loss.backward()
            step_loss += float(loss.detach())
        if pending is not None:  # update_lag = 1: the previous update lands only now
            apply(pending)
        pending = [p.grad for p in params]
        if update_lag == 0:
            apply(pending)
            pending = None
        step += 1
        train_seconds += time.perf_counter() - began
        losses.append(step_loss)
        if step % every == 0 or step == total_steps:
            val_loss = evaluate(model, val_x, val_y, eval_batch, compute)
            point = CurvePoint(
                step * tokens_per_step,
                step,
                train_seconds,
                val_loss,
                sum(losses) / len(losses),
                landed_loss(val_loss) if landed_val else None,
            )
            losses.clear()
            curve.append(point)
            logger.info("step %d tokens %d val_loss %.4f", step, point.tokens, val_loss)
            if on_point is not None:
                on_point(point)
            if target_val_loss is not None and val_loss < target_val_loss:
                reached = point.tokens
                break
    done = step * tokens_per_step
    return ReferenceResult(
        val_loss_start=start_loss,
        val_loss_end=curve[-1].val_loss,
        tokens=done,
        steps=step,
        seconds=train_seconds,
        tokens_per_second=done / train_seconds if train_seconds > 0 else float("nan"),
        tokens_to_target=reached,
        curve=tuple(curve),
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: train the reference and print the curve, then one JSON line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--spec", type=Path, default=None, help="run spec TOML (default: embedded tiny run)"
    )
    parser.add_argument("--tokens", type=int, default=1_000_000, help="training tokens")
    parser.add_argument("--seed", type=int, default=0, help="trainer data seed")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (swarm daemons use 1)"
    )
    parser.add_argument(
        "--log-every", type=int, default=None, help="tokens between validation points"
    )
    parser.add_argument(
        "--target", type=float, default=None, help="stop below this validation loss"
    )
    parser.add_argument(
        "--update-lag",
        type=float,
        default=0.0,
        help="fraction of the next step run before an update lands (0 synchronous, 1 most stale)",
    )
    parser.add_argument(
        "--val-windows",
        type=int,
        default=None,
        help="evaluate only the first N validation windows (default: all of the spec's)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device to train on, e.g. cuda (default cpu); precision from the spec",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = default_run_spec() if args.spec is None else load_run_spec(args.spec)

    def show(point: CurvePoint) -> None:
        print(
            f"tokens {point.tokens:>9d}  step {point.step:>5d}  {point.train_seconds:7.1f} s  "
            f"val {point.val_loss:.4f}  train {point.train_loss:.4f}",
            flush=True,
        )

    result = train_reference(
        spec,
        args.tokens,
        args.seed,
        log_every=args.log_every,
        target_val_loss=args.target,
        update_lag=args.update_lag,
        device=args.device,
        on_point=show,
        val_windows=args.val_windows,
    )
    summary = asdict(result)
    summary.pop("curve")
    summary["run_id"] = spec.run_id
    summary["update_lag"] = args.update_lag
    summary["curve"] = [[p.tokens, round(p.val_loss, 4)] for p in result.curve]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
