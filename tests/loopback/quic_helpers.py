"""Helpers for loopback QUIC tests: configs with short deadlines, endpoints, a runner."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from wanswarm.transport.config import CongestionConfig, FecConfig, TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress
from wanswarm.transport.identity import Identity

T = TypeVar("T")


def config(**overrides: Any) -> TransportConfig:
    """Loopback settings: short deadlines so that failure tests stay fast."""
    fields: dict[str, Any] = {
        "host": "127.0.0.1",
        "connect_timeout_s": 3.0,
        "handshake_timeout_s": 3.0,
        "dead_peer_timeout_s": 1.5,
        "shutdown_timeout_s": 2.0,
        "request_receive_timeout_s": 20.0,
        "response_send_timeout_s": 20.0,
        # aioquic's Reno on plain loopback: congestion.py's controller divides by a zero
        # min RTT when uvloop's 1 ms clock makes an RTT sample 0.0 (reported); the WAN
        # test and test_congestion_adapter exercise it
        "congestion": CongestionConfig(algorithm="reno"),
    }
    fields.update(overrides)
    return TransportConfig(**fields)


def fec(enabled: bool = True, **overrides: Any) -> FecConfig:
    return FecConfig(enabled=enabled, **overrides)


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run a test coroutine on a fresh event loop with an overall deadline."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(bounded())


@asynccontextmanager
async def endpoint(
    cfg: TransportConfig | None = None, identity: Identity | None = None, port: int = 0
) -> AsyncIterator[Endpoint]:
    ep = Endpoint(identity or Identity.generate(), cfg or config())
    await ep.start("127.0.0.1", port)
    try:
        yield ep
    finally:
        await ep.close()


def address(ep: Endpoint) -> PeerAddress:
    host, port = ep.address
    return PeerAddress(ep.peer_id, host, port)
