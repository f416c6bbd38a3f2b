"""Dispatcher for the codecs of :mod:`.registry`: Triton on CUDA tensors, the reference elsewhere.

A codec is named by its registry name. Its Triton launchers run on CUDA tensors; a codec
registered without Triton kernels runs its pure-torch reference on every device.
``impl`` (per call) or :func:`use_impl` (a context manager, per task/thread through a
context variable) force one implementation; tests use it to run the Triton kernels on
CPU tensors under ``TRITON_INTERPRET=1``. Triton itself is imported only when a Triton
launch is actually chosen, so importing this module on a CPU machine never loads it.

Where Triton cannot run (not installed, no C compiler to build the kernels' launcher, a
GPU too old for its code generator, any other exception from a launch), the call runs
the reference on the same device instead: the failure is logged once per device, and
later automatic choices go straight to the reference there (:func:`triton_failures`).
A :class:`.errors.KernelError` from a launcher (bad input, NaN/Inf) is the answer, not a
failure, and propagates. With ``impl="triton"`` forced, a failure still falls back but
every call tries Triton first.

The dispatcher checks every argument against the codec's layout before any launch, and
every result of a codec function against it after, so a codec's functions see (and
produce) exactly the shapes and dtypes that :class:`.registry.Layout` describes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator
from typing import Literal

import torch

from . import reference, registry
from .errors import KernelError, NonFiniteInput, RegistrationError, UnsupportedInput
from .registry import Codec, TritonKernels

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


def resolve_impl(t: torch.Tensor, impl: Impl | None = None, codec: str | None = None) -> Impl:
    """The implementation that will process ``t``: explicit > :func:`use_impl` > device.

    With ``codec``, a codec registered without Triton kernels always gets ``"reference"``.
    """
    if codec is not None and registry.get_codec(codec).triton is None:
        return "reference"
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
    codec: str,
    block_size: int,
    scale_dtype: torch.dtype = torch.float32,
    *,
    seed: int | None = None,
    codes_out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None,
    impl: Impl | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a flat, contiguous tensor with a registered codec; see :mod:`.registry`.

    Returns ``(codes, scales)`` as the codec's layout describes them (no scales for codecs
    that are not blockwise; ``block_size`` and ``scale_dtype`` then do not matter). When
    ``codes_out``/``scales_out`` are given (views into a payload buffer, on ``x``'s
    device) the results are written there and returned; otherwise they may alias ``x``.
    Raises UnsupportedInput for bad arguments or an unknown codec and NonFiniteInput for
    NaN/Inf. ``check_finite=False`` lets a Triton launch skip its device-side check (a
    NaN/Inf block then gets a NaN scale, which the caller must check, see
    :func:`check_scales_finite`); the reference always checks, since it costs it nothing.
    """
    entry = registry.get_codec(codec)
    layout = entry.layout
    _check_params(entry, block_size, scale_dtype)
    _check_input(entry, x)
    if seed is not None:
        if not layout.stochastic:
            raise UnsupportedInput(f"codec {entry.name} has no stochastic rounding")
        if not 0 <= seed <= reference.MAX_SEED:
            raise UnsupportedInput(f"seed must be in [0, {reference.MAX_SEED}], got {seed}")
    n = x.numel()
    codes_shape = (layout.codes_numel(n, x.dtype),)
    scales_shape = (layout.scales_numel(n, block_size),)
    _check_out(codes_out, codes_shape, layout.code_dtype, x)
    _check_out(scales_out, scales_shape, scale_dtype, x)
    triton = _usable_triton(entry, x, impl)
    codes = scales = None
    if triton is not None:
        try:
            codes, scales = triton.quantize(
                x,
                block_size,
                scale_dtype,
                seed=seed,
                codes_out=codes_out,
                scales_out=scales_out,
                check_finite=check_finite,
            )
        except KernelError:
            raise
        except Exception as exc:  # no compiler, an old GPU, a Triton bug: the reference
            _triton_failed(entry.name, x.device, exc)
    if codes is None or scales is None:
        codes, scales = entry.quantize(x, block_size, scale_dtype, seed=seed)
    _check_result(entry, "codes", codes, codes_shape, layout.code_dtype, x.device)
    _check_result(entry, "scales", scales, scales_shape, scale_dtype, x.device)
    if codes_out is not None and codes is not codes_out:
        codes = codes_out.copy_(codes)
    if scales_out is not None and scales is not scales_out:
        scales = scales_out.copy_(scales)
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    codec: str,
    block_size: int,
    numel: int,
    out_dtype: torch.dtype = torch.float32,
    *,
    impl: Impl | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: a new ``(numel,)`` tensor of ``out_dtype`` on the codes' device.

    Raises UnsupportedInput for inconsistent inputs and NonFiniteInput (or another
    KernelError) for codes the codec refuses, e.g. fp8 NaN codes. Call
    :func:`validate_scales` first on scales that came from the network.
    """
    entry = registry.get_codec(codec)
    layout = entry.layout
    _check_params(entry, block_size, scales.dtype)
    if layout.float_only and out_dtype not in reference.FLOAT_DTYPES:
        raise UnsupportedInput(
            f"codec {entry.name} produces float32/float16/bfloat16, got {out_dtype}"
        )
    if not isinstance(numel, int) or numel < 0:
        raise UnsupportedInput(f"numel must be a non-negative int, got {numel!r}")
    if codes.dtype != layout.code_dtype:
        raise UnsupportedInput(f"{entry.name} codes must be {layout.code_dtype}, got {codes.dtype}")
    codes_shape = (layout.codes_numel(numel, out_dtype),)
    if tuple(codes.shape) != codes_shape:
        raise UnsupportedInput(
            f"{entry.name} codes for {numel} elements must have shape {codes_shape}, "
            f"got {tuple(codes.shape)}"
        )
    scales_shape = (layout.scales_numel(numel, block_size),)
    if tuple(scales.shape) != scales_shape:
        raise UnsupportedInput(
            f"expected {scales_shape[0]} scales, got shape {tuple(scales.shape)}"
        )
    if not codes.is_contiguous() or not scales.is_contiguous():
        raise UnsupportedInput("dequantizers take contiguous codes and scales")
    if codes.device != scales.device:
        raise UnsupportedInput(f"codes on {codes.device} but scales on {scales.device}")
    triton = _usable_triton(entry, codes, impl)
    out: torch.Tensor | None = None
    if triton is not None:
        try:
            out = triton.dequantize(codes, scales, block_size, numel, out_dtype)
        except KernelError:
            raise
        except Exception as exc:  # no compiler, an old GPU, a Triton bug: the reference
            _triton_failed(entry.name, codes.device, exc)
    if out is None:
        out = entry.dequantize(codes, scales, block_size, numel, out_dtype)
    _check_result(entry, "output", out, (numel,), out_dtype, codes.device)
    return out


_failed_lock = threading.Lock()
_failed: dict[str, str] = {}  # device -> why Triton cannot run there


def _usable_triton(entry: Codec, t: torch.Tensor, impl: Impl | None) -> TritonKernels | None:
    """The codec's Triton launchers when they are chosen for ``t`` and have not failed on
    its device; None: the reference."""
    if entry.triton is None or resolve_impl(t, impl) != "triton":
        return None
    if impl is None and _forced.get() is None and str(t.device) in _failed:
        return None  # automatic choice: once failed on a device, the reference there
    return entry.triton


def _triton_failed(codec: str, device: torch.device, exc: Exception) -> None:
    """Log once per device that Triton cannot run there; later automatic choices skip it."""
    key = str(device)
    with _failed_lock:
        first = key not in _failed
        _failed.setdefault(key, f"{type(exc).__name__}: {exc}"[:500])
    if first:
        logger.warning(
            "Triton kernels failed on %s (codec %s: %s); using the pure-torch reference "
            "there from now on",
            key,
            codec,
            _failed[key],
        )


def triton_failures() -> dict[str, str]:
    """Devices on which a Triton launch failed, with why (selftest, status)."""
    with _failed_lock:
        return dict(_failed)


def reset_triton_failures() -> None:
    """Forget the failures (tests; a node whose driver was fixed restarts anyway)."""
    with _failed_lock:
        _failed.clear()


def validate_scales(scales: torch.Tensor, codec: str, out_dtype: torch.dtype) -> None:
    """Reject scales no conforming encoder produces (NaN/Inf, negative, above the limit).

    The limit is :func:`.reference.scale_limit_for` of the codec's ``qmax``; codecs that
    are not blockwise have no scales to check.
    """
    entry = registry.get_codec(codec)
    if entry.layout.qmax is not None:
        reference.check_scale_range(scales, entry.layout.qmax, out_dtype, entry.name)


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


def _check_params(entry: Codec, block_size: int, scale_dtype: torch.dtype) -> None:
    """Block size and scale dtype, which only blockwise codecs take."""
    if entry.layout.blockwise:
        reference.check_block_params(block_size, scale_dtype)


def _check_input(entry: Codec, x: torch.Tensor) -> None:
    """An encoder takes a contiguous 1-D tensor (a float one unless the codec is raw)."""
    if entry.layout.float_only:
        reference.check_quantize_input(x)
        return
    if x.dim() != 1:
        raise UnsupportedInput(f"encoders take a flat 1-D tensor, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise UnsupportedInput("encoders take a contiguous tensor")


def _check_result(
    entry: Codec,
    what: str,
    t: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """RegistrationError when a codec function breaks its layout (a bug in the codec)."""
    if not isinstance(t, torch.Tensor):
        raise RegistrationError(f"codec {entry.name} returned {type(t).__name__} as {what}")
    empty_scales = what == "scales" and shape == (0,)  # any dtype: nothing is stored
    if tuple(t.shape) != shape or (t.dtype != dtype and not empty_scales) or t.device != device:
        raise RegistrationError(
            f"codec {entry.name} returned {what} {tuple(t.shape)} {t.dtype} on {t.device}; "
            f"its layout says {shape} {dtype} on {device}"
        )
