"""Hostile bytes over an authenticated connection: each bad stream gets an error code
or an abort, the connection and the server live on, and honest requests succeed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wanswarm.transport.codecs import CodecSpec, encode
from wanswarm.transport.connections import Connections
from wanswarm.transport.endpoint import Endpoint, Request, Response
from wanswarm.transport.errors import ConnectError, ProtocolError
from wanswarm.transport.framing import (
    PREFIX,
    WIRE_VERSION,
    FrameType,
    HeaderReceived,
    MessageHeader,
    StreamDecoder,
    encode_frame,
    encode_header,
    tensor_spec,
)
from wanswarm.transport.identity import Identity
from wanswarm.transport.quic_link import QuicLink
from wanswarm.transport.stream import QuicStream

from .quic_helpers import address, config

CFG = config(request_receive_timeout_s=2.0)


class _World:
    """A server endpoint, an honest client endpoint and a raw authenticated link, all on
    one event loop that lives across hypothesis examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.served = 0

        async def setup() -> tuple[Endpoint, Endpoint, Connections, QuicLink]:
            server = Endpoint(Identity.generate(), CFG)
            await server.start("127.0.0.1", 0)

            async def echo(request: Request) -> Response:
                self.served += 1
                return Response(header=request.header, tensors=list(request.tensors))

            server.register("echo", echo)
            honest = Endpoint(Identity.generate(), CFG)
            await honest.start("127.0.0.1", 0)
            raw = Connections(Identity.generate(), CFG, lambda link: None)
            await raw.start("127.0.0.1", 0)
            link = await raw.get(address(server))
            return server, honest, raw, link

        self.server, self.honest, self.raw, self.link = self.loop.run_until_complete(setup())

    def run(self, coro: object, timeout: float = 15.0) -> object:
        async def bounded() -> object:
            async with asyncio.timeout(timeout):
                return await coro  # type: ignore[misc]

        return self.loop.run_until_complete(bounded())

    def close(self) -> None:
        async def teardown() -> None:
            await self.raw.close(1)
            await self.honest.close()
            await self.server.close()

        self.loop.run_until_complete(teardown())
        self.loop.close()


@pytest.fixture(scope="module")
def world() -> Iterator[_World]:
    w = _World()
    try:
        yield w
    finally:
        w.close()


async def _outcome(stream: QuicStream) -> str:
    """What the server did with the stream: the error code it answered, or 'aborted'."""
    decoder = StreamDecoder(CFG.limits)
    try:
        while True:
            data = await stream.read()
            for event in decoder.feed(data) if data else decoder.feed_eof():
                if isinstance(event, HeaderReceived):
                    return event.header.error_code or event.header.type
    except ConnectError:
        return "aborted"
    except ProtocolError as exc:  # would be a server bug: it must send valid frames
        raise AssertionError(f"server sent an invalid frame: {exc}") from exc


async def _send_raw(world: _World, data: bytes) -> str:
    stream = world.link.open_stream()
    try:
        await stream.write(data, end=True)
    except ConnectError:
        return "aborted"
    return await _outcome(stream)


async def _honest_request(world: _World) -> None:
    x = torch.randn(100)
    reply = await world.honest.request(address(world.server), "echo", {"ok": 1}, [x], timeout=10)
    assert reply.header == {"ok": 1} and torch.equal(reply.tensors[0], x)  # type: ignore[arg-type]


def _header(**fields: object) -> bytes:
    obj = {"version": WIRE_VERSION, "type": "request", "request_id": 1, "kind": "echo"}
    obj.update(fields)
    return encode_frame(FrameType.HEADER, json.dumps(obj).encode())


_valid = encode(torch.randn(8), CodecSpec("none"))
_valid_frame = encode_header(
    MessageHeader(
        version=WIRE_VERSION, type="request", request_id=1, kind="echo",
        tensors=(tensor_spec(_valid),),
    ),
    CFG.limits,
)

_CASES = {
    "unknown version": (PREFIX.pack(7, 1, 2) + b"{}", "unsupported_version"),
    "oversize header": (PREFIX.pack(WIRE_VERSION, 1, 1 << 30), "too_large"),
    "truncated payload": (_valid_frame + _valid.payload[:-3], "truncated"),
    "shape mismatch": (
        _header(tensors=[{"shape": [4], "dtype": "float32", "codec": "none", "nbytes": 9}]),
        "bad_payload",
    ),
    "unknown codec": (
        _header(tensors=[{"shape": [4], "dtype": "float32", "codec": "lz4", "nbytes": 24}]),
        "bad_codec",
    ),
    "too many elements": (
        _header(tensors=[{"shape": [1 << 40], "dtype": "uint8", "codec": "none", "nbytes": 8}]),
        "too_large",
    ),
    "not a request": (_header(type="response"), "bad_frame"),
    "auth frame": (encode_frame(FrameType.AUTH, b"\x01\x01"), "bad_frame"),
    "control for no transfer": (
        encode_frame(FrameType.CONTROL, b"\x01\x02" + bytes(20)),
        "bad_frame",
    ),
    "garbage payload bytes": (
        _valid_frame + b"\x07" + _valid.payload[1:],
        "bad_codec",
    ),
    # the request itself is complete: the handler races the refusal of the junk after it
    "trailing data": (_valid_frame + _valid.payload + b"junk", "truncated|response"),
    "bad fec layout": (
        _header(tensors=[{
            "shape": [4], "dtype": "float32", "codec": "none", "nbytes": 24,
            "transport": "datagram", "transfer_id": 1, "symbol_size": 3, "block_symbols": 1,
        }]),
        "bad_frame",
    ),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_each_kind_of_bad_stream_gets_its_error_code(world: _World, name: str) -> None:
    data, code = _CASES[name]
    outcome = world.run(_send_raw(world, data))
    assert outcome in code.split("|")
    world.run(_honest_request(world))
    assert not world.link.is_closed


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.builds(lambda tail: _valid_frame + tail, st.binary(max_size=64)),
        st.builds(
            lambda cut, noise: _valid_frame[:cut] + noise,
            st.integers(0, len(_valid_frame)),
            st.binary(max_size=32),
        ),
    )
)
def test_random_hostile_streams(world: _World, data: bytes) -> None:
    outcome = world.run(_send_raw(world, data))
    assert outcome in ("aborted", "echo", "response") or outcome.isidentifier()
    assert not world.link.is_closed  # peer input never kills the connection
    world.run(_honest_request(world))


def test_abrupt_resets_mid_request(world: _World) -> None:
    async def reset_after_header() -> None:
        for cut in (3, len(_valid_frame), len(_valid_frame) + 5):
            stream = world.link.open_stream()
            await stream.write((_valid_frame + _valid.payload)[:cut])
            stream.abort()
        await _honest_request(world)

    world.run(reset_after_header())
    assert not world.link.is_closed
