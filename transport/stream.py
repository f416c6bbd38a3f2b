"""One bidirectional QUIC stream as the application sees it: read, write, end, abort.

The stream holds no protocol state of its own: bytes go to the connection through the
small :class:`StreamOwner` interface (implemented by ``quic_link.QuicLink``), which also
tells it about data, resets, STOP_SENDING and the end of the connection.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from typing import Protocol

from .errors import ConnectError


class StreamCode(enum.IntEnum):
    """QUIC application error codes in RESET_STREAM / STOP_SENDING."""

    CANCELLED = 0x200  # the requester gave up (deadline) or the endpoint is closing
    REFUSED = 0x201  # the stream is not acceptable (before authentication, bad frame)


class StreamOwner(Protocol):
    """What a stream needs from its connection."""

    def send_stream_data(self, stream_id: int, data: bytes | memoryview, end: bool) -> None:
        """Queue bytes (ConnectError if the stream cannot send)."""
        ...

    async def wait_send_room(self, stream: QuicStream) -> None:
        """Return once the stream may queue more (ConnectError if it never will)."""
        ...

    def abort_stream(self, stream: QuicStream, code: StreamCode) -> None: ...

    def stop_receiving(self, stream: QuicStream, code: StreamCode) -> None:
        """Send STOP_SENDING and grant the stream no more flow-control credit."""
        ...

    @property
    def write_chunk(self) -> int: ...


class QuicStream:
    """One bidirectional stream; created by the connection, never by the application."""

    def __init__(self, owner: StreamOwner, stream_id: int) -> None:
        self.owner = owner
        self.stream_id = stream_id
        self.bytes_received = 0
        self.bytes_discarded = 0  # arrived after we stopped reading: dropped, not kept
        self._chunks: deque[bytes] = deque()
        self._eof = False
        self._recv_error: ConnectError | None = None
        self._send_error: ConnectError | None = None
        self._send_ended = False
        self._waiter: asyncio.Future[None] | None = None

    # receiving

    async def read(self) -> bytes:
        """Everything received so far (at least one byte), or b"" at the end of stream.

        ConnectError if the peer reset the stream or the connection closed. No deadline
        here: callers wrap reads in their own.
        """
        while not self._chunks and not self._eof and self._recv_error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._chunks:
            data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            return data
        if self._recv_error is not None:
            raise self._recv_error
        return b""

    # sending

    async def write(self, data: bytes | bytearray | memoryview, *, end: bool = False) -> None:
        """Queue ``data`` (and the FIN if ``end``), waiting while the stream holds more than
        a flow-control window of unacknowledged bytes. ConnectError if it cannot send."""
        view = memoryview(data).cast("B")
        chunk = self.owner.write_chunk
        while True:
            await self.owner.wait_send_room(self)
            part, view = view[:chunk], view[chunk:]
            last = not view.nbytes
            self._send(part, end=end and last)
            if last:
                return

    def write_nowait(self, data: bytes) -> None:
        """Queue a small frame now, without waiting for send room (control messages from
        callbacks). ConnectError if the stream cannot send."""
        self._send(data, end=False)

    def end(self) -> None:
        """Send the FIN (idempotent; a no-op once the stream cannot send)."""
        if not self._send_ended and self._send_error is None:
            self._send(b"", end=True)

    def abort(self, code: StreamCode = StreamCode.CANCELLED) -> None:
        """Reset our direction and ask the peer to stop sending (idempotent); what was
        received and not read is dropped."""
        self.owner.abort_stream(self, code)
        self._chunks.clear()

    def stop_receiving(self, code: StreamCode = StreamCode.CANCELLED) -> None:
        """We will read no more (the exchange is over): ask the peer to stop sending
        (STOP_SENDING), drop what is buffered, and drop whatever still arrives, which
        earns no more flow-control credit (quic_config.CreditedConnection). Our own
        direction is left as it is (idempotent)."""
        self._chunks.clear()
        if self.can_receive:
            self._recv_error = ConnectError(f"stopped reading stream {self.stream_id}")
            self.owner.stop_receiving(self, StreamCode(code))
            self._wake()

    def _send(self, data: bytes | memoryview, *, end: bool) -> None:
        if self._send_error is not None:
            raise self._send_error
        if self._send_ended:
            raise ConnectError(f"stream {self.stream_id} already ended")
        try:
            self.owner.send_stream_data(self.stream_id, data, end)
        except ConnectError as exc:
            self._send_error = exc
            raise
        self._send_ended = end

    # state

    @property
    def can_send(self) -> bool:
        return not self._send_ended and self._send_error is None

    @property
    def can_receive(self) -> bool:
        return not self._eof and self._recv_error is None

    @property
    def finished(self) -> bool:
        return not self.can_send and not self.can_receive

    @property
    def send_error(self) -> ConnectError | None:
        return self._send_error

    # called by the connection

    def on_data(self, data: bytes, end: bool) -> None:
        if not self.can_receive:
            self.bytes_discarded += len(data)
            return
        if data:
            self._chunks.append(data)
            self.bytes_received += len(data)
        if end:
            self._eof = True
        self._wake()

    def on_reset(self, code: int) -> None:
        if self.can_receive:
            self._recv_error = ConnectError(f"peer reset stream {self.stream_id} (code {code:#x})")
        self._wake()

    def on_stop(self, code: int) -> None:
        if self._send_error is None:
            self._send_error = ConnectError(
                f"peer stopped reading stream {self.stream_id} (code {code:#x})"
            )

    def on_closed(self, error: ConnectError) -> None:
        if self.can_receive:
            self._recv_error = error
        if self._send_error is None and not self._send_ended:
            self._send_error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
