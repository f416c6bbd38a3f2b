"""One connection's receiving side of FEC transfers: symbol datagrams to their transfers.

Sans-I/O like :mod:`.session`. The endpoint keeps one :class:`DatagramRouter` per QUIC
connection, hands it every DATAGRAM frame the connection delivers, registers a
:class:`~.session.ReceiverTransfer` when a header announces one, arms one timer at
:meth:`DatagramRouter.timer` and sends the repair requests :meth:`DatagramRouter.handle_timer`
returns on the transfers' streams.

A transfer's header travels on a stream, its symbols as datagrams: when the stream
packet carrying the header is lost, QUIC retransmits it about an RTT later while the
datagrams keep arriving. Those early datagrams are kept, bounded in bytes
(``early_buffer_bytes``) and age (``early_buffer_timeout``), and replayed when the
transfer is registered; datagrams for a recently removed transfer are counted as late;
malformed ones are counted. Nothing here raises for a peer's bytes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Final, NamedTuple

from .config import FecConfig
from .errors import FramingError
from .session import ReceiverTransfer
from .session_wire import decode_datagram

logger = logging.getLogger(__name__)


class TimerAction(NamedTuple):
    """What a timer expiry asks of the endpoint for one transfer: send ``request`` (a
    CONTROL frame body) on its stream, or, when ``request`` is None, fail it (it gave up:
    ``transfer.error``) and remove it."""

    transfer: ReceiverTransfer
    request: bytes | None


class DatagramRouter:
    """Routes one connection's symbol datagrams to its receiving transfers."""

    REMEMBERED: Final[int] = 1024
    """Removed transfer ids remembered, to tell late datagrams from early ones."""

    def __init__(self, config: FecConfig) -> None:
        self._config = config
        self._receivers: dict[int, ReceiverTransfer] = {}
        self._removed: OrderedDict[int, None] = OrderedDict()
        self._early: dict[int, deque[bytes]] = {}
        self._early_fifo: deque[tuple[float, int, int]] = deque()  # (arrival, id, bytes)
        self._early_bytes = 0
        self.malformed = 0
        self.late = 0
        self.early_dropped = 0

    def add(self, receiver: ReceiverTransfer, now: float) -> bool:
        """Register a transfer and replay its early datagrams; True if that completed it."""
        self._receivers[receiver.transfer_id] = receiver
        self._removed.pop(receiver.transfer_id, None)
        completed = False
        for data in self._early.pop(receiver.transfer_id, ()):
            self._early_bytes -= len(data)
            completed |= receiver.receive_datagram(data, now)
        return completed

    def remove(self, transfer_id: int) -> None:
        """Forget a transfer (done, failed or abandoned); its later datagrams are late."""
        self._receivers.pop(transfer_id, None)
        self._removed[transfer_id] = None
        if len(self._removed) > self.REMEMBERED:
            self._removed.popitem(last=False)

    def get(self, transfer_id: int) -> ReceiverTransfer | None:
        return self._receivers.get(transfer_id)

    def receive_datagram(
        self, data: bytes | bytearray | memoryview, now: float
    ) -> ReceiverTransfer | None:
        """Route one datagram; the transfer it completed, if it did (send its
        :meth:`~.session.ReceiverTransfer.completion`, take its result, remove it)."""
        try:
            datagram = decode_datagram(data)
        except FramingError:
            self.malformed += 1
            return None
        receiver = self._receivers.get(datagram.transfer_id)
        if receiver is not None:
            return receiver if receiver.receive_symbol(datagram, now) else None
        if datagram.transfer_id in self._removed:
            self.late += 1
        else:
            self._keep_early(datagram.transfer_id, bytes(data), now)
        return None

    def _keep_early(self, transfer_id: int, data: bytes, now: float) -> None:
        fifo = self._early_fifo
        while fifo and fifo[0][0] + self._config.early_buffer_timeout <= now:
            _, old_id, size = fifo.popleft()
            queue = self._early.get(old_id)
            if queue:  # else already replayed by add()
                queue.popleft()
                self._early_bytes -= size
                self.early_dropped += 1
                if not queue:
                    del self._early[old_id]
        if self._early_bytes + len(data) > self._config.early_buffer_bytes:
            self.early_dropped += 1
            return
        self._early.setdefault(transfer_id, deque()).append(data)
        fifo.append((now, transfer_id, len(data)))
        self._early_bytes += len(data)

    def timer(self) -> float | None:
        """Earliest deadline among the registered transfers; None if none is pending."""
        deadlines = [t for r in self._receivers.values() if (t := r.timer()) is not None]
        return min(deadlines, default=None)

    def handle_timer(self, now: float) -> list[TimerAction]:
        """Repair requests due now, and transfers that gave up, in registration order."""
        actions = []
        for receiver in list(self._receivers.values()):
            was_failed = receiver.failed
            request = receiver.handle_timer(now)
            if request is not None:
                actions.append(TimerAction(receiver, request))
            elif receiver.failed and not was_failed:
                actions.append(TimerAction(receiver, None))
        return actions


__all__ = ["DatagramRouter", "TimerAction"]
