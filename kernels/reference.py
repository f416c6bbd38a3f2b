"""Pure-torch specification of the blockwise quantizers (int8, fp8 e4m3, int4).

This module *is* the specification: the Triton kernels in ``quant_triton`` must match it
bit for bit, and ``docs/codecs.md`` describes the same arithmetic in words. The codec
entries of :mod:`.registry` wire both to the dispatcher.

A tensor is flattened to ``n`` elements and cut into blocks of ``block_size`` consecutive
elements (the last block may be short). Per block, in float32::

    amax  = max |x|                                   (NaN/Inf anywhere -> NonFiniteInput)
    scale = min(amax / QMAX, scale_limit)             IEEE division, then rounded to the
                                                      scale dtype (fp32 or fp16, RNE)
    y     = x / scale  if scale > 0  else 0           IEEE division by the *stored* scale
    int8  q = clamp(rne(y), -127, 127)                code = q as int8
    int4  q = clamp(rne(y), -7, 7)                    nibble = q + 8, two per byte, element 2j
                                                      in the low nibble of byte j
    fp8   code = e4m3fn(clamp(y, -448, 448))          RNE, torch's float8_e4m3fn cast
    stochastic (int8/int4): rne(y) is replaced by floor(y + u), u ~ U[0, 1) from Philox
                            keyed by (seed, element index // 4), output index % 4,
                            identical to ``tl.rand4x``.

Decoding is ``code_value * scale`` in float32, then a cast (RNE) to the output dtype. A
code's value never exceeds QMAX in magnitude: the two codes no encoder emits, int8's -128
and int4's nibble 0 (-8), decode as -127 and -7.

``scale_limit`` caps the scale so that ``QMAX * scale`` never exceeds the largest finite
value of the original dtype: decoding a conforming payload can never overflow. Since no
code decodes beyond QMAX, a payload whose scales pass :func:`check_scale_range` decodes
to finite values whatever its codes (fp8 NaN codes are refused), each at most
``QMAX * scale`` of its block in magnitude.
"""

from __future__ import annotations

import functools
import math
from typing import Final, Literal, get_args

import torch

from .errors import NonFiniteInput, UnsupportedInput

Format = Literal["int8", "fp8", "int4"]
FORMATS: Final[tuple[str, ...]] = get_args(Format)

# Largest code magnitude of each format (symmetric ranges: int8 never emits -128, int4
# never emits -8, fp8 saturates at the largest finite e4m3fn value).
QMAX: Final[dict[str, float]] = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}

FLOAT_DTYPES: Final[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
SCALE_DTYPES: Final[tuple[torch.dtype, ...]] = (torch.float32, torch.float16)
MIN_BLOCK_SIZE: Final[int] = 16
MAX_BLOCK_SIZE: Final[int] = 4096

# Triton's uint_to_uniform_float constant: the largest float with (2**31 - 1) * c < 1.
_UNIFORM_SCALE: Final[float] = 4.6566127342e-10
_PHILOX_KEY_A: Final[int] = 0x9E3779B9
_PHILOX_KEY_B: Final[int] = 0xBB67AE85
_PHILOX_ROUND_A: Final[int] = 0xD2511F53
_PHILOX_ROUND_B: Final[int] = 0xCD9E8D57
_PHILOX_ROUNDS: Final[int] = 10
_U32: Final[int] = 0xFFFFFFFF
MAX_SEED: Final[int] = (1 << 31) - 1


def num_blocks(numel: int, block_size: int) -> int:
    """Number of scale blocks for ``numel`` elements (the last block may be short)."""
    return -(-numel // block_size)


def codes_nbytes(fmt: Format, numel: int) -> int:
    """Bytes of quantized codes for ``numel`` elements: one per element, half for int4."""
    return (numel + 1) // 2 if fmt == "int4" else numel


def codes_dtype(fmt: Format) -> torch.dtype:
    """Storage dtype of the codes tensor: int8 for int8, uint8 (raw bits) otherwise."""
    return torch.int8 if fmt == "int8" else torch.uint8


def scale_limit(fmt: Format, dtype: torch.dtype, scale_dtype: torch.dtype) -> float:
    """:func:`scale_limit_for` the ``QMAX`` of a built-in format."""
    return scale_limit_for(QMAX[fmt], dtype, scale_dtype)


@functools.cache
def scale_limit_for(qmax: float, dtype: torch.dtype, scale_dtype: torch.dtype) -> float:
    """Largest scale (representable in ``scale_dtype``) with ``qmax * scale`` finite in ``dtype``.

    Checked exactly in float64: a scale has at most 24 significant bits and ``qmax`` at
    most 9 for the built-in formats (any ``qmax`` with at most 29 keeps it exact).
    """
    dmax = torch.finfo(dtype).max
    target = min(dmax / qmax, torch.finfo(scale_dtype).max)
    v = torch.tensor(target, dtype=torch.float64).to(scale_dtype)
    zero = torch.zeros((), dtype=scale_dtype)
    while float(v) * qmax > dmax:
        v = torch.nextafter(v, zero)
    return float(v)


def check_block_args(fmt: str, block_size: int, scale_dtype: torch.dtype) -> None:
    """Validate the format parameters shared by every implementation."""
    if fmt not in QMAX:
        raise UnsupportedInput(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")
    check_block_params(block_size, scale_dtype)


def check_block_params(block_size: int, scale_dtype: torch.dtype) -> None:
    """Block size and scale dtype of any blockwise codec."""
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1) != 0:
        raise UnsupportedInput(
            f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
            f"got {block_size}"
        )
    if scale_dtype not in SCALE_DTYPES:
        raise UnsupportedInput(f"scale dtype must be float32 or float16, got {scale_dtype}")


def check_quantize_input(x: torch.Tensor) -> None:
    """A quantizer takes a contiguous 1-D float32/float16/bfloat16 tensor."""
    if x.dtype not in FLOAT_DTYPES:
        raise UnsupportedInput(f"quantizers take float32/float16/bfloat16, got {x.dtype}")
    if x.dim() != 1:
        raise UnsupportedInput(f"quantizers take a flat 1-D tensor, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise UnsupportedInput("quantizers take a contiguous tensor")


def check_dequantize_input(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: Format,
    block_size: int,
    numel: int,
    out_dtype: torch.dtype,
) -> None:
    """Shapes, dtypes and layout of a dequantizer's inputs."""
    check_block_args(fmt, block_size, scales.dtype)
    if out_dtype not in FLOAT_DTYPES:
        raise UnsupportedInput(f"dequantizers produce float32/float16/bfloat16, got {out_dtype}")
    if codes.dtype != codes_dtype(fmt):
        raise UnsupportedInput(f"{fmt} codes must be {codes_dtype(fmt)}, got {codes.dtype}")
    if numel < 0:
        raise UnsupportedInput(f"numel must be non-negative, got {numel}")
    if tuple(codes.shape) != (codes_nbytes(fmt, numel),):
        raise UnsupportedInput(
            f"{fmt} codes for {numel} elements must have shape ({codes_nbytes(fmt, numel)},), "
            f"got {tuple(codes.shape)}"
        )
    nb = num_blocks(numel, block_size)
    if tuple(scales.shape) != (nb,):
        raise UnsupportedInput(f"expected {nb} scales, got shape {tuple(scales.shape)}")
    if not codes.is_contiguous() or not scales.is_contiguous():
        raise UnsupportedInput("dequantizers take contiguous codes and scales")
    if codes.device != scales.device:
        raise UnsupportedInput(f"codes on {codes.device} but scales on {scales.device}")


def check_seed(seed: int | None, fmt: Format) -> None:
    """Stochastic rounding exists for the integer formats only; seeds are 31-bit."""
    if seed is None:
        return
    if fmt == "fp8":
        raise UnsupportedInput("stochastic rounding is defined for int8 and int4 only")
    if not 0 <= seed <= MAX_SEED:
        raise UnsupportedInput(f"seed must be in [0, {MAX_SEED}], got {seed}")


def validate_scales(scales: torch.Tensor, fmt: Format, out_dtype: torch.dtype) -> None:
    """Reject scales a conforming encoder cannot produce (they come from the network).

    Every scale must be finite, non-negative and at most ``scale_limit``, so that decoding
    can neither produce nor overflow into a non-finite value.
    """
    check_scale_range(scales, QMAX[fmt], out_dtype, fmt)


def check_scale_range(
    scales: torch.Tensor, qmax: float, out_dtype: torch.dtype, codec: str
) -> None:
    """:func:`validate_scales` for any blockwise codec whose codes reach ``qmax`` at most."""
    if scales.numel() == 0:
        return
    s = scales.float()
    if not bool(torch.isfinite(s).all()):
        raise NonFiniteInput("payload carries a NaN or infinite scale")
    limit = scale_limit_for(qmax, out_dtype, scales.dtype)
    if not bool(((s >= 0) & (s <= limit)).all()):
        raise UnsupportedInput(
            f"payload carries a scale outside [0, {limit:g}] for {codec} decoding to {out_dtype}"
        )


def first_nonfinite_block(amax: torch.Tensor, block_size: int) -> str:
    """Human description of the first block whose absmax is not finite."""
    bad = (~torch.isfinite(amax)).nonzero()
    b = int(bad[0, 0]) if bad.numel() else 0
    return f"NaN or Inf in block {b} (elements {b * block_size}..{(b + 1) * block_size - 1})"


def philox_uniform4x(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Four uniform float32 in [0, 1) per int64 counter: ``(len, 4)``, equal to Triton's
    ``tl.rand4x(seed, counters)`` (column j is its j-th output).

    Philox-4x32-10 (Salmon et al., SC'11) on counter (lo, hi, 0, 0) and key
    (seed_lo, seed_hi); each output word is mapped to a float as in
    ``triton.language.random.uint_to_uniform_float``. int64 arithmetic: a product of
    two 32-bit words fits 64 bits, whose wrapped bit pattern still holds the high word.
    """
    mask = _U32
    c0 = counters & mask
    c1 = (counters >> 32) & mask
    c2 = torch.zeros_like(counters)
    c3 = torch.zeros_like(counters)
    k0 = seed & mask
    k1 = (seed >> 32) & mask
    for _ in range(_PHILOX_ROUNDS):
        pb = c2 * _PHILOX_ROUND_B
        pa = c0 * _PHILOX_ROUND_A
        c0 = (pb >> 32).bitwise_and_(mask).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (pa >> 32).bitwise_and_(mask).bitwise_xor_(c3).bitwise_xor_(k1)
        c1 = pb.bitwise_and_(mask)
        c3 = pa.bitwise_and_(mask)
        k0 = (k0 + _PHILOX_KEY_A) & mask
        k1 = (k1 + _PHILOX_KEY_B) & mask
    w = torch.stack((c0, c1, c2, c3), dim=1)  # (len, 4) words in [0, 2**32)
    # Reinterpret each word as int32; negative words map to their complement.
    w = torch.where(w >= (1 << 31), w - (1 << 32), w)
    w = torch.where(w < 0, -w - 1, w)
    return w.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def stochastic_uniforms(
    seed: int, numel: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The uniform draw of each element for stochastic rounding: ``(numel,)`` float32.

    Element ``i`` takes output ``i % 4`` of Philox counter ``i // 4``: one Philox
    evaluation serves four consecutive elements.
    """
    counters = torch.arange(-(-numel // 4), dtype=torch.int64, device=device)
    return philox_uniform4x(seed, counters).flatten()[:numel]


def _blocked(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(n,) float -> (nb, block_size) float32, zero-padded to whole blocks."""
    n = x.numel()
    nb = num_blocks(n, block_size)
    xf = x.to(torch.float32)
    pad = nb * block_size - n
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.view(nb, block_size)


def quantize(
    x: torch.Tensor,
    fmt: Format,
    block_size: int,
    scale_dtype: torch.dtype = torch.float32,
    *,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat float tensor blockwise: returns ``(codes, scales)``.

    ``codes`` has ``codes_nbytes(fmt, n)`` elements of ``codes_dtype(fmt)``; ``scales``
    has ``num_blocks(n, block_size)`` elements of ``scale_dtype``. ``seed`` (int8/int4
    only) selects stochastic rounding. Raises NonFiniteInput on NaN/Inf.
    """
    check_block_args(fmt, block_size, scale_dtype)
    check_quantize_input(x)
    check_seed(seed, fmt)
    n = x.numel()
    xb = _blocked(x, block_size)  # (nb, bs), may alias x: never written to
    # max |x| per block without a full-size temporary; NaN propagates through both. abs_:
    # torch.maximum(0.0, -0.0) may give -0.0 (by vectorization), and |x| is never -0.0
    amax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg()).abs_()  # (nb,)
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteInput(first_nonfinite_block(amax, block_size))
    qmax = QMAX[fmt]
    limit = scale_limit(fmt, x.dtype, scale_dtype)
    # qmax as a tensor on amax's device: CUDA divides by a CPU scalar as a multiplication
    # by its reciprocal (not IEEE division, so not what the CPU or the kernels compute)
    divisor = torch.full((), qmax, dtype=torch.float32, device=amax.device)
    scale = torch.clamp(amax / divisor, max=limit).to(scale_dtype)  # (nb,)
    s = scale.to(torch.float32)[:, None]  # (nb, 1)
    pos = s > 0
    y = xb / torch.where(pos, s, 1.0)  # (nb, bs), the one full-size float buffer
    if not bool(pos.all()):
        y.masked_fill_(~pos, 0.0)  # zero blocks: y = +0 (also for -0.0 inputs)
    if fmt == "fp8":
        codes = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8).flatten()[:n]
        return codes, scale
    if seed is None:
        q = y.round_()  # round half to even
    else:
        q = y.add_(stochastic_uniforms(seed, y.numel(), y.device).view_as(y)).floor_()
    q = q.clamp_(-qmax, qmax)
    if fmt == "int8":
        return q.to(torch.int8).flatten()[:n], scale
    nib = q.add_(8).to(torch.uint8).flatten()  # (nb*bs,), even length: block_size is even
    packed = nib[0::2] | (nib[1::2] << 4)
    return packed[: codes_nbytes(fmt, n)].contiguous(), scale


@functools.cache
def _code_table(fmt: Format, device: torch.device) -> torch.Tensor:
    """Value of every code byte: (256,) for fp8 (NaN for 0x7F/0xFF), (256, 2) for int4."""
    b = torch.arange(256, dtype=torch.int32)
    if fmt == "fp8":
        table = b.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    else:
        nibbles = torch.stack(((b & 0x0F).to(torch.float32), (b >> 4).to(torch.float32)), 1)
        table = (nibbles - 8).clamp_(min=-QMAX["int4"])  # nibble 0 (-8) decodes as -7
    return table.to(device)


def code_values(codes: torch.Tensor, fmt: Format, numel: int) -> torch.Tensor:
    """The float32 value of every code, before scaling: (numel,). fp8 NaN codes give NaN;
    no other code's value exceeds QMAX in magnitude (int8 -128 and int4 -8 decode as -QMAX).

    fp8 and int4 decode through a 256-entry table: the fp8 table is torch's own
    float8_e4m3fn -> float32 conversion of every byte, the int4 table holds both nibbles.
    """
    if fmt == "int8":
        return codes.to(torch.float32).clamp_(min=-QMAX["int8"])  # -128 decodes as -127
    table = _code_table(fmt, codes.device)
    vals = torch.index_select(table, 0, codes.to(torch.int64))
    return vals if fmt == "fp8" else vals.flatten()[:numel]


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: Format,
    block_size: int,
    numel: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``(numel,)`` tensor of ``out_dtype``.

    Raises NonFiniteInput if fp8 codes hold NaN (0x7F/0xFF, never emitted by an encoder).
    Scales are not range-checked here; :func:`validate_scales` does that for payloads.
    """
    check_dequantize_input(codes, scales, fmt, block_size, numel, out_dtype)
    vals = code_values(codes, fmt, numel)  # (n,) float32
    if fmt == "fp8" and bool(torch.isnan(vals).any()):
        raise NonFiniteInput("fp8 codes hold NaN (0x7F or 0xFF)")
    s = scales.to(torch.float32)
    out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    nf = numel // block_size
    head = nf * block_size
    torch.mul(vals[:head].view(nf, block_size), s[:nf, None], out=out[:head].view(nf, block_size))
    if head < numel:
        torch.mul(vals[head:], s[nf], out=out[head:])
    return out.to(out_dtype)


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y|| / ||x||`` in float64 (0 for an all-zero ``x`` reproduced exactly)."""
    xd = x.to(torch.float64).flatten()
    d = (xd - y.to(torch.float64).flatten()).norm().item()
    nx = xd.norm().item()
    return d / nx if nx > 0 else (0.0 if d == 0 else math.inf)
