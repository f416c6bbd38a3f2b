"""End-to-end benchmark: the tiny run on a local swarm under emulated WAN profiles and wire
codecs, side by side with the single-process reference trainer.

For every (profile, codec) configuration this script writes a run spec variant (a temporary
TOML file, the base spec with ``codecs.forward_activations`` and ``codecs.backward_gradients``
both set to the codec, so a different run id) and trains it on a local swarm of real daemons
(``wanswarm.node.tools.demo.run_swarm``: replicas x stages daemons on 127.0.0.1, every QUIC port
and every DHT port behind a WAN emulator of the profile, trainer i on data seed
``--data-seed`` + i) until the trainers completed ``--tokens`` tokens. Each configuration
reports:

- tokens/s: tokens the trainers completed during the training phase / its duration (the
  phase runs between the swarm's first and last validation; start-up excluded);
- wire bytes per token per stage boundary: the payload bytes the trainers sent and received
  across stage boundaries during the training phase / the tokens those hops carried /
  (stages - 1). Tokens carried = successful hops / (2 x stages - 1 hops per micro-batch) x
  micro-batch x seq_len, so micro-batches in flight when the phase starts or ends count for
  the hops they made within it (the trainers' completed-token counter would not). Counted:
  the encoded tensors of every successful hop (activations out of and into every stage
  after the first, output gradients of every stage but the last, and the stage input a
  backward carries when it cannot go by reference), as the trainers' ``payload_bytes``
  counters report them; not counted: the token ids sent to stage 0 and the targets sent to
  the last stage ((hops of stage 0 / 2 + hops of the last stage) x micro-batch x seq_len x
  8 bytes, subtracted), request headers, QUIC and FEC overhead. Each boundary's activation
  crosses the network twice (stage s -> trainer -> stage s + 1), and so does its gradient:
  the "ideal" column is that exact codec payload (4 transfers per boundary). Hops of
  micro-batches that failed later count, with the tokens they carried;
- QUIC bytes per token per boundary: UDP payload bytes every daemon's endpoint sent during
  the training phase / the same tokens / boundaries: everything on the wire between daemons (token
  ids, headers, FEC repair symbols, retransmissions, acknowledgements, pings). Averaging is
  not in it: hivemind averages over libp2p (TCP), outside QUIC; but it crosses the same
  emulated links (each emulator relays its daemon's libp2p port too, transport/wan_tcp.py),
  so tokens/s include its cost, and the report prints the libp2p bytes that crossed them;
- final validation loss: the swarm's own evaluation after training (``--eval-windows``
  windows through the swarm, activations through the codec). The trainers keep training
  while it runs, so it is compared with the reference at the mean of the token counts
  before and after it.

The reference (``wanswarm.node.tools.reference_training``) runs last in this process, one torch
thread by default, with the same model, init, data sampler, micro-batch, step size,
optimizer, schedule and per-stage clipping, for the largest token count any swarm reached
(whole steps, at least ``--tokens``), with the validation loss measured after every step
over the same windows, so the curve can be read at each swarm's token count (the last step
at or before it: parameters change only when a step lands). Each point is measured with
that step's update landed (on a copy: ``landed_val``), as the swarm's is by the time it
evaluates (its averaging lands within about a second of the step, in the background), not
with it still in flight as in the reference's own curve. It trains on
one data stream (seed ``--data-seed``), not the swarm's interleaving of one stream per
trainer: the same data order cannot be reproduced by an asynchronous swarm. It models the
swarm's delayed parameter updates (hivemind's DPU) with ``--update-lag`` (the fraction of
the next step's micro-batches that run before an update lands; 0 by default, since the
demo's daemons step synchronously, and 0.125 when they get ``--set
averaging.delayed_updates=true``); it does not model codec error or the staleness
of micro-batches in flight while a step lands. Its tokens/s is one process's compute
without the evaluations; the swarm's daemons (one thread each) share the machine's cores.

Targets (from the issue), marked met or missed: wan tokens/s >= 70% of lan for each codec;
final validation loss at most 2% above the reference for int8 and 3% for int4.

``--averaging`` runs every configuration once per stage averaging mode (the run spec's
``[averaging]`` section: ``allreduce``, ``gossip:H[:NEIGHBOURS]``,
``diloco:H[:COMPRESSION[:FRAGMENTS]]``; ``spec``, the default, keeps the base spec's). With
an all-reduce row and a gossip row of the same profile and codec, the report sets the
measured speed-up of gossip (its tokens/s over the all-reduce's) beside the one Decent-DP's
runtime model predicts (node/stage/gossip.py) from what the same two runs measured: gamma,
the all-reduce run's device-thread seconds inside the optimizer (where a synchronous step
waits for its all-reduce) over its seconds running requests; omega, the libp2p bytes per
token across the emulated links, gossip's over the all-reduce's; sigma^2 is not measured
(0). The validation losses come with it.

Output: progress lines on stderr while each configuration runs, then on stdout a table and
the target checks and, as the last line, one JSON object ``{"reference": {"tokens_per_s",
"val_loss", ...}, "results": [{"profile", "codec", "tokens_per_s", "wire_bytes_per_token",
"val_loss", ...}, ...], "targets": [...], "meta": {...}}``. ::

    python benchmarks/swarm.py --quick
    python benchmarks/swarm.py --tokens 300000 --profiles lan,wan --codecs none,int8,int4
    python benchmarks/swarm.py --codecs int8 --profiles wan --json-only
    python benchmarks/swarm.py --codecs int8 --profiles wan --averaging allreduce,gossip:4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from pydantic import ValidationError
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.config.layers import describe_validation_error, parse_assignment
from wanswarm.node.config.runspec import (
    RunSpec,
    RunSpecError,
    default_run_spec,
    load_run_spec,
    parse_run_spec,
)
from wanswarm.node.errors import NodeError
from wanswarm.node.stage import gossip
from wanswarm.node.tools.demo import DemoOptions, run_swarm
from wanswarm.node.tools.demo_daemons import DemoError, describe_wan_links
from wanswarm.node.tools.reference_training import CurvePoint, train_reference
from wanswarm.transport.codecs import parse_codec
from wanswarm.transport.errors import CodecError
from wanswarm.transport.wan import PROFILES

DEFAULT_TOKENS = 200_000  # per configuration; see --help for the time it takes
QUICK_TOKENS = 16_384  # two optimizer steps of the tiny run
DEFAULT_REPLICAS = 2
QUICK_REPLICAS = 1
DEFAULT_EVAL_WINDOWS = 64
QUICK_EVAL_WINDOWS = 16
DEFAULT_UPDATE_LAG = 0.125  # DPU lag on loopback, estimated at 0.1-0.2 in docs/tiny_run.md
# (the reference's lag when the daemons get --set averaging.delayed_updates=true; the demo's
# daemons, which the benchmark starts, step synchronously: lag 0)
THROUGHPUT_TARGET = 0.70  # wan tokens/s over lan tokens/s, per codec
VAL_LOSS_TOLERANCE = {"int8": 0.02, "int4": 0.03}  # final val loss over the reference's
TOKEN_ID_BYTES = torch.empty((), dtype=torch.int64).element_size()  # TrainStream gives int64 ids


class BenchmarkError(Exception):
    """The benchmark cannot run as asked (bad arguments, unusable spec)."""


# ---- run spec variants ------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string (ASCII, \\uXXXX escapes) is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise BenchmarkError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _toml_key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) else json.dumps(key)


def to_toml(data: dict[str, Any], _prefix: str = "") -> str:
    """Nested dicts of scalars and lists as TOML (tables for dicts); None has no TOML form."""
    lines = []
    tables = []
    for key, value in data.items():
        if value is None:
            raise BenchmarkError(f"{_prefix}{key} is None, which TOML cannot express")
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    text = "\n".join(lines) + ("\n" if lines else "")
    for key, value in tables:
        name = f"{_prefix}{_toml_key(key)}"
        text += f"\n[{name}]\n" + to_toml(value, f"{name}.")
    return text


def parse_averaging(text: str, base: AveragingSpec | None = None) -> AveragingSpec | None:
    """An ``--averaging`` item as the ``[averaging]`` section it asks for (None for ``spec``:
    the base spec's own): ``allreduce``, ``gossip:H[:NEIGHBOURS]``,
    ``diloco:H[:COMPRESSION[:FRAGMENTS]]`` (fragments: Streaming DiLoCo); the base spec's
    other averaging fields (timeouts, outer lr) are kept. BenchmarkError
    says what is wrong."""
    if text == "spec":
        return None
    mode, *rest = text.split(":")
    fields: dict[str, Any] = {"mode": mode, "fragments": 1}
    forms = "use spec, allreduce, gossip:H[:NEIGHBOURS] or diloco:H[:COMPRESSION[:FRAGMENTS]]"
    try:
        if mode == "allreduce" and not rest:
            fields["compression"] = "none"
        elif 1 <= len(rest) <= {"gossip": 2, "diloco": 3}.get(mode, -1):
            fields["inner_steps"] = rest[0]  # validated (and made a number) by the spec
            if len(rest) >= 2:
                # gossip_neighbours is a literal 1 or 2, which takes no string
                fields["gossip_neighbours" if mode == "gossip" else "compression"] = (
                    int(rest[1]) if mode == "gossip" and rest[1].isdigit() else rest[1]
                )
            if len(rest) == 3:
                fields["fragments"] = rest[2]  # Streaming DiLoCo
        else:
            raise ValueError(forms)
        raw = (base or AveragingSpec()).model_dump() | fields
        return AveragingSpec.model_validate(raw)
    except ValidationError as exc:
        raise BenchmarkError(
            f"--averaging {text!r}: {describe_validation_error(exc, root=AveragingSpec)}"
        ) from None
    except ValueError as exc:  # not one of the forms
        raise BenchmarkError(f"--averaging {text!r}: {exc}") from None


def spec_variant(spec: RunSpec, codec: str, averaging: str = "spec") -> tuple[RunSpec, str]:
    """The spec with both wire codecs set to ``codec`` (and its ``[averaging]`` section as
    ``averaging`` asks, see :func:`parse_averaging`), and its TOML text (which parses back to
    it)."""
    # None has no TOML form; every None in a run spec is its field's default ("not set")
    raw = spec.model_dump(mode="json", exclude_none=True)
    raw["codecs"] = {"forward_activations": codec, "backward_gradients": codec}
    section = parse_averaging(averaging, spec.averaging)
    if section is not None:
        raw["averaging"] = section.model_dump(mode="json")
    what = f"codecs {codec}" + ("" if section is None else f", averaging {averaging}")
    text = (
        f"# {spec.name} with {what} (benchmarks/swarm.py); "
        f"everything else as run {spec.run_id}\n"
        + to_toml(raw)
    )
    variant = parse_run_spec(text, f"<{spec.name} with {what}>")
    return variant, text


def write_spec_variant(
    spec: RunSpec, codec: str, directory: Path, averaging: str = "spec"
) -> tuple[RunSpec, Path]:
    variant, text = spec_variant(spec, codec, averaging)
    name = f"{codec}-{averaging}".replace(":", "_")
    path = directory / f"{spec.name}-{name}-{variant.run_id}.toml"
    path.write_text(text, encoding="utf-8")
    return variant, path


# ---- figures ------------------------------------------------------------------------------


def ideal_bytes_per_token(spec: RunSpec) -> float | None:
    """Codec payload per token per boundary: activation and gradient, each in and out of the
    trainer."""
    boundaries = spec.n_stages - 1
    if boundaries < 1:
        return None
    B, T, C = spec.batch.micro_batch_size, spec.model.seq_len, spec.model.d_model
    numel = B * T * C  # one (B, T, C) activation or gradient
    forward = parse_codec(spec.codecs.forward_activations).payload_nbytes(numel, torch.float32)
    backward = parse_codec(spec.codecs.backward_gradients).payload_nbytes(numel, torch.float32)
    return 2 * (forward + backward) / (B * T)


def wire_figures(training: dict[str, Any], spec: RunSpec) -> dict[str, float | None]:
    """Per-token, per-boundary bytes from the training phase's traffic (``Demo.traffic`` deltas)."""
    boundaries = spec.n_stages - 1
    hops = training["hops"]
    micro_batches = sum(hops) / (
        2 * spec.n_stages - 1
    )  # S forward hops and S - 1 backward ones each
    tokens = micro_batches * spec.batch.micro_batch_size * spec.model.seq_len
    if tokens <= 0 or boundaries < 1:
        return {"wire_bytes_per_token": None, "quic_bytes_per_token": None}
    ids = (
        (hops[0] / 2 + hops[-1]) * spec.batch.micro_batch_size * spec.model.seq_len * TOKEN_ID_BYTES
    )
    payload = training["payload_bytes_sent"] + training["payload_bytes_received"] - ids
    return {
        "wire_bytes_per_token": round(payload / tokens / boundaries, 1),
        "quic_bytes_per_token": round(training["quic_bytes_out"] / tokens / boundaries, 1),
    }


def summarize(profile: str, codec: str, figures: dict[str, Any], spec: RunSpec) -> dict[str, Any]:
    """One result row from ``run_swarm``'s figures."""
    training = figures["training"]
    return {
        "profile": profile,
        "codec": codec,
        "tokens_per_s": figures["tokens_per_s"],
        **wire_figures(training, spec),
        "val_loss": figures["val_loss_end"],
        "ideal_bytes_per_token": _round(ideal_bytes_per_token(spec), 1),
        "val_loss_start": figures["val_loss_start"],
        "tokens": figures["tokens"],
        "tokens_at_eval_end": figures["tokens_at_eval_end"],
        "training_tokens": training["tokens"],
        "elapsed_s": figures["elapsed_s"],
        "epoch": figures["epoch"],
        # the samples in a step, the mean over the stages' last steps (demo_figures.step_size)
        "samples_per_step": _mean_step(figures.get("stages", [])),
        "target_batch_size": spec.batch.target_batch_size,
        # each stage's averaging: mode, rounds per replica, rounds missed, bytes of its rounds
        "averaging": [r.get("averaging") for r in figures.get("stages", [])],
        # device-thread seconds over every stage server: running requests, and inside the
        # optimizer (a synchronous step's wait for its all-reduce is there)
        "compute_s": round(sum(r.get("compute_s", 0.0) for r in figures.get("stages", [])), 1),
        "optimizer_s": round(
            sum(r.get("optimizer_s", 0.0) for r in figures.get("stages", [])), 1
        ),
        # what crossed the WAN emulators over the whole run, QUIC datagrams and libp2p
        # streams (DHT, averaging, state): the averaging traffic shares the emulated links
        "wan_links": figures.get("wan_links"),
        "failed_micro_batches": figures["failed_micro_batches"],
        "retried_hops": training["retried_hops"],
        "cache_misses": training["cache_misses"],
        "run_id": figures["run_id"],
        "interrupted": figures["interrupted"],
    }


def _mean_step(stages: Sequence[dict[str, Any]]) -> float | None:
    sizes = [r["samples_per_step"] for r in stages if r.get("samples_per_step") is not None]
    return round(sum(sizes) / len(sizes), 1) if sizes else None


def failed_row(profile: str, codec: str, error: str, averaging: str = "spec") -> dict[str, Any]:
    return {
        "profile": profile,
        "codec": codec,
        "averaging_mode": averaging,
        "tokens_per_s": None,
        "wire_bytes_per_token": None,
        "val_loss": None,
        "error": error,
    }


def curve_at(curve: Sequence[tuple[int, float]], tokens: float) -> float | None:
    """The validation loss after ``tokens``: the last point at or before them (None past the end).

    A step function, not an interpolation: parameters change only when a step's update
    lands, so between steps k and k + 1 a swarm holds step k's parameters (its trainers'
    gradients for step k + 1 are still accumulating).
    """
    if not curve or not curve[0][0] <= tokens <= curve[-1][0]:
        return None
    return next(v for t, v in reversed(curve) if t <= tokens)


def match_reference(results: list[dict[str, Any]], curve: Sequence[tuple[int, float]]) -> None:
    """Add the reference's val loss at each swarm's evaluation (mean of tokens before and after
    it)."""
    for row in results:
        if row.get("val_loss") is None:
            continue
        at = (row["tokens"] + row["tokens_at_eval_end"]) / 2
        ref = curve_at(curve, at)
        row["reference_tokens"] = round(at)
        row["reference_val_loss"] = _round(ref, 4)
        # the reference's steps by then (its curve has a point at 0 and after every step)
        row["reference_steps"] = sum(1 for t, _ in curve if 0 < t <= at)
        row["val_loss_vs_reference"] = (
            None if ref is None else round(row["val_loss"] / ref - 1.0, 4)
        )


def check_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with its measured value and met (None: not measurable)."""
    targets = []
    by = {(r["profile"], r["codec"], r.get("averaging_mode", "spec")): r for r in results}
    for codec, avg in dict.fromkeys((r["codec"], r.get("averaging_mode", "spec")) for r in results):
        lan, wan = by.get(("lan", codec, avg)), by.get(("wan", codec, avg))
        if lan is None or wan is None:
            continue
        ratio = None
        if lan["tokens_per_s"] and wan["tokens_per_s"] is not None:
            ratio = round(wan["tokens_per_s"] / lan["tokens_per_s"], 3)
        what = codec if avg == "spec" else f"{codec}, {avg}"
        targets.append(
            {
                "target": f"wan tokens/s >= {THROUGHPUT_TARGET:.0%} of lan ({what})",
                "value": ratio,
                "threshold": THROUGHPUT_TARGET,
                "met": None if ratio is None else ratio >= THROUGHPUT_TARGET,
            }
        )
    for r in results:
        tolerance = VAL_LOSS_TOLERANCE.get(_codec_name(r["codec"]))
        if tolerance is None:
            continue
        excess = r.get("val_loss_vs_reference")
        targets.append(
            {
                "target": f"val loss <= reference + {tolerance:.0%} ({_name(r)})",
                "value": excess,
                "threshold": tolerance,
                "met": None if excess is None else excess <= tolerance,
            }
        )
    return targets


def _name(row: dict[str, Any]) -> str:
    """A configuration's name: profile/codec, and /averaging when not the spec's own."""
    avg = row.get("averaging_mode", "spec")
    return f"{row['profile']}/{row['codec']}" + ("" if avg == "spec" else f"/{avg}")


def row_mode(row: dict[str, Any]) -> str:
    """The averaging mode a result row ran (its --averaging item, else what its stages
    reported, else the spec default's)."""
    avg = row.get("averaging_mode", "spec")
    if avg != "spec":
        return str(avg.split(":")[0])
    stages = [a for a in row.get("averaging") or [] if a]
    return str(stages[0]["mode"]) if stages else "allreduce"


def decentralized_speedups(results: list[dict[str, Any]], replicas: int) -> list[dict[str, Any]]:
    """Each gossip row beside the all-reduce row of the same profile and codec: the measured
    speed-up (tokens/s) and Decent-DP's predicted one (node/stage/gossip.py) for the
    quantities measured in the same two runs: gamma, the all-reduce run's device-thread
    seconds inside the optimizer (where a synchronous step waits for its all-reduce) over
    its seconds running requests; omega, the gossip run's libp2p bytes per token over the
    all-reduce run's (what crossed the emulated links: averaging, DHT, state); sigma^2 is not
    measured (0: the model's straggler term left out). The loss gap comes with it: gossip's
    speed is bought with replicas that differ between rounds."""
    out = []
    done = [r for r in results if r.get("tokens_per_s")]
    for g in (r for r in done if row_mode(r) == "gossip"):
        ar = next((r for r in done if row_mode(r) == "allreduce"
                   and (r["profile"], r["codec"]) == (g["profile"], g["codec"])), None)
        if ar is None:
            continue
        gamma = ar["optimizer_s"] / ar["compute_s"] if ar.get("compute_s") else None
        links_g, links_a = g.get("wan_links") or {}, ar.get("wan_links") or {}
        omega = None
        if links_g.get("libp2p_bytes") and links_a.get("libp2p_bytes"):
            per_token_g = links_g["libp2p_bytes"] / g["tokens"]
            omega = per_token_g / (links_a["libp2p_bytes"] / ar["tokens"])
        avg = g.get("averaging_mode", "spec")
        parts = avg.split(":")
        k = int(parts[2]) if avg != "spec" and len(parts) > 2 else 1
        predicted = (
            None if gamma is None or omega is None
            else gossip.predicted_speedup(gamma, omega, 0.0, max(replicas, 2), k)
        )
        out.append({
            "profile": g["profile"], "codec": g["codec"],
            "gossip": _name(g), "allreduce": _name(ar),
            "measured_speedup": round(g["tokens_per_s"] / ar["tokens_per_s"], 3),
            "predicted_speedup": _round(predicted, 3),
            "gamma": _round(gamma, 3), "omega": _round(omega, 3), "sigma2": None,
            "val_loss_gossip": g.get("val_loss"), "val_loss_allreduce": ar.get("val_loss"),
        })
    return out


def _codec_name(codec: str) -> str:
    try:
        return str(parse_codec(codec).name)
    except CodecError:
        return codec


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


# ---- report -------------------------------------------------------------------------------


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_report(report: dict[str, Any]) -> str:
    """The human table: every configuration beside the reference, then the target checks."""
    meta, ref = report["meta"], report["reference"]
    w = max([14, *(len(_name(r)) for r in report["results"])])  # the config column
    lines = [
        f"swarm benchmark: run {meta['run']} "
        f"({meta['stages']} stages x {meta['replicas']} replicas, "
        f"{meta['tokens']} tokens per configuration, {meta['eval_windows']} validation windows); "
        f"reference: one process on {meta['reference_device']}, "
        f"{meta['reference_threads']} thread(s), "
        f"update lag {meta['update_lag']}",
        "",
        f"{'config':<{w}} {'tokens':>8} {'tok/s':>7} {'x ref':>6} {'wire B/tok':>10} {'ideal':>7} "
        f"{'QUIC B/tok':>10} {'val loss':>8} {'ref val':>8} {'vs ref':>7} {'steps':>6} "
        f"{'ref':>5} {'smp/step':>8}",
    ]
    ref_tps = ref.get("tokens_per_s")
    lines.append(
        f"{'reference':<{w}} {_num(ref.get('tokens'), 'd'):>8} {_num(ref_tps, '.0f'):>7} "
        f"{'1.00':>6} "
        f"{'-':>10} {'-':>7} {'-':>10} {_num(ref.get('val_loss'), '.4f'):>8} {'-':>8} {'-':>7}"
    )
    for r in report["results"]:
        name = _name(r)
        if r.get("error"):
            lines.append(f"{name:<{w}} failed: {r['error'].splitlines()[0]}")
            continue
        speed = r["tokens_per_s"] / ref_tps if ref_tps and r["tokens_per_s"] is not None else None
        vs = r.get("val_loss_vs_reference")
        lines.append(
            f"{name:<{w}} {r['tokens']:>8d} {_num(r['tokens_per_s'], '.0f'):>7} "
            f"{_num(speed, '.2f'):>6} "
            f"{_num(r['wire_bytes_per_token'], '.1f'):>10} "
            f"{_num(r.get('ideal_bytes_per_token'), '.1f'):>7} "
            f"{_num(r.get('quic_bytes_per_token'), '.1f'):>10} {_num(r['val_loss'], '.4f'):>8} "
            f"{_num(r.get('reference_val_loss'), '.4f'):>8} "
            f"{_num(None if vs is None else 100 * vs, '+.1f'):>6}% "
            f"{_num(r.get('epoch'), 'd'):>6} {_num(r.get('reference_steps'), 'd'):>5} "
            f"{_num(r.get('samples_per_step'), '.1f'):>8}"
        )
    lines += [
        "",
        "wire B/tok: trainer payload bytes across stage boundaries per token per boundary "
        "(token ids and targets excluded); ideal: the codec's payload for 4 crossings per "
        "boundary; QUIC B/tok: UDP bytes sent by every endpoint per token per boundary; "
        "ref val: the reference's curve at the swarm's tokens during its final evaluation; "
        "steps: the swarm's optimizer steps, ref: the reference's at the same tokens; "
        "smp/step: samples in a swarm step, summed over a stage's replicas (mean of the "
        f"stages' last steps; the spec's target: {meta.get('target_batch_size', '-')}).",
    ]
    for r in report["results"]:
        links = r.get("wan_links")
        if links:
            lines.append(
                f"{_name(r)}: across the emulated links (whole run) "
                f"{describe_wan_links(links)}, sharing each daemon's link"
            )
    for d in report.get("decentralized", []):
        lines.append(
            f"{d['gossip']} vs {d['allreduce']}: measured speed-up "
            f"{_num(d['measured_speedup'], '.2f')}x, Decent-DP's model "
            f"{_num(d['predicted_speedup'], '.2f')}x (gamma {_num(d['gamma'], '.2f')}, "
            f"omega {_num(d['omega'], '.2f')}, sigma^2 not measured); val loss "
            f"{_num(d['val_loss_gossip'], '.4f')} vs {_num(d['val_loss_allreduce'], '.4f')}"
        )
    lines += [
        "",
        "targets",
    ]
    if meta.get("quick"):
        lines.append(
            "  (--quick: a smoke test of the benchmark; "
            "a few steps on one replica say little about them)"
        )
    if not report["targets"]:
        lines.append("  (none measurable: needs lan and wan, or codec int8/int4)")
    for t in report["targets"]:
        value = t["value"]
        shown = (
            "-"
            if value is None
            else (f"{value:.2f}" if "tokens/s" in t["target"] else f"{100 * value:+.1f}%")
        )
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        lines.append(f"  {t['target']:<48} {shown:>8}  {verdict}")
    return "\n".join(lines)


# ---- arguments ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    tokens: int
    profiles: tuple[str, ...]
    codecs: tuple[str, ...]
    replicas: int
    eval_windows: int
    update_lag: float
    reference_threads: int
    data_seed: int
    max_train_s: float
    progress_s: float
    sets: tuple[str, ...]
    spec: Path | None
    json_only: bool
    keep: bool
    quick: bool = False
    reference_device: str = "cpu"
    averaging: tuple[str, ...] = ("spec",)


def _names(text: str, what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not names or any(not n for n in names):
        raise BenchmarkError(f"--{what}: give comma-separated names, e.g. lan,wan")
    if len(set(names)) != len(names):
        raise BenchmarkError(f"--{what}: {text!r} names one twice")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Time: every configuration costs start-up, two evaluations and shutdown "
            "(about 75 s with 3 daemons, about 200 s with 6, on a loaded 2-core machine) "
            "plus its tokens at the swarm's rate (1-2k tokens/s there). "
            f"The defaults ({DEFAULT_TOKENS} tokens, 6 configurations, {DEFAULT_REPLICAS} "
            "replicas) should take 35-45 minutes there, "
            f"--quick ({QUICK_TOKENS} tokens, {QUICK_REPLICAS} replica, "
            f"{QUICK_EVAL_WINDOWS} validation windows) about 10 "
            "(95 s per configuration measured under load); "
            "--profiles/--codecs choose fewer configurations."
        ),
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help=f"training tokens per configuration, the same for all and for the reference "
        f"(default {DEFAULT_TOKENS}; --quick {QUICK_TOKENS})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: fewer tokens, one replica, fewer validation windows "
        "(explicit flags win)",
    )
    parser.add_argument(
        "--profiles",
        default="lan,wan",
        help=f"WAN profiles, of {sorted(PROFILES)} (default lan,wan)",
    )
    parser.add_argument(
        "--codecs",
        default="none,int8,int4",
        help="wire codecs for activations and gradients, e.g. none,int8,int4,int8:b128 "
        "(default none,int8,int4)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help=f"daemons per stage (default {DEFAULT_REPLICAS}; --quick {QUICK_REPLICAS})",
    )
    parser.add_argument(
        "--eval-windows",
        type=int,
        default=None,
        help=f"validation windows, swarm and reference (default {DEFAULT_EVAL_WINDOWS}; "
        f"--quick {QUICK_EVAL_WINDOWS})",
    )
    parser.add_argument(
        "--update-lag",
        type=float,
        default=None,
        help="reference's delayed-update model, fraction of a step (default 0: the demo's "
        f"daemons step synchronously; {DEFAULT_UPDATE_LAG} with "
        "--set averaging.delayed_updates=true)",
    )
    parser.add_argument(
        "--reference-threads",
        type=int,
        default=1,
        help="torch threads of the reference (default 1)",
    )
    parser.add_argument(
        "--reference-device",
        default="cpu",
        help="torch device of the reference (default cpu; cuda to compare a swarm whose "
        "daemons run --set stage_server.device=cuda on the same GPU)",
    )
    parser.add_argument(
        "--data-seed",
        type=int,
        default=0,
        help="reference data seed; swarm trainer i uses this + i (default 0)",
    )
    parser.add_argument(
        "--max-train-s",
        type=float,
        default=900.0,
        help="stop a configuration's training after this long even below --tokens (default 900)",
    )
    parser.add_argument(
        "--progress-s",
        type=float,
        default=5.0,
        help="seconds between progress lines on stderr (default 5)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config setting for every daemon (repeatable), as for 'wanswarm demo'",
    )
    parser.add_argument(
        "--spec",
        type=Path,
        default=None,
        help="base run spec TOML (default: the embedded tiny run)",
    )
    parser.add_argument(
        "--json-only", action="store_true", help="print only the JSON line on stdout"
    )
    parser.add_argument("--keep", action="store_true", help="keep the daemons' state dirs and logs")
    parser.add_argument(
        "--averaging",
        default="spec",
        help="stage averaging modes to run each configuration in, comma-separated: spec (the "
        "base spec's [averaging], default), allreduce, gossip:H[:NEIGHBOURS], "
        "diloco:H[:COMPRESSION[:FRAGMENTS]] (FRAGMENTS: Streaming DiLoCo); with allreduce and "
        "gossip the report adds the measured gossip speed-up beside Decent-DP's predicted one",
    )
    return parser


def parse_options(argv: Sequence[str] | None = None) -> Options:
    """Parsed and checked arguments; BenchmarkError says what to change."""
    args = build_parser().parse_args(argv)
    tokens = (
        args.tokens if args.tokens is not None else (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    )
    replicas = (
        args.replicas
        if args.replicas is not None
        else (QUICK_REPLICAS if args.quick else DEFAULT_REPLICAS)
    )
    windows = (
        args.eval_windows
        if args.eval_windows is not None
        else (QUICK_EVAL_WINDOWS if args.quick else DEFAULT_EVAL_WINDOWS)
    )
    if tokens < 1 or replicas < 1 or windows < 1:
        raise BenchmarkError("--tokens, --replicas and --eval-windows must be >= 1")
    if args.reference_threads < 1 or args.data_seed < 0:
        raise BenchmarkError("--reference-threads must be >= 1 and --data-seed >= 0")
    if args.max_train_s <= 0 or args.progress_s <= 0:
        raise BenchmarkError("--max-train-s and --progress-s must be > 0")
    profiles = _names(args.profiles, "profiles")
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        raise BenchmarkError(f"--profiles: unknown {unknown}; use some of {sorted(PROFILES)}")
    codecs = _names(args.codecs, "codecs")
    for codec in codecs:
        try:
            parse_codec(codec)
        except CodecError as exc:
            raise BenchmarkError(f"--codecs: {exc}") from None
    averaging = _names(args.averaging, "averaging")
    for item in averaging:
        parse_averaging(item)
    delayed = False  # the demo's daemons step synchronously (node/tools/demo.py)
    for item in args.set:
        try:
            override = parse_assignment(item)
        except NodeError as exc:
            raise BenchmarkError(str(exc)) from None
        if override.path == "averaging.delayed_updates":
            delayed = str(override.value).strip().lower() not in ("false", "0", "no", "off")
    lag = (
        args.update_lag if args.update_lag is not None else (DEFAULT_UPDATE_LAG if delayed else 0.0)
    )
    if not 0.0 <= lag <= 1.0:
        raise BenchmarkError(f"--update-lag must be in [0, 1], got {lag}")
    return Options(
        tokens,
        profiles,
        codecs,
        replicas,
        windows,
        lag,
        args.reference_threads,
        args.data_seed,
        args.max_train_s,
        args.progress_s,
        tuple(args.set),
        args.spec,
        args.json_only,
        args.keep,
        args.quick,
        args.reference_device,
        averaging,
    )


# ---- running ------------------------------------------------------------------------------


def run_configurations(
    opts: Options,
    spec: RunSpec,
    directory: Path,
    swarm: Callable[[DemoOptions, TextIO], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every (profile, codec, averaging) on a swarm of its own (``run_swarm`` unless ``swarm``
    is given)."""
    swarm = run_swarm if swarm is None else swarm
    results: list[dict[str, Any]] = []
    variants = {
        (codec, avg): write_spec_variant(spec, codec, directory, avg)
        for codec in opts.codecs
        for avg in opts.averaging
    }
    configurations = [(p, c, a) for p in opts.profiles for c in opts.codecs for a in opts.averaging]
    for profile, codec, avg in configurations:
        variant, path = variants[(codec, avg)]
        label = "[" + _name({"profile": profile, "codec": codec, "averaging_mode": avg}) + "]"
        options = DemoOptions(
            replicas=opts.replicas,
            duration_s=opts.max_train_s,
            tokens=opts.tokens,
            wan=profile,
            keep=opts.keep,
            eval_windows=opts.eval_windows,
            extra=opts.sets,
            run_spec=path,
            data_seed=opts.data_seed,
            progress_period_s=opts.progress_s,
            label=label,
        )
        began = time.monotonic()
        try:
            figures = swarm(options, sys.stderr)
        except DemoError as exc:
            _progress(f"{label} failed: {exc}")
            results.append(failed_row(profile, codec, str(exc), avg))
            continue
        row = summarize(profile, codec, figures, variant)
        row["averaging_mode"] = avg
        results.append(row)
        _progress(
            f"{label} done in {time.monotonic() - began:.0f}s: {row['tokens_per_s']} tok/s, "
            f"val loss {row['val_loss']}, {row['wire_bytes_per_token']} B/token/boundary"
        )
        if row["interrupted"]:
            raise KeyboardInterrupt
    return results


def run_reference(
    opts: Options, spec: RunSpec, tokens: int
) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(opts.reference_threads)
    step_tokens = spec.batch.target_batch_size * spec.model.seq_len
    last = -math.inf

    def show(point: CurvePoint) -> None:
        nonlocal last
        if time.monotonic() - last >= opts.progress_s:
            last = time.monotonic()
            _progress(
                f"[reference] step {point.step}  {point.tokens} tokens  val {point.val_loss:.4f}  "
                f"{point.train_seconds:.0f}s of training"
            )

    try:
        result = train_reference(
            spec,
            tokens,
            opts.data_seed,
            log_every=step_tokens,
            on_point=show,
            update_lag=opts.update_lag,
            val_windows=opts.eval_windows,
            landed_val=True,
            device=opts.reference_device,
        )
    finally:
        torch.set_num_threads(threads)
    curve = [
        (p.tokens, p.val_loss if p.val_loss_landed is None else p.val_loss_landed)
        for p in result.curve
    ]
    at_budget = next(
        i for i, p in enumerate(result.curve) if p.tokens >= opts.tokens or p is result.curve[-1]
    )
    return {
        "tokens_per_s": round(result.tokens_per_second, 1),
        "val_loss": round(curve[at_budget][1], 4),  # the last update landed
        "val_loss_in_flight": round(result.curve[at_budget].val_loss, 4),  # not yet landed
        "tokens": result.curve[at_budget].tokens,
        "val_loss_start": round(result.val_loss_start, 4),
        "update_lag": opts.update_lag,
        "threads": opts.reference_threads,
        "device": opts.reference_device,
        "curve": [[t, round(v, 4)] for t, v in curve],
    }, curve


def build_report(
    opts: Options,
    spec: RunSpec,
    reference: dict[str, Any],
    curve: Sequence[tuple[int, float]],
    results: list[dict[str, Any]],
) -> dict[str, Any]:
    match_reference(results, curve)
    return {
        "reference": reference,
        "results": results,
        "targets": check_targets(results),
        "decentralized": decentralized_speedups(results, opts.replicas),
        "meta": {
            "run": spec.name,
            "run_id": spec.run_id,
            "stages": spec.n_stages,
            "target_batch_size": spec.batch.target_batch_size,
            "replicas": opts.replicas,
            "tokens": opts.tokens,
            "eval_windows": opts.eval_windows,
            "update_lag": opts.update_lag,
            "reference_threads": opts.reference_threads,
            "reference_device": opts.reference_device,
            "data_seed": opts.data_seed,
            "sets": list(opts.sets),
            "averaging": list(opts.averaging),
            "quick": opts.quick,
        },
    }


def _progress(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_options(argv)
        spec = default_run_spec() if opts.spec is None else load_run_spec(opts.spec)
    except (BenchmarkError, RunSpecError) as exc:
        print(f"swarm.py: {exc}", file=sys.stderr)
        return 2
    began = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="wanswarm-bench-") as tmp:
            results = run_configurations(opts, spec, Path(tmp))
        measured = [r["tokens_at_eval_end"] for r in results if r.get("val_loss") is not None]
        reach = max([opts.tokens, *measured])
        _progress(
            f"[reference] training {reach} tokens (the most any swarm reached, at least --tokens)"
        )
        reference, curve = run_reference(opts, spec, reach)
    except KeyboardInterrupt:
        _progress("interrupted")
        return 130
    report = build_report(opts, spec, reference, curve, results)
    report["meta"]["wall_s"] = round(time.monotonic() - began, 1)
    if not opts.json_only:
        print(format_report(report))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
