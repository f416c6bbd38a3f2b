"""The codec registry: one entry per codec, holding everything any layer needs to use it.

Adding a codec is one registration::

    register_codec(Codec(
        name="sign",                       # wire and config name
        codec_id=16,                       # payload header byte 1, never reused
        layout=Layout(blockwise=True, code_bits=1, qmax=1.0),
        quantize=sign_quantize,            # pure-torch reference: the specification
        dequantize=sign_dequantize,
        triton=None,                       # optional TritonKernels, bit-exact with the above
    ))

:mod:`wanswarm.transport.codecs` derives the wire strings, spec parameters, payload
length and header from the entry, and :mod:`.ops` dispatches ``quantize``/``dequantize``
to its Triton launchers (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` when
forced) or its reference; a codec without Triton kernels runs its reference everywhere.

The contract of a codec's functions, for ``n`` elements (``x`` is flat and contiguous):

- ``quantize(x, block_size, scale_dtype, *, seed) -> (codes, scales)``: ``codes`` has
  ``layout.codes_numel(n, x.dtype)`` elements of ``layout.code_dtype`` (for a raw layout,
  the tensor's bytes as uint8), ``scales`` has ``layout.scales_numel(n, block_size)``
  elements of ``scale_dtype`` (none for codecs that are not blockwise). ``seed`` is a
  31-bit int for stochastic rounding, only for layouts with ``stochastic``. NaN/Inf that
  the codec cannot carry raise :class:`NonFiniteInput`. Results may alias ``x``.
- ``dequantize(codes, scales, block_size, numel, out_dtype) -> (numel,) out_dtype``: a
  fresh tensor on the codes' device. Codes and scales may come from the network: the
  dispatcher has checked their shapes and dtypes and, for blockwise codecs, the
  transport range-checks a received payload's scales first (at most
  ``reference.scale_limit_for(qmax, out_dtype, scale_dtype)``); any other value the
  codec refuses raises a :class:`KernelError`, nothing else.
- Triton launchers take the same arguments; ``quantize`` also ``codes_out``,
  ``scales_out`` (buffers to write, or None) and ``check_finite`` (False: mark a block
  holding NaN/Inf with a NaN scale instead of synchronizing to raise).

The built-in codecs (none, bf16, int8, fp8, int4) are registered at the end of this
module. Kernels keep the registry because layouts and kernels live here; the wire meaning
of ``name`` and ``codec_id`` belongs to the transport, which only reads them.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Protocol

import torch

from . import reference
from .errors import RegistrationError, UnsupportedInput
from .reference import Format

# Names are lowercase identifiers: configs parse ``name[-sr][:option...]`` and the wire
# ``name/b<N>/<S>[/sr]``, so '-', ':' and '/' cannot occur in one. 16 characters keep the
# longest wire string (name + "/b4096/f16/sr") within the transport's 32.
NAME_PATTERN: Final[str] = r"[a-z][a-z0-9_]{0,15}"
RESERVED_NAMES: Final[frozenset[str]] = frozenset({"raw"})  # parse_codec's alias of none
MAX_CODEC_ID: Final[int] = 255  # one header byte
_NAME_RE: Final[re.Pattern[str]] = re.compile(NAME_PATTERN)
_CODE_BITS: Final[tuple[int, ...]] = (1, 2, 4, 8, 16, 32, 64)


class QuantizeFn(Protocol):
    def __call__(
        self, x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class DequantizeFn(Protocol):
    def __call__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        block_size: int,
        numel: int,
        out_dtype: torch.dtype,
    ) -> torch.Tensor: ...


class TritonQuantizeFn(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        block_size: int,
        scale_dtype: torch.dtype,
        *,
        seed: int | None,
        codes_out: torch.Tensor | None,
        scales_out: torch.Tensor | None,
        check_finite: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class TritonKernels:
    """Typed launchers of a codec's Triton kernels; they import triton when called."""

    quantize: TritonQuantizeFn
    dequantize: DequantizeFn


@dataclass(frozen=True)
class Layout:
    """What a payload body holds for ``n`` elements (after the transport's header).

    ``blockwise``: the body starts with one scale per block of ``block_size`` elements
    (both the block size and the scale dtype, fp32 or fp16, are parameters of the codec
    spec), then the codes. ``code_bits``: bits of one element's code; codes narrower than
    a byte are packed, element ``k`` of a byte in bits ``k * code_bits`` upwards; ``None``
    is a raw layout: the tensor's own bytes. ``code_dtype``: storage dtype of the codes
    tensor the codec functions take and return (one byte for packed, blockwise and raw
    codes, so that the codes' view of the body is always aligned). ``float_only``: the
    codec carries float32/float16/bfloat16 tensors only (else any payload dtype).
    ``stochastic``: a stochastic-rounding variant exists (a seed reaches ``quantize``).
    ``qmax``: blockwise codecs only, the largest magnitude any code decodes to (the
    decoder maps a code beyond it to +-qmax, or refuses it); decoding range-checks every
    scale against ``scale_limit_for(qmax, ...)``, so a conforming encoder caps its scales
    there, ``qmax * scale`` stays finite in the output dtype, and a payload whose scales
    pass decodes to finite values, each within ``qmax`` times its block's scale.
    ``refuses_codes``: blockwise codecs only, the decoder refuses some code values (fp8's
    NaN codes), so a payload is known to decode only once decoded; without it, checking
    the scales is enough.

    Raises RegistrationError for a combination that has no payload layout.
    """

    blockwise: bool
    code_bits: int | None
    code_dtype: torch.dtype = torch.uint8
    float_only: bool = True
    stochastic: bool = False
    qmax: float | None = None
    refuses_codes: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.code_dtype, torch.dtype):
            raise RegistrationError(f"code_dtype must be a torch dtype, got {self.code_dtype!r}")
        if self.code_dtype.is_complex or self.code_dtype == torch.bool:
            raise RegistrationError(f"code_dtype {self.code_dtype} cannot hold codes")
        if self.code_bits is None:
            if self.blockwise or self.stochastic or self.qmax is not None or self.refuses_codes:
                raise RegistrationError(
                    "a raw layout (code_bits=None) has no blocks, scales or stochastic rounding"
                )
            if self.code_dtype != torch.uint8:
                raise RegistrationError("a raw layout's codes are the tensor's bytes: uint8")
            return
        if isinstance(self.code_bits, bool) or self.code_bits not in _CODE_BITS:
            raise RegistrationError(
                f"code_bits must be one of {_CODE_BITS}, got {self.code_bits!r}"
            )
        width = 8 * self.code_dtype.itemsize
        if self.code_bits < 8 and width != 8:
            raise RegistrationError(
                f"{self.code_bits}-bit codes are packed into bytes: "
                f"code_dtype must be one byte wide, not {self.code_dtype}"
            )
        if self.code_bits >= 8 and self.code_bits != width:
            raise RegistrationError(
                f"{self.code_bits}-bit codes need a {self.code_bits}-bit code_dtype, "
                f"not {self.code_dtype}"
            )
        if not self.blockwise:
            if self.stochastic or self.qmax is not None or self.refuses_codes:
                raise RegistrationError(
                    "stochastic rounding, qmax and refused codes need a blockwise layout"
                )
            return
        if width != 8:
            raise RegistrationError(
                f"blockwise codes follow 2- or 4-byte scales: code_dtype must be one byte "
                f"wide, not {self.code_dtype}"
            )
        if not self.float_only:
            raise RegistrationError("a blockwise layout scales floats: float_only must be True")
        if (
            not isinstance(self.qmax, (int, float))
            or isinstance(self.qmax, bool)
            or not 0 < self.qmax < math.inf
        ):
            raise RegistrationError(
                f"a blockwise layout needs qmax, its largest code magnitude, got {self.qmax!r}"
            )

    @property
    def raw(self) -> bool:
        """The body is the tensor's own bytes."""
        return self.code_bits is None

    def codes_numel(self, numel: int, dtype: torch.dtype) -> int:
        """Elements of the codes tensor for ``numel`` elements of ``dtype``."""
        if self.code_bits is None:
            return numel * dtype.itemsize
        per = 8 * self.code_dtype.itemsize
        return -(-numel * self.code_bits // per)

    def codes_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of codes in the body."""
        return self.codes_numel(numel, dtype) * self.code_dtype.itemsize

    def scales_numel(self, numel: int, block_size: int) -> int:
        """Scales in the body: one per block for blockwise layouts, else none."""
        return reference.num_blocks(numel, block_size) if self.blockwise else 0

    def body_nbytes(
        self, numel: int, dtype: torch.dtype, block_size: int, scale_dtype: torch.dtype
    ) -> int:
        """Length of the body: scales, then codes."""
        scales = self.scales_numel(numel, block_size) * scale_dtype.itemsize
        return scales + self.codes_nbytes(numel, dtype)


@dataclass(frozen=True)
class Codec:
    """A registry entry: a codec's name, header id, layout, reference and optional kernels.

    ``quantize``/``dequantize`` are the pure-torch reference, the specification that the
    ``triton`` launchers (if any) must match bit for bit. See the module docstring for
    their contract. ``summary`` is one line for listings.
    """

    name: str
    codec_id: int
    layout: Layout
    quantize: QuantizeFn
    dequantize: DequantizeFn
    triton: TritonKernels | None = None
    summary: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise RegistrationError(
                f"codec name must match {NAME_PATTERN} (lowercase, no '-', ':' or '/'), "
                f"got {str(self.name)[:40]!r}"
            )
        if self.name in RESERVED_NAMES:
            raise RegistrationError(f"codec name {self.name!r} is reserved")
        cid = self.codec_id
        if not isinstance(cid, int) or isinstance(cid, bool) or not 0 <= cid <= MAX_CODEC_ID:
            raise RegistrationError(f"codec_id must be an int in [0, {MAX_CODEC_ID}], got {cid!r}")
        if not isinstance(self.layout, Layout):
            raise RegistrationError(f"codec {self.name}: layout must be a Layout")
        if not callable(self.quantize) or not callable(self.dequantize):
            raise RegistrationError(f"codec {self.name}: quantize and dequantize must be callable")
        if self.triton is not None and not isinstance(self.triton, TritonKernels):
            raise RegistrationError(f"codec {self.name}: triton must be TritonKernels or None")


_lock = threading.Lock()
_codecs: dict[str, Codec] = {}  # in registration order
_builtin: set[str] = set()


def register_codec(codec: Codec) -> Codec:
    """Add ``codec`` to the registry; RegistrationError if its name or id is taken."""
    if not isinstance(codec, Codec):
        raise RegistrationError(f"register_codec takes a Codec, got {type(codec).__name__}")
    with _lock:
        if codec.name in _codecs:
            raise RegistrationError(f"codec {codec.name!r} is already registered")
        for other in _codecs.values():
            if other.codec_id == codec.codec_id:
                raise RegistrationError(
                    f"codec id {codec.codec_id} of {codec.name!r} is taken by {other.name!r}"
                )
        _codecs[codec.name] = codec
    return codec


def unregister_codec(name: str) -> None:
    """Remove a codec registered with :func:`register_codec` (built-ins stay)."""
    with _lock:
        if name in _builtin:
            raise RegistrationError(f"built-in codec {name!r} cannot be unregistered")
        if _codecs.pop(name, None) is None:
            raise RegistrationError(f"codec {name!r} is not registered")


@contextlib.contextmanager
def registered(codec: Codec) -> Iterator[Codec]:
    """Register ``codec`` for the duration of the block (tests, experiments)."""
    register_codec(codec)
    try:
        yield codec
    finally:
        unregister_codec(codec.name)


def lookup(name: object) -> Codec | None:
    """The codec called ``name``, or None (``name`` may be anything, e.g. peer input)."""
    return _codecs.get(name) if isinstance(name, str) else None


def get_codec(name: object) -> Codec:
    """The codec called ``name``; UnsupportedInput listing the known ones otherwise."""
    codec = lookup(name)
    if codec is None:
        raise UnsupportedInput(
            f"unknown codec {str(name)[:40]!r}; known codecs: {', '.join(codec_names())}"
        )
    return codec


def codec_names() -> tuple[str, ...]:
    """Names of the registered codecs, in registration order."""
    with _lock:
        return tuple(_codecs)


def codecs() -> tuple[Codec, ...]:
    """The registered codecs, in registration order."""
    with _lock:
        return tuple(_codecs.values())


# -- the built-in codecs ------------------------------------------------------------------


def _none_quantize(
    x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.view(torch.uint8), x.new_empty(0, dtype=scale_dtype)


def _none_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, out_dtype: torch.dtype
) -> torch.Tensor:
    if out_dtype == torch.bool:  # any byte other than 0/1 is not a valid torch bool
        return codes != 0
    return codes.view(out_dtype).clone()


def _bf16_quantize(
    x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.to(torch.bfloat16), x.new_empty(0, dtype=scale_dtype)


def _bf16_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, out_dtype: torch.dtype
) -> torch.Tensor:
    return codes.to(out_dtype, copy=True)


def _blockwise_reference(fmt: Format) -> tuple[QuantizeFn, DequantizeFn]:
    """:func:`.reference.quantize`/``dequantize`` of one built-in blockwise format."""

    def quantize(
        x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.quantize(x, fmt, block_size, scale_dtype, seed=seed)

    def dequantize(
        codes: torch.Tensor,
        scales: torch.Tensor,
        block_size: int,
        numel: int,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return reference.dequantize(codes, scales, fmt, block_size, numel, out_dtype)

    return quantize, dequantize


def _blockwise_triton(fmt: Format) -> TritonKernels:
    """Launchers of :mod:`.quant_triton` for one format; triton is imported on first use."""

    def quantize(
        x: torch.Tensor,
        block_size: int,
        scale_dtype: torch.dtype,
        *,
        seed: int | None,
        codes_out: torch.Tensor | None,
        scales_out: torch.Tensor | None,
        check_finite: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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

    def dequantize(
        codes: torch.Tensor,
        scales: torch.Tensor,
        block_size: int,
        numel: int,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        from . import quant_triton

        return quant_triton.dequantize(codes, scales, fmt, block_size, numel, out_dtype)

    return TritonKernels(quantize, dequantize)


def _blockwise(fmt: Format, codec_id: int, bits: int, stochastic: bool, summary: str) -> Codec:
    quantize, dequantize = _blockwise_reference(fmt)
    layout = Layout(
        blockwise=True,
        code_bits=bits,
        code_dtype=reference.codes_dtype(fmt),
        stochastic=stochastic,
        qmax=reference.QMAX[fmt],
        refuses_codes=fmt == "fp8",  # its NaN codes
    )
    return Codec(fmt, codec_id, layout, quantize, dequantize, _blockwise_triton(fmt), summary)


# Codec ids are payload header values (docs/codecs.md): never reuse or renumber one.
for _codec in (
    Codec(
        "none",
        0,
        Layout(blockwise=False, code_bits=None, float_only=False),
        _none_quantize,
        _none_dequantize,
        summary="raw bytes of the tensor, any payload dtype",
    ),
    Codec(
        "bf16",
        1,
        Layout(blockwise=False, code_bits=16, code_dtype=torch.bfloat16),
        _bf16_quantize,
        _bf16_dequantize,
        summary="cast to bfloat16",
    ),
    _blockwise("int8", 2, 8, True, "blockwise absmax int8"),
    _blockwise("fp8", 3, 8, False, "e4m3fn codes with a per-block scale"),
    _blockwise("int4", 4, 4, True, "blockwise absmax int4, two codes per byte"),
):
    register_codec(_codec)
    _builtin.add(_codec.name)
del _codec
