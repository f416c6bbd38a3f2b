"""FEC transfers as sans-I/O state machines: a payload's symbols over QUIC DATAGRAM frames,
repair requests and completion over the request's stream.

No sockets, no asyncio, no clock: time comes in as ``now`` (seconds, any monotonic
origin) and every method returns what to send. The endpoint pumps them (see
:class:`SenderTransfer`, :class:`ReceiverTransfer`, and per connection
:class:`.datagram_router.DatagramRouter`). Formats are in :mod:`.session_wire`, the repair
budget in :mod:`.redundancy`, the code in :mod:`.fec`.

Protocol (one transfer; S sends a payload to R; ``seq`` numbers datagrams in send order)::

    S (SenderTransfer)                                   R (ReceiverTransfer)
    |-- stream: HEADER {transfer_id, length, symbol_size, block_symbols} ------->|
    |== datagrams: round 0, rows interleaved across blocks =====================>|
    |   (b0,esi0) (b1,esi0) ... (b0,esi1) (b1,esi1) ... sources, then            |
    |   r_b repair symbols per block (r_b from the path's loss estimate);        |
    |   the last datagram queued carries flag LAST                               |
    |                                         blocks with k symbols decode       |
    |                                         as they arrive; if all decode:     |
    |<-------------- stream: COMPLETION {seq_count, received, ...} --------------|
    |   stop; loss sample = 1 - received / seq_count                             |
    |                                                                            |
    |   otherwise R's timer fires (LAST seen + RTT/8, or no datagram for RTT/2): |
    |<-- stream: REPAIR_REQUEST {attempt, seq_count, received, (block, need)*} --|
    |   per block: fresh = budget(need) - queued - in flight (seq >= seq_count   |
    |   and sent less than an RTT ago: older unseen ones count as lost)          |
    |== datagrams: fresh repair symbols, new ESIs only, LAST on the last ========>|
    |                                    timer again; unanswered requests back   |
    |                                    off x2 and give up after N in a row     |
    |<-------------- stream: COMPLETION ------------------------------------------|

The sender has no timer: whatever is lost (tail datagrams, the LAST flag, a repair
request, repair symbols), the receiver's timer asks again, and the request's counts tell
the sender what is still in flight so that a spurious or repeated request costs little.
A lost completion costs only the rest of the sender's queue; the endpoint stops the
sender when the response arrives. Datagrams that arrive before their transfer's header
(its stream packet was lost) wait in the DatagramRouter's bounded early buffer.
"""

from __future__ import annotations

import bisect
import enum
import logging
from array import array
from collections import Counter, deque
from collections.abc import Iterator
from typing import Final

from .config import FecConfig
from .errors import FecError, FramingError
from .fec import MAX_ESI, BlockDecoder, BlockEncoder, TransferLayout
from .redundancy import (
    LossSample,
    block_target,
    budget_loss_rate,
    repair_count,
    symbols_needed,
)
from .session_wire import (
    DATAGRAM_HEADER,
    FLAG_LAST,
    MAX_REQUEST_ENTRIES,
    MAX_TRANSFER_ID,
    WIRE_VERSION,
    Completion,
    RepairRequest,
    SymbolDatagram,
    decode_control,
    decode_datagram,
    encode_control,
)

logger = logging.getLogger(__name__)

MAX_NEED_OVER_K: Final[int] = 16
"""A repair request may ask a block for at most k + this many symbols (the largest
decode_overhead a peer may be configured with)."""
MAX_EXPANSION: Final[int] = 8
"""A sender sends at most this many times (k + 16) symbols of a block, whatever a
receiver asks: bounds the bandwidth a confused or hostile receiver can draw."""
MAX_DECODE_EXTRA: Final[int] = 16
"""A block that still fails to decode with k + this many distinct symbols is corrupt
(RaptorQ fails with k + 16 symbols with probability ~1/256^17)."""


class TransferState(enum.Enum):
    ACTIVE = "active"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


def _interleave(counts: dict[int, int]) -> Iterator[int]:
    """Block numbers in row order: one symbol of each block per row, ascending blocks,
    so that a loss burst spreads over blocks instead of wiping one out."""
    left = dict(counts)
    active = sorted(b for b, n in left.items() if n > 0)
    while active:
        still = []
        for block in active:
            yield block
            left[block] -= 1
            if left[block]:
                still.append(block)
        active = still


class SenderTransfer:
    """Sending side of one transfer: yields symbol datagrams, serves repair requests.

    Drive it with :meth:`datagrams_to_send` while :attr:`pending` (as fast as the
    congestion controller lets datagrams out), :meth:`receive_control` with each CONTROL
    frame the receiver sends on the stream, and :meth:`stop` when the exchange ends some
    other way. ``payload`` is referenced, not copied: keep it unchanged until done.
    """

    def __init__(
        self,
        transfer_id: int,
        payload: bytes | bytearray | memoryview,
        symbol_size: int,
        config: FecConfig,
        loss_rate: float,
    ) -> None:
        if not 0 <= transfer_id <= MAX_TRANSFER_ID:
            raise FecError(f"transfer id {transfer_id} does not fit the datagram header")
        try:
            view = memoryview(payload).cast("B")
        except (TypeError, ValueError) as exc:
            raise FecError(f"payload is not a contiguous buffer: {exc}") from exc
        self.transfer_id = transfer_id
        self.layout = layout = TransferLayout.plan(len(view), symbol_size, config.max_block_symbols)
        self.state = TransferState.ACTIVE
        self.loss_sample: LossSample | None = None
        self.repair_requests = 0
        self.stale_requests = 0
        self.repair_symbols_sent = 0
        # stopped because its symbols no longer fit the path's datagrams (path_mtu.py)
        self.outgrown = False
        self._config = config
        self._view = view
        self._loss_rate = loss_rate
        blocks = layout.num_blocks
        p = budget_loss_rate(loss_rate, config)
        q = block_target(config.target_success, blocks)
        k = [layout.block_k(b) for b in range(blocks)]
        counts = {b: k[b] + repair_count(k[b], p, q, config.decode_overhead) for b in range(blocks)}
        self._k = k
        self._queued = [counts[b] for b in range(blocks)]
        self._sent = [0] * blocks
        self._next_source = [0] * blocks
        self._next_repair = list(k)
        self._ready: list[deque[memoryview]] = [deque() for _ in range(blocks)]
        self._encoders: list[BlockEncoder | None] = [None] * blocks
        self._next_precode = 0
        self._sources_sent = 0
        self._schedule: deque[Iterator[int]] = deque([_interleave(counts)])
        self._pending = sum(counts.values())
        self._seq_blocks = array("H")  # block of the datagram with seq i
        self._send_times = array("d")  # when the datagram with seq i was handed out
        self._last_attempt = 0
        self.initial_datagrams = self._pending

    # -- sending ---------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Datagrams queued and not yet handed out."""
        return self._pending

    @property
    def sent(self) -> int:
        """Datagrams handed out so far (the next seq)."""
        return len(self._seq_blocks)

    @property
    def done(self) -> bool:
        return self.state is not TransferState.ACTIVE

    def datagrams_to_send(self, limit: int, now: float) -> list[bytes]:
        """Up to ``limit`` datagrams, in send order; the last queued one is flagged LAST.

        ``now``: when they go out (hand them to QUIC right away); a repair request is
        answered knowing which datagrams could still be in flight."""
        out: list[bytes] = []
        size = self.layout.symbol_size
        pack = DATAGRAM_HEADER.pack
        while len(out) < limit and self._pending:
            block = self._next_block()
            esi = self._next_source[block]
            if esi < self._k[block]:
                self._next_source[block] = esi + 1
                self._sources_sent += 1
                start = (self.layout.block_first_symbol(block) + esi) * size
                symbol: bytes | memoryview = self._view[start : start + size]
                if len(symbol) < size:  # the payload's last symbol: zero-padded
                    symbol = bytes(symbol) + bytes(size - len(symbol))
            else:
                esi = self._next_repair[block]
                self._next_repair[block] = esi + 1
                symbol = self._repair_symbol(block, esi)
                self.repair_symbols_sent += 1
            self._pending -= 1
            self._queued[block] -= 1
            self._sent[block] += 1
            flags = 0 if self._pending else FLAG_LAST
            out.append(pack(WIRE_VERSION, flags, block, self.transfer_id, self.sent, esi) + symbol)
            self._seq_blocks.append(block)
            self._send_times.append(now)
        self._precode_ahead()
        return out

    def _next_block(self) -> int:
        while True:
            try:
                return next(self._schedule[0])
            except StopIteration:
                self._schedule.popleft()

    def _encoder(self, block: int) -> BlockEncoder:
        encoder = self._encoders[block]
        if encoder is None:
            start, end = self.layout.block_span(block)
            encoder = BlockEncoder(bytes(self._view[start:end]), self.layout.symbol_size)
            self._encoders[block] = encoder
        return encoder

    def _repair_symbol(self, block: int, esi: int) -> memoryview:
        ready = self._ready[block]
        if not ready:
            # All of this block's sources are out, so everything queued for it is a
            # repair: generate them in one call (each call copies the k source symbols).
            ready.extend(self._encoder(block).repair_symbols(esi, self._queued[block]))
        return ready.popleft()

    def _precode_ahead(self) -> None:
        """Run block precodes spread over the source phase rather than in one burst
        when the first repair row comes up (each costs ~5-10 ms per MB on this CPU)."""
        blocks = self.layout.num_blocks
        while (
            self._next_precode < blocks
            and self._sources_sent * blocks >= self._next_precode * self.layout.num_symbols
        ):
            block = self._next_precode
            self._next_precode += 1
            if self._queued[block] > self._k[block] - self._next_source[block]:
                self._encoder(block)

    # -- control from the receiver -----------------------------------------------------

    def receive_control(self, data: bytes | bytearray | memoryview, now: float, rtt: float) -> None:
        """Handle a CONTROL frame body from the receiver; ``rtt``: the path's smoothed RTT.

        FramingError (a ProtocolError: close the exchange with its code) if it is
        malformed or inconsistent with this transfer. Stale and duplicate repair requests
        are ignored, as is anything after the transfer ended.
        """
        message = decode_control(data)
        if message.transfer_id != self.transfer_id:
            raise FramingError(
                f"control message for transfer {message.transfer_id} on {self.transfer_id}'s stream"
            )
        if message.seq_count > self.sent or message.received > message.seq_count:
            raise FramingError(
                f"receiver reports {message.received} of {message.seq_count} datagrams, "
                f"{self.sent} sent"
            )
        if self.state is not TransferState.ACTIVE:
            return
        if isinstance(message, Completion):
            self._finish(TransferState.DONE)
            self.loss_sample = LossSample(message.seq_count, message.seq_count - message.received)
            return
        self._serve(message, now, rtt)

    def _serve(self, request: RepairRequest, now: float, rtt: float) -> None:
        if request.attempt <= self._last_attempt:
            self.stale_requests += 1
            return
        self._last_attempt = request.attempt
        self.repair_requests += 1
        observed = 1.0 - request.received / request.seq_count if request.seq_count else 0.0
        p = budget_loss_rate(max(self._loss_rate, observed), self._config)
        q = block_target(self._config.target_success, len(request.missing))
        # Still in flight when the receiver wrote the request: sent after the last datagram
        # it had seen, and less than an RTT ago (older ones would have arrived: lost).
        recent = bisect.bisect_right(self._send_times, now - rtt)
        in_flight = Counter(self._seq_blocks[max(request.seq_count, recent) :])
        fresh: dict[int, int] = {}
        for block, need in request.missing:
            if block >= self.layout.num_blocks or need > self._k[block] + MAX_NEED_OVER_K:
                raise FramingError(f"repair request for block {block} needs {need} symbols")
            underway = in_flight[block] + self._queued[block]
            count = symbols_needed(need, p, q) - underway
            allowed = min(
                MAX_EXPANSION * (self._k[block] + MAX_NEED_OVER_K)
                - self._sent[block]
                - self._queued[block],
                MAX_ESI + 1 - self._next_repair[block] - self._queued[block],
            )
            count = min(count, allowed)
            if count > 0:
                fresh[block] = count
                self._queued[block] += count
        if fresh:
            self._schedule.append(_interleave(fresh))
            self._pending += sum(fresh.values())
        logger.debug(
            "transfer %d: repair request %d for %d blocks, %d fresh symbols queued",
            self.transfer_id,
            request.attempt,
            len(request.missing),
            sum(fresh.values()),
        )

    def stop(self) -> None:
        """Stop sending (the exchange ended without a completion, or was abandoned)."""
        if self.state is TransferState.ACTIVE:
            self._finish(TransferState.STOPPED)

    def _finish(self, state: TransferState) -> None:
        self.state = state
        self._schedule.clear()
        self._pending = 0
        self._queued = [0] * self.layout.num_blocks
        self._ready = [deque() for _ in range(self.layout.num_blocks)]
        self._encoders = [None] * self.layout.num_blocks


class ReceiverTransfer:
    """Receiving side of one transfer: collects symbols, decodes, asks for repairs.

    Feed it every symbol datagram of its transfer (:meth:`receive_datagram`, or
    :meth:`receive_symbol` when already decoded, as the DatagramRouter does); when
    one returns True, send :meth:`completion` on the stream and take :meth:`result`.
    Call :meth:`handle_timer` at :meth:`timer` and send what it returns on the stream.
    """

    def __init__(
        self,
        transfer_id: int,
        layout: TransferLayout,
        config: FecConfig,
        *,
        now: float,
        rtt: float,
    ) -> None:
        """``layout`` from :meth:`TransferLayout.from_peer`; ``rtt``: smoothed, seconds."""
        if not 0 <= transfer_id <= MAX_TRANSFER_ID:
            raise FramingError(f"transfer id {transfer_id} does not fit the datagram header")
        self.transfer_id = transfer_id
        self.layout = layout
        self.state = TransferState.ACTIVE
        self.error: FecError | None = None
        self.received = 0
        self.duplicates = 0
        self.useless = 0
        self.malformed = 0
        self.requests_sent = 0
        self.seq_count = 0
        self._config = config
        self._rtt = max(0.0, rtt)
        blocks = layout.num_blocks
        self._out = bytearray(layout.num_symbols * layout.symbol_size)
        # Datagrams seen, by seq, grown on demand up to what an honest sender can send.
        self._max_seq = MAX_EXPANSION * (layout.num_symbols + MAX_NEED_OVER_K * blocks)
        self._seen = bytearray()
        self._have = bytearray(layout.num_symbols)  # 1 where the source symbol arrived
        self._sources = [0] * blocks
        self._count = [0] * blocks  # distinct symbols, source and repair
        self._complete = bytearray(blocks)
        self._blocks_left = blocks
        self._repair_esis: dict[int, set[int]] = {}
        self._held: dict[int, list[tuple[int, bytes]]] = {}  # repairs before decoding starts
        self._decoders: dict[int, BlockDecoder] = {}
        self._created = now
        self._last_arrival: float | None = None
        self._burst_ended = False
        self._request_time: float | None = None
        self._unanswered = 0
        self._attempt = 0

    @property
    def done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def failed(self) -> bool:
        return self.state is TransferState.FAILED

    def update_rtt(self, rtt: float) -> None:
        self._rtt = max(0.0, rtt)

    # -- datagrams ---------------------------------------------------------------------

    def receive_datagram(self, data: bytes | bytearray | memoryview, now: float) -> bool:
        """Take one datagram; True when it completed the transfer. Never raises for bad
        input: malformed datagrams are counted in :attr:`malformed` and dropped."""
        try:
            datagram = decode_datagram(data)
        except FramingError:
            self.malformed += 1
            return False
        return self.receive_symbol(datagram, now)

    def receive_symbol(self, d: SymbolDatagram, now: float) -> bool:
        """As :meth:`receive_datagram`, for a datagram already decoded."""
        layout = self.layout
        seq = d.seq
        if (
            d.transfer_id != self.transfer_id
            or d.block >= layout.num_blocks
            or len(d.symbol) != layout.symbol_size
            or seq >= self._max_seq
        ):
            self.malformed += 1
            return False
        if self.state is not TransferState.ACTIVE:
            self.useless += 1
            return False
        seqs = self._seen
        if seq >= len(seqs):
            seqs.extend(bytes(min(self._max_seq, max(seq + 1, 2 * len(seqs), 1024)) - len(seqs)))
        if seqs[seq]:
            self.duplicates += 1
            return False
        seqs[seq] = 1
        block, esi = d.block, d.esi
        self._last_arrival = now
        self._unanswered = 0
        if seq >= self.seq_count:
            self.seq_count = seq + 1
        if d.last:
            self._burst_ended = True
        if self._complete[block]:
            self.received += 1
            self.useless += 1
            return False
        k = layout.block_k(block)
        decoder = self._decoders.get(block)
        if esi < k:
            index = layout.block_first_symbol(block) + esi
            if self._have[index]:
                self.duplicates += 1
                return False
            self._have[index] = 1
            size = layout.symbol_size
            self._out[index * size : (index + 1) * size] = d.symbol
            self._sources[block] += 1
        else:
            seen = self._repair_esis.setdefault(block, set())
            if esi in seen:
                self.duplicates += 1
                return False
            seen.add(esi)
            if decoder is None:
                self._held.setdefault(block, []).append((esi, bytes(d.symbol)))
        self.received += 1
        self._count[block] += 1
        try:
            if self._sources[block] == k:
                return self._block_done(block, None)
            if self._count[block] < k:
                return False
            if decoder is None:
                return self._start_decoding(block)
            return self._block_done(block, decoder.add(esi, d.symbol))
        except FecError as exc:
            self._fail(FecError(f"block {block} undecodable: {exc}"))
            return False

    def _start_decoding(self, block: int) -> bool:
        layout = self.layout
        start, end = layout.block_span(block)
        decoder = BlockDecoder(end - start, layout.symbol_size)
        self._decoders[block] = decoder
        size = layout.symbol_size
        first = layout.block_first_symbol(block)
        result = None
        with memoryview(self._out) as out:  # released before _block_done may resize _out
            for esi in range(layout.block_k(block)):
                if self._have[first + esi]:
                    result = decoder.add(esi, out[(first + esi) * size : (first + esi + 1) * size])
        for esi, symbol in self._held.pop(block, []):
            if result is None:
                result = decoder.add(esi, symbol)
        return self._block_done(block, result)

    def _block_done(self, block: int, decoded: bytes | None) -> bool:
        """Record a block that completed (``decoded``: its bytes, or None when all its
        source symbols arrived). True when that was the transfer's last block."""
        if decoded is None and self._sources[block] < self.layout.block_k(block):
            if self._count[block] >= self.layout.block_k(block) + MAX_DECODE_EXTRA:
                raise FecError(f"{self._count[block]} symbols do not decode")
            return False
        if decoded is not None:
            start, _ = self.layout.block_span(block)
            self._out[start : start + len(decoded)] = decoded
        self._complete[block] = 1
        self._decoders.pop(block, None)
        self._held.pop(block, None)
        self._repair_esis.pop(block, None)
        self._blocks_left -= 1
        if self._blocks_left:
            return False
        self.state = TransferState.DONE
        del self._out[self.layout.length :]
        return True

    def _fail(self, error: FecError) -> None:
        logger.warning("transfer %d failed: %s", self.transfer_id, error)
        self.state = TransferState.FAILED
        self.error = error
        self._decoders.clear()
        self._held.clear()

    def result(self) -> bytearray:
        """The payload (the receive buffer itself, not a copy). FecError unless done."""
        if self.state is not TransferState.DONE:
            raise self.error or FecError(f"transfer {self.transfer_id} is not complete")
        return self._out

    def completion(self) -> bytes:
        """The COMPLETION control message to send once done."""
        if self.state is not TransferState.DONE:
            raise FecError(f"transfer {self.transfer_id} is not complete")
        return encode_control(
            Completion(
                self.transfer_id, self.seq_count, self.received, self.duplicates, self.useless
            )
        )

    # -- timer -------------------------------------------------------------------------

    def timer(self) -> float | None:
        """When :meth:`handle_timer` next has something to do; None once ended."""
        if self.state is not TransferState.ACTIVE:
            return None
        config, rtt = self._config, self._rtt
        idle = max(config.idle_rtt_fraction * rtt, config.min_timer)
        if self._unanswered and self._request_time is not None:
            due = self._request_time + (rtt + idle) * config.repair_backoff ** (
                self._unanswered - 1
            )
            if self._unanswered >= config.max_repair_requests:
                return min(due, self._give_up_at())
            return due
        if self._last_arrival is None:
            deadline = self._created + rtt + idle
        elif self._burst_ended:
            deadline = self._last_arrival + max(config.reorder_fraction * rtt, config.min_timer)
        else:
            deadline = self._last_arrival + idle
        if self._request_time is not None:  # nothing can answer a request within an RTT
            deadline = max(deadline, self._request_time + rtt)
        return deadline

    def _quiet_since(self) -> float:
        """The last datagram's arrival (the start, before any)."""
        return self._last_arrival if self._last_arrival is not None else self._created

    def _give_up_at(self) -> float:
        """When the transfer fails if its requests stay unanswered: ``give_up_after_s``
        after the last datagram."""
        return self._quiet_since() + self._config.give_up_after_s

    def handle_timer(self, now: float) -> bytes | None:
        """A REPAIR_REQUEST to send on the stream if blocks are still missing at the
        deadline; None otherwise. After ``max_repair_requests`` unanswered requests in a
        row, and ``give_up_after_s`` without a datagram, the transfer fails
        (:attr:`failed`, :attr:`error`) instead; until then the requests go on, backing
        off."""
        deadline = self.timer()
        if deadline is None or now < deadline:
            return None
        if self._unanswered >= self._config.max_repair_requests and now >= self._give_up_at():
            self._fail(FecError(f"{self._unanswered} repair requests went unanswered "
                                f"(no datagram for {now - self._quiet_since():.1f} s)"))
            return None
        overhead = self._config.decode_overhead
        missing = []
        for block in range(self.layout.num_blocks):
            if not self._complete[block]:
                k = self.layout.block_k(block)
                missing.append(
                    (block, min(k + overhead, max(1, k + overhead - self._count[block])))
                )
                if len(missing) == MAX_REQUEST_ENTRIES:
                    break
        self._attempt += 1
        self._unanswered += 1
        self._request_time = now
        self._burst_ended = False
        self.requests_sent += 1
        return encode_control(
            RepairRequest(
                self.transfer_id, self._attempt, self.seq_count, self.received, tuple(missing)
            )
        )


__all__ = [
    "ReceiverTransfer",
    "SenderTransfer",
    "TransferState",
]
