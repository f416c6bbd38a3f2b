"""Tensors at the endpoint's edge: what a message carries out, and what comes in.

Out, a message's tensors may be any :data:`Sendable`:

- a plain ``torch.Tensor``, encoded with the message's codec;
- an ``EncodedTensor``, whose payload goes out as it is;
- a :class:`ReceivedTensor`, relayed: its payload goes out exactly as it came in, never
  decoded or re-encoded here (so a trainer passes a stage's output on to the next stage
  quantized once, by the stage that computed it).

In, every tensor is first a :class:`ReceivedTensor`: its payload, checked at receipt
against everything the message header and the payload's own 8-byte codec header say
(codec, dtype, shape within the limits, payload length, header bytes), and decoded only
on first access, which checks the values (scales, NaN/Inf). A requester may take them so
(``Endpoint.request(..., lazy=True)``); otherwise the endpoint decodes them before
handing them over, as it always does for a server's requests.

Codec work on more than :data:`THREAD_BYTES` of tensor data runs in a worker thread,
never on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias, TypeVar, cast

import torch

from .codecs import (
    HEADER_NBYTES,
    CodecSpec,
    EncodedTensor,
    check_scales,
    encode,
    payload_peak,
)
from .errors import CodecError, FramingError, PayloadError, ProtocolError
from .framing import NON_FINITE, TensorPlan, decode_tensor, tensor_spec

THREAD_BYTES: Final[int] = 1 << 20  # codec work on more tensor bytes runs in a worker thread
# The wire error codes of a receiver that refused a tensor's payload when decoding it.
PAYLOAD_ERROR_CODES: Final[frozenset[str]] = frozenset(
    {NON_FINITE, PayloadError.code, CodecError.code}
)
_NONE: Final[CodecSpec] = CodecSpec("none")
_T = TypeVar("_T")
_UNKNOWN: Final[object] = object()  # a peak not computed yet


class ReceivedTensor:
    """A tensor as a peer sent it: its encoded payload, decoded on first access.

    Checked at construction (cheap, no decoding): the codec carries the dtype, the
    payload has the exact length the shape, dtype and codec give, and its codec header
    bytes match; the message's tensor spec was checked against the limits before
    (``framing.plan_tensors``). NOT checked until decoded: the values, i.e. the scales
    of a blockwise codec (finite, in range), fp8 NaN codes and, unless
    ``allow_nonfinite``, NaN/Inf in the decoded tensor. So :attr:`encoded` may be relayed
    undecoded to a peer that decodes it (and refuses bad values itself), while
    :meth:`tensor` gives a fully checked tensor or raises the ProtocolError the endpoint
    would have raised on receipt (PayloadError, code ``non_finite`` for NaN/Inf).

    The decoded tensor (or the error) is kept: decoding happens at most once. Safe to use
    from several threads. The payload is referenced, never copied, and never written to.
    """

    __slots__ = (
        "plan", "payload", "allow_nonfinite", "sender", "_lock", "_tensor", "_error", "_peak"
    )

    def __init__(
        self,
        plan: TensorPlan,
        payload: bytes | bytearray | memoryview,
        *,
        allow_nonfinite: bool = False,
        sender: str = "",
    ) -> None:
        expected = plan.codec.payload_nbytes(plan.numel, plan.dtype)  # CodecError: bad dtype
        if len(payload) != plan.spec.nbytes or len(payload) != expected:
            raise PayloadError(
                f"payload of {len(payload)} bytes for {plan.numel} elements with codec "
                f"{plan.spec.codec}: {expected} expected, header announced {plan.spec.nbytes}"
            )
        head = bytes(payload[:HEADER_NBYTES])
        if head != plan.codec.header(plan.dtype):
            raise CodecError(
                f"payload header {head.hex()} does not match codec {plan.spec.codec} for "
                f"{plan.spec.dtype} (expected {plan.codec.header(plan.dtype).hex()})"
            )
        self.plan = plan
        self.payload = payload
        self.allow_nonfinite = allow_nonfinite
        self.sender = sender  # peer id of who sent it ("" when unknown)
        self._lock = threading.Lock()
        self._tensor: torch.Tensor | None = None
        self._error: ProtocolError | None = None
        self._peak: object = _UNKNOWN

    @classmethod
    def of(
        cls, encoded: EncodedTensor, *, allow_nonfinite: bool = False, sender: str = ""
    ) -> ReceivedTensor:
        """What a peer receives for ``encoded`` (in-process use: fakes and tests)."""
        try:
            spec = tensor_spec(encoded)
        except ValueError as exc:  # pydantic: a shape or size no header could carry
            raise FramingError(f"no tensor spec for this tensor: {exc}") from None
        plan = TensorPlan(spec, encoded.spec, encoded.dtype, encoded.numel)
        return cls(plan, encoded.payload, allow_nonfinite=allow_nonfinite, sender=sender)

    # what the header says (no decoding)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.plan.spec.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the payload decodes to."""
        return self.plan.dtype

    @property
    def codec(self) -> CodecSpec:
        return self.plan.codec

    @property
    def numel(self) -> int:
        return self.plan.numel

    @property
    def nbytes(self) -> int:
        """Payload bytes (what travels)."""
        return len(self.payload)

    @property
    def decoded_nbytes(self) -> int:
        """Bytes of the decoded tensor (what decoding produces)."""
        return self.plan.numel * self.plan.dtype.itemsize

    @property
    def encoded(self) -> EncodedTensor:
        """The payload as an EncodedTensor (no copy), to relay as it is."""
        # codecs and framing read any bytes-like payload; nothing writes to it
        return EncodedTensor(self.plan.codec, self.shape, self.dtype, cast(bytes, self.payload))

    @property
    def is_decoded(self) -> bool:
        """Whether :meth:`tensor` has run (successfully or not)."""
        return self._tensor is not None or self._error is not None

    # decoding

    def tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The decoded, fully checked tensor (decoded on the first call, in this thread);
        the ProtocolError of a payload that fails the checks, on every call.

        ``device``: where to decode (default the CPU). On a GPU the payload goes to the
        device through pinned memory and is decoded there by the codec's kernels
        (:func:`.codecs.decode`), so only the encoded bytes cross the bus. The first call
        decides where the kept tensor lives; a later call for another device gets a copy.
        """
        target = None if device is None else torch.device(device)
        with self._lock:
            if self._tensor is None and self._error is None:
                try:
                    self._tensor = decode_tensor(
                        self.plan, self.payload, allow_nonfinite=self.allow_nonfinite,
                        device=target,
                    )
                except ProtocolError as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
            assert self._tensor is not None
            if target is not None and self._tensor.device != target:
                return self._tensor.to(target)
            return self._tensor

    @property
    def peak(self) -> float | None:
        """The largest |value| the payload decodes to, from its bytes on the host
        (:func:`.codecs.payload_peak`: a blockwise payload's scales, a raw one's values);
        None if it does not decode to floats. Only after :meth:`tensor` succeeded: the
        scales are then known to be in range. Saves a device synchronization: a GPU that
        decoded the tensor need not be asked for its maximum."""
        with self._lock:
            if self._tensor is None:
                raise RuntimeError("peak of a payload that has not been decoded and checked")
            if self._peak is _UNKNOWN:
                self._peak = payload_peak(self.encoded)
            return cast(float | None, self._peak)

    def checked_peak(self) -> float | None:
        """The payload's largest |value| (None if it does not decode to floats), once its
        values passed the checks :meth:`tensor` makes (its ProtocolError otherwise), without
        keeping a decoded tensor: a blockwise payload whose decoder refuses no code (int8,
        int4) is checked from its scales alone, since scales in range decode to finite
        values; the others are decoded into a scratch copy, dropped here. What a relaying
        trainer checks: the payload goes on as it came."""
        if self.is_decoded:
            self.tensor()  # its error, if decoding failed
            return self.peak
        layout = self.plan.codec.codec.layout
        if layout.blockwise and not layout.refuses_codes:
            check_scales(self.encoded)
            return payload_peak(self.encoded)
        scratch = decode_tensor(self.plan, self.payload, allow_nonfinite=self.allow_nonfinite)
        if not scratch.is_floating_point():
            return None
        return float(scratch.abs().amax()) if scratch.numel() else 0.0

    async def decode(self, device: torch.device | str | None = None) -> torch.Tensor:
        """:meth:`tensor`, in a worker thread when it is large (THREAD_BYTES)."""
        return await off_loop(self.decoded_nbytes, lambda: self.tensor(device))

    def __repr__(self) -> str:
        state = "decoded" if self._tensor is not None else "failed" if self._error else "encoded"
        return (
            f"ReceivedTensor({self.plan.spec.dtype} {self.shape}, {self.plan.spec.codec}, "
            f"{self.nbytes} B, {state})"
        )


Sendable: TypeAlias = torch.Tensor | EncodedTensor | ReceivedTensor


async def off_loop(nbytes: int, work: Callable[[], _T]) -> _T:
    """``work()``: in a worker thread when it handles more than THREAD_BYTES, else here."""
    return await asyncio.to_thread(work) if nbytes > THREAD_BYTES else work()


def sendable_nbytes(t: Sendable) -> int:
    """Bytes on the wire of an encoded or received tensor, in memory of a plain one."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, ReceivedTensor):
        return t.nbytes
    return len(t.payload)


async def encode_all(tensors: Sequence[Sendable], codec: CodecSpec | None) -> list[EncodedTensor]:
    """Every tensor as it goes out: plain ones encoded with ``codec`` (None: ``none``),
    encoded and received ones as they are; in a worker thread when large."""
    spec = codec or _NONE
    plain = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def run() -> list[EncodedTensor]:
        out = []
        for t in tensors:
            if isinstance(t, torch.Tensor):
                out.append(encode(t, spec))
            elif isinstance(t, ReceivedTensor):
                out.append(t.encoded)
            else:
                out.append(t)
        return out

    return await off_loop(plain, run)


async def decode_all(
    tensors: Sequence[ReceivedTensor], device: torch.device | str | None = None
) -> list[torch.Tensor]:
    """Every tensor decoded and checked (the first ProtocolError otherwise): float ones on
    ``device`` (default the CPU; see :meth:`ReceivedTensor.tensor`), integer ones (token
    ids, targets: nothing to dequantize, and their range checks are host work) on the CPU;
    in a worker thread when large."""
    total = sum(t.decoded_nbytes for t in tensors)
    return await off_loop(
        total, lambda: [t.tensor(device if t.dtype.is_floating_point else None) for t in tensors]
    )
