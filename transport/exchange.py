"""The two directions of one request/response exchange on a stream.

:func:`send_message` writes a message: its header, the payloads that travel on the
stream, and starts the FEC transfers of the payloads of at least ``fec.threshold_bytes``
(their symbols follow as DATAGRAM frames). :class:`Inbound` reads the other direction:
one message (header, stream payloads, FEC transfers), and all along the CONTROL frames
that the receiver of our own transfers sends back (repair requests, completion).

Who ends what: the requester keeps its direction open until the response is complete
(it carries the CONTROL frames of the response's transfers), then sends FIN; the server
sends FIN right after its response (nothing follows from its side), and keeps reading
the requester's CONTROL frames for its response transfers until the requester's FIN.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .codecs import EncodedTensor
from .config import TransportConfig
from .errors import FramingError, settle
from .framing import (
    WIRE_VERSION,
    ControlReceived,
    HeaderReceived,
    MessageHeader,
    MessageType,
    PayloadReceived,
    StreamDecoder,
    StreamEnded,
    TensorPlan,
    TensorSpec,
    encode_header,
    tensor_spec,
)
from .session import SenderTransfer
from .session_wire import decode_control
from .stream import QuicStream
from .transfers import TransferHub, fec_worthwhile


@dataclass
class Message:
    """A received message: its header and every tensor's payload by index."""

    header: MessageHeader
    plans: tuple[TensorPlan, ...]
    payloads: dict[int, bytearray] = field(default_factory=dict)


@dataclass
class Outgoing:
    """What :func:`send_message` started: FEC transfers to stop when the exchange ends."""

    transfers: list[SenderTransfer]
    hub: TransferHub

    def finish(self) -> None:
        for transfer in self.transfers:
            self.hub.finish(transfer)


async def send_message(
    stream: QuicStream,
    hub: TransferHub,
    config: TransportConfig,
    *,
    type: MessageType,
    request_id: int,
    kind: str,
    header: dict[str, object],
    encoded: Sequence[EncodedTensor],
    end: bool,
) -> Outgoing:
    """Write a message; ``end`` sends FIN after it. No deadline here: callers set one."""
    specs: list[TensorSpec] = []
    stream_payloads: list[bytes | memoryview] = []
    transfers: list[SenderTransfer] = []
    use_fec = hub.can_send()
    for item in encoded:
        if use_fec and fec_worthwhile(len(item.payload), config):
            transfer, fields = hub.send(item.payload)
            transfers.append(transfer)
            specs.append(tensor_spec(item, transfer=fields))
        else:
            specs.append(tensor_spec(item))
            if item.payload:
                stream_payloads.append(item.payload)
    message = MessageHeader(
        version=WIRE_VERSION,
        type=type,
        request_id=request_id,
        kind=kind,
        header=header,
        tensors=tuple(specs),
    )
    outgoing = Outgoing(transfers, hub)
    try:
        frame = encode_header(message, config.limits)
        await stream.write(frame, end=end and not stream_payloads)
        for i, payload in enumerate(stream_payloads):
            await stream.write(payload, end=end and i == len(stream_payloads) - 1)
    except BaseException:
        outgoing.finish()
        raise
    for transfer in transfers:  # after the header: the receiver learns of them first
        hub.start(transfer)
    return outgoing


class Inbound:
    """Reads one direction of an exchange in a task of its own (see module docstring).

    ``senders``: our FEC transfers whose CONTROL frames arrive on this direction (may be
    extended later). Nothing here has a deadline: callers set them.
    """

    def __init__(
        self,
        stream: QuicStream,
        hub: TransferHub,
        config: TransportConfig,
        expect: MessageType,
        senders: dict[int, SenderTransfer] | None = None,
        admit: Callable[[MessageHeader, int], None] | None = None,
    ) -> None:
        self.stream = stream
        # checks a header and its total payload bytes before anything is reserved or
        # allocated (the request kind's limit); raises a ProtocolError to refuse it
        self._admit = admit
        self.hub = hub
        self.config = config
        self.senders = senders if senders is not None else {}
        self._allowed = ("request",) if expect == "request" else ("response", "error")
        loop = asyncio.get_running_loop()
        self._header: asyncio.Future[Message] = loop.create_future()
        self._transfers: dict[int, asyncio.Future[bytearray]] = {}
        self._transfer_ids: list[int] = []
        self._reserved = 0  # payload bytes counted against the connection's budget
        self.task: asyncio.Task[None] = loop.create_task(self._pump())
        self.task.add_done_callback(self._settle)

    async def message(self) -> Message:
        """The complete message, FEC transfers included; the reading error if any."""
        message = await asyncio.shield(self._header)
        if not self._transfers:
            return message
        indices = list(self._transfers)
        everything = asyncio.gather(*(self._transfers[i] for i in indices))
        watched: list[asyncio.Future[Any]] = [everything, self.task]
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            error = None if everything.done() else self.task.exception()
            if error is not None:
                raise error
            results = await everything  # the peer ended its direction; symbols still count
        finally:
            if not everything.done():
                everything.cancel()
                # a cancelled gather ends with CancelledError set as its exception: read it,
                # or asyncio logs "exception was never retrieved" for every exchange
                # abandoned with transfers under way (a requester's timeout, a reset)
                everything.add_done_callback(settle)
        message.payloads.update(zip(indices, results, strict=True))
        return message

    async def end(self) -> None:
        """Until the peer ends this direction (FIN); its error if it failed instead."""
        await asyncio.shield(self.task)

    def close(self) -> None:
        """Stop reading, drop this message's incoming transfers and give back its
        reservation (idempotent). The exchange is over: whatever the peer still sends on
        this direction is refused (STOP_SENDING) and dropped, never buffered."""
        if not self.task.done():
            self.task.cancel()
        self.stream.stop_receiving()
        if not self._header.done():
            self._header.cancel()
        for transfer_id in self._transfer_ids:
            self.hub.abandon(transfer_id)
        self._transfer_ids.clear()
        self.hub.release(self._reserved)
        self._reserved = 0

    def _settle(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not self._header.done():
            self._header.set_exception(error)

    async def _pump(self) -> None:
        limits = self.config.limits
        decoder = StreamDecoder(limits, max_control_bytes=limits.max_control_bytes)
        message: Message | None = None
        waiting = 0  # stream payloads still to come
        while True:
            data = await self.stream.read()
            for event in decoder.feed(data) if data else decoder.feed_eof():
                if isinstance(event, ControlReceived):
                    self._control(event.body)
                elif isinstance(event, HeaderReceived):
                    if event.header.type not in self._allowed:
                        raise FramingError(
                            f"expected a {self._allowed[0]}, got {event.header.type}"
                        )
                    total = sum(p.spec.nbytes for p in event.plans)
                    if self._admit is not None:
                        self._admit(event.header, total)
                    self.hub.reserve(total)
                    self._reserved = total
                    message = Message(event.header, event.plans)
                    waiting = 0
                    for index, plan in enumerate(event.plans):
                        if plan.spec.transport == "datagram":
                            self._transfers[index] = self.hub.expect(plan.spec, self.stream)
                            self._transfer_ids.append(plan.spec.transfer_id or 0)
                        else:
                            waiting += 1
                elif isinstance(event, PayloadReceived):
                    if message is None:  # the decoder emits payloads only after a header
                        raise FramingError("payload before header")
                    message.payloads[event.index] = event.data
                    waiting -= 1
                elif isinstance(event, StreamEnded):
                    if message is None or waiting:
                        raise FramingError("stream ended before a complete message")
                    return
                else:
                    raise FramingError(f"unexpected {type(event).__name__}")
            if message is not None and not waiting and not self._header.done():
                self._header.set_result(message)

    def _control(self, body: bytes) -> None:
        transfer_id = decode_control(body).transfer_id
        transfer = self.senders.get(transfer_id)
        if transfer is None:
            raise FramingError(f"control message for unknown transfer {transfer_id}")
        self.hub.control(transfer, body)

