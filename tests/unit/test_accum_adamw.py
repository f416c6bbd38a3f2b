"""AccumAdamW (Decent-DP's AccumAdam with decoupled weight decay): AdamW at accum_steps 1,
moments that advance once per accum_steps steps on the mean gradient, the run spec's
fields, and its state through a stage optimizer's export and import."""

from __future__ import annotations

import pytest
import torch
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.config.runspec import RunSpecError, default_run_spec, parse_run_spec
from wanswarm.node.stage.optimizer import AccumAdamW, LocalOptimizer, make_inner_optimizer
from wanswarm.node.training.model import build_stage, param_groups


def _grads(steps: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def _run(opt: torch.optim.Optimizer, p: torch.nn.Parameter, grads: list[torch.Tensor]) -> None:
    for g in grads:
        p.grad = g.clone()
        opt.step()


def test_one_accumulation_step_is_adamw() -> None:
    grads = _grads(12, (5, 3))
    a = torch.nn.Parameter(torch.ones(5, 3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(5, 3, dtype=torch.float64))
    kwargs = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    _run(AccumAdamW([a], accum_steps=1, **kwargs), a, grads)
    _run(torch.optim.AdamW([b], **kwargs), b, grads)
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)


def test_moments_advance_every_s_steps_on_the_mean_gradient() -> None:
    s, beta1, beta2, lr, eps = 4, 0.9, 0.999, 0.01, 1e-8
    grads = _grads(8, (6,), seed=1)
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    opt = AccumAdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, accum_steps=s)
    m = torch.zeros(6, dtype=torch.float64)
    v = torch.zeros(6, dtype=torch.float64)
    expected = torch.zeros(6, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        k = -(-t // s)
        m_t, v_t = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        expected -= lr * (m_t / (1 - beta1**k)) / ((v_t / (1 - beta2**k)).sqrt() + eps)
        if t % s == 0:
            mean = torch.stack(grads[t - s : t]).mean(0)
            m, v = beta1 * m + (1 - beta1) * mean, beta2 * v + (1 - beta2) * mean * mean
        state = opt.state[p]
        torch.testing.assert_close(state["exp_avg"], m, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(state["exp_avg_sq"], v, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-15)
    assert int(opt.state[p]["step"]) == 8 and not opt.state[p]["accum"].any()


def test_clipping_applies_to_each_steps_gradient() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = AccumAdamW([p], lr=0.1, accum_steps=2, max_grad_norm=1.0)
    p.grad = torch.full((4,), 10.0)  # norm 20: clipped to 1
    opt.step()
    # each element 10 / 20 after clipping, a half of it accumulated
    torch.testing.assert_close(opt.state[p]["accum"], torch.full((4,), 0.5) / 2)


def test_spec_fields_run_id_and_refusals() -> None:
    spec = default_run_spec()
    gossip = spec.model_copy(update={"averaging": AveragingSpec(mode="gossip")})
    accum = spec.model_copy(update={"averaging": AveragingSpec(
        mode="gossip", inner_optimizer="accum_adamw", accum_steps=8)})
    assert "inner_optimizer" not in gossip.canonical_json()  # defaults keep older run ids
    assert "accum_adamw" in accum.canonical_json() and accum.run_id != gossip.run_id
    with pytest.raises(RunSpecError) as info:
        parse_run_spec('name = "t"\n[averaging]\ninner_optimizer = "accum_adamw"\n')
    assert "averaging.inner_optimizer" in str(info.value)
    with pytest.raises(RunSpecError) as info:
        parse_run_spec('name = "t"\n[averaging]\nmode = "diloco"\naccum_steps = 0\n')
    assert "averaging.accum_steps" in str(info.value)


def test_a_stage_optimizer_carries_the_accumulator_through_its_state() -> None:
    spec = default_run_spec()
    spec = spec.model_copy(update={"averaging": AveragingSpec(
        mode="diloco", inner_optimizer="accum_adamw", accum_steps=3)})
    module = build_stage(spec, 1)
    assert isinstance(make_inner_optimizer(spec, param_groups(module, 0.0)), AccumAdamW)
    opt = LocalOptimizer(module, spec)
    assert isinstance(opt._opt, AccumAdamW)
    batch = spec.batch.micro_batch_size
    x = torch.randn(batch, 16, spec.model.d_model)
    for _ in range(spec.batch.target_batch_size // batch):  # one inner step
        module(x).square().mean().backward()
        opt.step(batch)
    epoch, tensors, meta = opt.export_state()
    accums = [name for name in tensors if name.endswith(".accum")]
    assert epoch == 1 and accums and any(tensors[n].any() for n in accums)
    other = LocalOptimizer(build_stage(spec, 1), spec)
    other.import_state(epoch, tensors, meta)
    _, again, _ = other.export_state()
    assert all(torch.equal(again[n], tensors[n]) for n in tensors)
