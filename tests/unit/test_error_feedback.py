"""Error feedback: the sum of sent gradients tracks the sum of true gradients; bounded memory."""

from __future__ import annotations

import math

import pytest
import torch
from wanswarm.transport.codecs import CodecSpec, decode, encode
from wanswarm.transport.error_feedback import ErrorFeedback
from wanswarm.transport.errors import ConfigError, PayloadError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("wire", ["int4/b64/f32", "int8/b64/f16", "fp8/b32/f32", "int4/b32/f32/sr"])
@pytest.mark.parametrize("constant", [True, False])
def test_accumulated_error_stays_bounded(wire: str, constant: bool) -> None:
    """EF: |sum(sent) - sum(true)| = |residual| <= one step's quantization error, at every
    step; a plain quantizer's accumulated error grows (linearly for a constant gradient,
    like sqrt(T) for independent ones)."""
    spec = CodecSpec.from_wire(wire)
    ef = ErrorFeedback()
    gen = _gen(1)
    n, steps = 512, 300
    base = torch.randn(n, generator=gen) * 1e-3
    true_sum = torch.zeros(n, dtype=torch.float64)
    ef_sum = torch.zeros(n, dtype=torch.float64)
    plain_sum = torch.zeros(n, dtype=torch.float64)
    worst_ef = 0.0
    for _ in range(steps):
        g = base if constant else torch.randn(n, generator=gen) * 1e-3
        true_sum += g.double()
        ef_sum += decode(ef.encode(("peer", 1, "w"), g, spec, generator=gen)).double()
        plain_sum += decode(encode(g, spec, generator=gen)).double()
        # One step's error is below one quantization step of the largest block:
        # absmax(g + r) / QMAX, where |g + r| <= |g| + step.
        err = (ef_sum - true_sum).abs().max().item()
        worst_ef = max(worst_ef, err)
        residual = ef.residual(("peer", 1, "w"))
        assert residual is not None
        # Telescoping: sum(true) - sum(sent) is the residual, up to the float32 rounding
        # of g + r in each step (about 1e-10 here, against residuals of about 1e-4).
        assert torch.allclose((true_sum - ef_sum).float(), residual, atol=1e-7, rtol=1e-3)
    # |g + r| < 2 * 5 sigma; one step is absmax / QMAX (int) or 2**-4 relative (fp8).
    step = 2 * 1e-3 * 5 / {"int4": 7, "int8": 127, "fp8": 16}[spec.name]
    assert worst_ef < step
    plain_err = (plain_sum - true_sum).abs().max().item()
    assert plain_err > 5 * worst_ef


def test_drift_growth_of_plain_quantizer_vs_error_feedback() -> None:
    """Measured over time: plain drift grows with T, EF error does not."""
    spec = CodecSpec("int4", 64)
    ef = ErrorFeedback()
    gen = _gen(2)
    g = torch.randn(256, generator=gen)
    true_sum = torch.zeros(256, dtype=torch.float64)
    ef_sum = torch.zeros_like(true_sum)
    plain_sum = torch.zeros_like(true_sum)
    ef_norms, plain_norms = [], []
    for t in range(1, 401):
        true_sum += g.double()
        ef_sum += decode(ef.encode("k", g, spec)).double()
        plain_sum += decode(encode(g, spec)).double()
        if t in (50, 400):
            ef_norms.append((ef_sum - true_sum).norm().item())
            plain_norms.append((plain_sum - true_sum).norm().item())
    assert plain_norms[1] > 7 * plain_norms[0]  # linear growth: 8x more steps
    assert ef_norms[1] < 2 * ef_norms[0] + 1e-6


def test_lossless_codec_keeps_no_residual() -> None:
    ef = ErrorFeedback()
    x = torch.randn(10)
    ef.encode("a", x, CodecSpec("int8", 16))
    assert "a" in ef
    e = ef.encode("a", x, CodecSpec("none"))
    assert torch.equal(decode(e), x)
    assert "a" not in ef and ef.nbytes == 0


def test_payload_keeps_dtype_and_shape() -> None:
    ef = ErrorFeedback()
    g = torch.randn(4, 9, generator=_gen(3)).to(torch.bfloat16)
    e = ef.encode("k", g, CodecSpec("int8", 16))
    assert e.dtype == torch.bfloat16 and e.shape == (4, 9)
    r = ef.residual("k")
    assert r is not None and r.dtype == torch.float32 and r.shape == (4, 9)
    # The residual includes the bf16 rounding of g + r too: exact bookkeeping in float32.
    assert torch.equal(r, g.float() - decode(e).float())


def test_lru_by_entries() -> None:
    ef = ErrorFeedback(max_entries=3)
    spec = CodecSpec("int4", 16)
    x = torch.randn(32, generator=_gen(4))
    for k in ("a", "b", "c"):
        ef.encode(k, x, spec)
    ef.encode("a", x, spec)  # refresh a: b is now the oldest
    ef.encode("d", x, spec)
    assert {k for k in ("a", "b", "c", "d") if k in ef} == {"a", "c", "d"}
    assert len(ef) == 3 and ef.nbytes == 3 * 32 * 4


def test_lru_by_bytes() -> None:
    ef = ErrorFeedback(max_bytes=1000)
    spec = CodecSpec("int8", 16)
    ef.encode("small", torch.randn(100), spec)  # 400 B
    ef.encode("mid", torch.randn(125), spec)  # 500 B
    assert ef.nbytes == 900
    ef.encode("more", torch.randn(50), spec)  # 200 B: evicts "small"
    assert "small" not in ef and ef.nbytes == 700
    ef.encode("huge", torch.randn(1000), spec)  # 4000 B > max_bytes: not kept
    assert "huge" not in ef and ef.nbytes == 700


def test_reset_all_and_by_prefix() -> None:
    ef = ErrorFeedback()
    spec = CodecSpec("int8", 16)
    x = torch.randn(20)
    keys = [("p1", 0, "w"), ("p1", 0, "b"), ("p1", 1, "w"), ("p2", 0, "w"), "loose"]
    for k in keys:
        ef.encode(k, x, spec)
    ef.reset(("p1", 0))
    assert [k for k in keys if k in ef] == [("p1", 1, "w"), ("p2", 0, "w"), "loose"]
    assert ef.nbytes == 3 * 20 * 4
    ef.reset(("p2",))
    assert [k for k in keys if k in ef] == [("p1", 1, "w"), "loose"]
    ef.reset()
    assert len(ef) == 0 and ef.nbytes == 0


def test_shape_change_drops_residual() -> None:
    ef = ErrorFeedback()
    spec = CodecSpec("int4", 16)
    ef.encode("k", torch.randn(20), spec)
    x = torch.randn(5, 4)
    e = ef.encode("k", x, spec)
    assert torch.equal(decode(e), decode(encode(x, spec)))  # no stale residual was added


def test_nonfinite_gradient_keeps_old_residual() -> None:
    ef = ErrorFeedback()
    spec = CodecSpec("int8", 16)
    ef.encode("k", torch.randn(20, generator=_gen(5)), spec)
    before = ef.residual("k")
    bad = torch.randn(20)
    bad[3] = math.nan
    with pytest.raises(PayloadError):
        ef.encode("k", bad, spec)
    after = ef.residual("k")
    assert before is not None and after is not None and torch.equal(before, after)


def test_bad_limits() -> None:
    with pytest.raises(ConfigError):
        ErrorFeedback(max_entries=0)
    with pytest.raises(ConfigError):
        ErrorFeedback(max_bytes=-1)
