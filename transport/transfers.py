"""FEC transfers on one connection: the asyncio pump around session.py.

One :class:`TransferHub` per authenticated connection. Sending: each
:class:`~.session.SenderTransfer` becomes a datagram source of the connection, which
pulls symbols only as its congestion window has room (quic_link.py). Receiving: every
DATAGRAM frame goes to the connection's :class:`~.datagram_router.DatagramRouter`; a
transfer announced by a message header is registered with :meth:`TransferHub.expect`,
its COMPLETION and REPAIR_REQUEST messages go out as CONTROL frames on the stream that
announced it, and its payload (or its failure) resolves a future.

The router's deadlines only move later as datagrams arrive, except when one carries
the LAST flag (the end of a burst: the receiver then waits just RTT/8 for stragglers),
so the one timer is re-armed on registration, on LAST datagrams and after it fires.
"""

from __future__ import annotations

import asyncio
import logging

from .budget import InboundBudget
from .config import TransportConfig
from .datagram_router import DatagramRouter
from .errors import FecError, FramingError
from .fec import TransferLayout
from .framing import FrameType, TensorSpec, encode_frame
from .quic_link import QuicLink
from .redundancy import LossEstimator
from .session import ReceiverTransfer, SenderTransfer
from .session_wire import FLAG_LAST, MAX_TRANSFER_ID, symbol_size_for
from .stream import QuicStream

logger = logging.getLogger(__name__)

_DEFAULT_RTT = 0.1  # before the connection has a measurement (aioquic's initial RTT)


class _Source:
    """A sender transfer as a datagram source of the connection."""

    def __init__(self, transfer: SenderTransfer) -> None:
        self.transfer = transfer

    def next_datagrams(self, max_size: int, count: int, now: float) -> list[bytes]:
        if self.transfer.done or not self.transfer.pending:
            return []
        return self.transfer.datagrams_to_send(count, now)


class _Incoming:
    def __init__(self, receiver: ReceiverTransfer, stream: QuicStream) -> None:
        self.receiver = receiver
        self.stream = stream
        self.future: asyncio.Future[bytearray] = asyncio.get_running_loop().create_future()


class TransferHub:
    """Sending and receiving FEC transfers on one connection."""

    def __init__(
        self,
        link: QuicLink,
        config: TransportConfig,
        loss: LossEstimator,
        budget: InboundBudget | None = None,
    ) -> None:
        self.link = link
        self.config = config
        self.loss = loss
        # the node's budget, shared by every connection (None: this connection's only)
        self.budget = budget
        self._loop = asyncio.get_running_loop()
        self._router = DatagramRouter(config.fec)
        self._incoming: dict[int, _Incoming] = {}
        self._sources: dict[int, _Source] = {}
        self._next_id = 0
        self._inflight = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        link.on_datagram = self._on_datagram
        link.on_closed.append(self._on_link_closed)
        link.on_payload_lowered.append(self._on_payload_lowered)

    def reserve(self, nbytes: int) -> None:
        """Count a message's payload against the connection's in-flight budget
        (``limits.max_inflight_bytes``) and the node's (``limits.max_inbound_bytes``),
        before anything is allocated; FramingError with code ``busy`` (nothing reserved)
        beyond either."""
        limit = self.config.limits.max_inflight_bytes
        if self._inflight + nbytes > limit:
            raise FramingError(
                f"{self._inflight} payload bytes already in flight on this connection, "
                f"{nbytes} more exceed max_inflight_bytes={limit}",
                code="busy",
            )
        if self.budget is not None:
            self.budget.reserve(nbytes)
        self._inflight += nbytes

    def release(self, nbytes: int) -> None:
        nbytes = min(nbytes, self._inflight)
        self._inflight -= nbytes
        if self.budget is not None:
            self.budget.release(nbytes)

    def rtt(self) -> float:
        rtt = self.link.stats().smoothed_rtt
        return rtt if rtt > 0 else _DEFAULT_RTT

    # -- sending -------------------------------------------------------------------------

    def can_send(self) -> bool:
        """Whether the peer takes DATAGRAM frames large enough for FEC symbols."""
        return self._largest_symbol() is not None

    def _largest_symbol(self) -> int | None:
        """The largest FEC symbol one of the connection's datagrams carries now; None when
        the peer takes no DATAGRAM frames large enough for one."""
        size = self.link.max_datagram_payload
        if size is None:
            return None
        try:
            return symbol_size_for(size)
        except FecError:
            return None

    def send(
        self, payload: bytes | memoryview
    ) -> tuple[SenderTransfer, tuple[int, int, int]]:
        """Start sending ``payload``; also returns (transfer id, symbol size, block symbols)
        for its header entry. Symbols go out once the header is on the stream."""
        size = self.link.max_datagram_payload
        if size is None:
            raise FecError("the peer does not accept DATAGRAM frames")
        transfer_id = self._next_id
        self._next_id = (self._next_id + 1) % (MAX_TRANSFER_ID + 1)
        transfer = SenderTransfer(
            transfer_id, payload, symbol_size_for(size), self.config.fec, self.loss.loss_rate
        )
        layout = transfer.layout
        return transfer, (transfer_id, layout.symbol_size, layout.block_symbols)

    def start(self, transfer: SenderTransfer) -> None:
        """Let the connection pull the transfer's symbols."""
        source = _Source(transfer)
        self._sources[transfer.transfer_id] = source
        self.link.add_datagram_source(source)

    def control(self, transfer: SenderTransfer, body: bytes) -> None:
        """A CONTROL frame from the receiver of ``transfer`` (FramingError if malformed)."""
        was_done = transfer.done
        transfer.receive_control(body, self._loop.time(), self.rtt())
        if transfer.done and not was_done:
            self.finish(transfer)
        elif transfer.pending:
            self.link.schedule_transmit()

    def finish(self, transfer: SenderTransfer) -> None:
        """Stop ``transfer`` (if still active) and fold its loss sample into the path's."""
        transfer.stop()
        source = self._sources.pop(transfer.transfer_id, None)
        if source is not None:
            self.link.remove_datagram_source(source)
        if transfer.loss_sample is not None:
            self.loss.add(transfer.loss_sample)

    # -- receiving ----------------------------------------------------------------------

    def expect(self, spec: TensorSpec, stream: QuicStream) -> asyncio.Future[bytearray]:
        """Register the transfer a header announced; its future gets the payload."""
        if spec.transfer_id is None or spec.symbol_size is None or spec.block_symbols is None:
            raise FramingError("tensor is not a datagram transfer")
        if spec.transfer_id in self._incoming:
            raise FramingError(f"transfer {spec.transfer_id} is already under way")
        layout = TransferLayout.from_peer(
            spec.nbytes,
            spec.symbol_size,
            spec.block_symbols,
            max_length=self.config.limits.max_message_bytes,
        )
        now = self._loop.time()
        receiver = ReceiverTransfer(
            spec.transfer_id, layout, self.config.fec, now=now, rtt=self.rtt()
        )
        incoming = _Incoming(receiver, stream)
        self._incoming[spec.transfer_id] = incoming
        if self._router.add(receiver, now):
            self._complete(incoming)
        self._arm()
        return incoming.future

    def abandon(self, transfer_id: int) -> None:
        """Forget an incoming transfer whose exchange ended."""
        incoming = self._incoming.pop(transfer_id, None)
        if incoming is not None:
            self._router.remove(transfer_id)
            if not incoming.future.done():
                incoming.future.cancel()

    def _on_datagram(self, data: bytes) -> None:
        receiver = self._router.receive_datagram(data, self._loop.time())
        if receiver is not None:
            incoming = self._incoming.get(receiver.transfer_id)
            if incoming is not None:
                self._complete(incoming)
        elif len(data) > 1 and data[1] & FLAG_LAST:
            self._arm()

    def _complete(self, incoming: _Incoming) -> None:
        transfer_id = incoming.receiver.transfer_id
        self._incoming.pop(transfer_id, None)
        self._router.remove(transfer_id)
        try:
            incoming.stream.write_nowait(
                encode_frame(FrameType.CONTROL, incoming.receiver.completion())
            )
        except Exception as exc:  # the stream is gone: its exchange fails on its own
            logger.debug("completion of transfer %d not sent: %s", transfer_id, exc)
        if not incoming.future.done():
            incoming.future.set_result(incoming.receiver.result())

    def _arm(self) -> None:
        deadline = self._router.timer()
        if deadline is None:
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = self._loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        rtt = self.rtt()
        for incoming in self._incoming.values():
            incoming.receiver.update_rtt(rtt)
        for action in self._router.handle_timer(self._loop.time()):
            incoming_ = self._incoming.get(action.transfer.transfer_id)
            if incoming_ is None:
                continue
            if action.request is None:  # gave up
                self._incoming.pop(action.transfer.transfer_id, None)
                self._router.remove(action.transfer.transfer_id)
                if not incoming_.future.done():
                    error = action.transfer.error or FecError("transfer failed")
                    incoming_.future.set_exception(error)
                continue
            try:
                incoming_.stream.write_nowait(encode_frame(FrameType.CONTROL, action.request))
            except Exception as exc:
                logger.debug("repair request not sent: %s", exc)
        self._arm()

    def _on_payload_lowered(self, link: QuicLink) -> None:
        """The connection sends smaller datagrams from now on (path_mtu.py found its larger
        size lost on the path): transfers whose symbols no longer fit one stop sending.
        Their receivers ask for repairs that go unanswered and fail them (bounded by
        ``fec.max_repair_requests``); a request whose own transfer failed that way is sent
        again by the endpoint (its handler never ran), a response's fails its exchange.
        What is sent from now on is cut into symbols of the new size."""
        largest = self._largest_symbol() or 0
        for transfer_id, source in list(self._sources.items()):
            if source.transfer.layout.symbol_size > largest:
                logger.info("transfer %d stopped: its %d-byte symbols no longer fit the "
                            "path's datagrams", transfer_id, source.transfer.layout.symbol_size)
                source.transfer.outgrown = True
                self.finish(source.transfer)

    def _on_link_closed(self, link: QuicLink) -> None:
        error = link.closed_error()
        for incoming in self._incoming.values():
            if not incoming.future.done():
                incoming.future.set_exception(error)
        self._incoming.clear()
        for source in self._sources.values():
            source.transfer.stop()
        self._sources.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def fec_worthwhile(nbytes: int, config: TransportConfig) -> bool:
    """Whether a payload of ``nbytes`` should travel as an FEC transfer."""
    return config.fec.enabled and nbytes >= max(1, config.fec.threshold_bytes)
