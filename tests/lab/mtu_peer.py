"""One endpoint in a lab host, for test_path_mtu.py.

``serve``: print ``{peer_id, port}`` as a JSON line, then serve until stdin closes.
``dial <peer id> <host> <port>``: connect, wait until the connection's path MTU search
is over (every probe acknowledged or given up), and print the largest UDP payload it
sends the peer and the probe counters as a JSON line.
``dial <peer id> <host> <port> shrink``: the same, then wait for a line on stdin (the
test has made the path's MTU smaller), send three 400 KB echo requests one after the
other, and print their outcomes, how long each took, the largest UDP payload then, the
probe counters and whether the connection is still the first one, as a second JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import torch
from wanswarm.transport.config import TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.identity import Identity

SEARCH_S = 30.0  # six probes of at most 1 s each, with room
ECHO_FLOATS = 100 * 1024  # 400 KB each way: an FEC transfer at the default threshold
REQUESTS = 3


async def _echo(request: Request) -> Response:
    return Response(header={}, tensors=[t * 2 for t in request.tensors])


def _counts(ep: Endpoint) -> dict[str, int]:
    counts = ep._connections.socket.counts
    return {k: v for k, v in counts.items() if k.startswith("mtu_")}


async def serve() -> None:
    async with Endpoint(Identity.generate(), TransportConfig(host="0.0.0.0")) as ep:
        ep.register("echo", _echo)
        print(json.dumps({"peer_id": ep.peer_id, "port": ep.address[1]}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def dial(peer_id: str, host: str, port: int, shrink: bool) -> None:
    async with Endpoint(Identity.generate(), TransportConfig(host="0.0.0.0")) as ep:
        await ep.ping(PeerAddress(peer_id, host, port), timeout=10)
        socket = ep._connections.socket
        deadline = time.monotonic() + SEARCH_S
        # over: a probe acknowledged, or all six (two sizes, three tries) sent and settled
        while not socket.counts["mtu_probe.acked"] and (
            socket.counts["mtu_probe.sent"] < 6 or socket._mtu_probes
        ):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)  # the search adopts the size right after its last answer
        stats = ep.path_stats(peer_id)
        print(json.dumps({
            "max_udp_payload": stats.max_udp_payload if stats else None,
            "counts": _counts(ep),
        }), flush=True)
        if not shrink:
            return
        first = ep._connections.links()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        outcomes, seconds = [], []
        for _ in range(REQUESTS):
            payload = torch.randn(ECHO_FLOATS)
            started = loop.time()
            try:
                reply = await ep.request(PeerAddress(peer_id, host, port), "echo", {},
                                         [payload], timeout=30)
                outcomes.append("ok" if torch.equal(reply.tensors[0], payload * 2) else "wrong")
            except Exception as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
            seconds.append(round(loop.time() - started, 3))
        stats = ep.path_stats(peer_id)
        print(json.dumps({
            "outcomes": outcomes,
            "seconds": seconds,
            "max_udp_payload": stats.max_udp_payload if stats else None,
            "counts": _counts(ep),
            "same_connection": ep._connections.links() == first,
        }), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve())
    else:
        asyncio.run(dial(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:] == ["shrink"]))
