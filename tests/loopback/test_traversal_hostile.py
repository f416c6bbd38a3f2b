"""Traversal requests and relay packets from peers that do not play by the rules: each is
refused with a clear error code or dropped and counted, and nothing else is affected."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest
import torch
from wanswarm.transport.config import LimitsConfig, TransportConfig, TraversalConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.errors import RemoteError
from wanswarm.transport.identity import Identity
from wanswarm.transport.relay import encode_relay
from wanswarm.transport.traversal_wire import INTRODUCE, INTRODUCTION, RELAY, RELAY_OFFER

from ..waiting import async_wait_for
from .quic_helpers import address, config, endpoint, run
from .test_traversal import InboundFilter, _tensor, behind


async def _echo(request: Request) -> Response:
    return Response(header=dict(request.header), tensors=[t * 2 for t in request.tensors])


def _cfg(**traversal: Any) -> TransportConfig:
    return config(traversal=TraversalConfig(**{"punch_timeout_s": 5.0, **traversal}))


async def _refusal(ep: Endpoint, peer: PeerAddress, kind: str, header: dict[str, Any]) -> str:
    with pytest.raises(RemoteError) as info:
        await ep.request(peer, kind, header, timeout=10)
    return info.value.code


def _introduction(peer: str, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "peer": peer, "host": "127.0.0.1", "port": 9, "reachable": False,
        "nonce": os.urandom(16).hex(), "ts": time.time(),
    }
    fields.update(overrides)
    return fields


def test_introductions_and_relay_requests_for_unknown_or_bad_targets() -> None:
    async def main() -> None:
        async with endpoint() as r, endpoint() as a:
            stranger = Identity.generate().peer_id  # a valid id with no connection to r
            rv = address(r)
            assert await _refusal(a, rv, INTRODUCE, {"target": stranger, "reachable": False}) \
                == "unknown_peer"
            assert await _refusal(a, rv, RELAY, {"target": stranger}) == "unknown_peer"
            for bad in (
                {"target": "not-a-peer-id", "reachable": False},  # malformed id
                {"target": stranger},  # a field missing
                {"target": stranger, "reachable": "yes"},  # wrong type
                {"target": stranger, "reachable": False, "extra": 1},  # unknown field
                {"target": "x" * 20_000, "reachable": False},  # oversize
                {"target": a.peer_id, "reachable": False},  # itself
            ):
                assert await _refusal(a, rv, INTRODUCE, bad) == "bad_request", bad
            # the builtin kinds take no tensors: refused from the header, nothing read
            with pytest.raises(RemoteError) as info:
                await a.request(rv, "_observe", {}, [torch.ones(2)], timeout=10)
            assert info.value.code == "too_large"
            with pytest.raises(ValueError):
                a.register("_observe", _echo)  # node kinds cannot take the reserved names
            assert await a.observe(rv, timeout=10) == a.address  # still serving

    run(main())


def test_introductions_only_from_our_rendezvous_fresh_and_once() -> None:
    async def main() -> None:
        loose = config(limits=LimitsConfig(max_header_bytes=1 << 20))  # sends oversize headers
        async with endpoint(loose) as r, endpoint() as c, endpoint(_cfg()) as b:
            await b.keep(address(r), timeout=10)
            target = address(b)
            # from a peer that is not b's rendezvous
            assert await _refusal(c, target, INTRODUCTION, _introduction(c.peer_id)) == "refused"
            assert await _refusal(c, target, RELAY_OFFER, {
                "peer": c.peer_id, "token": "00" * 8, "nonce": "11" * 16, "ts": time.time(),
            }) == "refused"
            # from the rendezvous, but stale, replayed, malformed, oversize
            to_b = PeerAddress(b.peer_id, *b.address)
            fresh = _introduction(c.peer_id)
            assert (await r.request(to_b, INTRODUCTION, fresh, timeout=10)).header == {}
            assert await _refusal(r, to_b, INTRODUCTION, fresh) == "replayed"
            old = _introduction(c.peer_id, ts=time.time() - 3600)
            assert await _refusal(r, to_b, INTRODUCTION, old) == "stale"
            future = _introduction(c.peer_id, ts=time.time() + 3600)
            assert await _refusal(r, to_b, INTRODUCTION, future) == "stale"
            for bad in (
                _introduction(c.peer_id, nonce="zz" * 16),
                _introduction(c.peer_id, port=0),
                _introduction(c.peer_id, host="h" * 70_000),  # beyond max_header_bytes
                _introduction("12D3KooWbad"),
                {"peer": c.peer_id},
            ):
                code = await _refusal(r, to_b, INTRODUCTION, bad)
                assert code in {"bad_request", "too_large", "bad_frame"}, (code, bad)
            assert await _refusal(r, to_b, INTRODUCTION, _introduction(b.peer_id)) \
                == "bad_request"  # an introduction to itself

    run(main())


def test_floods_beyond_the_rate_limits_are_refused() -> None:
    async def main() -> None:
        limited = _cfg(introductions_per_minute=10, dialbacks_per_minute=1,
                       dialback_timeout_s=0.5)
        async with endpoint(limited) as r, endpoint() as a, endpoint(_cfg()) as b:
            await b.keep(address(r), timeout=10)
            codes = []
            for _ in range(8):
                try:
                    await a.request(address(r), INTRODUCE,
                                    {"target": b.peer_id, "reachable": False}, timeout=10)
                    codes.append("ok")
                except RemoteError as exc:
                    codes.append(exc.code)
            # a burst of 2 (a fifth of 10, at least 2), then refusals
            assert codes[:2] == ["ok", "ok"] and set(codes[2:]) == {"rate_limited"}, codes
            results: list[bool | str] = []
            for _ in range(4):
                try:
                    results.append(await a.dial_back(address(r), timeout=10))
                except RemoteError as exc:
                    results.append(exc.code)
            assert results[:2] == [True, True] and set(results[2:]) == {"rate_limited"}
            assert await a.observe(address(r), timeout=10) == a.address

    run(main())


def test_forged_relay_packets_are_dropped_without_effect() -> None:
    async def main() -> None:
        no_punch = _cfg(punch_packets=0)
        async with endpoint() as r, endpoint(no_punch) as a, endpoint(no_punch) as b:
            InboundFilter(a)
            InboundFilter(b)
            b.register("echo", _echo)
            await b.keep(address(r), timeout=10)
            peer_b = behind(b, r)
            await a.request(peer_b, "echo", {}, timeout=30)
            relay = r._traversal.relay
            assert relay is not None
            (channel,) = relay.channels
            before = channel.forwarded_packets
            forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                forger.bind(("127.0.0.1", 0))
                junk = os.urandom(1200)
                forger.sendto(encode_relay(os.urandom(8), junk), r.address)  # wrong token
                forger.sendto(encode_relay(channel.a.token, junk), r.address)  # wrong source
                forger.sendto(encode_relay(channel.b.token, junk), r.address)
                forger.sendto(b"\x21abc", r.address)  # truncated
                forger.sendto(b"\x05" + junk, r.address)  # neither QUIC nor ours
                forger.sendto(encode_relay(b"\0" * 8, junk), b.address)  # to an end
            finally:
                forger.close()
            sock = r._connections.socket  # loopback keeps order: the last one counted last
            await async_wait_for(lambda: sock.counts["dropped.not_quic"], 10, "forged packets")
            counts = r.traversal_counts()  # tokens of no channel of ours go to the end table
            assert counts["relay_end.dropped.unknown_token"] >= 1
            assert counts["relay.dropped.wrong_source"] == 2
            assert counts["relay_end.dropped.malformed"] == 1
            assert counts["socket.dropped.not_quic"] == 1
            assert channel.forwarded_packets >= before  # nothing forged was forwarded
            x = torch.randn(64)
            reply = await a.request(peer_b, "echo", {}, [x], timeout=30)  # still works
            assert torch.equal(_tensor(reply.tensors[0]), x * 2)
            assert a.paths()[b.peer_id] == "relayed"

    run(main())


def test_a_relay_without_room_refuses_and_a_relay_offer_to_a_peer_without_rendezvous() -> None:
    async def main() -> None:
        async with endpoint(_cfg(relay_channels_max=0)) as r, endpoint() as a, \
                endpoint() as b:
            await a.observe(address(r), timeout=10)
            await b.observe(address(r), timeout=10)  # connected, but r is not b's rendezvous
            assert await _refusal(a, address(r), RELAY, {"target": b.peer_id}) == "refused"
        async with endpoint() as r, endpoint() as a, endpoint() as b:
            await b.observe(address(r), timeout=10)
            assert await _refusal(a, address(r), RELAY, {"target": b.peer_id}) == "refused"
            assert r._traversal.relay is not None and r._traversal.relay.channels == []

    run(main())
