"""One endpoint in a lab host, for test_mapping.py.

``serve``: print ``{peer_id, port}`` as a JSON line, then serve until stdin closes.
``observe <peer id> <host> <port>``: ask that peer for our mapping on its two ports
(``observe_mapping``) and print what the node's check makes of it (``classify``).
"""

from __future__ import annotations

import asyncio
import json
import sys

from wanswarm.node.membership.addresses import local_hosts
from wanswarm.node.membership.reachability import Observation, classify
from wanswarm.transport.config import TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress
from wanswarm.transport.identity import Identity


async def serve() -> None:
    async with Endpoint(Identity.generate(), TransportConfig(host="0.0.0.0")) as ep:
        print(json.dumps({"peer_id": ep.peer_id, "port": ep.address[1]}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def observe(peer_id: str, host: str, port: int) -> None:
    async with Endpoint(Identity.generate(), TransportConfig(host="0.0.0.0")) as ep:
        seen, probed = await ep.observe_mapping(PeerAddress(peer_id, host, port), timeout=10)
        nat = classify(local_hosts("0.0.0.0", [host]), [Observation(peer_id, *seen, probed)])
        print(json.dumps({"seen": list(seen), "probed": probed and list(probed), "nat": nat}),
              flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve())
    else:
        asyncio.run(observe(sys.argv[2], sys.argv[3], int(sys.argv[4])))
