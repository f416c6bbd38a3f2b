"""Compiled Triton kernels on CUDA against the pure-torch reference (on the CPU), bit for bit.

Skipped without CUDA. Triton decides at decoration time whether a kernel is compiled or
interpreted, and tests/conftest.py defaults TRITON_INTERPRET to 1 for the CPU tiers, so
run this tier in its own process with the interpreter off:

    TRITON_INTERPRET=0 python -m pytest tests/gpu -q

Under the interpreter these tests skip (they exist to check the compiled code).
"""

from __future__ import annotations

import math

import pytest
import torch
from wanswarm.kernels import ops
from wanswarm.kernels import reference as R
from wanswarm.kernels.errors import NonFiniteInput
from wanswarm.transport.codecs import CodecSpec, decode, encode
from wanswarm.transport.errors import PayloadError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SCALES = (torch.float32, torch.float16)


@pytest.fixture(autouse=True)
def _compiled_triton() -> None:
    if ops.triton_interpreted():
        pytest.skip("run with TRITON_INTERPRET=0: this tier checks the compiled kernels")
    pytest.importorskip("triton")


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    return t


def _data(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-5.0, 3.5) if dtype == torch.float16 else (-8.0, 8.0)
    x = torch.randn(n, generator=g) * torch.logspace(lo, hi, n)[torch.randperm(n, generator=g)]
    x[:: max(1, n // 11)] = 0.0
    x[1 :: max(2, n // 13)] = -0.0
    return x.to(dtype)


def _check(x_cpu: torch.Tensor, fmt: R.Format, bs: int, sd: torch.dtype, seed: int | None) -> None:
    c_ref, s_ref = R.quantize(x_cpu, fmt, bs, sd, seed=seed)
    c_gpu, s_gpu = ops.quantize(x_cpu.cuda(), fmt, bs, sd, seed=seed, impl="triton")
    assert torch.equal(_bits(s_gpu.cpu()), _bits(s_ref)), "scales differ"
    diff = (c_gpu.cpu() != c_ref).nonzero().flatten()[:5].tolist()
    assert not diff, f"codes differ at {diff}"
    for out_dtype in {x_cpu.dtype, torch.float32}:
        d_ref = R.dequantize(c_ref, s_ref, fmt, bs, x_cpu.numel(), out_dtype)
        d_gpu = ops.dequantize(
            c_ref.cuda(), s_ref.cuda(), fmt, bs, x_cpu.numel(), out_dtype, impl="triton"
        )
        assert torch.equal(_bits(d_gpu.cpu()), _bits(d_ref)), f"dequantized {out_dtype} differs"


@pytest.mark.parametrize("fmt", R.FORMATS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("sd", SCALES)
@pytest.mark.parametrize("n,bs", [(1, 16), (1000, 16), (4097, 64), (100_003, 128), (65_536, 4096)])
def test_matches_reference(
    fmt: R.Format, dtype: torch.dtype, sd: torch.dtype, n: int, bs: int
) -> None:
    _check(_data(n, n + bs, dtype), fmt, bs, sd, None)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("seed", [0, 77, R.MAX_SEED])
def test_stochastic_matches_reference(fmt: R.Format, seed: int) -> None:
    _check(_data(50_001, seed % 100, torch.float32), fmt, 64, torch.float32, seed)


def test_large_tensor() -> None:
    x = _data(1 << 24, 3, torch.bfloat16)  # 16 Mi elements: many programs
    _check(x, "int8", 64, torch.float32, None)
    _check(x, "int4", 32, torch.float16, 5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("fmt", R.FORMATS)
def test_extreme_magnitudes_and_subnormals(fmt: R.Format, dtype: torch.dtype) -> None:
    fi = torch.finfo(dtype)
    vals = [fi.max, -fi.max, fi.max / 3, fi.tiny, -fi.tiny, fi.tiny * 0.25, 1.0, fi.eps]
    x = torch.cat([torch.tensor(vals * 4), torch.tensor([fi.tiny * k for k in range(-16, 16)])]).to(
        dtype
    )
    for sd in SCALES:
        _check(x, fmt, 32, sd, None)


def test_fp8_every_rounding_case() -> None:
    v = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (v[1:] + v[:-1]) / 2
    grid = torch.cat(
        [
            v,
            mids,
            torch.nextafter(mids, torch.full_like(mids, math.inf)),
            torch.nextafter(mids, torch.zeros_like(mids)),
        ]
    )
    grid = torch.cat([grid, -grid])
    pad = (-grid.numel()) % 63
    vals = torch.cat([grid, torch.zeros(pad)]).view(-1, 63)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1).flatten().contiguous()
    codes, scales = ops.quantize(x.cuda(), "fp8", 64, impl="triton")
    assert torch.all(scales == 1.0)
    assert torch.equal(codes.cpu(), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("fmt", R.FORMATS)
def test_nonfinite(fmt: R.Format) -> None:
    x = torch.randn(1000, device="cuda")
    x[500] = math.nan
    with pytest.raises(NonFiniteInput, match="block 7 "):
        ops.quantize(x, fmt, 64, impl="triton")
    with pytest.raises(PayloadError):
        encode(x, CodecSpec(fmt, 64))


def test_codecs_on_cuda_match_cpu_payloads() -> None:
    x = _data(12_345, 9, torch.bfloat16).view(5, 2469)
    for wire in ("bf16", "int8/b64/f32", "int8/b32/f16/sr", "fp8/b64/f32", "int4/b32/f32/sr"):
        spec = CodecSpec.from_wire(wire)
        cpu = encode(x, spec, generator=torch.Generator().manual_seed(1))
        gpu = encode(x.cuda(), spec, generator=torch.Generator().manual_seed(1))
        assert gpu.payload == cpu.payload, wire
        out = decode(gpu, device="cuda")
        assert out.is_cuda and out.shape == x.shape
        assert torch.equal(_bits(out.cpu()), _bits(decode(cpu)))
