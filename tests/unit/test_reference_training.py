"""The single-process reference trainer: learns, is deterministic, clips per stage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from wanswarm.node.data import load_corpus
from wanswarm.node.model import build_full_model
from wanswarm.node.reference_training import clip_per_stage, train_reference
from wanswarm.node.runspec import RunSpec


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


def test_delayed_updates_apply_each_gradient_one_step_late(tmp_path: Path) -> None:
    spec = tiny_spec()
    corpus = load_corpus(spec.data, corpus_file(tmp_path))
    step = 8 * 16
    one = train_reference(spec, step, seed=0, log_every=step, corpus=corpus, delayed_updates=True)
    assert one.val_loss_end == one.val_loss_start  # the first gradient is still in flight
    prompt = train_reference(spec, 2 * step, seed=0, log_every=step, corpus=corpus)
    late = train_reference(
        spec, 3 * step, seed=0, log_every=step, corpus=corpus, delayed_updates=True
    )
    # Two updates from the same two gradients, but the second computed at stale parameters.
    assert late.curve[3].val_loss != prompt.curve[2].val_loss
    assert late.curve[2].val_loss == pytest.approx(prompt.curve[1].val_loss, abs=1e-6)
    assert late.curve[3].val_loss < late.curve[0].val_loss
