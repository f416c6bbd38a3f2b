"""The single-process reference trainer: learns, is deterministic, clips per stage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from wanswarm.node.config.runspec import RunSpec
from wanswarm.node.tools.reference_training import clip_per_stage, evaluate, main, train_reference
from wanswarm.node.training.data import load_corpus, validation_set
from wanswarm.node.training.model import build_full_model


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_spec() -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": "ref",
            "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "seq_len": 16},
            "stages": {"blocks_per_stage": [1, 1]},
            "batch": {"micro_batch_size": 4, "target_batch_size": 8},
            "optimizer": {"lr": 1e-2, "warmup_steps": 2, "decay_steps": 20},
            "data": {"corpus": ["text.txt"], "validation_fraction": 0.1, "validation_windows": 16},
        }
    )


def corpus_file(tmp_path: Path) -> Path:
    # A repetitive text: a few steps suffice to learn something.
    (tmp_path / "text.txt").write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    return tmp_path


def test_learns_and_is_deterministic(tmp_path: Path) -> None:
    spec = tiny_spec()
    corpus = load_corpus(spec.data, corpus_file(tmp_path))
    seen = []
    a = train_reference(
        spec, 8 * 16 * 12, seed=0, log_every=8 * 16 * 4, corpus=corpus, on_point=seen.append
    )
    b = train_reference(spec, 8 * 16 * 12, seed=0, log_every=8 * 16 * 4, corpus=corpus)
    assert a.steps == 12 and a.tokens == 12 * 8 * 16
    assert [p.step for p in a.curve] == [0, 4, 8, 12]
    assert [p.val_loss for p in a.curve] == [p.val_loss for p in b.curve]
    assert list(a.curve) == seen
    assert a.val_loss_end < a.val_loss_start - 1.0
    assert a.tokens_per_second > 0 and a.tokens_to_target is None


def test_stops_at_target(tmp_path: Path) -> None:
    spec = tiny_spec()
    corpus = load_corpus(spec.data, corpus_file(tmp_path))
    result = train_reference(
        spec, 8 * 16 * 40, seed=1, log_every=8 * 16, target_val_loss=4.0, corpus=corpus
    )
    assert result.tokens_to_target == result.tokens < 8 * 16 * 40
    assert result.val_loss_end < 4.0 <= result.curve[-2].val_loss


def test_clip_is_per_stage() -> None:
    model = build_full_model(tiny_spec())
    for i, stage in enumerate(model.stages):
        for p in stage.parameters():
            p.grad = torch.full_like(p, float(i + 1))
    clip_per_stage(model, 1.0)
    for stage in model.stages:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in stage.parameters()]))
        assert abs(float(norm) - 1.0) < 1e-4  # each stage clipped to 1 on its own


def test_update_lag_applies_each_update_late(tmp_path: Path) -> None:
    spec = tiny_spec()  # two micro-batches per step
    corpus = load_corpus(spec.data, corpus_file(tmp_path))
    step = 8 * 16

    def run(steps: int, lag: float) -> list[float]:
        result = train_reference(spec, steps * step, log_every=step, corpus=corpus, update_lag=lag)
        return [p.val_loss for p in result.curve]

    synchronous, half, stale = run(3, 0.0), run(3, 0.5), run(3, 1.0)
    assert stale[1] == stale[0]  # most stale: the first update has not landed after step 1
    assert half[1] == stale[1]
    # The first update is computed from the same gradient in every mode.
    assert stale[2] == pytest.approx(synchronous[1], abs=1e-6)
    assert half[2] == pytest.approx(synchronous[1], abs=1e-6)
    # Later updates come from gradients at stale parameters: everything differs.
    assert len({synchronous[2], half[3], stale[3]}) == 3
    assert max(half[3], stale[3]) < synchronous[0]
    with pytest.raises(ValueError, match="update_lag"):
        train_reference(spec, step, corpus=corpus, update_lag=1.5)


def test_val_windows_evaluates_the_first_windows(tmp_path: Path) -> None:
    spec = tiny_spec()  # 16 validation windows
    corpus = load_corpus(spec.data, corpus_file(tmp_path))
    step = 8 * 16
    first4 = train_reference(spec, step, log_every=step, corpus=corpus, val_windows=4)
    everything = train_reference(spec, step, log_every=step, corpus=corpus, val_windows=None)
    beyond = train_reference(spec, step, log_every=step, corpus=corpus, val_windows=1000)
    model = build_full_model(spec)
    val_x, val_y = validation_set(spec, corpus)
    assert first4.val_loss_start == evaluate(model, val_x[:4], val_y[:4], 32)
    assert everything.val_loss_start == evaluate(model, val_x, val_y, 32)
    assert first4.val_loss_start != everything.val_loss_start
    assert [p.val_loss for p in beyond.curve] == [p.val_loss for p in everything.curve]
    # training itself does not depend on what is evaluated
    assert first4.steps == everything.steps == 1
    with pytest.raises(ValueError, match="val_windows"):
        train_reference(spec, step, corpus=corpus, val_windows=0)


def test_cli_prints_the_curve_and_a_json_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "spec.toml"
    spec_file.write_text(
        'name = "ref"\n'
        "[model]\nd_model = 32\nn_heads = 2\nn_layers = 2\nseq_len = 16\n"
        "[stages]\nblocks_per_stage = [1, 1]\n"
        "[batch]\nmicro_batch_size = 4\ntarget_batch_size = 8\n"
        "[optimizer]\nlr = 1e-2\nwarmup_steps = 2\ndecay_steps = 20\n"
        f'[data]\ncorpus = ["{corpus_file(tmp_path) / "text.txt"}"]\n'
        "validation_fraction = 0.1\nvalidation_windows = 16\n"
    )
    code = main(["--spec", str(spec_file), "--tokens", str(8 * 16 * 2), "--val-windows", "4",
                 "--log-every", str(8 * 16)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["steps"] == 2 and summary["tokens"] == 2 * 8 * 16
    assert [tokens for tokens, _ in summary["curve"]] == [0, 8 * 16, 2 * 8 * 16]
    assert len(lines) == 4  # one line per curve point, then the JSON line


def test_landed_val_applies_the_update_in_flight_on_a_copy(tmp_path: Path) -> None:
    spec = tiny_spec()
    corpus = load_corpus(spec.data, corpus_file(tmp_path))
    step = 8 * 16

    def run(lag: float, landed: bool) -> list[tuple[float, float | None]]:
        result = train_reference(
            spec, 3 * step, log_every=step, corpus=corpus, update_lag=lag, landed_val=landed
        )
        return [(p.val_loss, p.val_loss_landed) for p in result.curve]

    stale, stale_landed = run(1.0, False), run(1.0, True)
    synchronous = run(0.0, True)
    # training is unchanged by the extra evaluation
    assert [v for v, _ in stale_landed] == [v for v, _ in stale]
    assert all(landed is None for _, landed in stale)
    # nothing in flight: the landed loss is the loss
    assert all(landed == v for v, landed in synchronous)
    assert stale_landed[0][1] == stale_landed[0][0]
    # after step 1 the in-flight update is the synchronous run's first one
    assert stale_landed[1][1] == pytest.approx(synchronous[1][0], abs=1e-6)
    assert stale_landed[1][1] != stale_landed[1][0]
    # and it lands in the real run one step later
    assert stale_landed[2][0] == pytest.approx(stale_landed[1][1], abs=1e-6)
