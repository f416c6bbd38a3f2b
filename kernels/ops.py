"""Dispatcher for the blockwise quantizers: Triton on CUDA tensors, the reference elsewhere.

``impl`` (per call) or :func:`use_impl` (a context manager, per task/thread through a
context variable) force one implementation; tests use it to run the Triton kernels on
CPU tensors under ``TRITON_INTERPRET=1``. Triton itself is imported only when a Triton
launch is actually chosen, so importing this module on a CPU machine never loads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Literal

import torch

from . import reference
from .errors import NonFiniteInput, UnsupportedInput
from .reference import Format

logger = logging.getLogger(__name__)

Impl = Literal["triton", "reference"]

_forced: contextvars.ContextVar[Impl | None] = contextvars.ContextVar(
    "wanswarm_kernels_impl", default=None
)


@contextlib.contextmanager
def use_impl(impl: Impl | None) -> Iterator[None]:
    """Force ``"triton"`` or ``"reference"`` inside the block (``None``: automatic)."""
    if impl not in ("triton", "reference", None):
        raise UnsupportedInput(f"impl must be 'triton', 'reference' or None, got {impl!r}")
    token = _forced.set(impl)
    try:
        yield
    finally:
        _forced.reset(token)


def triton_interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (checked without importing it)."""
    found = importlib.util.find_spec("triton") is not None
    if not found:
        logger.info("triton is not installed: CUDA tensors use the pure-torch quantizers")
    return found


def resolve_impl(t: torch.Tensor, impl: Impl | None = None) -> Impl:
    """The implementation that will process ``t``: explicit > :func:`use_impl` > device."""
    chosen = impl if impl is not None else _forced.get()
    if chosen is None:
        return "triton" if t.is_cuda and triton_available() else "reference"
    if chosen == "triton" and not t.is_cuda and not triton_interpreted():
        raise UnsupportedInput(
            "the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"
        )
    if chosen not in ("triton", "reference"):
        raise UnsupportedInput(f"impl must be 'triton' or 'reference', got {chosen!r}")
    return chosen


def quantize(
    x: torch.Tensor,
    fmt: Format,
    block_size: int,
    scale_dtype: torch.dtype = torch.float32,
    *,
    seed: int | None = None,
    codes_out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None,
    impl: Impl | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat, contiguous float tensor blockwise; see :mod:`.reference`.

    Returns ``(codes, scales)``. When ``codes_out``/``scales_out`` are given (views into a
    payload buffer, on ``x``'s device) the results are written there and returned.
    Raises UnsupportedInput for bad arguments and NonFiniteInput for NaN/Inf.
    ``check_finite=False`` lets the Triton path skip its device-side check (a NaN/Inf block
    then gets a NaN scale, which the caller must check, see :func:`check_scales_finite`);
    the reference always checks, since it costs it nothing.
    """
    reference.check_block_args(fmt, block_size, scale_dtype)
    reference.check_quantize_input(x)
    reference.check_seed(seed, fmt)
    _check_out(codes_out, (reference.codes_nbytes(fmt, x.numel()),), reference.codes_dtype(fmt), x)
    _check_out(scales_out, (reference.num_blocks(x.numel(), block_size),), scale_dtype, x)
    if resolve_impl(x, impl) == "triton":
        from . import quant_triton

        return quant_triton.quantize(
            x,
            fmt,
            block_size,
            scale_dtype,
            seed=seed,
            codes_out=codes_out,
            scales_out=scales_out,
            check_finite=check_finite,
        )
    codes, scales = reference.quantize(x, fmt, block_size, scale_dtype, seed=seed)
    if codes_out is not None:
        codes = codes_out.copy_(codes)
    if scales_out is not None:
        scales = scales_out.copy_(scales)
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: Format,
    block_size: int,
    numel: int,
    out_dtype: torch.dtype = torch.float32,
    *,
    impl: Impl | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: a new ``(numel,)`` tensor of ``out_dtype`` on the codes' device.

    Raises UnsupportedInput for inconsistent inputs and NonFiniteInput for fp8 NaN codes.
    Call :func:`validate_scales` first on scales that came from the network.
    """
    reference.check_dequantize_input(codes, scales, fmt, block_size, numel, out_dtype)
    if resolve_impl(codes, impl) == "triton":
        from . import quant_triton

        return quant_triton.dequantize(codes, scales, fmt, block_size, numel, out_dtype)
    return reference.dequantize(codes, scales, fmt, block_size, numel, out_dtype)


def validate_scales(scales: torch.Tensor, fmt: Format, out_dtype: torch.dtype) -> None:
    """Reject scales no conforming encoder produces (NaN/Inf, negative, above the limit)."""
    reference.validate_scales(scales, fmt, out_dtype)


def check_scales_finite(scales: torch.Tensor, block_size: int) -> None:
    """NonFiniteInput if a quantizer marked a block as holding NaN/Inf (a NaN scale)."""
    if scales.numel() and not bool(torch.isfinite(scales).all()):
        raise NonFiniteInput(reference.first_nonfinite_block(scales.float(), block_size))


def _check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor
) -> None:
    if out is None:
        return
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise UnsupportedInput(
            f"output buffer must be {shape} {dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    if out.device != like.device or not out.is_contiguous():
        raise UnsupportedInput(f"output buffer must be contiguous on {like.device}")
