"""Subspace compression (node/training/subspace.py): exact reconstruction after projection,
the pipeline equals the swarm's chain, the gradient lift is exact, bases are reproducible,
and malformed wire input is refused with ValueError."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from wanswarm.node.config.runspec import RunSpec
from wanswarm.node.training.model import build_full_model, build_stage, param_groups
from wanswarm.node.training.subspace import (
    Subspace,
    fixed_table,
    master_basis,
    residual_writers,
    token_id_dtype,
)

from tests.benchmark_loader import load_benchmark


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_spec(k: Any = (4, 8), architecture: str = "gpt", positions: str = "rotary") -> RunSpec:
    model: dict[str, Any] = {
        "architecture": architecture, "d_model": 32, "n_heads": 4, "n_layers": 4,
        "seq_len": 16, "positions": positions,
    }
    if architecture == "llama":
        model.update(n_kv_heads=2, logit_multiplier=1.0)
    return RunSpec.model_validate({
        "name": "sub", "seed": 3, "model": model,
        "stages": {"blocks_per_stage": [1, 2, 1]}, "subspace": {"k": k},
    })


def train_steps(spec: RunSpec, steps: int = 3) -> Any:
    model = build_full_model(spec)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=gen)  # (B, T)
        model.forward_loss(x, x.roll(1, dims=1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.project_()
    return model


@pytest.mark.parametrize(
    ("architecture", "positions"), [("gpt", "rotary"), ("gpt", "learned"), ("llama", "rotary")]
)
def test_reconstruction_is_exact_after_projection(architecture: str, positions: str) -> None:
    spec = small_spec(architecture=architecture, positions=positions)
    model = train_steps(spec)
    sub = model.subspace
    assert sub is not None
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    torch.set_grad_enabled(False)  # the autouse fixture's teardown runs after: restore here
    try:
        _check_boundaries(model, sub, x)
    finally:
        torch.set_grad_enabled(True)
    assert sub.constraint_error(model.stages[-1]) == 0.0  # the last stage is free


def _check_boundaries(model: Any, sub: Subspace, x: torch.Tensor) -> None:
    h = x
    for b in range(sub.n_boundaries):
        assert sub.constraint_error(model.stages[b]) < 1e-6
        h = model.stages[b](h)  # (B, T, C): the stage's own output, no transform yet
        rebuilt = sub.from_wire(sub.to_wire(h, x, b), x, b)
        assert torch.allclose(rebuilt, h, atol=1e-5 * float(h.abs().max()), rtol=0)


def test_training_leaves_the_subspace_until_projected() -> None:
    spec = small_spec()
    model = build_full_model(spec)
    sub = model.subspace
    assert sub is not None
    assert max(sub.constraint_error(s) for s in model.stages) < 1e-6  # built inside
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    x = torch.randint(0, 256, (2, 16))
    model.forward_loss(x, x).backward()
    opt.step()
    assert sub.constraint_error(model.stages[0]) > 1e-2  # Adam's update leaves the span
    model.project_()
    assert sub.constraint_error(model.stages[0]) < 1e-6


def test_writers_cover_every_residual_projection() -> None:
    gpt = build_stage(small_spec(positions="learned"), 0)
    names = [n for n, _, _ in residual_writers(gpt)]
    assert names == [
        "tok_emb.weight", "pos_emb.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.proj.weight"
    ]
    llama = build_stage(small_spec(architecture="llama"), 1)
    assert [n for n, _, _ in residual_writers(llama)] == [
        f"blocks.{i}.{p}.weight" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")
    ]
    # a bias is projected too (our blocks have none; a Linear with one must be covered)
    block: Any = gpt.blocks[0]
    block.attn.proj = torch.nn.Linear(32, 32, bias=True)
    assert "blocks.0.attn.proj.bias" in [n for n, _, _ in residual_writers(gpt)]
    sub = Subspace.for_run(small_spec())
    assert sub is not None
    sub.project_(gpt)
    assert sub.constraint_error(gpt) < 1e-6


def test_pipeline_equals_the_swarm_chain() -> None:
    spec = small_spec()
    model = train_steps(spec, steps=2)
    sub = model.subspace
    assert sub is not None
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    y = x.roll(-1, dims=1)
    h = model.stages[0](x)
    for b in range(sub.n_boundaries):  # what stage servers do: coefficients on the wire
        c = sub.to_wire(h, x, b)  # (B, T, k_b)
        assert c.shape == (2, 16, sub.k_at(b))
        h = model.stages[b + 1](sub.from_wire(c, x, b))
    assert torch.equal(h, model(x))
    assert torch.equal(model.stages[-1].forward_loss(sub.from_wire(
        sub.to_wire(model.stages[1](sub.from_wire(sub.to_wire(model.stages[0](x), x, 0), x, 0)),
                    x, 1), x, 1), y), model.forward_loss(x, y))


def test_stages_copy_and_pickle_with_their_subspace() -> None:
    model = build_full_model(small_spec())
    twin = copy.deepcopy(model)  # reference_training copies the model (update lag)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(twin(x), model(x))
    stage = pickle.loads(pickle.dumps(model.stages[0]))
    assert torch.equal(stage(x), model.stages[0](x))


def test_stage_zero_adds_the_fixed_embedding() -> None:
    spec = small_spec()
    stage = build_stage(spec, 0)
    sub = Subspace.for_run(spec)
    assert sub is not None
    x = torch.randint(0, 256, (2, 16))
    stage.blocks = torch.nn.ModuleList()  # only the embeddings
    table = sub.fixed_embedding("cpu", torch.float32)
    assert table.shape == (256, 32)
    assert torch.equal(stage(x), stage.tok_emb(x) + table[x])


class _Lifted(torch.autograd.Function):
    """A boundary as the swarm runs it: coefficients forward, U^T g back, lifted by U."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, tokens: torch.Tensor, sub: Subspace) -> torch.Tensor:
        ctx.sub = sub
        return sub.from_wire(sub.to_wire(h, tokens, 1), tokens, 1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.sub.grad_from_wire(ctx.sub.grad_to_wire(g, 1), 1), None, None


def test_gradient_lift_is_the_exact_gradient() -> None:
    sub = Subspace(seed=1, d_model=6, vocab_size=5, widths=(2, 3))
    tokens = torch.tensor([[0, 4, 2]])
    w = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def composed(h: torch.Tensor) -> torch.Tensor:  # the next stage after the boundary
        return torch.tanh(_Lifted.apply(h, tokens, sub) @ w)

    h = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(composed, (h,))
    # and autograd through to_wire/from_wire (what PipelineModel does) agrees with the lift
    g = torch.randn(1, 3, 6, dtype=torch.float64)
    (direct,) = torch.autograd.grad(sub.from_wire(sub.to_wire(h, tokens, 1), tokens, 1), h, g)
    assert torch.allclose(direct, sub.grad_from_wire(sub.grad_to_wire(g, 1), 1))


def test_bases_are_reproducible_nested_and_orthonormal() -> None:
    a = Subspace(seed=7, d_model=64, vocab_size=256, widths=(8, 16))
    b = Subspace(seed=7, d_model=64, vocab_size=256, widths=(8, 16))
    for boundary in (0, 1):
        assert torch.equal(a.basis(boundary, "cpu", torch.float32),
                           b.basis(boundary, "cpu", torch.float32))
    assert torch.equal(a.fixed_embedding("cpu", torch.float32),
                       b.fixed_embedding("cpu", torch.float32))
    u = a.basis(1, "cpu", torch.float64)  # (C, 16)
    assert torch.allclose(u.T @ u, torch.eye(16, dtype=torch.float64), atol=1e-6)
    assert torch.equal(a.basis(0, "cpu", torch.float32), u[:, :8].float())  # nested
    wider = master_basis(7, 64, 256, 32)  # another k_max keeps the leading columns
    assert torch.allclose(wider[:, :16], u.float(), atol=1e-6)
    other = Subspace(seed=8, d_model=64, vocab_size=256, widths=(8, 16))
    assert not torch.equal(other.basis(0, "cpu", torch.float32), a.basis(0, "cpu", torch.float32))


def test_bases_are_pinned() -> None:
    # Pinned: every peer must derive these exact bits from the seed (a change here splits runs)
    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]

    assert digest(master_basis(0, 16, 256, 4)) == PINNED_BASIS
    assert digest(fixed_table(0, 16, 256, 1.0)) == PINNED_TABLE


PINNED_BASIS = "cbe43614f8581aa7"
PINNED_TABLE = "54920f37265eaecd"


def test_wire_dtypes_follow_the_input() -> None:
    sub = Subspace(seed=0, d_model=16, vocab_size=256, widths=(4,))
    x = torch.randint(0, 256, (2, 3))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = torch.randn(2, 3, 16).to(dtype)
        c = sub.to_wire(h, x, 0)
        assert c.dtype == dtype and c.shape == (2, 3, 4)
        assert sub.from_wire(c, x, 0).dtype == dtype
        assert sub.grad_to_wire(h, 0).dtype == dtype
        assert sub.grad_from_wire(c, 0).shape == (2, 3, 16)
    for ids in (x.to(torch.uint8), x.to(torch.int16), x.to(torch.int32)):  # the wire's widths
        assert torch.equal(sub.to_wire(torch.ones(2, 3, 16), ids, 0),
                           sub.to_wire(torch.ones(2, 3, 16), x, 0))


def test_token_id_dtype() -> None:
    assert token_id_dtype(256) == torch.uint8
    assert token_id_dtype(257) == torch.int16
    assert token_id_dtype(32767) == torch.int16
    assert token_id_dtype(32768) == torch.int32
    with pytest.raises(ValueError):
        token_id_dtype(0)


def test_bad_wire_input_raises_value_error() -> None:
    sub = Subspace(seed=0, d_model=16, vocab_size=100, widths=(4, 8))
    h, x = torch.randn(2, 3, 16), torch.randint(0, 100, (2, 3))
    c = sub.to_wire(h, x, 0)
    bad: list[tuple[Any, ...]] = [
        (sub.to_wire, torch.randn(2, 3, 15), x, 0),  # wrong width
        (sub.to_wire, torch.randn(2, 16), x, 0),  # wrong rank
        (sub.to_wire, torch.ones(2, 3, 16, dtype=torch.int64), x, 0),  # not float
        (sub.to_wire, h, x.float(), 0),  # ids not integers
        (sub.to_wire, h, x[:, :2], 0),  # ids of another shape
        (sub.to_wire, h, x, 2),  # no such boundary
        (sub.to_wire, h, x, -1),
        (sub.from_wire, c, x, 1),  # k_1 = 8, not 4
        (sub.from_wire, c, torch.full((2, 3), 100), 0),  # id out of range
        (sub.from_wire, c, torch.full((2, 3), -1), 0),
        (sub.from_wire, c, torch.full((2, 3), 255, dtype=torch.uint8), 0),
        (sub.from_wire, c.double().to(torch.int32), x, 0),
        (sub.to_wire, h, torch.full((2, 3), 2**40), 0),
        (sub.grad_to_wire, torch.randn(2, 3, 8), 0),
        (sub.grad_from_wire, torch.randn(2, 3, 8), 0),
        (sub.grad_from_wire, torch.randn(2, 3, 4), True),
        (sub.grad_from_wire, "coefficients", 0),
    ]
    for fn, *args in bad:
        with pytest.raises(ValueError):
            fn(*args)
    other = build_stage(small_spec(), 0)  # d_model 32: not this subspace's module
    with pytest.raises(ValueError, match="d_model"):
        sub.project_(other)


def test_compression_benchmark_quick(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("compression.py", "bench_compression")
    monkeypatch.setattr(sys, "argv", ["compression.py", "--quick", "--json", "--threads", "1"])
    bench.main()
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    rows = {r["codec"]: r for r in line["results"]}
    int4 = "int4:b32:f16"
    # k1: the widest subspace 16x smaller than bf16 at d_model 32 (k15 at the default 256)
    assert list(rows) == ["none", "int8", "int4", "k1", "k4", "k8+int8", "k8+int4",
                          f"k4+{int4}", f"k8+{int4}", f"k2/6+{int4}"]
    assert bench.sixteenth_width(256) == 15 and bench.sixteenth_width(32) == 1
    assert rows["k1"]["compression_vs_bf16"] >= 16 > rows["k4"]["compression_vs_bf16"]
    for r in rows.values():
        assert {"codec", "bytes_per_token_per_boundary", "compression_vs_bf16", "val_loss",
                "gap_vs_uncompressed"} <= set(r)
        assert r["compression_vs_bf16"] == pytest.approx(2 * 32 / r["bytes_per_token_per_boundary"])
    assert rows["none"]["gap_vs_uncompressed"] == 0.0
    # payloads: 8-byte header per micro-batch of 4 x 32 tokens; subspace rows add 1-byte ids
    header = 8 / (4 * 32)
    assert rows["none"]["bytes_per_token_per_boundary"] == pytest.approx(4 * 32 + header)
    assert rows["k4"]["bytes_per_token_per_boundary"] == pytest.approx(2 * 4 + header + 1)
    assert rows["k4"]["grad_bytes_per_token_per_boundary"] == pytest.approx(2 * 4 + header)
    assert rows["k8+int4"]["bytes_per_token_per_boundary"] == pytest.approx(
        8 * 4 / 64 + 8 * 0.5 + header + 1  # a fp32 scale per 64 values, 4 bits a value
    )
    assert rows[f"k4+{int4}"]["bytes_per_token_per_boundary"] == pytest.approx(
        4 * 2 / 32 + 4 * 0.5 + header + 1  # a fp16 scale per 32 values
    )
    # nested widths 2 and 6: the mean width 4, so the same bytes per boundary on average
    assert rows[f"k2/6+{int4}"]["bytes_per_token_per_boundary"] == pytest.approx(
        rows[f"k4+{int4}"]["bytes_per_token_per_boundary"]
    )
    assert rows["k4"]["constraint_error"] < 1e-6
    assert any("k8+int8" in text for text in out[:-1])  # the table
