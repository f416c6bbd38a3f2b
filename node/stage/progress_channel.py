"""The libp2p channel that carries a stage's progress pushes (progress_push.py).

One :class:`ProgressChannel` per progress tracker built with a push book (membership/dht.py;
the collaborative optimizer passes one when ``averaging.push_progress`` is on), pumped on the
tracker's own event loop: it opens a replica of the DHT's p2pd client, registers the stream
handler ``{prefix}_progress_push`` and, whenever this replica's count changes
(``notify``, from any thread), sends the newest count to every other replica that has a
progress record (at most :data:`MAX_TARGETS`, each send bounded by :data:`SEND_TIMEOUT_S`).
Counts that change while a push is under way are coalesced into the next one. What arrives
goes through the tracker's :class:`~.progress_push.PushBook`: a read bounded in bytes and
time, at most :data:`MAX_OPEN_STREAMS` read at once, and the book's screening.

A push that fails costs nothing but its count (``failed``): the DHT's records still carry
every count, only later. The channel never raises into the tracker: a setup that fails is
logged once and leaves the tracker on the DHT alone.

hivemind internals relied on (pinned hivemind==1.1.12; tests/unit/test_hivemind_internals.py):
``DHT._get_p2p_daemon_listen_maddr`` through ``DHT.run_coroutine``, ``P2P.replicate``,
``P2P.add_binary_stream_handler`` / ``remove_binary_stream_handler``, and the stream-open
request of the daemon's control protocol (``P2P._client.control.daemon_connector``,
``p2pd_pb2``, ``write_pbmsg``, ``read_pbmsg_safe``, ``raise_if_failed``): hivemind's own
``call_binary_stream_handler`` leaves its connection to the daemon open when the peer has no
such handler (a replica that has not registered it yet, or has just left), and an unclosed
socket per failed push would pile up (:func:`_open_stream` closes it).
"""

from __future__ import annotations

import asyncio
import contextlib
import pkgutil
import time
from typing import Any

import hivemind.utils.multiaddr.codecs as multiaddr_codecs
from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import (
    ControlFailure,
    raise_if_failed,
    read_pbmsg_safe,
    write_pbmsg,
)
from hivemind.proto import p2pd_pb2

from ..logs import get_logger
from .progress_push import PUSH_BYTES, PushedCount, encode_push

log = get_logger(__name__)


def _import_multiaddr_codecs() -> None:
    """Import every multiaddr codec now, on the importing (main) thread. hivemind imports
    them lazily, the first time an address is printed or parsed: a channel that did so on
    its tracker's thread while the main thread forked another optimizer's averager left the
    child waiting for good on the module lock that thread held (a test's second optimizer
    hung in its averager's start, inside ``Multiaddr.__repr__``). The channel's own hivemind
    imports are at the top of this module for the same reason."""
    for module in pkgutil.iter_modules(multiaddr_codecs.__path__):
        multiaddr_codecs.codec_by_name(module.name)


_import_multiaddr_codecs()

HANDLER_SUFFIX = "_progress_push"
SETUP_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 2.0
MAX_TARGETS = 16
MAX_OPEN_STREAMS = 32
SHUTDOWN_POLL_S = 0.25


class ProgressChannel:
    """Pushes this replica's count to the stage's other replicas and takes theirs."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self.sent = 0
        self.failed = 0
        self.dropped_streams = 0  # over MAX_OPEN_STREAMS at once
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wanted: asyncio.Event | None = None

    @property
    def name(self) -> str:
        return f"{self._tracker.prefix}{HANDLER_SUFFIX}"

    def notify(self) -> None:
        """This replica's count changed (any thread): push it soon."""
        loop, wanted = self._loop, self._wanted
        if loop is None or wanted is None:
            return
        with contextlib.suppress(RuntimeError):  # the tracker's loop is closing
            loop.call_soon_threadsafe(wanted.set)

    def status(self) -> dict[str, Any]:
        book = self._tracker.push_book
        out: dict[str, Any] = {"sent": self.sent, "failed": self.failed}
        if book is not None:
            out.update(book.status())
        return out

    async def run(self) -> None:
        """Until the tracker shuts down (module docstring); never raises."""
        try:
            await self._run()
        except Exception as exc:  # a task boundary: the tracker goes on with the DHT alone
            log.warning("%s: progress pushes stopped: %s: %s",
                        self._tracker.prefix, type(exc).__name__, exc)

    async def _run(self) -> None:
        tracker = self._tracker
        shutdown = tracker.shutdown_triggered
        loop = asyncio.get_running_loop()
        after = getattr(tracker, "pushes_after", None)  # membership/dht.py: no setup during
        while after is not None and not after.is_set():  # the optimizer's averager forks
            if shutdown.is_set():
                return
            await asyncio.sleep(SHUTDOWN_POLL_S)
        try:
            maddr = await asyncio.wait_for(
                loop.run_in_executor(
                    None, tracker.dht.run_coroutine,
                    type(tracker.dht)._get_p2p_daemon_listen_maddr,
                ),
                SETUP_TIMEOUT_S,
            )
            p2p = await asyncio.wait_for(P2P.replicate(maddr), SETUP_TIMEOUT_S)
        except (OSError, TimeoutError, RuntimeError, ValueError, EOFError) as exc:
            log.warning("%s: no progress pushes (cannot reach the DHT's p2pd: %s); "
                        "counts travel through the DHT only", tracker.prefix, exc)
            return
        try:
            await asyncio.wait_for(
                p2p.add_binary_stream_handler(self.name, self._on_push), SETUP_TIMEOUT_S
            )
            self._wanted = asyncio.Event()
            self._loop = loop
            self._wanted.set()  # the current count, once
            while not shutdown.is_set():
                try:
                    await asyncio.wait_for(self._wanted.wait(), SHUTDOWN_POLL_S)
                except TimeoutError:
                    continue
                self._wanted.clear()
                await self._push(p2p)
        finally:
            self._loop = None
            with contextlib.suppress(Exception):  # the daemon may be gone already
                await asyncio.wait_for(p2p.remove_binary_stream_handler(self.name), 2.0)
            await p2p.shutdown()

    async def _push(self, p2p: Any) -> None:
        tracker = self._tracker
        local = tracker.local_progress
        data = encode_push(PushedCount(
            seq=time.time_ns(), epoch=int(local.epoch), samples=float(local.samples_accumulated)
        ))
        targets = list(tracker.replica_records)[:MAX_TARGETS]
        if targets:
            await asyncio.gather(*(self._send(p2p, peer, data) for peer in targets))

    async def _send(self, p2p: Any, peer: bytes, data: bytes) -> None:
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                writer = await _open_stream(p2p, PeerID(peer), self.name)
                try:
                    writer.write(data)
                    await writer.drain()
                finally:
                    writer.close()
            self.sent += 1
        except (OSError, TimeoutError, ValueError, ControlFailure, P2PDaemonError,
                P2PHandlerError) as exc:
            self.failed += 1
            log.debug("%s: progress push to a replica failed: %s", self._tracker.prefix, exc)

    async def _on_push(self, info: Any, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        try:
            if self._open >= MAX_OPEN_STREAMS:
                self.dropped_streams += 1
                return
            self._open += 1
            try:
                data = await asyncio.wait_for(reader.readexactly(PUSH_BYTES), READ_TIMEOUT_S)
            except asyncio.IncompleteReadError as exc:
                data = exc.partial  # refused as malformed below
            except (TimeoutError, OSError):
                data = b""
            finally:
                self._open -= 1
            tracker = self._tracker
            book = tracker.push_book
            if book is None:
                return
            book.accept(
                info.peer_id.to_bytes(), data, known=tracker.replica_records.keys(),
                local_epoch=int(tracker.local_progress.epoch), now=time.monotonic(),
            )
        finally:
            writer.close()



async def _open_stream(p2p: Any, peer: Any, proto: str) -> asyncio.StreamWriter:
    """A stream to ``proto`` at ``peer`` through the daemon (its control protocol's
    STREAM_OPEN, as hivemind's ``call_binary_stream_handler`` sends it), with the daemon
    connection closed whenever the open fails or is cancelled."""
    control = p2p._client.control
    _reader, writer = await control.daemon_connector.open_connection()
    try:
        request = p2pd_pb2.Request(
            type=p2pd_pb2.Request.STREAM_OPEN,
            streamOpen=p2pd_pb2.StreamOpenRequest(peer=peer.to_bytes(), proto=[proto]),
        )
        await write_pbmsg(writer, request)
        response = p2pd_pb2.Response()
        await read_pbmsg_safe(_reader, response)
        raise_if_failed(response)
    except BaseException:
        writer.close()
        raise
    return writer
