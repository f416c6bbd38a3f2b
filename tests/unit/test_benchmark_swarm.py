"""benchmarks/swarm.py without swarms: run spec variants, the wire figures, the reference
matching, the targets, the report and its JSON line, argument checks. The swarm runs are
replaced by a fake ``run_swarm`` that returns figures of a known shape; the reference runs
for real on a two-stage toy spec."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO, cast

import pytest
import torch
from wanswarm.node.cli import build_parser
from wanswarm.node.config.runspec import (
    RunSpec,
    default_run_spec,
    differing_fields,
    load_run_spec,
    parse_run_spec,
)
from wanswarm.node.tools.demo import JSON_FIELDS, Demo, DemoOptions
from wanswarm.node.tools.demo_daemons import DemoError
from wanswarm.transport.codecs import parse_codec

from tests.benchmark_loader import load_benchmark

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "runs"


bench = load_benchmark("swarm.py", "bench_swarm")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def toy_spec(corpus: Path) -> RunSpec:
    return RunSpec.model_validate({
        "name": "toy",
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "seq_len": 16},
        "stages": {"blocks_per_stage": [1, 1]},
        "batch": {"micro_batch_size": 4, "target_batch_size": 8},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2, "decay_steps": 200},
        "data": {"corpus": [str(corpus)], "validation_fraction": 0.1, "validation_windows": 16},
    })


def corpus_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    return path


# ---- spec variants ----------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "int8", "int4", "int8:b128", "bf16"])
def test_spec_variant_differs_only_in_codecs(tmp_path: Path, codec: str) -> None:
    base = default_run_spec()
    variant, path = bench.write_spec_variant(base, codec, tmp_path)
    loaded = load_run_spec(path)
    assert loaded == variant
    assert loaded.codecs.forward_activations == loaded.codecs.backward_gradients == codec
    assert set(differing_fields(base, loaded)) <= {
        "codecs.forward_activations",
        "codecs.backward_gradients",
    }
    assert (loaded.run_id == base.run_id) == (codec == base.codecs.forward_activations == "int8")
    assert loaded.run_id in path.name


def test_every_shipped_run_spec_survives_the_toml_writer() -> None:
    for path in sorted(CONFIGS.glob("*.toml")):
        spec = load_run_spec(path)
        raw = spec.model_dump(mode="json", exclude_none=True)
        assert parse_run_spec(bench.to_toml(raw)) == spec, path


def test_toml_writer_values_and_refusals() -> None:
    text = bench.to_toml({"a": 1e-8, "b": [0.9, 0.95], "c": 'say "hi"\n', "d": True, "odd key": 3,
                          "t": {"u": {"v": -2}}, "inf": float("inf")})
    import tomllib

    assert tomllib.loads(text) == {
        "a": 1e-8, "b": [0.9, 0.95], "c": 'say "hi"\n', "d": True, "odd key": 3,
        "t": {"u": {"v": -2}}, "inf": float("inf"),
    }
    with pytest.raises(bench.BenchmarkError, match="t.x is None"):
        bench.to_toml({"t": {"x": None}})
    with pytest.raises(bench.BenchmarkError, match="cannot write"):
        bench.to_toml({"x": object()})


# ---- figures ------------------------------------------------------------------------------


def traffic_of(spec: RunSpec, micro_batches: int, carried: int = 0) -> dict[str, Any]:
    """The trainers' counters after ``micro_batches`` clean micro-batches (SWARM hop by hop),
    ``carried`` of whose backward hops on stage 1 carried their input (no cache there)."""
    B, T, C, S = spec.batch.micro_batch_size, spec.model.seq_len, spec.model.d_model, spec.n_stages
    ids = B * T * 8
    fwd = parse_codec(spec.codecs.forward_activations).payload_nbytes(B * T * C, torch.float32)
    bwd = parse_codec(spec.codecs.backward_gradients).payload_nbytes(B * T * C, torch.float32)
    # forward: ids -> stage 0 -> y0 back; y_{s-1} -> stage s -> y_s back;
    # y_{S-2} + targets -> stage S-1
    # backward: grad -> stage s (S-2..0), dL/dx back from every stage but 0
    sent = ids + (S - 2) * fwd + (fwd + ids) + (S - 1) * bwd
    received = (S - 1) * fwd + (S - 1) * bwd
    return {
        "tokens": micro_batches * B * T,
        "payload_bytes_sent": micro_batches * sent + carried * fwd,
        "payload_bytes_received": micro_batches * received,
        "hops": [2 * micro_batches] * (S - 1) + [micro_batches],
        "retried_hops": 0, "cache_misses": carried, "failed_micro_batches": 0,
        "quic_bytes_out": micro_batches * (sent + received) * 11 // 10, "quic_bytes_in": 0,
    }


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_wire_bytes_count_boundary_tensors_only(codec: str) -> None:
    spec, _ = bench.spec_variant(default_run_spec(), codec)
    ideal = bench.ideal_bytes_per_token(spec)
    B, T, C = spec.batch.micro_batch_size, spec.model.seq_len, spec.model.d_model
    expected = {
        "none": 4 * C * 4,
        "int8": 4 * (C + 4 * C // 64),
        "int4": 4 * (C // 2 + 4 * C // 64),
    }[codec]
    assert ideal == pytest.approx(expected + 4 * 8 / (B * T))  # plus each payload's 8-byte header
    figures = bench.wire_figures(traffic_of(spec, micro_batches=50), spec)
    assert figures["wire_bytes_per_token"] == pytest.approx(ideal, abs=0.05)
    # a backward that carries its input adds that activation's crossing
    carried = bench.wire_figures(traffic_of(spec, micro_batches=50, carried=10), spec)
    fwd = parse_codec(codec).payload_nbytes(B * T * C, torch.float32)
    extra = 10 * fwd / (50 * B * T) / (spec.n_stages - 1)
    assert carried["wire_bytes_per_token"] == pytest.approx(ideal + extra, abs=0.05)
    assert figures["quic_bytes_per_token"] is not None and figures["quic_bytes_per_token"] > ideal
    # tokens come from the hops made in the phase, not from the completed-token counter (which
    # misses micro-batches in flight at either end of the phase)
    skewed = {**traffic_of(spec, micro_batches=50), "tokens": 47 * B * T}
    assert bench.wire_figures(skewed, spec) == figures


def test_wire_figures_without_tokens_or_boundaries() -> None:
    spec = default_run_spec()
    assert bench.wire_figures({**traffic_of(spec, 0)}, spec) == {
        "wire_bytes_per_token": None, "quic_bytes_per_token": None}
    one_stage = RunSpec.model_validate(
        {"name": "one", "model": {"n_layers": 2}, "stages": {"blocks_per_stage": [2]}}
    )
    assert bench.ideal_bytes_per_token(one_stage) is None


def test_curve_holds_each_step_until_the_next() -> None:
    curve = [(0, 5.0), (100, 3.0), (200, 2.0)]
    assert bench.curve_at(curve, 0) == 5.0
    assert bench.curve_at(curve, 99.5) == 5.0
    assert bench.curve_at(curve, 100) == 3.0
    assert bench.curve_at(curve, 150) == 3.0
    assert bench.curve_at(curve, 200) == 2.0
    assert bench.curve_at(curve, 201) is None and bench.curve_at([], 0) is None
    assert bench.curve_at(curve, -1) is None


# ---- results, targets, report --------------------------------------------------------------


def figures(spec: RunSpec, *, tokens_per_s: float, val: float, micro_batches: int = 40,
            interrupted: bool = False) -> dict[str, Any]:
    """What run_swarm returns (the --json fields and the rest), with traffic_of's counters."""
    training = traffic_of(spec, micro_batches)
    tokens = training["tokens"] + 4096
    return {
        "val_loss_start": 5.6, "val_loss_end": val, "tokens": tokens, "tokens_per_s": tokens_per_s,
        "daemons": 2 * spec.n_stages, "stages": [], "elapsed_s": 10.0, "epoch": 3,
        "wire_bytes_per_token": [],
        "run_id": spec.run_id, "codecs": spec.codecs.model_dump(), "wan": "lan", "replicas": 2,
        "tokens_at_eval_end": tokens + 2048, "failed_micro_batches": 0, "training": training,
        "interrupted": interrupted,
    }


CURVE = [(0, 5.6), (20_000, 3.0), (40_000, 2.5), (60_000, 2.3)]


def results_of(
    spec: RunSpec, rows: dict[tuple[str, str], tuple[float, float]]
) -> list[dict[str, Any]]:
    out = []
    for (profile, codec), (tps, val) in rows.items():
        variant, _ = bench.spec_variant(spec, codec)
        out.append(
            bench.summarize(profile, codec, figures(variant, tokens_per_s=tps, val=val), variant)
        )
    return out


def test_targets_are_marked_met_and_missed() -> None:
    spec = default_run_spec()
    results = results_of(spec, {
        ("lan", "int8"): (2000.0, 2.9), ("wan", "int8"): (1500.0, 3.2),
        ("lan", "int4"): (2000.0, 3.05), ("wan", "int4"): (1300.0, 3.0),
        ("lan", "none"): (2100.0, 3.5),
    })
    bench.match_reference(results, CURVE)
    at = (results[0]["tokens"] + results[0]["tokens_at_eval_end"]) / 2
    ref = bench.curve_at(CURVE, at)
    assert results[0]["reference_tokens"] == round(at)
    assert results[0]["reference_val_loss"] == round(ref, 4)
    assert results[0]["val_loss_vs_reference"] == round(2.9 / ref - 1, 4)
    verdicts = {t["target"]: (t["value"], t["met"]) for t in bench.check_targets(results)}
    assert verdicts["wan tokens/s >= 70% of lan (int8)"] == (0.75, True)
    assert verdicts["wan tokens/s >= 70% of lan (int4)"] == (0.65, False)
    assert "wan tokens/s >= 70% of lan (none)" not in verdicts  # no wan run of it
    assert verdicts["val loss <= reference + 2% (lan/int8)"][1] is (2.9 <= 1.02 * ref)
    assert verdicts["val loss <= reference + 2% (wan/int8)"][1] is False
    assert verdicts["val loss <= reference + 3% (wan/int4)"][1] is (3.0 <= 1.03 * ref)
    assert not any("none)" in k and "val loss" in k for k in verdicts)  # no val target for none
    assert len(verdicts) == 6


def test_failed_configuration_is_reported_not_fatal() -> None:
    spec = default_run_spec()
    results = results_of(spec, {("lan", "int8"): (2000.0, 2.9)})
    results.append(
        bench.failed_row("wan", "int8", "daemon 3 exited with status 1; its log ends:\n  boom")
    )
    bench.match_reference(results, CURVE)
    targets = bench.check_targets(results)
    assert {t["target"]: t["met"] for t in targets}["wan tokens/s >= 70% of lan (int8)"] is None
    report = build(spec, results)
    text = bench.format_report(report)
    assert "wan/int8       failed: daemon 3 exited with status 1; its log ends:" in text
    assert "not measured" in text


def build(spec: RunSpec, results: list[dict[str, Any]]) -> dict[str, Any]:
    opts = bench.parse_options(["--tokens", "40000"])
    reference = {"tokens_per_s": 5400.0, "val_loss": 2.5, "tokens": 40_960, "val_loss_start": 5.6,
                 "update_lag": 0.125, "threads": 1, "curve": [list(p) for p in CURVE]}
    return bench.build_report(opts, spec, reference, CURVE, results)


def test_report_table_and_json_line() -> None:
    spec = default_run_spec()
    results = results_of(spec, {("lan", "int8"): (2000.0, 2.9), ("wan", "int8"): (1000.0, 2.95)})
    report = build(spec, results)
    text = bench.format_report(report)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("config"))
    assert lines[header + 1].split()[:4] == ["reference", "40960", "5400", "1.00"]
    lan = lines[header + 2].split()
    assert lan[0] == "lan/int8" and lan[2] == "2000" and lan[3] == "0.37"
    assert float(lan[4]) == results[0]["wire_bytes_per_token"]
    assert "wan tokens/s >= 70% of lan (int8)" in text and "0.50  MISSED" in text
    decoded = json.loads(json.dumps(report))
    assert set(decoded["reference"]) >= {"tokens_per_s", "val_loss"}
    for row in decoded["results"]:
        assert set(row) >= {"profile", "codec", "tokens_per_s", "wire_bytes_per_token", "val_loss"}
    assert decoded["meta"]["run_id"] == spec.run_id and decoded["meta"]["tokens"] == 40_000
    assert "--quick" not in text
    quick = bench.build_report(
        bench.parse_options(["--quick"]), spec, report["reference"], CURVE, results
    )
    assert "(--quick: a smoke test" in bench.format_report(quick)


# ---- running, with a fake swarm --------------------------------------------------------------


class FakeSwarm:
    def __init__(self, fail: str | None = None, interrupt: str | None = None) -> None:
        self.calls: list[DemoOptions] = []
        self.fail, self.interrupt = fail, interrupt

    def __call__(self, options: DemoOptions, out: TextIO) -> dict[str, Any]:
        self.calls.append(options)
        assert options.run_spec is not None
        spec = load_run_spec(options.run_spec)  # the variant must still be on disk and valid
        codec = spec.codecs.forward_activations
        if f"{options.wan}/{codec}" == self.fail:
            raise DemoError("timed out after 300s waiting for every daemon online")
        return figures(spec, tokens_per_s=1000.0, val=3.0, micro_batches=4,
                       interrupted=f"{options.wan}/{codec}" == self.interrupt)


def test_configurations_get_their_spec_profile_and_seeds(tmp_path: Path) -> None:
    opts = bench.parse_options(["--quick", "--profiles", "lan,wan", "--codecs", "none,int4",
                                "--set", "trainer.request_timeout_s=60", "--data-seed", "7"])
    fake = FakeSwarm(fail="wan/none")
    results = bench.run_configurations(opts, default_run_spec(), tmp_path, fake)
    assert [(r["profile"], r["codec"]) for r in results] == [
        ("lan", "none"), ("lan", "int4"), ("wan", "none"), ("wan", "int4")]
    assert results[2]["error"].startswith("timed out") and results[2]["val_loss"] is None
    assert results[3]["val_loss"] == 3.0 and results[3]["wire_bytes_per_token"] is not None
    first = fake.calls[0]
    assert (first.wan, first.replicas, first.tokens, first.eval_windows) == (
        "lan", 1, bench.QUICK_TOKENS, 16
    )
    assert first.data_seed == 7 and first.extra == ("trainer.request_timeout_s=60",)
    assert first.label == "[lan/none]" and first.progress_period_s == 5.0
    assert fake.calls[0].run_spec == fake.calls[2].run_spec != fake.calls[1].run_spec


def test_an_interrupted_configuration_stops_the_benchmark(tmp_path: Path) -> None:
    opts = bench.parse_options(["--quick", "--codecs", "int8"])
    fake = FakeSwarm(interrupt="lan/int8")
    with pytest.raises(KeyboardInterrupt):
        bench.run_configurations(opts, default_run_spec(), tmp_path, fake)
    assert len(fake.calls) == 1


def test_main_trains_the_reference_and_ends_with_the_json_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = toy_spec(corpus_file(tmp_path))
    spec_file = tmp_path / "toy.toml"
    spec_file.write_text(bench.to_toml(spec.model_dump(mode="json", exclude_none=True)))
    monkeypatch.setattr(bench, "run_swarm", FakeSwarm())
    step = 8 * 16
    # daemons with delayed updates: the reference models their lag (and reads landed updates)
    code = bench.main(["--spec", str(spec_file), "--tokens", str(2 * step), "--codecs", "int8,int4",
                       "--eval-windows", "4", "--progress-s", "0.001",
                       "--set", "averaging.delayed_updates=true"])
    captured = capsys.readouterr()
    assert code == 0
    lines = captured.out.strip().splitlines()
    report = json.loads(lines[-1])
    assert "targets" in lines  # the human table came first
    reference = report["reference"]
    # fake swarms reach 4 micro-batches + 4096 + 2048 tokens: the reference trains as far
    reach = 4 * 4 * 16 + 4096 + 2048
    assert reference["curve"][-1][0] == -(-reach // step) * step and reference["tokens"] == 2 * step
    assert [t for t, _ in reference["curve"]] == list(range(0, reference["curve"][-1][0] + 1, step))
    assert reference["update_lag"] == bench.DEFAULT_UPDATE_LAG and reference["tokens_per_s"] > 0
    # read with the last update landed
    assert reference["val_loss"] != reference["val_loss_in_flight"]
    # still learning at the end (not one value rounded alike at two converged steps)
    assert len({v for _, v in reference["curve"][-5:]}) > 1
    assert [r["codec"] for r in report["results"]] == ["int8", "int4"] * 2
    assert all(r["reference_val_loss"] is not None for r in report["results"])
    assert len(report["targets"]) == 2 + 4
    assert "[reference] step" in captured.err


def test_demo_json_fields_are_part_of_the_result() -> None:
    spec = default_run_spec()
    assert set(JSON_FIELDS) <= set(figures(spec, tokens_per_s=1.0, val=1.0))


# ---- arguments ----------------------------------------------------------------------------


def test_defaults_and_quick() -> None:
    opts = bench.parse_options([])
    assert (opts.tokens, opts.replicas, opts.eval_windows) == (bench.DEFAULT_TOKENS, 2, 64)
    assert opts.profiles == ("lan", "wan") and opts.codecs == ("none", "int8", "int4")
    assert opts.update_lag == 0.0  # the demo's daemons step synchronously
    quick = bench.parse_options(["--quick", "--replicas", "2"])
    assert (quick.tokens, quick.replicas, quick.eval_windows) == (bench.QUICK_TOKENS, 2, 16)
    delayed = bench.parse_options(["--set", "averaging.delayed_updates=true"])
    assert delayed.update_lag == bench.DEFAULT_UPDATE_LAG
    assert bench.parse_options(["--set", "averaging.delayed_updates=false"]).update_lag == 0.0
    assert bench.parse_options(
        ["--set", "averaging.delayed_updates=true", "--update-lag", "0.3"]
    ).update_lag == 0.3


@pytest.mark.parametrize(("argv", "message"), [
    (["--profiles", "lan,moon"], "unknown"),
    (["--profiles", "lan,lan"], "twice"),
    (["--profiles", "lan,"], "comma-separated"),
    (["--codecs", "int3"], "--codecs"),
    (["--tokens", "0"], "must be >= 1"),
    (["--replicas", "0"], "must be >= 1"),
    (["--update-lag", "1.5"], "update-lag"),
    (["--max-train-s", "0"], "must be > 0"),
    (["--set", "novalue"], "expected section.key=value"),
])
def test_bad_arguments_say_what_to_change(argv: list[str], message: str) -> None:
    with pytest.raises(bench.BenchmarkError, match=message):
        bench.parse_options(argv)


def test_main_exits_2_on_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--codecs", "int3"]) == 2
    assert bench.main(["--spec", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert "--codecs" in err and "missing.toml" in err


# ---- what the benchmark uses of the demo ----------------------------------------------------


def test_demo_sums_traffic_over_its_daemons(tmp_path: Path) -> None:
    spec_file = tmp_path / "int4.toml"
    variant, text = bench.spec_variant(default_run_spec(), "int4")
    spec_file.write_text(text)
    demo = Demo(DemoOptions(run_spec=spec_file, root=tmp_path))
    assert demo.spec == variant and demo.spec_path == spec_file.resolve()

    def status(tokens: int, hops: dict[str, int], out: int) -> dict[str, Any]:
        return {"components": {
            "trainer": {
                "tokens": tokens,
                "payload_bytes": {"sent": 10 * tokens, "received": 20 * tokens},
                "hops": hops, "retried_hops": 1, "cache_misses": 2,
                "micro_batches": {"failed": 3},
            },
            "endpoint": {"bytes_out": out, "bytes_in": out - 1},
        }}

    demo.nodes = [
        cast(Any, SimpleNamespace(status=status(1024, {"0": 4, "1": 4, "2": 2}, 500))),
        cast(Any, SimpleNamespace(status=status(2048, {"0": 8, "1": 8, "2": 4, "9": 1}, 700))),
        cast(Any, SimpleNamespace(status={})),  # not polled yet
    ]
    assert demo.traffic() == {
        "tokens": 3072, "payload_bytes_sent": 30720, "payload_bytes_received": 61440,
        "hops": [12, 12, 6], "retried_hops": 2, "cache_misses": 4, "failed_micro_batches": 6,
        "quic_bytes_out": 1200, "quic_bytes_in": 1198,
    }


def test_demo_refuses_an_unusable_run_spec(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[codecs]\nforward_activations = "int3"\n')
    with pytest.raises(DemoError, match="codecs.forward_activations"):
        Demo(DemoOptions(run_spec=bad, root=tmp_path))
    with pytest.raises(DemoError, match="cannot read run spec"):
        Demo(DemoOptions(run_spec=tmp_path / "missing.toml", root=tmp_path))
    assert list(tmp_path.glob("wanswarm-demo-*")) == []  # refused before making its directory


def test_demo_cli_takes_a_run_spec() -> None:
    args = build_parser().parse_args(["demo", "--run-spec", "runs/x.toml", "--replicas", "1"])
    assert args.run_spec == Path("runs/x.toml")
    assert build_parser().parse_args(["demo"]).run_spec is None


# ---- averaging modes and the measured gossip speed-up -----------------------------------------


def test_averaging_items_set_the_spec_section_and_bad_ones_are_refused(tmp_path: Path) -> None:
    base = default_run_spec()
    assert bench.parse_averaging("spec") is None
    gossip = bench.parse_averaging("gossip:4:2", base.averaging)
    assert (gossip.mode, gossip.inner_steps, gossip.gossip_neighbours) == ("gossip", 4, 2)
    diloco = bench.parse_averaging("diloco:8:sign")
    assert (diloco.mode, diloco.inner_steps, diloco.compression) == ("diloco", 8, "sign")
    streamed = bench.parse_averaging("diloco:8:int8:4")
    assert (streamed.inner_steps, streamed.compression, streamed.fragments) == (8, "int8", 4)
    variant, path = bench.write_spec_variant(base, "int8", tmp_path, "gossip:4")
    assert load_run_spec(path) == variant and variant.averaging.mode == "gossip"
    assert {f.split(".")[0] for f in differing_fields(base, variant)} == {"averaging"}
    assert bench.spec_variant(base, "int8", "spec")[0].averaging == base.averaging
    for bad, message in [("gossip", "gossip:H"), ("gossip:0", "inner_steps"),
                         ("gossip:4:3", "gossip_neighbours"), ("diloco:4:zip", "compression"),
                         ("allreduce:2", "use spec"), ("sgd", "use spec"),
                         ("diloco:6:int8:4", "multiple of averaging.fragments"),
                         ("gossip:4:1:2", "use spec")]:
        with pytest.raises(bench.BenchmarkError, match=message):
            bench.parse_averaging(bad)
    with pytest.raises(bench.BenchmarkError, match="--averaging 'gossip:x'"):
        bench.parse_options(["--averaging", "allreduce,gossip:x"])


def test_each_averaging_mode_is_a_configuration_and_gossip_is_set_beside_allreduce(
    tmp_path: Path
) -> None:
    opts = bench.parse_options(["--quick", "--profiles", "wan", "--codecs", "int8",
                                "--averaging", "allreduce,gossip:4", "--replicas", "2"])
    fake = FakeSwarm()
    results = bench.run_configurations(opts, default_run_spec(), tmp_path, fake)
    assert [r["averaging_mode"] for r in results] == ["allreduce", "gossip:4"]
    assert [c.label for c in fake.calls] == ["[wan/int8/allreduce]", "[wan/int8/gossip:4]"]
    modes = [load_run_spec(c.run_spec).averaging.mode for c in fake.calls]  # type: ignore[arg-type]
    assert modes == ["allreduce", "gossip"]
    # the measured and predicted speed-ups from the two rows' own figures
    ar, gs = results
    ar.update(tokens_per_s=1000.0, compute_s=80.0, optimizer_s=40.0, tokens=100_000,
              wan_links={"libp2p_bytes": 100_000_000, "quic_bytes": 1, "libp2p_connections": 1})
    gs.update(tokens_per_s=1600.0, compute_s=80.0, optimizer_s=1.0, tokens=100_000,
              wan_links={"libp2p_bytes": 20_000_000, "quic_bytes": 1, "libp2p_connections": 1})
    (d,) = bench.decentralized_speedups(results, 2)
    assert d["measured_speedup"] == 1.6 and d["gamma"] == 0.5 and d["omega"] == 0.2
    assert d["predicted_speedup"] == 1.5  # (1 + 0.5) / max(1, 0.2 * 0.5), sigma^2 left out
    assert (d["gossip"], d["allreduce"]) == ("wan/int8/gossip:4", "wan/int8/allreduce")
    assert bench.row_mode(ar) == "allreduce" and bench.row_mode({"averaging": None}) == "allreduce"
    report = build(default_run_spec(), results)
    assert report["decentralized"] and "measured speed-up 1.60x" in bench.format_report(report)
    failed = bench.failed_row("wan", "int8", "boom", "gossip:4")
    assert bench.decentralized_speedups([ar, failed], 2) == []
