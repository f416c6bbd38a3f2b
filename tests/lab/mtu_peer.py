"""One endpoint in a lab host, for test_path_mtu.py.

``serve``: print ``{peer_id, port}`` as a JSON line, then serve until stdin closes.
``dial <peer id> <host> <port>``: connect, wait until the connection's path MTU search
is over (every probe acknowledged or given up), and print the largest UDP payload it
sends the peer and the probe counters as a JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from wanswarm.transport.config import TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress
from wanswarm.transport.identity import Identity

SEARCH_S = 30.0  # six probes of at most 1 s each, with room


async def serve() -> None:
    async with Endpoint(Identity.generate(), TransportConfig(host="0.0.0.0")) as ep:
        print(json.dumps({"peer_id": ep.peer_id, "port": ep.address[1]}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def dial(peer_id: str, host: str, port: int) -> None:
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
            "counts": {k: v for k, v in socket.counts.items() if k.startswith("mtu_")},
        }), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve())
    else:
        asyncio.run(dial(sys.argv[2], sys.argv[3], int(sys.argv[4])))
