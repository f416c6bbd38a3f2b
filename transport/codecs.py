"""Tensor codecs: a tensor of any shape <-> a payload (bytes) plus a small spec.

The codecs are the entries of :mod:`wanswarm.kernels.registry` (built in: ``none``,
``bf16``, ``int8``, ``fp8``, ``int4``; adding one is one ``register_codec`` call). This
module reads every codec property from its entry: the names :func:`parse_codec` and
:meth:`CodecSpec.from_wire` accept, whether a spec takes a block size, scale dtype and
stochastic rounding (``/sr``), which dtypes it carries, the payload length and header.

Every payload starts with an 8-byte header (layout version, codec id, block size, flags,
dtype) followed by the scales (blockwise codecs) and the codes; ``docs/codecs.md`` is
the normative description and :meth:`CodecSpec.payload_nbytes` gives its exact length.
The arithmetic lives in ``wanswarm.kernels`` (Triton on CUDA, pure torch elsewhere).

Everything that comes from a peer (codec strings, dtype names, payload bytes) is
untrusted: malformed input raises :class:`CodecError` or :class:`PayloadError`, never
anything else.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import torch

from ..kernels import ops, registry
from ..kernels import reference as kref
from ..kernels.errors import KernelError, NonFiniteInput
from ..kernels.registry import Codec, Layout
from . import staging
from .errors import CodecError, PayloadError

logger = logging.getLogger(__name__)

ScaleDtype = Literal["fp16", "fp32"]

LAYOUT_VERSION: Final[int] = 1
HEADER_NBYTES: Final[int] = 8
MAX_WIRE_LEN: Final[int] = 32
MAX_DIMS: Final[int] = 32  # torch's own limit is 64; our tensors have a handful
MAX_DIM: Final[int] = 1 << 48  # any larger extent cannot be a real tensor

_FLAG_FP16_SCALES: Final[int] = 0x01
_FLAG_STOCHASTIC: Final[int] = 0x02
_SCALE_DTYPES: Final[dict[str, torch.dtype]] = {"fp32": torch.float32, "fp16": torch.float16}

# Dtypes a payload may carry: wire name -> (torch dtype, header code). Codes are part of
# the payload layout (docs/codecs.md) and never change meaning.
_DTYPE_TABLE: Final[dict[str, tuple[torch.dtype, int]]] = {
    "float32": (torch.float32, 1),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 3),
    "float64": (torch.float64, 4),
    "int64": (torch.int64, 5),
    "int32": (torch.int32, 6),
    "int16": (torch.int16, 7),
    "int8": (torch.int8, 8),
    "uint8": (torch.uint8, 9),
    "bool": (torch.bool, 10),
}
WIRE_DTYPES: Final[dict[str, torch.dtype]] = {k: v[0] for k, v in _DTYPE_TABLE.items()}
_DTYPE_NAMES: Final[dict[torch.dtype, str]] = {v[0]: k for k, v in _DTYPE_TABLE.items()}
_DTYPE_CODES: Final[dict[torch.dtype, int]] = {v[0]: v[1] for v in _DTYPE_TABLE.values()}
FLOAT_DTYPES: Final[tuple[torch.dtype, ...]] = kref.FLOAT_DTYPES

_WIRE_RE: Final[re.Pattern[str]] = re.compile(
    rf"(?P<name>{registry.NAME_PATTERN})"
    r"(?:/b(?P<bs>[1-9][0-9]{0,4})/(?P<sd>f16|f32)(?P<sr>/sr)?)?"
)


def codec_names() -> tuple[str, ...]:
    """Names of the registered codecs, in registration order."""
    return registry.codec_names()


def _known() -> str:
    return ", ".join(registry.codec_names())


def _entry(name: object) -> Codec:
    """The registry entry of a codec name; CodecError listing the known ones otherwise."""
    codec = registry.lookup(name)
    if codec is None:
        raise CodecError(f"unknown codec {str(name)[:40]!r}; known codecs: {_known()}")
    return codec


def dtype_to_wire(dtype: torch.dtype) -> str:
    """Wire name of a payload dtype (``"float32"``, ``"int64"``, ...)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} cannot travel in a payload") from None


def dtype_from_wire(name: str) -> torch.dtype:
    """Torch dtype for a wire dtype name; CodecError on anything else (peer input)."""
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise CodecError(f"unknown payload dtype {str(name)[:40]!r}")
    return WIRE_DTYPES[name]


@dataclass(frozen=True)
class CodecSpec:
    """A registered codec and its parameters; equal specs have equal wire strings and vice versa.

    ``block_size``, ``scale_dtype`` only matter for blockwise codecs and are reset to
    their defaults for the others (``none``, ``bf16``) so that the spec stays canonical.
    """

    name: str
    block_size: int = 64
    scale_dtype: ScaleDtype = "fp32"
    stochastic: bool = False

    def __post_init__(self) -> None:
        layout = _entry(self.name).layout
        if self.stochastic not in (True, False):
            raise CodecError("stochastic must be a bool")
        if self.stochastic and not layout.stochastic:
            capable = [c.name for c in registry.codecs() if c.layout.stochastic]
            raise CodecError(
                f"stochastic rounding exists for {', '.join(capable)} only, not {self.name}"
            )
        if not layout.blockwise:
            object.__setattr__(self, "block_size", 64)
            object.__setattr__(self, "scale_dtype", "fp32")
            return
        bs = self.block_size
        if (
            not isinstance(bs, int)
            or isinstance(bs, bool)
            or not kref.MIN_BLOCK_SIZE <= bs <= kref.MAX_BLOCK_SIZE
            or bs & (bs - 1)
        ):
            raise CodecError(
                f"block_size must be a power of two in [{kref.MIN_BLOCK_SIZE}, "
                f"{kref.MAX_BLOCK_SIZE}], got {str(bs)[:20]}"
            )
        if self.scale_dtype not in _SCALE_DTYPES:
            raise CodecError(
                f"scale_dtype must be 'fp16' or 'fp32', got {str(self.scale_dtype)[:20]!r}"
            )

    @property
    def codec(self) -> Codec:
        """The registry entry (CodecError if the codec was unregistered since)."""
        return _entry(self.name)

    @property
    def quantizing(self) -> bool:
        """True for the blockwise codecs (int8, fp8, int4, ...)."""
        return self.codec.layout.blockwise

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    def to_wire(self) -> str:
        """Canonical string: ``none``, ``bf16``, ``int8/b64/f32``, ``int4/b32/f16/sr``.

        A codec that is not blockwise is its name; a blockwise one adds its block size,
        scale dtype and ``/sr`` for stochastic rounding.
        """
        if not self.quantizing:
            return self.name
        sd = "f16" if self.scale_dtype == "fp16" else "f32"
        return f"{self.name}/b{self.block_size}/{sd}" + ("/sr" if self.stochastic else "")

    @classmethod
    def from_wire(cls, s: str) -> CodecSpec:
        """Parse a canonical wire string; CodecError on anything else (peer input)."""
        if not isinstance(s, str) or len(s) > MAX_WIRE_LEN:
            raise CodecError("codec identifier is not a short string")
        m = _WIRE_RE.fullmatch(s)
        codec = registry.lookup(m["name"]) if m is not None else None
        if m is None or codec is None or codec.layout.blockwise != (m["bs"] is not None):
            raise CodecError(f"unknown codec identifier {s!r}")
        if m["bs"] is None:
            return cls(name=codec.name)
        spec = cls(
            name=codec.name,
            block_size=int(m["bs"]),
            scale_dtype="fp16" if m["sd"] == "f16" else "fp32",
            stochastic=m["sr"] is not None,
        )
        if spec.to_wire() != s:  # e.g. leading zeros: one spelling per codec
            raise CodecError(f"codec identifier {s!r} is not canonical")
        return spec

    def check_dtype(self, dtype: torch.dtype) -> None:
        """CodecError unless this codec can carry tensors of ``dtype``."""
        self._check_dtype(self.codec, dtype)

    def _check_dtype(self, codec: Codec, dtype: torch.dtype) -> None:
        if dtype not in _DTYPE_CODES:
            raise CodecError(f"dtype {dtype} cannot travel in a payload")
        if codec.layout.float_only and dtype not in FLOAT_DTYPES:
            raise CodecError(f"codec {self.name} carries float32/float16/bfloat16, not {dtype}")

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Exact payload length, header included, for ``numel`` elements of ``dtype``."""
        codec = self.codec
        self._check_dtype(codec, dtype)
        if not isinstance(numel, int) or numel < 0:
            raise CodecError(f"numel must be a non-negative int, got {numel!r}")
        body = codec.layout.body_nbytes(numel, dtype, self.block_size, self.torch_scale_dtype)
        return HEADER_NBYTES + body

    def header(self, dtype: torch.dtype) -> bytes:
        """The 8-byte payload header for a tensor of ``dtype`` (docs/codecs.md)."""
        codec = self.codec
        self._check_dtype(codec, dtype)
        blockwise = codec.layout.blockwise
        flags = 0
        if blockwise and self.scale_dtype == "fp16":
            flags |= _FLAG_FP16_SCALES
        if self.stochastic:
            flags |= _FLAG_STOCHASTIC
        log2_bs = self.block_size.bit_length() - 1 if blockwise else 0
        return bytes((LAYOUT_VERSION, codec.codec_id, log2_bs, flags, _DTYPE_CODES[dtype], 0, 0, 0))


@dataclass(frozen=True)
class EncodedTensor:
    """A payload and what is needed to decode it (the header fields travel separately)."""

    spec: CodecSpec
    shape: tuple[int, ...]
    dtype: torch.dtype  # the original (decoded) dtype
    # what travels: from encode(), a read-only view of the buffer the codec wrote (no copy
    # into a bytes object; on CUDA that buffer is the pinned host copy); from the wire,
    # the bytes received
    payload: bytes | memoryview

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_FRIENDLY_SCALE: Final[dict[str, ScaleDtype]] = {
    "f16": "fp16",
    "fp16": "fp16",
    "f32": "fp32",
    "fp32": "fp32",
}


def parse_codec(s: str) -> CodecSpec:
    """Friendly codec names for configs and CLIs -> CodecSpec; CodecError on bad input.

    Accepts the wire form and ``name[-sr][:option...]`` for any registered codec, with
    options ``b<N>`` (block size), ``f16``/``fp16``/``f32``/``fp32`` (scale dtype) and
    ``sr`` for blockwise codecs; ``raw`` means ``none``. Examples: ``int8``, ``int4-sr``,
    ``fp8``, ``int8:b128``, ``int4:b32:f16:sr``. An unknown name's error lists the known
    codecs.
    """
    if not isinstance(s, str) or len(s) > 64:
        raise CodecError("codec name is not a short string")
    text = s.strip().lower()
    tokens = re.split(r"[:/]", text)
    head = tokens[0]
    stochastic = False
    if head.endswith("-sr"):
        head, stochastic = head[:-3], True
    if head == "raw":
        head = "none"
    codec = registry.lookup(head)
    if codec is None:
        raise CodecError(f"unknown codec {s!r}; known codecs: {_known()} (e.g. 'int8:b64')")
    block_size: int | None = None
    scale: ScaleDtype | None = None
    for tok in tokens[1:]:
        if tok == "sr":
            if stochastic:
                raise CodecError(f"codec {s!r}: stochastic rounding given twice")
            stochastic = True
        elif tok in _FRIENDLY_SCALE:
            if scale is not None:
                raise CodecError(f"codec {s!r}: scale dtype given twice")
            scale = _FRIENDLY_SCALE[tok]
        elif re.fullmatch(r"b[0-9]{1,5}", tok):
            if block_size is not None:
                raise CodecError(f"codec {s!r}: block size given twice")
            block_size = int(tok[1:])
        else:
            raise CodecError(f"codec {s!r}: unknown option {tok!r} (use b<N>, f16, f32 or sr)")
    if not codec.layout.blockwise and (block_size is not None or scale is not None):
        raise CodecError(f"codec {s!r}: {head} takes no block size or scale dtype")
    return CodecSpec(
        name=codec.name,
        block_size=64 if block_size is None else block_size,
        scale_dtype="fp32" if scale is None else scale,
        stochastic=stochastic,
    )


def encode(
    t: torch.Tensor,
    spec: CodecSpec,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> EncodedTensor:
    """Encode ``t`` (any shape and device) with ``spec``.

    ``dtype`` is the dtype the payload decodes to (default ``t.dtype``): a bfloat16
    activation can travel as a float32 payload, quantized straight from its bf16 values
    (no float32 copy is made when the codec reads the source dtype itself, see
    :func:`encodes_directly`). ``generator`` drives the stochastic-rounding seed (default:
    torch's global RNG). Raises CodecError if the codec cannot carry the dtype and
    PayloadError if a quantizing codec meets NaN/Inf.
    """
    return encode_start(t, spec, generator=generator, dtype=dtype).result()


def encode_start(
    t: torch.Tensor,
    spec: CodecSpec,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> PendingEncode:
    """:func:`encode`, launched: on CUDA the payload's copy to the host is left under way,
    and :meth:`PendingEncode.result` waits for it (from any thread). Elsewhere the payload
    is complete on return. CodecError and the CPU quantizer's PayloadError are raised here;
    on CUDA a NaN/Inf is found on the host copy, by ``result``."""
    wire = t.dtype if dtype is None else dtype
    _, pending = _launch_encode(t, spec, generator, wire)
    return pending


def encode_roundtrip(
    t: torch.Tensor,
    spec: CodecSpec,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[EncodedTensor, torch.Tensor]:
    """Encode ``t`` and also return what the receiver will decode, on ``t``'s device.

    The second tensor equals ``decode(encoded, device=t.device)`` bit for bit, without
    the round trip through host bytes (error feedback needs it for its residual).
    """
    wire = t.dtype if dtype is None else dtype
    buf, pending = _launch_encode(t, spec, generator, wire)
    encoded = pending.result()
    return encoded, _decode_buffer(buf, spec, encoded.shape, wire, t.device, untrusted=False)


def payload_peak(e: EncodedTensor) -> float | None:
    """The largest |value| the payload decodes to, read on the host from its bytes; None
    for a payload that does not decode to floats.

    A blockwise payload's is the largest ``|scale| * qmax`` of its blocks, from its scales
    alone and computed as the decoder computes: no code decodes beyond ``qmax``
    (docs/codecs.md), so this is never below the decoded tensor's largest |value|, and it
    equals it for a conforming encoder rounding to nearest (whose block of largest scale
    holds a code at +-qmax). A raw payload's is its values' (one pass on the host). NaN
    if a value or scale is NaN, inf if one is infinite. The payload's length and header
    must have been checked (a received payload, or our own).
    """
    if e.dtype not in FLOAT_DTYPES:
        return None
    n = math.prod(e.shape)
    if n == 0:
        return 0.0
    spec = e.spec
    layout = spec.codec.layout
    buf = _view_payload(cast(Any, e.payload))
    if not layout.blockwise:
        body = _decode_buffer(buf, spec, e.shape, e.dtype, torch.device("cpu"), untrusted=False)
        return float(body.detach().abs().amax())  # amax propagates NaN
    assert layout.qmax is not None
    scales = _split_payload(buf, spec, layout, n, e.dtype)[0]
    # the decoder's own arithmetic (a float32 product, then the output dtype's rounding,
    # both monotonic): exactly what a code of qmax in the block of largest scale gives
    largest = scales.abs().amax().float() * layout.qmax
    return float(largest.to(e.dtype))


def check_scales(e: EncodedTensor) -> None:
    """PayloadError for a blockwise payload's scales that decoding would refuse (NaN,
    infinite, negative, above the codec's limit for the payload's dtype); nothing to
    check for other codecs. The payload's length and header must have been checked."""
    try:
        _check_scales(_view_payload(cast(Any, e.payload)), e.spec, math.prod(e.shape), e.dtype)
    except KernelError as exc:
        raise PayloadError(f"{e.spec.to_wire()} payload: {exc}") from exc


def _check_scales(buf: torch.Tensor, spec: CodecSpec, n: int, dtype: torch.dtype) -> None:
    """KernelError for the scales of a payload buffer on the host that decoding refuses."""
    layout = spec.codec.layout
    if layout.blockwise:
        ops.validate_scales(_split_payload(buf, spec, layout, n, dtype)[0], spec.name, dtype)


def encodes_directly(spec: CodecSpec, source: torch.dtype, wire: torch.dtype) -> bool:
    """Whether ``spec`` encodes a ``source`` tensor as a ``wire`` payload without a cast.

    Same dtype: always. Otherwise the codec must read float inputs itself (not a raw
    layout, whose body is the tensor's own bytes) and every finite ``source`` value must
    be finite in ``wire`` (a blockwise encoder caps its scales for the source dtype, which
    must then pass the decoder's check for the wire dtype).
    """
    if source == wire:
        return True
    if spec.codec.layout.raw or source not in FLOAT_DTYPES or wire not in FLOAT_DTYPES:
        return False
    return torch.finfo(source).max <= torch.finfo(wire).max


def _shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


class PendingEncode:
    """An encoded payload whose copy to the host may still be under way (CUDA)."""

    def __init__(
        self, spec: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype,
        copy: staging.HostCopy, *, header: torch.Tensor | None,
    ) -> None:
        self.spec = spec
        self.shape = shape
        self.dtype = dtype  # the payload's (decoded) dtype
        self._copy = copy
        self._header = header  # written into the host copy once it is there
        self._done: EncodedTensor | None = None

    @property
    def copying(self) -> bool:
        """Whether :meth:`result` waits for a device-to-host copy."""
        return self._done is None and self._copy.pending

    def result(self) -> EncodedTensor:
        """The payload, once on the host. PayloadError if a device kernel found NaN/Inf
        (it marks such blocks with NaN scales, checked here on the host copy). Call from
        one thread at a time."""
        if self._done is not None:
            return self._done
        host = self._copy.wait()
        if self._header is not None:
            # the header goes into the host copy only: a copy from pageable host memory
            # into the device buffer would synchronize (torch waits for such a copy), and
            # nothing reads the device buffer's header (the body's views start after it)
            host[:HEADER_NBYTES].copy_(self._header)
            layout = self.spec.codec.layout
            if layout.blockwise:
                n = math.prod(self.shape)
                try:
                    scales = _split_payload(host, self.spec, layout, n, self.dtype)[0]
                    ops.check_scales_finite(scales, self.spec.block_size)
                except NonFiniteInput as exc:
                    raise PayloadError(f"cannot encode with {self.spec.to_wire()}: {exc}") from exc
            self._header = None
        self._done = EncodedTensor(self.spec, self.shape, self.dtype, _to_bytes(host))
        return self._done


def _launch_encode(
    t: torch.Tensor, spec: CodecSpec, generator: torch.Generator | None, dtype: torch.dtype
) -> tuple[torch.Tensor, PendingEncode]:
    """The whole payload of ``t`` as a ``dtype`` payload, as a uint8 tensor on ``t``'s
    device (on a GPU its header bytes are left unwritten), and its host copy, launched.

    The codec writes its scales and codes straight into the payload buffer, on the
    tensor's device (Triton there when the codec has kernels and ``t`` is on CUDA); on
    CUDA the host copy lands in pinned memory (:mod:`.staging`).
    """
    layout = spec.codec.layout
    spec.check_dtype(dtype)
    shape = _shape_of(t)
    if not encodes_directly(spec, t.dtype, dtype):
        t = t.to(dtype)
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    header = torch.frombuffer(bytearray(spec.header(dtype)), dtype=torch.uint8)
    buf = torch.empty(spec.payload_nbytes(n, dtype), dtype=torch.uint8, device=flat.device)
    scales_out, codes_out = _split_payload(buf, spec, layout, n, dtype)
    seed: int | None = None
    if spec.stochastic:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        seed = int(
            torch.randint(0, kref.MAX_SEED + 1, (1,), generator=generator, device=gen_device)
        )
    try:
        ops.quantize(
            flat,
            spec.name,
            spec.block_size,
            spec.torch_scale_dtype,
            seed=seed,
            codes_out=codes_out,
            scales_out=scales_out,
            check_finite=flat.device.type == "cpu",  # on a device: checked on the host copy
        )
    except NonFiniteInput as exc:
        raise PayloadError(f"cannot encode with {spec.to_wire()}: {exc}") from exc
    except KernelError as exc:
        raise CodecError(f"cannot encode with {spec.to_wire()}: {exc}") from exc
    if buf.device.type == "cpu":
        buf[:HEADER_NBYTES].copy_(header)
        return buf, PendingEncode(spec, shape, dtype, staging.HostCopy(buf, None), header=None)
    return buf, PendingEncode(spec, shape, dtype, staging.start_to_host(buf), header=header)


def _split_payload(
    buf: torch.Tensor, spec: CodecSpec, layout: Layout, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a payload buffer's body: (scales in their dtype, codes in the code dtype).

    ``layout`` is the spec's codec's. Codecs that are not blockwise have no scales.
    """
    sd = spec.torch_scale_dtype
    end_scales = HEADER_NBYTES + layout.scales_numel(n, spec.block_size) * sd.itemsize
    scales = buf[HEADER_NBYTES:end_scales].view(sd)
    codes = buf[end_scales : end_scales + layout.codes_nbytes(n, dtype)]
    return scales, codes.view(layout.code_dtype)


def kernel_format(spec: CodecSpec) -> str:
    """The name :mod:`wanswarm.kernels.ops` dispatches a blockwise codec by.

    CodecError for codecs that are not blockwise (``ops`` takes every codec's name).
    """
    if not spec.quantizing:
        raise CodecError(f"codec {spec.name} is not blockwise")
    return spec.name


def _to_bytes(host: torch.Tensor) -> memoryview:
    """A read-only view of ``host``'s bytes, which it keeps alive: ``host`` is the encoder's
    own fresh buffer (never written once encoded), so the payload need not be copied into
    a ``bytes`` object (12.5 MB took 5.8 ms on an H100's host, twice a micro-batch)."""
    return memoryview(cast(Any, host.numpy())).toreadonly()


_readonly_lock = threading.Lock()
_readonly_seen = False


def _view_payload(payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """Zero-copy uint8 view of the payload (never written to: results are fresh tensors).

    torch warns once per process when it wraps a read-only buffer; that warning is about
    writes, which we never do, so it is silenced on the first read-only wrap only.
    """
    global _readonly_seen
    if _readonly_seen or not memoryview(payload).readonly:
        return torch.frombuffer(payload, dtype=torch.uint8)
    with _readonly_lock, warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        view = torch.frombuffer(payload, dtype=torch.uint8)
        _readonly_seen = True
    return view


def decode(e: EncodedTensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Decode a payload into a fresh tensor of ``e.dtype`` and ``e.shape`` on ``device``.

    The payload is untrusted: a wrong length, header or layout raises CodecError; NaN or
    out-of-range scales and fp8 NaN codes raise PayloadError. Nothing else escapes. The
    result never aliases the payload.
    """
    spec, dtype = e.spec, e.dtype
    if not isinstance(spec, CodecSpec):
        raise CodecError("not a CodecSpec")
    if not isinstance(dtype, torch.dtype):
        raise CodecError("not a torch dtype")
    spec.check_dtype(dtype)
    shape = e.shape
    if (
        not isinstance(shape, tuple)
        or len(shape) > MAX_DIMS
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape
        )
    ):
        raise CodecError(f"bad tensor shape {str(shape)[:80]}")
    n = math.prod(shape)
    payload = e.payload
    if isinstance(payload, memoryview):
        if not payload.c_contiguous:
            raise CodecError("payload memoryview is not contiguous")
        payload = payload.cast("B")
    elif not isinstance(payload, (bytes, bytearray)):
        raise CodecError("payload is not a bytes-like object")
    expected = spec.payload_nbytes(n, dtype)
    if len(payload) != expected:
        raise CodecError(
            f"{spec.to_wire()} payload for {n} {dtype_to_wire(dtype)} elements must be "
            f"{expected} bytes, got {len(payload)}"
        )
    if bytes(payload[:HEADER_NBYTES]) != spec.header(dtype):
        raise CodecError(_describe_header_mismatch(bytes(payload[:HEADER_NBYTES]), spec, dtype))
    try:
        target = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError) as exc:
        raise CodecError(f"bad device {device!r}") from exc
    return _decode_buffer(_view_payload(payload), spec, shape, dtype, target, untrusted=True)


def _decode_buffer(
    buf: torch.Tensor,
    spec: CodecSpec,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    target: torch.device,
    *,
    untrusted: bool,
) -> torch.Tensor:
    """Decode a length- and header-checked payload buffer into a fresh tensor on ``target``.

    ``untrusted`` payloads (from the network) get their scales range-checked first.
    """
    n = math.prod(shape)
    layout = spec.codec.layout
    try:
        if untrusted:  # on the host, before anything moves to the device
            _check_scales(buf, spec, n, dtype)
        if buf.device != target:
            buf = staging.to_device(buf, target)
        scales, codes = _split_payload(buf, spec, layout, n, dtype)
        out = ops.dequantize(codes, scales, spec.name, spec.block_size, n, dtype)
    except KernelError as exc:
        raise PayloadError(f"{spec.to_wire()} payload: {exc}") from exc
    return out.view(shape)


def _describe_header_mismatch(got: bytes, spec: CodecSpec, dtype: torch.dtype) -> str:
    if got[0] != LAYOUT_VERSION:
        return (
            f"payload layout version {got[0]} is not supported (this build reads {LAYOUT_VERSION})"
        )
    return (
        f"payload header {got.hex()} does not match codec {spec.to_wire()} for "
        f"{dtype_to_wire(dtype)} (expected {spec.header(dtype).hex()})"
    )
