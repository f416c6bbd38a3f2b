"""Triton kernels for the blockwise quantizers; bit-exact with :mod:`.reference`.

One pass each way. The quantizer reads a tile of ``ROWS`` blocks (``ROWS * BS`` elements,
about 4096), reduces each block's absmax, computes and stores its scale, divides,
rounds and packs the codes; the dequantizer reads codes and scales and writes the
output dtype. Every program touches a contiguous span of memory, so loads and stores
vectorize to 128-bit transactions; there is no autotuning (the kernels are memory-bound
and the tile size only needs to be large enough to keep the memory system busy).

Bit-exactness with torch, on GPUs and in Triton's CPU interpreter alike:

- divisions use ``tl.math.div_rn`` (IEEE round-to-nearest; ``/`` may be approximate);
- launches pass ``enable_fp_fusion=False`` (no FMA contraction of ``y + u`` etc.) and
  ``enable_reflect_ftz=False`` (libdevice keeps subnormals, as torch does);
- round-half-even is computed from ``floor`` (no reliance on a backend's ``rint``);
- e4m3fn is encoded and decoded with integer bit operations (the interpreter's cast to
  ``tl.float8e4nv`` mis-rounds values whose mantissa carries into the exponent), and
  the cast float32 -> bfloat16 is done on the bits too;
- stochastic rounding draws ``tl.rand4x(seed, element_index // 4)`` (one Philox call per
  four elements), which the reference reproduces with its own Philox.

This module imports triton at import time; the launchers that :mod:`.registry` gives the
int8, fp8 and int4 codecs import it only when :mod:`.ops` chooses a Triton launch.
"""

from __future__ import annotations

import logging
from typing import Final

import torch
import triton
import triton.language as tl

from . import reference
from .errors import NonFiniteInput, UnsupportedInput
from .reference import Format

logger = logging.getLogger(__name__)

_FMT_IDS: Final[dict[str, int]] = {"int8": 0, "fp8": 1, "int4": 2}
_TILE: Final[int] = 4096  # elements per program (before int4 packing)
MAX_NUMEL: Final[int] = (1 << 31) - 2 * reference.MAX_BLOCK_SIZE  # int32 offsets stay in range
_LAUNCH_OPTIONS: Final[dict[str, bool]] = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def _rne(y: tl.tensor) -> tl.tensor:
    """Round half to even, exactly, for |y| < 2**22 (float32 in, float32 out)."""
    fl = tl.floor(y)
    d = y - fl
    odd = (fl.to(tl.int32) & 1) != 0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return fl + up.to(tl.float32)


@triton.jit
def _e4m3fn_encode(y: tl.tensor) -> tl.tensor:
    """float32 in [-448, 448] -> e4m3fn bits (int32), round half to even, like torch."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal results (|y| >= 2**-6): drop 20 mantissa bits with RNE, rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal results: multiples of 2**-9 (code 8 is the smallest normal, 2**-6).
    sub = _rne(a.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)
    mag = tl.minimum(mag, 0x7E)  # saturate at 448
    return sign | mag


@triton.jit
def _e4m3fn_decode(c: tl.tensor) -> tl.tensor:
    """e4m3fn bits (int32, 0..255, no NaN) -> float32."""
    sign = (c & 0x80) << 24
    e = (c >> 3) & 0xF
    m = c & 0x7
    normal = sign | ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign
    return tl.where(e == 0, sub, normal).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(v: tl.tensor) -> tl.tensor:
    """float32 (finite) -> bfloat16 bits as int16, round half to even."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _quantize_kernel(
    x_ptr: tl.tensor,
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    n: tl.tensor,
    nb: tl.tensor,
    limit: tl.tensor,
    seed: tl.tensor,
    FMT: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    QMAX: tl.constexpr,
    SCALE_FP16: tl.constexpr,
    STOCHASTIC: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BS)  # (BS,)
    offs = rows[:, None] * BS + cols[None, :]  # (ROWS, BS)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    ok = ax < float("inf")  # False for +-Inf and NaN
    bad = tl.sum((~ok).to(tl.int32), axis=1)  # (ROWS,)
    x = tl.where(ok, x, 0.0)
    amax = tl.max(tl.where(ok, ax, 0.0), axis=1)  # (ROWS,)
    scale = tl.minimum(tl.math.div_rn(amax, QMAX), limit)
    if SCALE_FP16:
        stored = scale.to(tl.float16)
    else:
        stored = scale
    tl.store(
        scales_ptr + rows, tl.where(bad > 0, float("nan"), stored.to(tl.float32)), mask=rows < nb
    )
    s = stored.to(tl.float32)[:, None]  # (ROWS, 1)
    pos = s > 0
    y = tl.where(pos, tl.math.div_rn(x, tl.where(pos, s, 1.0)), 0.0)  # (ROWS, BS)
    if FMT == 1:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        code = _e4m3fn_encode(y)
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=offs < n)
    else:
        # Clamp first: a scale capped at ``limit`` leaves |y| unbounded, and the integer
        # conversion in _rne needs |y| < 2**22. Clamping to the integer QMAX commutes with
        # round-half-even. It does not with ``floor(y + u)``: for y beyond -QMAX, -QMAX + u
        # can round up to -QMAX + 1 in float32 (u within 2**-22 of 1; seen on an H100), where
        # the reference's floor(y + u) is at most -QMAX. Clamping to QMAX + 1 keeps every
        # y + u that the reference's clamp maps to +-QMAX on that side of it.
        if STOCHASTIC:
            y = tl.minimum(tl.maximum(y, -QMAX - 1.0), QMAX + 1.0)
        else:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if STOCHASTIC:
            # Philox counter c serves elements 4c..4c+3 (output j for element 4c + j).
            ctr = rows[:, None] * (BS // 4) + tl.arange(0, BS // 4)[None, :]  # (ROWS, BS/4)
            u0, u1, u2, u3 = tl.rand4x(seed, ctr)
            u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (ROWS, BS))
            q = tl.floor(y + u)
        else:
            q = _rne(y)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int32)
        if FMT == 0:
            tl.store(codes_ptr + offs, q.to(tl.int8), mask=offs < n)
        else:
            lo, hi = tl.split(tl.reshape(q + 8, (ROWS, BS // 2, 2)))  # (ROWS, BS/2) each
            packed = (lo | (hi << 4)).to(tl.uint8)
            boffs = rows[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
            tl.store(codes_ptr + boffs, packed, mask=boffs < (n + 1) // 2)


@triton.jit
def _dequantize_kernel(
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    out_ptr: tl.tensor,
    flags_ptr: tl.tensor,
    n: tl.tensor,
    nb: tl.tensor,
    FMT: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    OUT_KIND: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    offs = rows[:, None] * BS + tl.arange(0, BS)[None, :]  # (ROWS, BS)
    s = tl.load(scales_ptr + rows, mask=rows < nb, other=0.0).to(tl.float32)[:, None]
    if FMT == 2:
        boffs = rows[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]  # (ROWS, BS/2)
        b = tl.load(codes_ptr + boffs, mask=boffs < (n + 1) // 2, other=0).to(tl.int32)
        lo = tl.maximum((b & 0xF) - 8, -7).to(tl.float32)  # nibble 0 (-8) decodes as -7
        hi = tl.maximum((b >> 4) - 8, -7).to(tl.float32)
        v = tl.reshape(tl.join(lo, hi), (ROWS, BS))  # (ROWS, BS), element 2j = low nibble
    elif FMT == 1:
        c = tl.load(codes_ptr + offs, mask=offs < n, other=0).to(tl.int32)
        tl.store(flags_ptr + pid, tl.max(tl.max(((c & 0x7F) == 0x7F).to(tl.int32), axis=1)))
        v = _e4m3fn_decode(tl.where((c & 0x7F) == 0x7F, 0, c))
    else:
        v = tl.load(codes_ptr + offs, mask=offs < n, other=0).to(tl.int32)
        v = tl.maximum(v, -127).to(tl.float32)  # -128 decodes as -127
    out = v * s
    if OUT_KIND == 0:
        tl.store(out_ptr + offs, out, mask=offs < n)
    elif OUT_KIND == 1:
        tl.store(out_ptr + offs, out.to(tl.float16), mask=offs < n)
    else:
        tl.store(out_ptr + offs, _bf16_bits(out), mask=offs < n)


def _rows(block_size: int) -> int:
    return max(1, _TILE // block_size)


def _num_warps(block_size: int) -> int:
    return 4 if _rows(block_size) * block_size <= _TILE else 8


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise UnsupportedInput("all tensors of one launch must be on the same device")


def quantize(
    x: torch.Tensor,
    fmt: Format,
    block_size: int,
    scale_dtype: torch.dtype = torch.float32,
    *,
    seed: int | None = None,
    codes_out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat contiguous float tensor; same contract as :func:`.reference.quantize`.

    Writes into ``codes_out``/``scales_out`` when given. Raises UnsupportedInput for a
    wrong dtype, shape, layout or device and NonFiniteInput for NaN/Inf. A block holding
    NaN/Inf gets a NaN scale; ``check_finite=False`` skips the check (and its device
    synchronization) for a caller that checks the scales itself, e.g. on the host copy.
    """
    reference.check_block_args(fmt, block_size, scale_dtype)
    reference.check_quantize_input(x)
    reference.check_seed(seed, fmt)
    n = x.numel()
    if n > MAX_NUMEL:
        raise UnsupportedInput(f"the Triton quantizer takes at most {MAX_NUMEL} elements, got {n}")
    nb = reference.num_blocks(n, block_size)
    if codes_out is None:
        codes_out = torch.empty(
            reference.codes_nbytes(fmt, n), dtype=reference.codes_dtype(fmt), device=x.device
        )
    if scales_out is None:
        scales_out = torch.empty(nb, dtype=scale_dtype, device=x.device)
    _check_out(codes_out, reference.codes_nbytes(fmt, n), reference.codes_dtype(fmt))
    _check_out(scales_out, nb, scale_dtype)
    _check_device(x, codes_out, scales_out)
    if n == 0:
        return codes_out, scales_out
    rows = _rows(block_size)
    grid = (triton.cdiv(nb, rows),)
    _quantize_kernel[grid](
        x,
        codes_out,
        scales_out,
        n,
        nb,
        reference.scale_limit(fmt, x.dtype, scale_dtype),
        0 if seed is None else seed,
        FMT=_FMT_IDS[fmt],
        BS=block_size,
        ROWS=rows,
        QMAX=reference.QMAX[fmt],
        SCALE_FP16=scale_dtype == torch.float16,
        STOCHASTIC=seed is not None,
        num_warps=_num_warps(block_size),
        **_LAUNCH_OPTIONS,
    )
    if check_finite and not bool(torch.isfinite(scales_out).all()):
        raise NonFiniteInput(reference.first_nonfinite_block(scales_out.float(), block_size))
    return codes_out, scales_out


_OUT_KINDS: Final[dict[torch.dtype, int]] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: Format,
    block_size: int,
    numel: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize`; same contract as :func:`.reference.dequantize`."""
    reference.check_dequantize_input(codes, scales, fmt, block_size, numel, out_dtype)
    if numel > MAX_NUMEL:
        raise UnsupportedInput(
            f"the Triton dequantizer takes at most {MAX_NUMEL} elements, got {numel}"
        )
    out = torch.empty(numel, dtype=out_dtype, device=codes.device)
    if numel == 0:
        return out
    nb = reference.num_blocks(numel, block_size)
    rows = _rows(block_size)
    grid = (triton.cdiv(nb, rows),)
    flags = torch.zeros(grid[0] if fmt == "fp8" else 1, dtype=torch.int32, device=codes.device)
    _dequantize_kernel[grid](
        codes,
        scales,
        out.view(torch.int16) if out_dtype == torch.bfloat16 else out,
        flags,
        numel,
        nb,
        FMT=_FMT_IDS[fmt],
        BS=block_size,
        ROWS=rows,
        OUT_KIND=_OUT_KINDS[out_dtype],
        num_warps=_num_warps(block_size),
        **_LAUNCH_OPTIONS,
    )
    if fmt == "fp8" and bool(flags.any()):
        raise NonFiniteInput("fp8 codes hold NaN (0x7F or 0xFF)")
    return out


def _check_out(t: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
    if tuple(t.shape) != (numel,) or t.dtype != dtype or not t.is_contiguous():
        raise UnsupportedInput(
            f"output buffer must be contiguous ({numel},) {dtype}, got {tuple(t.shape)} {t.dtype}"
        )
