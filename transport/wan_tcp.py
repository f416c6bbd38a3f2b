"""The WAN emulator's TCP side: a relay whose byte streams cross the same two links as the
UDP datagrams.

A daemon speaks QUIC (UDP) for stage traffic and libp2p (TCP) for the DHT, hivemind's
all-reduce and state downloads. Behind one access link both share its rate and delay, so
the emulator relays both through the same ``LinkEmulator`` pair: each chunk a connection
reads becomes one item of the uplink (client to target) or the downlink (target to
client), queued behind whatever datagrams are there and delivered after the link's delay.

What a stream cannot take from the profile, it does not: a chunk is never lost (TCP would
retransmit it, which the kernel's loopback TCP below us does not need to), never dropped
by the queue and never reordered. Instead of dropping, a connection stops reading while the
link's queue is over its bound (``LinkEmulator.room``), so the sender's TCP window fills
and its flow control takes over, as behind a real bottleneck. Each connection also holds
at most ``max_in_flight`` bytes read but not yet delivered, which bounds the relay's memory
on a link without a rate limit. Loss therefore slows streams only through the datagrams
that share the link; that is the model's one simplification (say so where figures are
reported).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["StreamChunk", "TcpRelay"]

Address = tuple[str, int]
# Read size: small enough that a chunk's serialization time stays well under the link's
# delay at the slowest profile (16 KiB at 20 Mb/s: 6.5 ms), large enough to stay cheap.
CHUNK_BYTES = 16 * 1024
MAX_IN_FLIGHT_BYTES = 4 * 1024 * 1024
CONNECT_TIMEOUT_S = 10.0


class _Leg:
    """One direction of one relayed connection: what was read and not yet delivered."""

    __slots__ = ("delivered", "ended", "in_flight", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.in_flight = 0
        self.delivered = asyncio.Event()
        self.ended = asyncio.Event()  # the end of the stream crossed the link


class StreamChunk:
    """A link item: bytes of one connection's direction, or its end (``data`` empty)."""

    __slots__ = ("data", "leg")

    def __init__(self, leg: _Leg, data: bytes) -> None:
        self.leg = leg
        self.data = data

    def deliver(self) -> None:
        leg = self.leg
        leg.in_flight -= len(self.data)
        leg.delivered.set()
        if not self.data:
            leg.ended.set()
        writer = leg.writer
        if writer.is_closing():
            return
        try:
            if self.data:
                writer.write(self.data)
            elif writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()
        except (OSError, RuntimeError) as exc:  # the peer reset the connection meanwhile
            logger.debug("relay write failed: %s", exc)
            writer.close()


Submit = Callable[[StreamChunk, int, float], None]
Room = Callable[[float], float]


class TcpRelay:
    """Accepts TCP connections on ``listen`` and relays each to ``target``: client to target
    bytes through ``up`` (a submit and a room function of the uplink), target to client
    bytes through ``down``."""

    def __init__(
        self,
        target: Address,
        up: tuple[Submit, Room],
        down: tuple[Submit, Room],
        *,
        listen: Address = ("127.0.0.1", 0),
        max_connections: int = 1024,
        max_in_flight: int = MAX_IN_FLIGHT_BYTES,
    ) -> None:
        self.target = target
        self._up = up
        self._down = down
        self._listen = listen
        self._max_connections = max_connections
        self._max_in_flight = max_in_flight
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.address: Address | None = None
        self.connections = 0
        self.refused = 0
        self.connect_errors = 0
        self.bytes_up = 0
        self.bytes_down = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self._listen)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    def stats(self) -> dict[str, int]:
        return {
            "connections": self.connections,
            "open": len(self._writers) // 2,
            "refused": self.refused,
            "connect_errors": self.connect_errors,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
        }

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if len(self._writers) // 2 >= self._max_connections:
            self.refused += 1
            c_writer.close()
            return
        try:
            t_reader, t_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), CONNECT_TIMEOUT_S
            )
        except (TimeoutError, OSError) as exc:
            self.connect_errors += 1
            logger.debug("relay cannot reach %s:%d: %s", *self.target, exc)
            c_writer.close()
            return
        self.connections += 1
        self._writers |= {c_writer, t_writer}
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await asyncio.gather(
                self._pump(c_reader, _Leg(t_writer), self._up, up=True),
                self._pump(t_reader, _Leg(c_writer), self._down, up=False),
            )
        finally:
            for writer in (c_writer, t_writer):
                writer.close()
                self._writers.discard(writer)
            self._tasks.discard(task)

    async def _pump(
        self, reader: asyncio.StreamReader, leg: _Leg, link: tuple[Submit, Room], *, up: bool
    ) -> None:
        submit, room = link
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                while True:  # TCP's flow control: wait for room instead of dropping
                    wait = room(time.monotonic())
                    if leg.in_flight > self._max_in_flight:
                        leg.delivered.clear()
                        await leg.delivered.wait()
                    elif wait > 0.0:
                        await asyncio.sleep(max(wait, 0.001))
                    else:
                        break
                leg.in_flight += len(data)
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                submit(StreamChunk(leg, data), len(data), time.monotonic())
                if not data:  # the end crosses the link after the last bytes: wait for it
                    await leg.ended.wait()
                    return
        except (OSError, asyncio.IncompleteReadError) as exc:
            logger.debug("relay read failed: %s", exc)
            leg.writer.close()
