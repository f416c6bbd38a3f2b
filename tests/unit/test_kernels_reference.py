"""The pure-torch quantizers: exact small cases, element-wise error bounds, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from wanswarm.kernels import ops
from wanswarm.kernels import reference as R
from wanswarm.kernels.errors import KernelError, NonFiniteInput, UnsupportedInput

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SCALES = (torch.float32, torch.float16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_int8_small_case_by_hand() -> None:
    # One block (padded to 16) with absmax 127: scale 1, codes = round-half-even(x).
    x = torch.tensor([127.0, -63.5, 0.5, 1.5, 2.5, -0.4, 0.0, 3.49])
    codes, scales = R.quantize(x, "int8", 16)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [127, -64, 0, 2, 2, 0, 0, 3]
    assert R.dequantize(codes, scales, "int8", 16, 8).tolist() == [127, -64, 0, 2, 2, 0, 0, 3]


def test_int4_packing_layout() -> None:
    # absmax 7 -> scale 1; element 2j in the low nibble of byte j, nibble = q + 8;
    # the odd tail's missing element is quantized as zero (nibble 8).
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -3.0])
    codes, scales = R.quantize(x, "int4", 16)
    assert scales.tolist() == [1.0]
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [(1 << 4) | 15, (8 << 4) | 9, (8 << 4) | 5]
    assert R.dequantize(codes, scales, "int4", 16, 5).tolist() == [7, -7, 1, 0, -3]


def test_fp8_is_torch_e4m3fn_cast_after_scaling() -> None:
    x = torch.linspace(-448, 448, 64)
    codes, scales = R.quantize(x, "fp8", 64)
    assert scales.tolist() == [1.0]
    assert torch.equal(codes, x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_zero_block_has_zero_scale_and_zero_codes() -> None:
    x = torch.zeros(40)
    x[20:] = torch.randn(20, generator=_gen(0))
    for fmt in R.FORMATS:
        codes, scales = R.quantize(x, fmt, 16)  # type: ignore[arg-type]
        assert scales[0] == 0 and scales[1] > 0
        out = R.dequantize(codes, scales, fmt, 16, 40)  # type: ignore[arg-type]
        assert torch.all(out[:16] == 0)
    codes, _ = R.quantize(torch.zeros(5), "int4", 16)
    assert codes.tolist() == [0x88, 0x88, 0x88]


def test_negative_zero_survives_fp8() -> None:
    x = torch.tensor([-0.0, 1.0] + [0.0] * 14)
    codes, _ = R.quantize(x, "fp8", 16)
    assert codes[0] == 0x80


@pytest.mark.parametrize("fmt", R.FORMATS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("scale_dtype", SCALES)
def test_elementwise_error_bounds(
    fmt: R.Format, dtype: torch.dtype, scale_dtype: torch.dtype
) -> None:
    """|x - dec(enc(x))| <= s/2 (int8/int4); <= 2**-4 |x| + 2**-10 s (fp8, 3 mantissa bits)."""
    n, bs = 1000, 64
    x = (torch.randn(n, generator=_gen(1)) * torch.logspace(-3, 3, n)).to(dtype)
    codes, scales = R.quantize(x, fmt, bs, scale_dtype)
    out = R.dequantize(codes, scales, fmt, bs, n, torch.float32)
    s = scales.float().repeat_interleave(bs)[:n]
    err = (x.float() - out).abs()
    # Float32 arithmetic (division, product) adds a few ulps on top of the exact bound.
    slack = 4 * torch.finfo(torch.float32).eps * x.float().abs()
    if fmt == "fp8":
        bound = x.float().abs() * 2.0**-4 + s * 2.0**-10 + slack
    else:
        bound = s / 2 + slack
    if scale_dtype == torch.float16:  # the rounded scale may clamp the block's largest code
        bound = bound + x.float().abs() * 2.0**-10
    assert torch.all(err <= bound), (err - bound).max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_stochastic_rounding_error_below_one_step(fmt: R.Format) -> None:
    x = torch.randn(500, generator=_gen(2))
    codes, scales = R.quantize(x, fmt, 32, seed=7)
    out = R.dequantize(codes, scales, fmt, 32, 500)
    s = scales.repeat_interleave(32)[:500]
    assert torch.all((x - out).abs() <= s * (1 + 1e-6))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(fmt: R.Format) -> None:
    """Mean over K seeds converges to x; round-to-nearest keeps a fixed bias."""
    qmax = R.QMAX[fmt]
    # Block of 16: the first element fixes the scale at 1; the others sit between codes.
    frac = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9, 0.25, 0.05, 0.95] * 2)[:15]
    x = torch.cat([torch.tensor([qmax]), torch.arange(15) % 5 - 2 + frac])
    k = 2000
    # K copies of the block in one tensor: each copy draws its own uniforms (they are
    # keyed by element position), so one call gives K independent roundings of every value.
    xs = x.repeat(k)
    codes, scales = R.quantize(xs, fmt, 16, seed=99)
    mean = R.dequantize(codes, scales, fmt, 16, xs.numel()).double().view(k, 16).mean(dim=0)
    # Each draw is x rounded up or down by one step: std <= 1/2, so 5 sigma is 2.5/sqrt(k).
    assert torch.all((mean - x.double()).abs() <= 2.5 / math.sqrt(k))
    det = R.dequantize(*R.quantize(x, fmt, 16), fmt, 16, 16).double()
    assert (det - x.double()).abs().max() >= 0.25  # nearest rounding is biased here


def test_stochastic_rounding_depends_on_seed_only() -> None:
    x = torch.randn(300, generator=_gen(3))
    a = R.quantize(x, "int8", 64, seed=11)
    b = R.quantize(x, "int8", 64, seed=11)
    c = R.quantize(x, "int8", 64, seed=12)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_philox_uniform_range_and_uniformity() -> None:
    u = R.stochastic_uniforms(12345, 1 << 16)
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    hist = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 50.0  # 15 dof: p < 1e-5 above 45
    # Different seeds and offsets give different streams.
    v = R.stochastic_uniforms(12346, 1 << 16)
    assert float((u == v).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("scale_dtype", SCALES)
@pytest.mark.parametrize("fmt", R.FORMATS)
def test_huge_magnitudes_stay_finite(
    fmt: R.Format, dtype: torch.dtype, scale_dtype: torch.dtype
) -> None:
    big = torch.finfo(dtype).max
    x = torch.tensor([big, -big, big / 3, 1.0] * 8, dtype=dtype)
    codes, scales = R.quantize(x, fmt, 16, scale_dtype)
    assert torch.all(scales.float() <= R.scale_limit(fmt, dtype, scale_dtype))
    out = R.dequantize(codes, scales, fmt, 16, x.numel(), dtype)
    assert torch.isfinite(out).all()
    if scale_dtype == torch.float32:
        assert torch.allclose(out[:2].double(), x[:2].double(), rtol=0.01)


@pytest.mark.parametrize("fmt", R.FORMATS)
def test_tiny_magnitudes(fmt: R.Format) -> None:
    # float32 scales follow values down to subnormals; float16 scales flush tiny blocks.
    x = torch.tensor([1e-30, -3e-31, 2e-38, 0.0] * 4)
    codes, scales = R.quantize(x, fmt, 16)
    out = R.dequantize(codes, scales, fmt, 16, 16)
    assert abs(float(out[0]) - 1e-30) <= 1e-30 * 0.07
    sub = torch.tensor([1e-44, -1e-45] + [0.0] * 14)  # float32 subnormals
    out = R.dequantize(*R.quantize(sub, fmt, 16), fmt, 16, 16)
    assert torch.isfinite(out).all()
    codes, scales = R.quantize(torch.full((16,), 1e-9), fmt, 16, torch.float16)
    assert scales.tolist() == [0.0]
    assert torch.all(R.dequantize(codes, scales, fmt, 16, 16) == 0)


def test_scale_limit_is_tight() -> None:
    for fmt in R.FORMATS:
        for dtype in FLOATS:
            for sd in SCALES:
                lim = R.scale_limit(fmt, dtype, sd)  # type: ignore[arg-type]
                dmax = torch.finfo(dtype).max
                assert lim * R.QMAX[fmt] <= dmax
                nxt = torch.nextafter(torch.tensor(lim, dtype=sd), torch.tensor(math.inf, dtype=sd))
                assert float(nxt) * R.QMAX[fmt] > dmax or math.isinf(float(nxt))


@pytest.mark.parametrize("fmt", R.FORMATS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_input_is_a_clear_error(fmt: R.Format, bad: float) -> None:
    x = torch.randn(100, generator=_gen(4))
    x[70] = bad
    with pytest.raises(NonFiniteInput, match="block 2 "):
        R.quantize(x, fmt, 32)


def test_fp8_nan_codes_rejected_on_decode() -> None:
    codes, scales = R.quantize(torch.randn(32, generator=_gen(5)), "fp8", 16)
    for nan_code in (0x7F, 0xFF):
        bad = codes.clone()
        bad[3] = nan_code
        with pytest.raises(NonFiniteInput):
            R.dequantize(bad, scales, "fp8", 16, 32)


def test_validate_scales() -> None:
    ok = torch.tensor([0.0, 1.0, 2.5])
    R.validate_scales(ok, "int8", torch.float32)
    with pytest.raises(NonFiniteInput):
        R.validate_scales(torch.tensor([1.0, math.nan]), "int8", torch.float32)
    with pytest.raises(NonFiniteInput):
        R.validate_scales(torch.tensor([math.inf]), "int8", torch.float32)
    with pytest.raises(UnsupportedInput):
        R.validate_scales(torch.tensor([-1.0]), "int8", torch.float32)
    with pytest.raises(UnsupportedInput):  # 1000 * 127 overflows float16
        R.validate_scales(torch.tensor([1000.0]), "int8", torch.float16)


def test_input_checks() -> None:
    x = torch.randn(64)
    with pytest.raises(UnsupportedInput):
        R.quantize(x.to(torch.float64), "int8", 64)
    with pytest.raises(UnsupportedInput):
        R.quantize(x.view(8, 8), "int8", 64)
    with pytest.raises(UnsupportedInput):
        R.quantize(torch.randn(128)[::2], "int8", 64)
    for bs in (0, 8, 48, 8192):
        with pytest.raises(UnsupportedInput):
            R.quantize(x, "int8", bs)
    with pytest.raises(UnsupportedInput):
        R.quantize(x, "int2", 64)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedInput):
        R.quantize(x, "fp8", 64, seed=1)
    with pytest.raises(UnsupportedInput):
        R.quantize(x, "int8", 64, seed=-1)
    with pytest.raises(UnsupportedInput):
        R.quantize(x, "int8", 64, torch.bfloat16)
    codes, scales = R.quantize(x, "int8", 16)
    with pytest.raises(UnsupportedInput):
        R.dequantize(codes[:-1], scales, "int8", 16, 64)
    with pytest.raises(UnsupportedInput):
        R.dequantize(codes, scales[:-1], "int8", 16, 64)
    with pytest.raises(UnsupportedInput):
        R.dequantize(codes.view(torch.uint8), scales, "int8", 16, 64)
    with pytest.raises(UnsupportedInput):
        R.dequantize(codes, scales, "int8", 16, 64, torch.int32)
    assert issubclass(UnsupportedInput, KernelError)


def test_empty_tensor() -> None:
    for fmt in R.FORMATS:
        codes, scales = R.quantize(torch.zeros(0), fmt, 64)  # type: ignore[arg-type]
        assert codes.numel() == 0 and scales.numel() == 0
        assert R.dequantize(codes, scales, fmt, 64, 0).numel() == 0  # type: ignore[arg-type]


def test_dispatcher_defaults_to_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(100)
    assert ops.resolve_impl(x) == "reference"
    with ops.use_impl("reference"):
        assert ops.resolve_impl(x) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UnsupportedInput), ops.use_impl("triton"):
        ops.resolve_impl(x)
    with pytest.raises(UnsupportedInput), ops.use_impl("cuda"):  # type: ignore[arg-type]
        pass


def test_dispatcher_writes_into_output_buffers() -> None:
    x = torch.randn(100, generator=_gen(6))
    codes = torch.empty(50, dtype=torch.uint8)
    scales = torch.empty(4, dtype=torch.float16)
    got = ops.quantize(x, "int4", 32, torch.float16, codes_out=codes, scales_out=scales)
    assert got[0] is codes and got[1] is scales
    ref = R.quantize(x, "int4", 32, torch.float16)
    assert torch.equal(codes, ref[0]) and torch.equal(scales, ref[1])
    with pytest.raises(UnsupportedInput):
        ops.quantize(x, "int4", 32, torch.float16, codes_out=torch.empty(49, dtype=torch.uint8))
