"""The upload limit holds: a node capped at ``--limit-mbps`` sends at that rate while it keeps
answering small requests (transport.upload_limit_mbps, transport/upload_limit.py).

Two real transport Endpoints on 127.0.0.1, one uvloop loop. The limited node ("uploader")
pushes ``--mib`` MiB tensors to the other with ``--in-flight`` requests at once, more than the
limit can carry (bulk upload: what a stage server answering many trainers does), and at the
same time sends a small request every ``--small-period`` s, as a trainer's next micro-batch
would: those must keep completing. After ``--warmup`` s, the uploader's sent bytes (UDP
payload, the endpoint's ``bytes_out``, the figure ``wanswarm status`` shows as "out") are
measured over ``--seconds`` s. Prints one JSON line::

    nice -n 10 python benchmarks/upload_limit.py --limit-mbps 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
import uvloop
from wanswarm.transport.config import TransportConfig
from wanswarm.transport.endpoint import Endpoint, PeerAddress, Request, Response
from wanswarm.transport.identity import Identity


async def _sink(request: Request) -> Response:
    return Response(header={"n": sum(t.numel() for t in request.tensors)})


async def main(args: argparse.Namespace) -> dict[str, object]:
    timeout = 120.0
    limited = TransportConfig(
        upload_limit_mbps=args.limit_mbps,
        request_receive_timeout_s=timeout,
        response_send_timeout_s=timeout,
    )
    free = TransportConfig(request_receive_timeout_s=timeout, response_send_timeout_s=timeout)
    uploader, receiver = Endpoint(Identity.generate(), limited), Endpoint(Identity.generate(), free)
    await receiver.start("127.0.0.1", 0)
    await uploader.start("127.0.0.1", 0)
    receiver.register("sink", _sink)
    peer = PeerAddress(receiver.peer_id, *receiver.address)
    stop = asyncio.Event()
    bulk_done = 0
    small_latency: list[float] = []
    small_failed = 0
    try:
        await uploader.request(peer, "sink", {}, [], timeout=30)
        payload = torch.randint(0, 256, (int(args.mib * 2**20),), dtype=torch.uint8)

        async def bulk() -> None:
            nonlocal bulk_done
            while not stop.is_set():
                await uploader.request(peer, "sink", {}, [payload], timeout=timeout)
                bulk_done += 1

        async def small() -> None:
            nonlocal small_failed
            tiny = torch.zeros(256, dtype=torch.float32)
            while not stop.is_set():
                began = time.perf_counter()
                try:
                    await uploader.request(peer, "sink", {}, [tiny], timeout=10)
                except Exception:  # counted: the limit must not starve small requests
                    small_failed += 1
                else:
                    small_latency.append(time.perf_counter() - began)
                await asyncio.sleep(args.small_period)

        tasks = [asyncio.create_task(bulk()) for _ in range(args.in_flight)]
        tasks.append(asyncio.create_task(small()))
        await asyncio.sleep(args.warmup)
        out0, t0, n_small0 = uploader.totals()["bytes_out"], time.perf_counter(), len(small_latency)
        await asyncio.sleep(args.seconds)
        out1, t1 = uploader.totals()["bytes_out"], time.perf_counter()
        measured = (out1 - out0) * 8 / (t1 - t0) / 1e6
        during = small_latency[n_small0:]
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        socket_status = uploader._connections.socket._upload  # the limiter's own counters
        return {
            "benchmark": "upload_limit",
            "limit_mbps": args.limit_mbps,
            "measured_mbps": round(measured, 2),
            "ratio": round(measured / args.limit_mbps, 3),
            "within_10pct": abs(measured / args.limit_mbps - 1) <= 0.10,
            "seconds": round(t1 - t0, 2),
            "bulk_mib": args.mib,
            "bulk_requests_done": bulk_done,
            "small_requests_during": len(during),
            "small_failed": small_failed,
            "small_p50_ms": round(statistics.median(during) * 1000, 1) if during else None,
            "small_max_ms": round(max(during) * 1000, 1) if during else None,
            "limiter": None if socket_status is None else socket_status.status(),
        }
    finally:
        await uploader.close()
        await receiver.close()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-mbps", type=float, default=20.0)
    parser.add_argument("--mib", type=float, default=4.0, help="bulk tensor size, MiB")
    parser.add_argument("--in-flight", type=int, default=2, help="bulk requests at once")
    parser.add_argument("--small-period", type=float, default=0.1)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=12.0)
    return parser.parse_args()


if __name__ == "__main__":
    print(json.dumps(uvloop.run(main(_parse()))))
