"""Erasure-coded blocks: how a payload is cut into RaptorQ blocks, and the typed adapter
over the ``raptorq`` binding (the only module that imports it).

RaptorQ (RFC 6330) is a fountain code: a block of k source symbols yields source symbols
(encoding symbol ids, ESIs, 0..k-1, the data itself: the code is systematic) and any number
of repair symbols (ESIs k, k+1, ...); any k of them decode the block with probability
about 0.996, any k + h with about 1 - 1/256^(h+1).

Layout (:class:`TransferLayout`). A payload of ``length`` bytes is cut into
``ceil(length / symbol_size)`` symbols (the last one zero-padded) and the symbols into
``ceil(symbols / block_symbols)`` blocks whose sizes differ by at most one, first the
larger ones (RFC 6330 §4.4.1.2's Partition[]). A block is the contiguous byte range of
its symbols, so a received source symbol is written straight to its place in the output.
Sender and receiver derive the same layout from the three announced numbers.

The binding (``raptorq`` 2.0 on PyPI) exposes only whole-object ``Encoder`` and
``Decoder`` built by ``with_defaults(data, mtu)``, not the Rust crate's per-block
``SourceBlockEncoder::repair_packets(start, count)``. We encode each of our blocks as
one RaptorQ object, which is one RaptorQ source block without sub-blocking as long as
the block stays under the library's sub-block size (measured: about 10 MiB, e.g. 7855
symbols of 1328 bytes); :data:`MAX_BLOCK_BYTES` keeps a margin below that. Repair
symbols with ESIs [a, a+n) cost generating ESIs [k, a+n) and copying the k source
packets, because ``get_encoded_packets(r)`` always returns the source symbols and the
first r repairs; the expensive part, the precode, is done once per block. The binding
panics (a BaseException) on malformed packets and silently misdecodes ones of the wrong
length, so every input is checked here first; anything it raises becomes ``FecError``.
It holds the GIL while it works.

Throughput measured on this machine (Python 3.11, raptorq 2.0, 2 shared cores,
``process_time``, 1328-byte symbols; ``python benchmarks/fec.py``):

=========  ==================  ==========================  ==============
k          encoder (precode)   decode, 5% sources replaced  all sources
=========  ==================  ==========================  ==============
256        154 MB/s            215 MB/s                     1.6 GB/s
1024       213 MB/s            183 MB/s                     0.8 GB/s
4096       122 MB/s            111 MB/s                     0.5 GB/s
=========  ==================  ==========================  ==============

That was at load average ~3 on the 2 shared cores; at load ~9 the same benchmark gave
encoder 125 / 120 / 90 MB/s and decode (5%) 129 / 97 / 90 MB/s for k = 256 / 1024 / 4096.
The receiver in session.py never runs the decoder for a block whose source symbols all
arrived.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Final

import raptorq

from .errors import FecError, FramingError

logger = logging.getLogger(__name__)

SYMBOL_ALIGNMENT: Final[int] = 8
"""RaptorQ's default alignment: symbol sizes are multiples of it."""
MIN_SYMBOL_SIZE: Final[int] = 64
MAX_SYMBOL_SIZE: Final[int] = 16384
MAX_BLOCK_SYMBOLS: Final[int] = 4096
MAX_BLOCK_BYTES: Final[int] = 8 * 1024 * 1024
"""Largest block, bytes: below raptorq's default sub-block size (~10 MiB, measured)."""
MAX_BLOCKS: Final[int] = 65535
"""Blocks per transfer: block numbers are u16 on the wire."""
MAX_ESI: Final[int] = (1 << 24) - 1
"""Encoding symbol ids are 24-bit (RFC 6330 §3.2)."""

# RFC 6330 §3.2 FEC Payload ID as the binding reads it: SBN (u8, always 0 here) | ESI (u24).
_PAYLOAD_ID: Final[struct.Struct] = struct.Struct("!I")
_PAYLOAD_ID_BYTES: Final[int] = _PAYLOAD_ID.size


@dataclass(frozen=True, slots=True)
class TransferLayout:
    """How a payload of ``length`` bytes is cut into symbols and blocks.

    ``block_symbols`` is the cap the sender chose; actual blocks hold ``large_k`` or
    ``large_k - 1`` symbols. Build with :meth:`plan` (our own payload) or
    :meth:`from_peer` (numbers from a peer's header, validated).
    """

    length: int
    symbol_size: int
    block_symbols: int
    num_symbols: int
    num_blocks: int
    large_blocks: int
    large_k: int
    small_k: int

    @classmethod
    def _derive(cls, length: int, symbol_size: int, block_symbols: int) -> TransferLayout:
        num_symbols = -(-length // symbol_size)
        num_blocks = -(-num_symbols // block_symbols)
        # RFC 6330 §4.4.1.2 Partition[num_symbols, num_blocks].
        large_k = -(-num_symbols // num_blocks)
        small_k = num_symbols // num_blocks
        large_blocks = num_symbols - small_k * num_blocks
        return cls(
            length=length,
            symbol_size=symbol_size,
            block_symbols=block_symbols,
            num_symbols=num_symbols,
            num_blocks=num_blocks,
            large_blocks=large_blocks,
            large_k=large_k,
            small_k=small_k,
        )

    @staticmethod
    def _problem(length: int, symbol_size: int, block_symbols: int, max_length: int) -> str:
        """What is wrong with these numbers, or '' if they make a valid layout."""
        if not MIN_SYMBOL_SIZE <= symbol_size <= MAX_SYMBOL_SIZE:
            return f"symbol size {symbol_size} outside [{MIN_SYMBOL_SIZE}, {MAX_SYMBOL_SIZE}]"
        if symbol_size % SYMBOL_ALIGNMENT:
            return f"symbol size {symbol_size} is not a multiple of {SYMBOL_ALIGNMENT}"
        if not 1 <= length <= max_length:
            return f"length {length} outside [1, {max_length}]"
        cap = min(MAX_BLOCK_SYMBOLS, MAX_BLOCK_BYTES // symbol_size)
        if not 1 <= block_symbols <= cap:
            return f"{block_symbols} symbols per block outside [1, {cap}] for this symbol size"
        symbols = -(-length // symbol_size)
        blocks = -(-symbols // block_symbols)
        if blocks > MAX_BLOCKS:
            return f"{blocks} blocks, more than {MAX_BLOCKS}"
        return ""

    @classmethod
    def plan(cls, length: int, symbol_size: int, max_block_symbols: int) -> TransferLayout:
        """Our own layout for a payload; FecError if it cannot be coded (e.g. empty)."""
        block_symbols = max(1, min(max_block_symbols, MAX_BLOCK_BYTES // max(symbol_size, 1)))
        problem = cls._problem(length, symbol_size, block_symbols, MAX_BLOCKS * MAX_BLOCK_BYTES)
        if problem:
            raise FecError(f"cannot lay out payload: {problem}")
        return cls._derive(length, symbol_size, block_symbols)

    @classmethod
    def from_peer(
        cls, length: int, symbol_size: int, block_symbols: int, *, max_length: int
    ) -> TransferLayout:
        """Validate a layout announced by a peer; FramingError names the bad number."""
        problem = cls._problem(length, symbol_size, block_symbols, max_length)
        if problem:
            raise FramingError(f"bad FEC layout: {problem}")
        return cls._derive(length, symbol_size, block_symbols)

    def block_k(self, block: int) -> int:
        """Source symbols in ``block``."""
        return self.large_k if block < self.large_blocks else self.small_k

    def block_first_symbol(self, block: int) -> int:
        """Index (over the whole payload) of ``block``'s first source symbol."""
        if block < self.large_blocks:
            return block * self.large_k
        return self.large_blocks * self.large_k + (block - self.large_blocks) * self.small_k

    def block_span(self, block: int) -> tuple[int, int]:
        """Byte range [start, end) of ``block`` in the payload (the last one is short)."""
        start = self.block_first_symbol(block) * self.symbol_size
        end = min(start + self.block_k(block) * self.symbol_size, self.length)
        return start, end


def _check_block(length: int, symbol_size: int) -> None:
    if not MIN_SYMBOL_SIZE <= symbol_size <= MAX_SYMBOL_SIZE or symbol_size % SYMBOL_ALIGNMENT:
        raise FecError(f"unusable symbol size {symbol_size}")
    if not 1 <= length <= MAX_BLOCK_BYTES or -(-length // symbol_size) > MAX_BLOCK_SYMBOLS:
        raise FecError(f"unusable block of {length} bytes in {symbol_size}-byte symbols")


class BlockEncoder:
    """RaptorQ encoder of one block: runs the precode once, then makes repair symbols."""

    __slots__ = ("_encoder", "k", "symbol_size")

    def __init__(self, block: bytes, symbol_size: int) -> None:
        """``block``: the block's bytes (the last symbol may be short; it is zero-padded)."""
        _check_block(len(block), symbol_size)
        self.symbol_size = symbol_size
        self.k = -(-len(block) // symbol_size)
        try:
            self._encoder = raptorq.Encoder.with_defaults(block, symbol_size)
        except Exception as exc:  # the binding's TypeError/OverflowError/ValueError
            raise FecError(f"RaptorQ encoder rejected the block: {exc}") from exc
        except BaseException as exc:  # pyo3's PanicException derives from BaseException
            if type(exc).__name__ == "PanicException":
                raise FecError(f"RaptorQ encoder panicked: {exc}") from exc
            raise

    def repair_symbols(self, first_esi: int, count: int) -> list[memoryview]:
        """Repair symbols with ESIs ``first_esi .. first_esi + count - 1`` (each >= k).

        Each is a ``symbol_size``-byte view; the same ESI always gives the same bytes.
        """
        if count < 0 or first_esi < self.k or first_esi + count - 1 > MAX_ESI:
            raise FecError(f"repair ESIs [{first_esi}, {first_esi + count}) out of range")
        if count == 0:
            return []
        try:
            packets = self._encoder.get_encoded_packets(first_esi + count - self.k)
        except Exception as exc:
            raise FecError(f"RaptorQ encoder failed: {exc}") from exc
        except BaseException as exc:
            if type(exc).__name__ == "PanicException":
                raise FecError(f"RaptorQ encoder panicked: {exc}") from exc
            raise
        wanted = packets[first_esi:]
        if (
            len(wanted) != count
            or _PAYLOAD_ID.unpack_from(wanted[0])[0] != first_esi
            or len(wanted[-1]) != _PAYLOAD_ID_BYTES + self.symbol_size
        ):
            raise FecError("RaptorQ encoder returned an unexpected packet sequence")
        return [memoryview(p)[_PAYLOAD_ID_BYTES:] for p in wanted]


class BlockDecoder:
    """RaptorQ decoder of one block, fed one symbol at a time.

    Duplicates are harmless (the binding ignores them); callers that count symbols
    should filter them anyway.
    """

    __slots__ = ("_decoder", "block_length", "k", "symbol_size")

    def __init__(self, block_length: int, symbol_size: int) -> None:
        _check_block(block_length, symbol_size)
        self.block_length = block_length
        self.symbol_size = symbol_size
        self.k = -(-block_length // symbol_size)
        try:
            self._decoder = raptorq.Decoder.with_defaults(block_length, symbol_size)
        except Exception as exc:
            raise FecError(f"RaptorQ decoder rejected the block: {exc}") from exc

    def add(self, esi: int, symbol: bytes | bytearray | memoryview) -> bytes | None:
        """Add the symbol with id ``esi``; the block's bytes once it decodes, else None.

        FecError for a symbol of the wrong size or an ESI out of range (the caller drops
        it) and for anything the binding raises.
        """
        if len(symbol) != self.symbol_size:
            raise FecError(f"symbol of {len(symbol)} bytes, expected {self.symbol_size}")
        if not 0 <= esi <= MAX_ESI:
            raise FecError(f"ESI {esi} out of range")
        try:
            result: bytes | None = self._decoder.decode(_PAYLOAD_ID.pack(esi) + symbol)
        except Exception as exc:
            raise FecError(f"RaptorQ decoder failed: {exc}") from exc
        except BaseException as exc:
            if type(exc).__name__ == "PanicException":
                raise FecError(f"RaptorQ decoder panicked: {exc}") from exc
            raise
        if result is not None and len(result) != self.block_length:
            raise FecError(f"RaptorQ decoded {len(result)} bytes, expected {self.block_length}")
        return result


__all__ = [
    "MAX_BLOCKS",
    "MAX_BLOCK_BYTES",
    "MAX_BLOCK_SYMBOLS",
    "MAX_ESI",
    "MAX_SYMBOL_SIZE",
    "MIN_SYMBOL_SIZE",
    "SYMBOL_ALIGNMENT",
    "BlockDecoder",
    "BlockEncoder",
    "TransferLayout",
]
