"""The model: stages chain to the full model, init is reproducible, counts, gradients."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from wanswarm.node.config.runspec import RunSpec
from wanswarm.node.training.model import (
    StageInputError,
    apply_rotary,
    build_full_model,
    build_stage,
    count_parameters,
    expected_stage_parameters,
    param_groups,
    rotary_tables,
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: one thread is faster than a contended pool, and results do not vary."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_spec(
    name: str = "m", blocks: tuple[int, ...] = (1, 2, 1), positions: str = "rotary"
) -> RunSpec:
    return RunSpec.model_validate(
        {
            "name": name,
            "model": {
                "d_model": 32,
                "n_heads": 4,
                "n_layers": sum(blocks),
                "seq_len": 16,
                "positions": positions,
            },
            "stages": {"blocks_per_stage": list(blocks)},
        }
    )


def tokens(batch: int = 3, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_chained_stages_equal_full_model() -> None:
    spec = small_spec()
    full = build_full_model(spec)
    stages = [build_stage(spec, s) for s in range(spec.n_stages)]
    idx = tokens()
    h = idx
    for stage in stages:
        h = stage(h)
    logits = full(idx)
    assert logits.shape == (3, 16, 256)
    assert torch.equal(h, logits)
    targets = tokens(seed=1)
    assert torch.equal(
        stages[-1].forward_loss(stages[1](stages[0](idx)), targets), full.forward_loss(idx, targets)
    )


def test_init_is_reproducible_and_per_stage() -> None:
    spec = small_spec()
    rng_before = torch.get_rng_state()
    a = build_stage(spec, 1)
    assert torch.equal(torch.get_rng_state(), rng_before), (
        "building a stage must not change the global RNG"
    )
    torch.manual_seed(1234)  # another process, another global RNG state: same parameters
    b = build_stage(spec, 1)
    for (name_a, pa), (name_b, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert name_a == name_b and torch.equal(pa, pb)
    # Same shapes, different seeds: stage 1 and 2 of a 4-block model hold different values.
    other = build_stage(small_spec(blocks=(1, 1, 2)), 1)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, other.blocks[0].attn.qkv.weight)
    full = build_full_model(spec)
    for s in range(spec.n_stages):
        for pa, pb in zip(
            full.stages[s].parameters(), build_stage(spec, s).parameters(), strict=True
        ):
            assert torch.equal(pa, pb)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_parameter_counts(positions: str) -> None:
    spec = small_spec(positions=positions)
    C, V, hidden = 32, 256, 128
    T = 16 if positions == "learned" else 0  # learned positions: a (T, C) table on stage 0
    block = 4 * C + 4 * C * C + 2 * C * hidden
    assert [count_parameters(build_stage(spec, s)) for s in range(3)] == [
        V * C + T * C + block,
        2 * block,
        block + 2 * C + C * V,
    ]
    assert [expected_stage_parameters(spec, s) for s in range(3)] == [
        count_parameters(build_stage(spec, s)) for s in range(3)
    ]
    one = small_spec(blocks=(2,), positions=positions)
    assert count_parameters(build_stage(one, 0)) == V * C + T * C + 2 * block + 2 * C + C * V


def test_rotary_scores_depend_on_offset_only() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    cos, sin = rotary_tables(40, 8, 10000.0, torch.device("cpu"))  # (40, 4) each

    def score(tq: int, tk: int) -> float:
        rq = apply_rotary(q, cos[tq : tq + 1], sin[tq : tq + 1])
        rk = apply_rotary(k, cos[tk : tk + 1], sin[tk : tk + 1])
        return float((rq * rk).sum())

    assert score(7, 5) == pytest.approx(score(30, 28), rel=1e-5)
    assert score(7, 5) != pytest.approx(score(7, 4), rel=1e-3)
    assert torch.allclose(apply_rotary(q, cos[:1], sin[:1]), q)  # position 0: no rotation


def test_initial_loss_is_near_uniform() -> None:
    spec = small_spec()
    loss = build_full_model(spec).forward_loss(tokens(), tokens(seed=1))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_forward_loss_is_mean_cross_entropy() -> None:
    spec = small_spec()
    full = build_full_model(spec)
    idx, targets = tokens(), tokens(seed=1)
    logits = full(idx)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    assert torch.equal(full.forward_loss(idx, targets), expected)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_causal(positions: str) -> None:
    full = build_full_model(small_spec(positions=positions))
    idx = tokens()
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    assert torch.equal(full(idx)[:, :10], full(changed)[:, :10])
    assert not torch.equal(full(idx)[:, 10:], full(changed)[:, 10:])


def test_stagewise_backward_equals_full_backward() -> None:
    """Each stage recomputes its forward from a detached input, as a stateless server does."""
    spec = small_spec()
    full = build_full_model(spec)
    stages = [build_stage(spec, s) for s in range(spec.n_stages)]
    idx, targets = tokens(), tokens(seed=1)
    full.forward_loss(idx, targets).backward()

    inputs = [idx]
    with torch.no_grad():
        for stage in stages[:-1]:
            inputs.append(stage(inputs[-1]))  # what the trainer keeps for every hop
    last_in = inputs[-1].clone().requires_grad_(True)
    stages[-1].forward_loss(last_in, targets).backward()
    grad = last_in.grad
    for s in range(spec.n_stages - 2, -1, -1):
        x = inputs[s] if s == 0 else inputs[s].clone().requires_grad_(True)
        stages[s](x).backward(grad)
        grad = x.grad
    for s in range(spec.n_stages):
        for (name, pa), pb in zip(
            full.stages[s].named_parameters(), stages[s].parameters(), strict=True
        ):
            assert pa.grad is not None and pb.grad is not None
            # Same arithmetic, but autograd may sum contributions in another order.
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-7), name


def test_input_checks() -> None:
    spec = small_spec()
    first, middle, last = (build_stage(spec, s) for s in range(3))
    first.check_input(tokens())
    with pytest.raises(StageInputError, match="int64 token ids"):
        first.check_input(torch.zeros(2, 4))
    with pytest.raises(StageInputError, match=r"\[0, 256\)"):
        first.check_input(torch.full((2, 4), 256))
    with pytest.raises(StageInputError, match="T <= 16"):
        first.check_input(tokens(length=17))
    middle.check_input(torch.zeros(2, 4, 32))
    with pytest.raises(StageInputError, match=r"float32 activations \(B, T, 32\)"):
        middle.check_input(torch.zeros(2, 4, 31))
    with pytest.raises(StageInputError, match="not the last stage"):
        middle.forward_loss(torch.zeros(2, 4, 32), tokens(2, 4))
    with pytest.raises(StageInputError, match="targets must be int64"):
        last.forward_loss(torch.zeros(2, 4, 32), tokens(2, 5))


def test_param_groups_cover_every_parameter_once() -> None:
    full = build_full_model(small_spec())
    groups = param_groups(full, 0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in full.parameters())
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[0]["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0


def test_logit_multiplier_scales_head_output_not_initial_logits() -> None:
    base = small_spec()
    assert base.model.logit_multiplier == 4.0
    last = build_stage(base, 2)
    h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))  # (B, T, C)
    assert last.head is not None and last.ln_f is not None
    g = h
    for block in last.blocks:
        g = block(g)  # (B, T, C)
    assert torch.equal(last(h), last.head(last.ln_f(g)) * 4.0)
    # The init is divided by the multiplier, so the initial logits have GPT-2's scale.
    assert abs(last.head.weight.std().item() - 0.02 / 4.0) < 0.0005
    plain = RunSpec.model_validate(
        {**base.model_dump(), "model": {**base.model.model_dump(), "logit_multiplier": 1.0}}
    )
    assert abs(build_stage(plain, 2).head.weight.std().item() - 0.02) < 0.002
