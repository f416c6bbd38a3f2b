"""A DHT node for the lab's hivemind tests, run inside a lab host: ``python hivemind_peer.py
STATE_DIR CONFIG_JSON``.

It starts the node's DHT the way the daemon does (``Dht.spawn`` with a ``DhtConfig``), prints
one JSON line when the DHT is ready, then answers one JSON line per command read from stdin:

- ``maddrs``: what ``Dht.visible_maddrs`` gives to others
- ``publish STAGE``: store this node's typed records; ``read``: the servers found
- ``average VALUE SIZE GROUP TIMEOUT``: one hivemind all-reduce of a tensor of SIZE floats
  filled with VALUE, in a group of GROUP peers; ``load TIMEOUT``: download that state
- ``quit``
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from wanswarm.node.config.sections import DhtConfig
from wanswarm.node.membership.dht import Dht
from wanswarm.node.membership.records import RttRecord, ServerRecord
from wanswarm.node.service.statedir import load_identity

RUN = "lab"


def answer(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    state_dir, config = Path(sys.argv[1]), DhtConfig.model_validate_json(sys.argv[2])
    identity, key = load_identity(state_dir)
    started = time.monotonic()
    dht = Dht.spawn(config, RUN, identity, key)
    asyncio.run(dht.wait_ready())
    answer(peer_id=identity.peer_id, ready_s=time.monotonic() - started)
    averager: DecentralizedAverager | None = None
    try:
        for line in sys.stdin:
            word, *args = line.split()
            if word == "maddrs":
                answer(maddrs=asyncio.run(dht.visible_maddrs()))
            elif word == "publish":
                server = ServerRecord(
                    peer_id=identity.peer_id, state="online", stage=int(args[0])
                )
                rtt = RttRecord(peer_id=identity.peer_id, rtts={})
                ok = asyncio.run(dht.publish(server, rtt, time.time() + 60))
                answer(stored=ok)
            elif word == "read":
                read = asyncio.run(dht.read_membership())
                answer(servers={p: r.stage for p, (r, _) in read.servers.items()})
            elif word == "average":
                value, size, group, timeout = float(args[0]), int(args[1]), int(args[2]), float(
                    args[3])
                averager = DecentralizedAverager(
                    [torch.full((size,), value)], dht._process, prefix="lab_round",
                    target_group_size=group, min_group_size=group, min_matchmaking_time=5.0,
                    request_timeout=3.0, start=True,
                )
                began = time.monotonic()
                try:
                    control = averager.step(timeout=timeout)
                except Exception as exc:  # reported to the test, which fails with it
                    answer(ok=False, error=f"{type(exc).__name__}: {exc}")
                    continue
                with averager.get_tensors() as tensors:
                    mean = float(tensors[0].mean())
                answer(ok=control is not None, seconds=time.monotonic() - began, mean=mean,
                       group=None if control is None else len(control))
            elif word == "load" and averager is not None:
                began = time.monotonic()
                loaded = averager.load_state_from_peers(timeout=float(args[0]))
                answer(ok=loaded is not None, seconds=time.monotonic() - began,
                       mean=None if loaded is None else float(loaded[1][0].mean()))
            elif word == "quit":
                break
    finally:
        if averager is not None:
            averager.shutdown()
        asyncio.run(dht.shutdown(timeout=10))


if __name__ == "__main__":
    main()
