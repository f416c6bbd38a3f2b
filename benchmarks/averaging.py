"""Averaging modes side by side: bytes per token, validation loss, replica divergence.

Trains the same stage-split byte-level GPT (the run spec below: 2 stages) with ``--replicas``
replicas per stage in each averaging mode, to the same number of tokens and the same number
of optimizer steps per replica, and prints one final JSON line (with ``--json``)::

    {"results": [{"mode", "averaging_bytes_per_token", "reduction_vs_allreduce",
                  "val_loss", "gap_vs_allreduce", "replica_max_divergence", ...}],
     "runtime_model": {...}}

The default length, 2,000 optimizer steps per replica (4.1M tokens, about 2 minutes a
mode on one core), is long enough for DiLoCo's early lag to close: at 200 steps every
DiLoCo mode trailed the all-reduce by 6.6-8%, at 2,000 by 1.2-2.1% (docs/averaging.md).

The replicas are simulated in this one process, which is what lets the whole comparison
run in minutes on a laptop's CPU. Each micro-batch is routed through one replica of each
stage (a random permutation per wave, as a trainer's routing spreads micro-batches over the
servers of a stage), so replicas of a stage see different data and different partners. The
averaging arithmetic is the swarm's own code, not a copy: the outer step, the weighted mean
and the codecs with error feedback are node/stage/outer.py and pseudo_gradient.py
(pseudo_gradient's int8/int4 are transport/codecs.py byte for byte), the gossip topology is
node/stage/gossip.py.

Modes (docs/averaging.md):

- ``allreduce``: the default; one gradient all-reduce per optimizer step of the stage's
  ``--global-batch`` samples, exact mean (hivemind's fp16 butterfly all-reduce on the wire:
  each replica sends ``2 (R - 1) / R`` of the stage's gradients at 2 bytes a value);
- ``diloco-H<h>``: each replica takes AdamW steps on ``--global-batch / R`` samples (so every
  mode takes the same number of optimizer steps per replica on the same total samples), and
  every ``h`` steps an outer Nesterov round; uncompressed pseudo-gradients go through an fp32
  butterfly all-reduce (``2 (R - 1) / R`` x 4 bytes a value), compressed ones are all-gathered
  (each replica sends its payload to the ``R - 1`` others; a sum of int4 or sign codes is not
  itself one) and every replica decodes and averages the same bits;
- ``diloco-H<h>-stream<f>-sign-ef``: Streaming DiLoCo's fragments (Douillard et al. 2025,
  arXiv:2501.18512) without its overlap: the stage's tensors are split into ``f`` fragments
  of about equal size, and fragment ``p`` takes its outer round every ``h`` steps, offset by
  ``p h / f`` steps, so a round sends ``1 / f`` of the stage at a time (the same bytes per
  token as ``diloco-H<h>``, a ``f`` times smaller peak); sign pseudo-gradients with error
  feedback;
- ``gossip-H<h>``: the same inner steps; every ``h`` steps each replica averages its
  parameters with its neighbours of the round on the one-peer exponential graph (float32
  parameters, one neighbour); replicas then differ, which ``replica_max_divergence`` shows;
- ``gossip-H<h>-accum<s>`` and ``diloco-H<h>-accum<s>``: the same with Decent-DP's AccumAdam
  as the inner optimizer (``averaging.inner_optimizer = "accum_adamw"``, ``accum_steps``
  ``s`` from ``--accum-steps``): each inner step sees only ``--global-batch / R`` samples,
  the small per-worker batch AccumAdam is for; its moments advance every ``s`` steps on
  their mean gradient.

The outer step's lr and momentum default to 1.0 and 0.5 (``--outer``; several pairs run
every DiLoCo mode with each): in 200-step runs of this benchmark DiLoCo's own 0.7 / 0.9,
tuned for H = 500 from a pretrained start, trailed them by 6-17% in validation loss
(docs/averaging.md has the sweep).

``averaging_bytes_per_token``: bytes all replicas of all stages sent for averaging, over the
tokens trained. ``gap_vs_allreduce``: relative difference of validation loss (mode /
allreduce - 1), measured on replica 0 of each stage after the last round. The Decent-DP
runtime model is evaluated for gamma (an all-reduce's communication time over a step's
compute time, at ``--link-mbps``), omega (a gossip round's over an all-reduce's, from their
bytes) and sigma^2 (the measured relative variance of per-step compute time); a measured
speed-up needs real links and is not produced in-process.

Run with ``nice``: ``nice -n 10 python benchmarks/averaging.py --json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the kernels' reference paths

import torch  # noqa: E402
from wanswarm.node.config.averaging_spec import AveragingSpec  # noqa: E402
from wanswarm.node.config.runspec import (  # noqa: E402
    BatchSpec,
    DataSpec,
    ModelSpec,
    OptimizerSpec,
    RunSpec,
    StagesSpec,
)
from wanswarm.node.stage import gossip, outer  # noqa: E402
from wanswarm.node.stage.optimizer import make_adamw, make_inner_optimizer  # noqa: E402
from wanswarm.node.stage.pseudo_gradient import ErrorFeedback, PseudoGradientCodec  # noqa: E402
from wanswarm.node.training.data import TrainStream, load_corpus, validation_set  # noqa: E402
from wanswarm.node.training.model import build_stage, param_groups  # noqa: E402


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # allreduce, diloco, gossip
    inner_steps: int = 1
    compression: str = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1  # Streaming DiLoCo: parameter fragments synchronised on a stagger
    accum_steps: int = 0  # > 0: the inner steps take AccumAdamW with these accumulation steps


@dataclass
class Replica:
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    outer: outer.OuterState | None = None
    feedback: ErrorFeedback | None = None
    samples: int = 0  # trained on so far
    extra: dict[str, Any] = field(default_factory=dict)


def run_spec(args: argparse.Namespace) -> RunSpec:
    return RunSpec(
        name="avgbench",
        model=ModelSpec(d_model=args.d_model, n_heads=4, n_layers=4, seq_len=args.seq_len),
        stages=StagesSpec(blocks_per_stage=(2, 2)),
        batch=BatchSpec(micro_batch_size=args.micro_batch, target_batch_size=args.global_batch),
        optimizer=OptimizerSpec(
            lr=args.lr, warmup_steps=args.warmup, schedule="cosine", decay_steps=args.steps,
            min_lr_ratio=0.1,
        ),
        data=DataSpec(validation_windows=args.val_windows),
    )


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters()}


def train(mode: Mode, spec: RunSpec, args: argparse.Namespace, corpus: Any) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    n_rep, n_stages = args.replicas, spec.n_stages
    micro = spec.batch.micro_batch_size
    # samples per optimizer step on one replica: the whole batch (allreduce) or its share
    per_step = args.global_batch if mode.kind == "allreduce" else args.global_batch // n_rep
    codec = PseudoGradientCodec(mode.compression, block_size=64, density=args.topk_density)
    stages: list[list[Replica]] = []
    for s in range(n_stages):
        group = []
        for _ in range(n_rep):
            module = build_stage(spec, s)  # every replica starts from the stage's init
            groups = param_groups(module, spec.optimizer.weight_decay)
            if mode.accum_steps:  # the swarm's own choice of inner optimizer (optimizer.py)
                inner = AveragingSpec(mode=mode.kind, inner_optimizer="accum_adamw",
                                      accum_steps=mode.accum_steps)
                opt = make_inner_optimizer(spec.model_copy(update={"averaging": inner}), groups)
            else:
                opt = make_adamw(spec.optimizer, groups)
            for p in module.parameters():
                p.grad = None
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, spec.optimizer.lr_multiplier)
            rep = Replica(module, opt, schedule)
            if mode.kind != "allreduce":
                rep.outer = outer.OuterState.start(_params(module))
                rep.feedback = ErrorFeedback(codec)
            group.append(rep)
        stages.append(group)
    stream = TrainStream(spec, seed=args.seed, corpus=corpus)
    route_gen = torch.Generator().manual_seed(args.seed + 1)
    sent_bytes = 0
    step_times: list[float] = []
    rounds = 0
    micro_per_step = per_step // micro
    stage_fragments = [split_fragments(group[0].module, mode.fragments) for group in stages]
    offsets = [f * mode.inner_steps // mode.fragments for f in range(mode.fragments)]
    for step in range(args.steps):
        started = time.perf_counter()
        # one optimizer step per replica: every replica of every stage sees micro_per_step
        # micro-batches (allreduce: the stage's whole batch, its gradients then averaged)
        waves = micro_per_step if mode.kind != "allreduce" else micro_per_step // n_rep
        for _ in range(max(1, waves)):
            perms = [torch.randperm(n_rep, generator=route_gen).tolist() for _ in range(n_stages)]
            for lane in range(n_rep):
                x, y = next(stream)
                h: torch.Tensor = x
                chain = [stages[s][perms[s][lane]] for s in range(n_stages)]
                for rep in chain[:-1]:
                    h = rep.module(h)
                loss = chain[-1].module.forward_loss(h, y)  # type: ignore[operator]
                (loss / (micro_per_step if mode.kind != "allreduce" else waves)).backward()
                for rep in chain:
                    rep.samples += micro
        step_times.append(time.perf_counter() - started)
        for s, group in enumerate(stages):
            if mode.kind == "allreduce":
                # exact mean of the replicas' gradients: the stage's step on its whole batch
                mean = [
                    torch.stack([p.grad for p in ps]).mean(0)  # type: ignore[misc]
                    for ps in zip(*(list(r.module.parameters()) for r in group), strict=True)
                ]
                numel = sum(g.numel() for g in mean)
                sent_bytes += int(n_rep * 2 * (n_rep - 1) / n_rep * 2 * numel)
                for rep in group:
                    for p, g in zip(rep.module.parameters(), mean, strict=True):
                        p.grad = g.clone()
            for rep in group:
                rep.opt.step()
                rep.schedule.step()
                rep.opt.zero_grad(set_to_none=True)
            if mode.kind == "allreduce":
                continue
            for f, names in enumerate(stage_fragments[s]):
                if step + 1 >= offsets[f] and (step + 1 - offsets[f]) % mode.inner_steps == 0:
                    sent_bytes += outer_round(mode, group, spec, args, rounds, s, names)
        if mode.kind != "allreduce":
            rounds += sum(
                1 for o in offsets if step + 1 >= o and (step + 1 - o) % mode.inner_steps == 0
            )
    tokens = args.steps * args.global_batch * spec.model.seq_len
    val_loss = evaluate([group[0].module for group in stages], spec, corpus)
    divergence = max(
        outer.max_divergence([_params(r.module) for r in group]) for group in stages
    )
    compute = statistics.mean(step_times) / n_rep  # one replica's share of a step's compute
    rel_var = statistics.pvariance(step_times) / statistics.mean(step_times) ** 2
    return {
        "mode": mode.name,
        "averaging_bytes_per_token": sent_bytes / tokens,
        "val_loss": val_loss,
        "replica_max_divergence": divergence,
        "optimizer_steps_per_replica": args.steps,
        "outer_rounds": rounds,
        "tokens": tokens,
        "step_compute_s": compute,
        "step_compute_rel_var": rel_var,
        "averaging_bytes_total": sent_bytes,
    }


def split_fragments(module: torch.nn.Module, n: int) -> list[list[str]]:
    """The stage's parameter names in ``n`` fragments of about equal size, as the daemon
    splits them (``outer.split_fragments``)."""
    return outer.split_fragments({name: p.numel() for name, p in module.named_parameters()}, n)


def outer_round(
    mode: Mode,
    group: list[Replica],
    spec: RunSpec,
    args: argparse.Namespace,
    rnd: int,
    s: int,
    names: list[str] | None = None,
) -> int:
    """One outer round of a stage (of the fragment ``names``, else of every parameter);
    returns the bytes its replicas sent."""
    n_rep = len(group)
    if mode.kind == "gossip":
        # parameters averaged with the round's neighbours (Metropolis weights, symmetric)
        w = gossip.mixing_matrix(n_rep, rnd, k=1)
        snaps = [{n: p.detach().clone() for n, p in r.module.named_parameters()} for r in group]
        numel = sum(t.numel() for t in snaps[0].values())
        sent = 0
        for i, rep in enumerate(group):
            with torch.no_grad():
                for name, p in rep.module.named_parameters():
                    p.copy_(sum(w[i][j] * snaps[j][name] for j in range(n_rep) if w[i][j]))
            sent += 4 * numel * (sum(1 for j in range(n_rep) if j != i and w[i][j]))
        return sent
    contributions = []
    sent = 0
    numel = 0
    views = [_fragment(rep, names) for rep in group]
    for rep, (state, params) in zip(group, views, strict=True):
        assert rep.feedback is not None
        delta = outer.pseudo_gradient(state.anchor, params)
        decoded, nbytes = rep.feedback.compress_all(delta)
        numel = sum(t.numel() for t in delta.values())
        # the samples this replica trained on since this fragment's last round
        key = "since:" + (",".join(names) if names is not None else "*")
        contributions.append((decoded, float(rep.samples - rep.extra.get(key, 0))))
        rep.extra[key] = rep.samples
        if mode.compression == "none":
            sent += int(2 * (n_rep - 1) / n_rep * 4 * numel)  # fp32 butterfly all-reduce
        else:
            sent += (n_rep - 1) * nbytes  # all-gather of the compressed payload
    mean = outer.weighted_mean(contributions)
    for state, params in views:
        outer.nesterov_step(state, mean, mode.outer_lr, mode.outer_momentum)
        outer.load_anchor(params, state)
    return sent


def _fragment(
    rep: Replica, names: list[str] | None
) -> tuple[outer.OuterState, dict[str, torch.Tensor]]:
    """The replica's outer state and parameters restricted to ``names`` (the same tensors,
    so a step on the view is a step on the replica)."""
    assert rep.outer is not None
    params = _params(rep.module)
    if names is None:
        return rep.outer, params
    state = outer.fragment_view(rep.outer, names)
    return state, {n: params[n] for n in names}


@torch.no_grad()
def evaluate(modules: list[torch.nn.Module], spec: RunSpec, corpus: Any) -> float:
    x, y = validation_set(spec, corpus)
    losses = []
    for i in range(0, x.shape[0], 32):
        h: torch.Tensor = x[i : i + 32]
        for m in modules[:-1]:
            h = m(h)
        losses.append(float(modules[-1].forward_loss(h, y[i : i + 32])))  # type: ignore[operator]
    return sum(losses) / len(losses)


def _outer_pair(pair: str) -> tuple[float, float]:
    lr, momentum = (float(v) for v in pair.split(":"))
    return lr, momentum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one final JSON line")
    parser.add_argument("--replicas", type=int, default=4, help="replicas per stage (2-4)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per replica")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step, stage")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--outer", nargs="+", default=["1.0:0.5"],
        help="outer lr:momentum pairs; with several, each DiLoCo mode runs with each",
    )
    parser.add_argument("--h", type=int, nargs=2, default=[8, 40], help="two values of H")
    parser.add_argument("--topk-density", type=float, default=0.02)
    parser.add_argument(
        "--accum-steps", type=int, default=4,
        help="AccumAdamW's accumulation steps in the *-accum modes (Decent-DP: ~ workers)",
    )
    parser.add_argument("--val-windows", type=int, default=128)
    parser.add_argument("--link-mbps", type=float, default=100.0, help="for the runtime model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="", help="comma-separated subset of mode names")
    args = parser.parse_args()
    if not 2 <= args.replicas <= 4 or args.global_batch % (args.replicas * args.micro_batch):
        parser.error("need 2-4 replicas and global-batch a multiple of replicas x micro-batch")
    torch.set_num_threads(args.threads)
    spec = run_spec(args)
    corpus = load_corpus(spec.data)
    h_small, h_big = args.h
    diloco = [
        (f"diloco-H{h_small}", h_small, "none"),
        (f"diloco-H{h_big}", h_big, "none"),
        (f"diloco-H{h_small}-int4-ef", h_small, "int4"),
        (f"diloco-H{h_small}-sign-ef", h_small, "sign"),
        (f"diloco-H{h_small}-topk-ef", h_small, "topk"),
    ]
    streamed = (f"diloco-H{h_small}-stream4-sign-ef", h_small, "sign")
    modes = [Mode("allreduce", "allreduce")]
    for pair in args.outer:
        lr, momentum = _outer_pair(pair)
        suffix = f"@{lr:g}/{momentum:g}" if len(args.outer) > 1 else ""
        modes += [Mode(name + suffix, "diloco", h, c, lr, momentum) for name, h, c in diloco]
        name, h, c = streamed
        modes.append(Mode(name + suffix, "diloco", h, c, lr, momentum, fragments=4))
    modes.append(Mode(f"gossip-H{h_small}", "gossip", h_small))
    s = args.accum_steps
    modes.append(Mode(f"gossip-H{h_small}-accum{s}", "gossip", h_small, accum_steps=s))
    modes.append(Mode(f"diloco-H{h_small}-accum{s}", "diloco", h_small, "none",
                      *_outer_pair(args.outer[0]), accum_steps=s))
    if args.modes:
        wanted = set(args.modes.split(","))
        modes = [m for m in modes if m.name.split("@")[0] in wanted or m.name == "allreduce"]
    results = []
    for mode in modes:
        started = time.perf_counter()
        result = train(mode, spec, args, corpus)
        result["wall_s"] = round(time.perf_counter() - started, 1)
        results.append(result)
        if not args.json:
            print(json.dumps(result))
    base = results[0]
    for r in results:
        r["reduction_vs_allreduce"] = (
            base["averaging_bytes_per_token"] / r["averaging_bytes_per_token"]
            if r["averaging_bytes_per_token"]
            else math.inf
        )
        r["gap_vs_allreduce"] = r["val_loss"] / base["val_loss"] - 1.0
        for key in ("averaging_bytes_per_token", "reduction_vs_allreduce"):
            r[key] = round(r[key], 3)
        for key in ("val_loss", "gap_vs_allreduce", "step_compute_s", "step_compute_rel_var"):
            r[key] = round(r[key], 5)
        r["replica_max_divergence"] = float(f"{r['replica_max_divergence']:.3g}")
    # Decent-DP runtime model from measured compute and the modes' bytes
    step_s = base["step_compute_s"]
    sigma2 = base["step_compute_rel_var"]
    per_replica_step_bytes = base["averaging_bytes_total"] / args.steps / (
        args.replicas * spec.n_stages
    )
    gamma = per_replica_step_bytes * 8 / (args.link_mbps * 1e6) / step_s
    gossip_results = [r for r in results if r["mode"].startswith("gossip")]
    model: dict[str, Any] = {"gamma": gamma, "sigma2": sigma2, "link_mbps": args.link_mbps}
    if gossip_results:
        g = gossip_results[0]
        h = int(g["mode"].split("H")[1].split("-")[0])
        rounds_bytes = g["averaging_bytes_total"] / g["outer_rounds"] / (
            args.replicas * spec.n_stages
        )
        model["omega"] = rounds_bytes / (per_replica_step_bytes * h)
        model["predicted_speedup_gossip"] = gossip.predicted_speedup(
            gamma, model["omega"], sigma2, args.replicas, k=1
        )
        model["measured_speedup_gossip"] = None  # needs real links (module docstring)
    summary = {"results": [
        {k: r[k] for k in (
            "mode", "averaging_bytes_per_token", "reduction_vs_allreduce", "val_loss",
            "gap_vs_allreduce", "replica_max_divergence", "optimizer_steps_per_replica",
            "outer_rounds", "tokens", "wall_s",
        )} for r in results
    ], "runtime_model": model}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
