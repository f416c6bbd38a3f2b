"""The wanswarm/1 stream wire format: versioned frames, message headers, tensor payloads.

Pure: bytes in, events or errors out; no sockets, no clocks. Everything decoded here
comes from a peer, so every length is bounded by ``LimitsConfig`` *before* anything is
allocated, and every failure is a :class:`ProtocolError` (FramingError, PayloadError,
CodecError) whose ``code`` goes back to the peer; nothing else escapes.

One QUIC bidirectional stream carries one exchange. Each direction is a sequence of
frames::

    frame   = version:u8 | type:u8 | length:u32be | body[length]
    HEADER  (1)  body = JSON MessageHeader, then, *unframed*, the payload bytes of the
                 tensors whose transport is "stream", concatenated in header order
    CONTROL (2)  body = an FEC transfer control message (session_wire.py), opaque here
    AUTH    (3)  body = an identity handshake message (handshake.py), opaque here

A direction holds at most one HEADER (the request, the response or an error), any
number of CONTROL frames before and after it, and ends with the stream's FIN at a frame
boundary. AUTH frames appear only on the handshake stream.

Payloads of tensors whose transport is "datagram" are not on the stream: they travel
as FEC-protected QUIC DATAGRAM frames of the transfer named by ``transfer_id`` (whose
layout ``symbol_size`` and ``block_symbols`` also give, session.py); the CONTROL frames
of that transfer (repair requests, completion) go the other way on the same stream.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .codecs import (
    CodecSpec,
    EncodedTensor,
    decode,
    dtype_from_wire,
    dtype_to_wire,
)
from .config import LimitsConfig
from .errors import CodecError, FramingError, PayloadError, ProtocolError

WIRE_VERSION: Final[int] = 1
PREFIX: Final[struct.Struct] = struct.Struct("!BBI")
PREFIX_BYTES: Final[int] = PREFIX.size  # 6
MAX_DIMS: Final[int] = 16
MAX_KIND_CHARS: Final[int] = 64
MAX_ERROR_MESSAGE_CHARS: Final[int] = 1024
MAX_AUTH_BYTES: Final[int] = 1024
MAX_ID: Final[int] = (1 << 62) - 1  # a QUIC varint's range

# Wire error codes beyond the family defaults (bad_frame, bad_payload, bad_codec).
UNSUPPORTED_VERSION: Final[str] = "unsupported_version"
TOO_LARGE: Final[str] = "too_large"
TRUNCATED: Final[str] = "truncated"
NON_FINITE: Final[str] = "non_finite"


class FrameType(enum.IntEnum):
    HEADER = 1
    CONTROL = 2
    AUTH = 3


MessageType = Literal["request", "response", "error"]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class TensorSpec(_Wire):
    """One tensor of a message: what it decodes to and where its payload travels."""

    shape: tuple[int, ...] = Field(max_length=MAX_DIMS)
    dtype: str = Field(max_length=16, description="wire dtype name, e.g. 'float32'")
    codec: str = Field(max_length=32, description="CodecSpec wire string, e.g. 'int8/b64/f32'")
    nbytes: int = Field(ge=0, le=MAX_ID, description="payload length in bytes")
    transport: Literal["stream", "datagram"] = "stream"
    transfer_id: int | None = Field(default=None, ge=0, le=MAX_ID)
    symbol_size: int | None = Field(default=None, ge=1, le=65535)
    block_symbols: int | None = Field(default=None, ge=1, le=65535)

    @model_validator(mode="after")
    def _check(self) -> TensorSpec:
        if any(d < 0 for d in self.shape):
            raise ValueError("negative dimension")
        fec = (self.transfer_id, self.symbol_size, self.block_symbols)
        if self.transport == "datagram":
            if None in fec:
                raise ValueError("a datagram tensor needs transfer_id, symbol_size, block_symbols")
            if self.nbytes == 0:
                raise ValueError("an empty payload travels on the stream")
        elif fec != (None, None, None):
            raise ValueError("transfer fields are for datagram tensors only")
        return self


class MessageHeader(_Wire):
    """The JSON header of a request, a response or an error."""

    version: int
    type: MessageType
    request_id: int = Field(ge=0, le=MAX_ID)
    kind: str = Field(default="", max_length=MAX_KIND_CHARS, pattern=r"^[A-Za-z0-9_.:-]*$")
    header: dict[str, Any] = Field(default_factory=dict)
    tensors: tuple[TensorSpec, ...] = ()
    error_code: str | None = Field(default=None, max_length=64)
    error_message: str | None = Field(default=None, max_length=MAX_ERROR_MESSAGE_CHARS)

    @model_validator(mode="after")
    def _check(self) -> MessageHeader:
        if (self.type == "error") != (self.error_code is not None):
            raise ValueError("error_code is required for, and only for, error messages")
        if self.type == "request" and not self.kind:
            raise ValueError("a request needs a kind")
        return self


@dataclass(frozen=True)
class TensorPlan:
    """A validated tensor spec: parsed codec and dtype, element count."""

    spec: TensorSpec
    codec: CodecSpec
    dtype: torch.dtype
    numel: int


# -- frames -------------------------------------------------------------------------


def encode_frame(frame_type: FrameType, body: bytes) -> bytes:
    """One frame: prefix and body."""
    return PREFIX.pack(WIRE_VERSION, frame_type, len(body)) + body


def encode_header(header: MessageHeader, limits: LimitsConfig) -> bytes:
    """A HEADER frame. FramingError if it exceeds ``limits.max_header_bytes``."""
    try:
        body = header.model_dump_json().encode()
    except (ValueError, TypeError) as exc:  # pydantic's serialization errors
        raise FramingError(f"header is not JSON-serializable: {exc}") from exc
    if len(body) > limits.max_header_bytes:
        raise FramingError(
            f"header of {len(body)} bytes exceeds max_header_bytes={limits.max_header_bytes}",
            code=TOO_LARGE,
        )
    return encode_frame(FrameType.HEADER, body)


def decode_prefix(data: bytes | bytearray | memoryview) -> tuple[FrameType, int]:
    """Parse a 6-byte frame prefix; FramingError for a bad version or type."""
    if len(data) < PREFIX_BYTES:
        raise FramingError("frame prefix truncated", code=TRUNCATED)
    version, frame_type, length = PREFIX.unpack_from(data)
    if version != WIRE_VERSION:
        raise FramingError(
            f"wire version {version} unsupported (this build speaks {WIRE_VERSION})",
            code=UNSUPPORTED_VERSION,
        )
    try:
        return FrameType(frame_type), length
    except ValueError:
        raise FramingError(f"unknown frame type {frame_type}") from None


def decode_header(body: bytes | bytearray, limits: LimitsConfig) -> MessageHeader:
    """Parse and validate a HEADER body (the JSON); FramingError on any defect."""
    if len(body) > limits.max_header_bytes:
        raise FramingError("header exceeds max_header_bytes", code=TOO_LARGE)
    try:
        header = MessageHeader.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[:1]
        raise FramingError(f"malformed header: {first}") from None
    if header.version != WIRE_VERSION:
        raise FramingError(
            f"header version {header.version} unsupported (this build speaks {WIRE_VERSION})",
            code=UNSUPPORTED_VERSION,
        )
    return header


def plan_tensors(header: MessageHeader, limits: LimitsConfig) -> tuple[TensorPlan, ...]:
    """Check every tensor spec against the limits and its codec, before any allocation.

    FramingError (too many, too large), CodecError (unknown codec or dtype, a codec that
    cannot carry the dtype), PayloadError (``nbytes`` disagrees with shape and codec).
    """
    if len(header.tensors) > limits.max_tensors:
        raise FramingError(
            f"{len(header.tensors)} tensors exceed max_tensors={limits.max_tensors}",
            code=TOO_LARGE,
        )
    plans = []
    total = 0
    for i, spec in enumerate(header.tensors):
        numel = 1
        for d in spec.shape:
            numel *= d
            if numel > limits.max_tensor_elements:
                break
        if numel > limits.max_tensor_elements:
            raise FramingError(
                f"tensor {i} of shape {spec.shape} exceeds "
                f"max_tensor_elements={limits.max_tensor_elements}",
                code=TOO_LARGE,
            )
        codec = CodecSpec.from_wire(spec.codec)
        dtype = dtype_from_wire(spec.dtype)
        expected = codec.payload_nbytes(numel, dtype)
        if spec.nbytes != expected:
            raise PayloadError(
                f"tensor {i}: shape {spec.shape} {spec.dtype} with codec {spec.codec} "
                f"needs {expected} bytes, header says {spec.nbytes}"
            )
        total += expected
        if total > limits.max_message_bytes:
            raise FramingError(
                f"payloads exceed max_message_bytes={limits.max_message_bytes}", code=TOO_LARGE
            )
        plans.append(TensorPlan(spec, codec, dtype, numel))
    return tuple(plans)


# -- tensors --------------------------------------------------------------------------


def tensor_spec(
    encoded: EncodedTensor,
    *,
    transfer: tuple[int, int, int] | None = None,
) -> TensorSpec:
    """The header entry describing an encoded tensor; ``transfer`` = (transfer id, symbol
    size, block symbols) when its payload travels as an FEC transfer."""
    shape, dtype = tuple(encoded.shape), dtype_to_wire(encoded.dtype)
    codec, nbytes = encoded.spec.to_wire(), len(encoded.payload)
    if transfer is None:
        return TensorSpec(shape=shape, dtype=dtype, codec=codec, nbytes=nbytes)
    transfer_id, symbol_size, block_symbols = transfer
    return TensorSpec(
        shape=shape,
        dtype=dtype,
        codec=codec,
        nbytes=nbytes,
        transport="datagram",
        transfer_id=transfer_id,
        symbol_size=symbol_size,
        block_symbols=block_symbols,
    )


def decode_tensor(
    plan: TensorPlan,
    payload: bytes | bytearray | memoryview,
    *,
    allow_nonfinite: bool,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Decode one payload on ``device`` (default the CPU); PayloadError (code
    ``non_finite``) for NaN/Inf unless allowed.

    A blockwise payload is not searched for NaN/Inf: once its scales passed the decoder's
    range check it decodes to finite values whatever its codes (docs/codecs.md), so only
    raw payloads (``none``, ``bf16``) are, which on a GPU spares a synchronization."""
    if len(payload) != plan.spec.nbytes:
        raise PayloadError(
            f"payload of {len(payload)} bytes, header announced {plan.spec.nbytes}"
        )
    # codecs.decode reads any bytes-like payload; a bytearray saves a copy of the payload
    encoded = EncodedTensor(plan.codec, plan.spec.shape, plan.dtype, cast(bytes, payload))
    tensor = decode(encoded, device=device)
    if allow_nonfinite or plan.codec.quantizing:
        return tensor
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise PayloadError("tensor holds NaN or Inf values", code=NON_FINITE)
    return tensor


# -- the incremental decoder ------------------------------------------------------------


@dataclass(frozen=True)
class HeaderReceived:
    header: MessageHeader
    plans: tuple[TensorPlan, ...]


@dataclass(frozen=True)
class PayloadReceived:
    """The complete payload of the ``index``-th tensor (a stream-transport one)."""

    index: int
    data: bytearray


@dataclass(frozen=True)
class ControlReceived:
    body: bytes


@dataclass(frozen=True)
class AuthReceived:
    body: bytes


@dataclass(frozen=True)
class StreamEnded:
    """The direction ended cleanly at a frame boundary."""


StreamEvent = HeaderReceived | PayloadReceived | ControlReceived | AuthReceived | StreamEnded


class StreamDecoder:
    """Turns the bytes of one stream direction into events, enforcing every limit.

    ``feed`` and ``feed_eof`` raise a ProtocolError on the first defect; the decoder is
    then dead and raises that error again on every call.
    """

    def __init__(
        self,
        limits: LimitsConfig,
        *,
        max_control_bytes: int = 64 * 1024,
        allow_auth: bool = False,
    ) -> None:
        self._limits = limits
        self._max_body = {
            FrameType.HEADER: limits.max_header_bytes,
            FrameType.CONTROL: max_control_bytes,
            FrameType.AUTH: MAX_AUTH_BYTES if allow_auth else -1,
        }
        self._buf = bytearray()
        self._error: ProtocolError | None = None
        self._seen_header = False
        self._ended = False
        # pending stream payloads after a header: (tensor index, nbytes)
        self._payloads: list[tuple[int, int]] = []
        self._payload = bytearray()

    @property
    def in_payload(self) -> bool:
        return bool(self._payloads)

    def feed(self, data: bytes | bytearray | memoryview) -> list[StreamEvent]:
        if self._error is not None:
            raise self._error
        try:
            if self._ended:
                raise FramingError("data after end of stream")
            return self._consume(data)
        except ProtocolError as exc:
            self._error = exc
            raise

    def feed_eof(self) -> list[StreamEvent]:
        if self._error is not None:
            raise self._error
        if self._payloads or self._buf:
            self._error = FramingError("stream ended inside a frame or payload", code=TRUNCATED)
            raise self._error
        self._ended = True
        return [StreamEnded()]

    def _consume(self, data: bytes | bytearray | memoryview) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        view = memoryview(data)
        while view.nbytes:
            if self._payloads:
                index, nbytes = self._payloads[0]
                take = min(nbytes - len(self._payload), view.nbytes)
                self._payload += view[:take]
                view = view[take:]
                if len(self._payload) == nbytes:
                    events.append(PayloadReceived(index, self._payload))
                    self._payload = bytearray()
                    self._payloads.pop(0)
                continue
            self._buf += view
            view = memoryview(b"")
            while not self._payloads and len(self._buf) >= PREFIX_BYTES:
                frame_type, length = decode_prefix(self._buf)
                limit = self._max_body[frame_type]
                if length > limit:
                    if limit < 0:
                        raise FramingError(f"{frame_type.name} frame not allowed here")
                    raise FramingError(
                        f"{frame_type.name} frame of {length} bytes exceeds {limit}",
                        code=TOO_LARGE,
                    )
                if len(self._buf) < PREFIX_BYTES + length:
                    break
                body = bytes(self._buf[PREFIX_BYTES : PREFIX_BYTES + length])
                del self._buf[: PREFIX_BYTES + length]
                events.extend(self._frame(frame_type, body))
            if self._payloads and self._buf:
                # bytes after a header belong to its payloads: hand them back
                view, self._buf = memoryview(bytes(self._buf)), bytearray()
        return events

    def _frame(self, frame_type: FrameType, body: bytes) -> list[StreamEvent]:
        if frame_type == FrameType.CONTROL:
            return [ControlReceived(body)]
        if frame_type == FrameType.AUTH:
            return [AuthReceived(body)]
        if self._seen_header:
            raise FramingError("second message header on one stream direction")
        self._seen_header = True
        header = decode_header(body, self._limits)
        plans = plan_tensors(header, self._limits)
        events: list[StreamEvent] = [HeaderReceived(header, plans)]
        for i, plan in enumerate(plans):
            if plan.spec.transport != "stream":
                continue
            if plan.spec.nbytes == 0:
                events.append(PayloadReceived(i, bytearray()))
            else:
                self._payloads.append((i, plan.spec.nbytes))
        return events


def message_nbytes(plans: Sequence[TensorPlan]) -> int:
    """Total payload bytes of a message, for accounting."""
    return sum(p.spec.nbytes for p in plans)


def error_header(request_id: int, code: str, message: str) -> MessageHeader:
    """The header of an error message (message truncated to the wire limit)."""
    return MessageHeader(
        version=WIRE_VERSION,
        type="error",
        request_id=request_id,
        error_code=code[:64],
        error_message=message[:MAX_ERROR_MESSAGE_CHARS],
    )


def is_json_safe(value: Any) -> bool:
    """True if ``value`` is finite-JSON-serializable (no NaN/Inf floats)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_safe(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(is_json_safe(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))


__all__ = [
    "AuthReceived",
    "CodecError",
    "ControlReceived",
    "FrameType",
    "HeaderReceived",
    "MessageHeader",
    "PayloadReceived",
    "StreamDecoder",
    "StreamEnded",
    "StreamEvent",
    "TensorPlan",
    "TensorSpec",
    "WIRE_VERSION",
    "decode_header",
    "decode_prefix",
    "decode_tensor",
    "encode_frame",
    "encode_header",
    "error_header",
    "plan_tensors",
    "tensor_spec",
]
