"""Goodput and CPU cost of Endpoint.request on loopback, or across the WAN emulator.

Both endpoints run in this process on one uvloop loop (so both ends share one core);
the WAN emulator, when used, runs in the same loop. One warm-up request (handshake
excluded), then ``--repeats`` requests each carrying one uint8 tensor of ``--mib`` MiB
(codec none) to a handler that answers an empty response. Goodput = payload bits /
request time; CPU = ``time.process_time`` (all threads, both ends) per GB (10^9 bytes)
of payload. Prints one JSON line per request::

    python benchmarks/endpoint_loopback.py --algorithm reno --fec off
    python benchmarks/endpoint_loopback.py --profile wan --algorithm wanswarm --mib 16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import uvloop
from wanswarm.transport.config import CongestionConfig, FecConfig, TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.identity import Identity
from wanswarm.transport.wan import WanEmulator


async def _sink(request: Request) -> Response:
    return Response(header={"n": sum(t.numel() for t in request.tensors)})


async def main(args: argparse.Namespace) -> None:
    config = TransportConfig(
        congestion=CongestionConfig(algorithm=args.algorithm),
        fec=FecConfig(enabled=args.fec == "on"),
        request_receive_timeout_s=args.timeout,
        response_send_timeout_s=args.timeout,
    )
    server, client = Endpoint(Identity.generate(), config), Endpoint(Identity.generate(), config)
    await server.start("127.0.0.1", 0)
    await client.start("127.0.0.1", 0)
    server.register("sink", _sink)
    wan = WanEmulator(args.profile, target=server.address, seed=1) if args.profile else None
    try:
        if wan is not None:
            await wan.start()
        host, port = wan.address if wan is not None else server.address
        peer = PeerAddress(server.peer_id, host, port)
        await client.request(peer, "sink", {}, [], timeout=args.timeout)
        payload = torch.randint(0, 256, (int(args.mib * 2**20),), dtype=torch.uint8)
        for i in range(args.repeats):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await client.request(peer, "sink", {}, [payload], timeout=args.timeout)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            stats = client.path_stats(server.peer_id)
            print(json.dumps({
                "repeat": i, "profile": args.profile or "loopback", "algorithm": args.algorithm,
                "fec": args.fec, "mib": args.mib, "seconds": round(wall, 3),
                "goodput_mbps": round(payload.nbytes * 8 / wall / 1e6, 1),
                "cpu_s_per_gb": round(cpu / (payload.nbytes / 1e9), 1),
                "loss_rate": round(stats.loss_rate, 4) if stats else None,
                "srtt_ms": round(stats.smoothed_rtt * 1000, 1) if stats else None,
                "loadavg_1m": os.getloadavg()[0],
            }), flush=True)
    finally:
        if wan is not None:
            await wan.close()
        await client.close()
        await server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algorithm", default="wanswarm", help="wanswarm, reno or cubic")
    parser.add_argument("--fec", choices=["on", "off"], default="on")
    parser.add_argument(
        "--profile", default=None, help="a WAN emulator profile (lan, home, wan, bad)"
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    uvloop.run(main(parser.parse_args()))
