"""transport.fec: block layout and the RaptorQ adapter."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.transport.errors import FecError, FramingError
from wanswarm.transport.fec import (
    MAX_BLOCK_BYTES,
    MAX_BLOCK_SYMBOLS,
    MAX_BLOCKS,
    MAX_ESI,
    MAX_SYMBOL_SIZE,
    MIN_SYMBOL_SIZE,
    BlockDecoder,
    BlockEncoder,
    TransferLayout,
)

T = 1328  # the symbol size of a 1350-byte datagram


def _symbols(data: bytes, size: int) -> list[bytes]:
    padded = data + bytes(-len(data) % size)
    return [padded[i : i + size] for i in range(0, len(padded), size)]


# -- layout ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(1, 1 << 24),
    symbol_units=st.integers(MIN_SYMBOL_SIZE // 8, MAX_SYMBOL_SIZE // 8),
    block_symbols=st.integers(1, MAX_BLOCK_SYMBOLS),
)
def test_layout_partitions_payload_into_contiguous_near_equal_blocks(
    length: int, symbol_units: int, block_symbols: int
) -> None:
    symbol_size = symbol_units * 8
    try:
        layout = TransferLayout.from_peer(length, symbol_size, block_symbols, max_length=1 << 24)
    except FramingError:
        # Only the documented bounds may refuse a layout.
        assert (
            block_symbols * symbol_size > MAX_BLOCK_BYTES
            or math.ceil(math.ceil(length / symbol_size) / block_symbols) > MAX_BLOCKS
        )
        return
    ks = [layout.block_k(b) for b in range(layout.num_blocks)]
    assert sum(ks) == layout.num_symbols == -(-length // symbol_size)
    assert max(ks) - min(ks) <= 1 and max(ks) <= block_symbols and min(ks) >= 1
    assert ks == sorted(ks, reverse=True)
    position = 0
    for block in range(layout.num_blocks):
        assert layout.block_first_symbol(block) * symbol_size == position
        start, end = layout.block_span(block)
        assert start == position and end > start
        position = end
    assert position == length


def test_layout_plan_matches_peer_view_and_caps_block_bytes() -> None:
    layout = TransferLayout.plan(10_000_000, MAX_SYMBOL_SIZE, MAX_BLOCK_SYMBOLS)
    assert layout.block_symbols == MAX_BLOCK_BYTES // MAX_SYMBOL_SIZE  # capped by bytes
    peer = TransferLayout.from_peer(
        layout.length, layout.symbol_size, layout.block_symbols, max_length=1 << 30
    )
    assert peer == layout


@pytest.mark.parametrize(
    ("length", "symbol_size", "block_symbols"),
    [
        (0, T, 1024),  # empty
        (1001, T, 1024),  # longer than max_length
        (100, 63 * 8 + 1, 16),  # not aligned
        (100, MIN_SYMBOL_SIZE - 8, 16),  # too small a symbol
        (100, MAX_SYMBOL_SIZE + 8, 16),  # too large a symbol
        (100, T, 0),  # no symbols per block
        (100, T, MAX_BLOCK_SYMBOLS + 1),  # too many symbols per block
        (100, MAX_SYMBOL_SIZE, MAX_BLOCK_BYTES // MAX_SYMBOL_SIZE + 1),  # block too large
    ],
)
def test_layout_from_peer_rejects_out_of_bounds(
    length: int, symbol_size: int, block_symbols: int
) -> None:
    with pytest.raises(FramingError):
        TransferLayout.from_peer(length, symbol_size, block_symbols, max_length=1000)


def test_layout_rejects_too_many_blocks() -> None:
    with pytest.raises(FramingError, match="blocks"):
        TransferLayout.from_peer(64 * (MAX_BLOCKS + 1), 64, 1, max_length=1 << 40)
    with pytest.raises(FecError):
        TransferLayout.plan(0, T, 1024)


# -- encoder / decoder ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "symbol_size"),
    [
        (1, T),
        (3, 64),
        (MAX_BLOCK_SYMBOLS, MAX_BLOCK_BYTES // MAX_BLOCK_SYMBOLS),
        (MAX_BLOCK_BYTES // MAX_SYMBOL_SIZE, MAX_SYMBOL_SIZE),
    ],
)
def test_encoder_is_systematic_up_to_the_block_bounds(k: int, symbol_size: int) -> None:
    """Our receiver writes source symbols straight into place and skips decoding when all
    arrive: that needs RaptorQ's source symbols to be the block's slices, i.e. no
    sub-blocking, at the largest blocks we allow. Checked through the decoder: with one
    source symbol replaced by a repair symbol, the decoded block equals the data."""
    rng = random.Random(k)
    data = rng.randbytes(k * symbol_size - 5)
    encoder = BlockEncoder(data, symbol_size)
    assert encoder.k == k
    decoder = BlockDecoder(len(data), symbol_size)
    sources = _symbols(data, symbol_size)
    result = None
    for esi, symbol in enumerate(sources[1:], start=1):
        result = decoder.add(esi, symbol)
    assert result is None or k == 1
    (repair,) = encoder.repair_symbols(k, 1)
    result = decoder.add(k, repair)
    assert result == data


def test_decode_from_repair_symbols_only_and_from_random_subsets() -> None:
    rng = random.Random(7)
    data = rng.randbytes(200 * T + 17)
    encoder = BlockEncoder(data, T)
    k = encoder.k
    sources = _symbols(data, T)
    repairs = encoder.repair_symbols(k, k + 20)
    # Only repair symbols.
    decoder = BlockDecoder(len(data), T)
    results = [decoder.add(k + i, bytes(symbol)) for i, symbol in enumerate(repairs)]
    decoded = [r for r in results if r is not None]
    assert decoded and decoded[0] == data
    assert results.index(decoded[0]) <= k + 3  # k + a few symbols suffice
    # A random half of the sources and enough repairs, shuffled.
    pool = [(esi, s) for esi, s in enumerate(sources) if rng.random() < 0.5]
    pool += [(k + i, bytes(s)) for i, s in enumerate(repairs[: k - len(pool) + 2])]
    rng.shuffle(pool)
    decoder = BlockDecoder(len(data), T)
    outcome = None
    for esi, symbol in pool:
        outcome = decoder.add(esi, symbol) or outcome
    assert outcome == data


def test_repair_symbols_are_deterministic_and_disjoint_ranges_differ() -> None:
    data = random.Random(3).randbytes(50 * T)
    encoder = BlockEncoder(data, T)
    first = [bytes(s) for s in encoder.repair_symbols(50, 10)]
    again = [bytes(s) for s in encoder.repair_symbols(55, 10)]
    assert first[5:] == again[:5]
    assert len(set(first + again)) == 15
    assert encoder.repair_symbols(60, 0) == []
    assert all(len(s) == T for s in first)


def test_encoder_and_decoder_reject_bad_arguments() -> None:
    data = bytes(10 * T)
    encoder = BlockEncoder(data, T)
    with pytest.raises(FecError):
        encoder.repair_symbols(9, 1)  # a source ESI
    with pytest.raises(FecError):
        encoder.repair_symbols(MAX_ESI, 2)  # past the 24-bit ESI space
    with pytest.raises(FecError):
        encoder.repair_symbols(10, -1)
    with pytest.raises(FecError):
        BlockEncoder(b"", T)
    with pytest.raises(FecError):
        BlockEncoder(data, T + 1)
    with pytest.raises(FecError):
        BlockEncoder(bytes(MAX_BLOCK_BYTES + 1), MAX_SYMBOL_SIZE)
    decoder = BlockDecoder(len(data), T)
    with pytest.raises(FecError):
        decoder.add(0, bytes(T - 1))  # the binding would accept it and misdecode
    with pytest.raises(FecError):
        decoder.add(0, bytes(T + 1))
    with pytest.raises(FecError):
        decoder.add(MAX_ESI + 1, bytes(T))
    with pytest.raises(FecError):
        decoder.add(-1, bytes(T))
    with pytest.raises(FecError):
        BlockDecoder(0, T)


@settings(max_examples=100, deadline=None)
@given(esi=st.integers(0, MAX_ESI), symbol=st.binary(min_size=0, max_size=200))
def test_decoder_fed_garbage_raises_only_fec_error(esi: int, symbol: bytes) -> None:
    decoder = BlockDecoder(5 * 128 - 3, 128)
    try:
        result = decoder.add(esi, symbol)
    except FecError:
        assert len(symbol) != 128
        return
    assert result is None or len(result) == 5 * 128 - 3
