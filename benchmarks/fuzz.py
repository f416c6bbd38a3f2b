"""Fuzzing at scale: mutated frames and datagrams against a live stage server.

Three processes on this host:

- the target (``--serve``): one QUIC endpoint with the handlers a daemon registers on it
  (``node/endpoint.py``: kinds take no tensors unless declared, the stage kinds' sizes
  from the run spec, ``run_spec``; a real ``StageServer`` of the middle stage of a
  3-stage run, with its state donor's kinds; the endpoint's NAT traversal kinds). It
  counts every exception logged with a traceback (a handler or packet that raised where
  peer input must be refused as data) and reports its totals at the end;
- the fuzzer (``--fuzz``): a real identity with a real aioquic connection (and a plain
  UDP socket) sending ``--frames`` generated frames and datagrams: mutations (bit flips,
  byte changes, truncation, splicing, repeated and inserted bytes, length fields) of valid
  frames of every kind (request headers for every served kind with their tensor payloads,
  response and error headers, CONTROL and AUTH frames), random bytes, FEC symbol
  datagrams as DATAGRAM frames, and raw UDP datagrams (mutated QUIC Initials, relay and
  punch packets, random bytes). Stream cases go out on their own stream each, many at
  once, and every answer is read (bounded wait);
- this process: an honest trainer sending ``forward`` requests to the stage, first with
  no fuzzing (the baseline), then all through the fuzzing.

A crash is the target exiting before it is told to, or an exception it logged with a
traceback. Prints one final JSON line::

    nice -n 10 python benchmarks/fuzz.py --json            # 1,000,000 frames
    python benchmarks/fuzz.py --frames 2000 --json         # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import torch
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from wanswarm.node.config.runspec import BatchSpec, ModelSpec, RunSpec, StagesSpec
from wanswarm.node.endpoint import EndpointComponent, stage_request_limits
from wanswarm.node.protocol import (
    BackwardRequest,
    EvalLossRequest,
    ForwardLossRequest,
    ForwardRequest,
    HopId,
    InfoRequest,
    Kind,
    to_header,
)
from wanswarm.transport.codecs import CodecSpec, encode
from wanswarm.transport.config import CongestionConfig, FecConfig, TransportConfig
from wanswarm.transport.connections import Connections
from wanswarm.transport.endpoint import Endpoint, PeerAddress
from wanswarm.transport.errors import ConnectError, ProtocolError, TransportError
from wanswarm.transport.framing import (
    WIRE_VERSION,
    FrameType,
    HeaderReceived,
    MessageHeader,
    StreamDecoder,
    encode_frame,
    encode_header,
    error_header,
    tensor_spec,
)
from wanswarm.transport.identity import Identity
from wanswarm.transport.quic_config import ALPN
from wanswarm.transport.quic_link import QuicLink
from wanswarm.transport.relay import PUNCH_BYTE, RELAY_BYTE
from wanswarm.transport.session import SenderTransfer
from wanswarm.transport.stream import QuicStream

B, T, C = 2, 16, 32
STAGE = 1
RAW = CodecSpec("none")


def spec() -> RunSpec:
    return RunSpec(
        name="fuzz",
        model=ModelSpec(d_model=C, n_heads=2, n_layers=3, seq_len=T),
        stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
        batch=BatchSpec(micro_batch_size=B, target_batch_size=2 * B),
    )


def transport_config() -> TransportConfig:
    return TransportConfig(
        host="127.0.0.1",
        # aioquic's Reno on loopback (see tests/loopback/quic_helpers.py)
        congestion=CongestionConfig(algorithm="reno"),
        request_receive_timeout_s=5.0,
        response_send_timeout_s=5.0,
        fec=FecConfig(threshold_bytes=2048),  # the stage's payloads travel as FEC too
    )


# -- the target ----------------------------------------------------------------------------


class _Tracebacks(logging.Handler):
    """Counts records logged with an exception: the target's crashes."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.count += 1
            if len(self.first) < 5:
                self.first.append(self.format(record)[-2000:])


async def serve() -> None:
    from wanswarm.node.stage.optimizer import LocalOptimizer
    from wanswarm.node.stage.server import StageServer
    from wanswarm.node.stage.server_config import StageServerConfig

    tracebacks = _Tracebacks()
    logging.getLogger().addHandler(tracebacks)
    logging.getLogger().setLevel(logging.WARNING)
    run_spec, cfg = spec(), transport_config()
    endpoint = Endpoint(Identity.generate(), cfg, default_request_bytes=0)
    for kind, max_bytes in stage_request_limits(run_spec).items():
        endpoint.limit(kind, max_bytes)
    node = EndpointComponent(cfg, run_spec, announce_host="", announce_port=0,
                             request_timeout_s=5.0)
    endpoint.register("run_spec", node._on_run_spec, max_bytes=0)
    await endpoint.start("127.0.0.1", 0)
    server = StageServer(
        run_spec, STAGE, StageServerConfig(device="cpu", benchmark_iterations=1),
        endpoint=endpoint, make_optimizer=lambda m: LocalOptimizer(m, run_spec),
    )
    await server.open()
    host, port = endpoint.address
    kinds = sorted(endpoint._handlers)
    print(json.dumps({"ready": True, "host": host, "port": port, "peer_id": endpoint.peer_id,
                      "run_id": run_spec.run_id, "kinds": kinds}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    totals = endpoint.totals()
    errors = Counter({k: v for k, v in totals.items() if k.startswith("errors_sent.")})
    report = {
        "tracebacks": tracebacks.count, "first_tracebacks": tracebacks.first,
        "rss_mib": round(_rss() / 2**20, 1), "requests_served": totals["requests_served"],
        "inbound_peak_mib": round(totals["inbound_peak"] / 2**20, 2),
        "errors_sent": dict(errors.most_common(12)),
        "socket": dict(endpoint.traversal_counts()),
        "stage_failed": server.counters.failed if hasattr(server.counters, "failed") else None,
    }
    await server.close()
    await endpoint.close()
    print(json.dumps(report), flush=True)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- generation (pure: an rng in, bytes out) -----------------------------------------------


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four random mutations of ``data``."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        n = len(out)
        if op == 0 and n:  # flip bits
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(n)
                out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # set bytes to interesting values
            for _ in range(rng.randint(1, 4)):
                out[rng.randrange(n)] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2 and n:  # truncate
            del out[rng.randrange(n):]
        elif op == 3:  # insert random bytes
            i = rng.randrange(n + 1)
            out[i:i] = rng.randbytes(rng.randint(1, 32))
        elif op == 4 and n:  # repeat a slice
            i = rng.randrange(n)
            j = min(n, i + rng.randint(1, 64))
            out[i:i] = out[i:j] * rng.randint(1, 4)
        elif op == 5 and n >= 8:  # a frame's length field (bytes 4..8 of its prefix)
            value = rng.choice((0, 1, 255, 1 << 16, 1 << 24, 0xFFFFFFFF, rng.getrandbits(32)))
            out[4:8] = value.to_bytes(4, "big")
        elif op == 6 and n:  # delete a slice
            i = rng.randrange(n)
            del out[i:i + rng.randint(1, 64)]
        else:  # swap two halves
            i = rng.randrange(n + 1)
            out = out[i:] + out[:i]
    return bytes(out)


class Corpus:
    """Valid frames of every kind (each case a list of frames), to mutate."""

    def __init__(self, kinds: list[str], run_id: str, trainer: str, rng: random.Random) -> None:
        self.rng = rng
        self.cases: list[list[bytes]] = []
        x = torch.randn(B, T, C)
        tokens = torch.randint(0, 256, (B, T))
        mb = iter(range(1, 1 << 30))

        def hop() -> HopId:
            return HopId(run_id=run_id, trainer=trainer, micro_batch=next(mb), stage=STAGE)

        stage_requests: dict[str, tuple[dict[str, Any], list[torch.Tensor]]] = {
            str(Kind.FORWARD): (to_header(ForwardRequest(hop=hop(), budget_s=5)), [x]),
            str(Kind.BACKWARD): (
                to_header(BackwardRequest(hop=hop(), budget_s=5, input_carried=True)),
                [x, x * 1e-3],
            ),
            str(Kind.FORWARD_LOSS): (to_header(ForwardLossRequest(hop=hop(), budget_s=5)),
                                     [x, tokens]),
            str(Kind.EVAL_LOSS): (to_header(EvalLossRequest(hop=hop(), budget_s=5)),
                                  [x, tokens]),
            str(Kind.STAGE_INFO): (to_header(InfoRequest(run_id=run_id)), []),
        }
        limits = transport_config().limits
        for kind in kinds:
            header, tensors = stage_requests.get(kind, ({"epoch": 1, "index": 0}, []))
            encoded = [encode(t, RAW) for t in tensors]
            message = MessageHeader(
                version=WIRE_VERSION, type="request", request_id=rng.randrange(1 << 20),
                kind=kind, header=header, tensors=tuple(tensor_spec(e) for e in encoded),
            )
            payloads = [bytes(e.payload) for e in encoded]
            self.cases.append([encode_header(message, limits), *payloads])
        response = MessageHeader(version=WIRE_VERSION, type="response", request_id=1)
        self.cases.append([encode_header(response, limits)])
        self.cases.append([encode_header(error_header(1, "busy", "x"), limits)])
        self.cases.append([encode_frame(FrameType.CONTROL, rng.randbytes(24))])
        self.cases.append([encode_frame(FrameType.AUTH, rng.randbytes(64))])
        transfer = SenderTransfer(3, rng.randbytes(20_000), 1184, FecConfig(), 0.01)
        self.datagrams = transfer.datagrams_to_send(64, 0.0)
        quic = QuicConnection(configuration=QuicConfiguration(alpn_protocols=[ALPN],
                                                              is_client=True))
        quic.connect(("127.0.0.1", 9), now=0.0)
        self.initial = quic.datagrams_to_send(now=0.0)[0][0]

    def stream_case(self) -> tuple[bytes, int]:
        """A stream's bytes and how many frames they were made of."""
        rng = self.rng
        if rng.random() < 0.05:
            return rng.randbytes(rng.randint(0, 512)), 1
        frames = list(rng.choice(self.cases))
        if rng.random() < 0.3:  # splice in frames of another case
            frames += rng.choice(self.cases)[: rng.randint(1, 2)]
        mutated = [mutate(f, rng) if rng.random() < 0.6 else f for f in frames]
        if rng.random() < 0.3:
            mutated = [mutate(b"".join(mutated), rng)]
        return b"".join(mutated), len(frames)

    def quic_datagram(self) -> bytes:
        """A DATAGRAM frame's payload: a mutated FEC symbol, or random bytes."""
        if self.rng.random() < 0.1:
            return self.rng.randbytes(self.rng.randint(0, 1100))
        return mutate(self.rng.choice(self.datagrams), self.rng)[:1100]

    def udp_datagram(self) -> bytes:
        """A raw UDP datagram to the QUIC port."""
        rng = self.rng
        pick = rng.random()
        if pick < 0.4:
            return mutate(self.initial, rng)
        if pick < 0.6:
            return bytes([rng.choice((RELAY_BYTE, PUNCH_BYTE))]) + rng.randbytes(
                rng.randint(0, 1300))
        return rng.randbytes(rng.randint(0, 1400))


# -- the fuzzer ------------------------------------------------------------------------------


async def _answer(stream: QuicStream, decoder: StreamDecoder, timeout: float) -> str:
    try:
        async with asyncio.timeout(timeout):
            while True:
                data = await stream.read()
                for event in decoder.feed(data) if data else decoder.feed_eof():
                    if isinstance(event, HeaderReceived):
                        return event.header.error_code or event.header.type
    except TimeoutError:
        stream.abort()
        return "no_answer"
    except ConnectError:
        return "aborted"
    except ProtocolError:
        return "answer_not_a_frame"


async def fuzz(
    target: dict[str, Any], frames: int, seed: int, concurrency: int, max_seconds: float | None
) -> None:
    rng = random.Random(seed)
    cfg = transport_config()
    raw = Connections(Identity.generate(), cfg, lambda link: None)
    await raw.start("127.0.0.1", 0)
    peer = PeerAddress(target["peer_id"], target["host"], target["port"])
    corpus = Corpus(target["kinds"], target["run_id"], raw.identity.peer_id, rng)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setblocking(False)
    counts: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    sent = 0
    link: QuicLink | None = None
    started = time.perf_counter()
    slots = asyncio.Semaphore(concurrency)

    async def stream_case(data: bytes) -> None:
        try:
            assert link is not None
            stream = link.open_stream()
            try:
                async with asyncio.timeout(5):
                    await stream.write(data, end=True)
            except (ConnectError, TimeoutError):
                answers["write_refused"] += 1
                stream.abort()
                return
            answers[await _answer(stream, StreamDecoder(cfg.limits), 5.0)] += 1
        finally:
            slots.release()

    tasks: set[asyncio.Task[None]] = set()
    while sent < frames:
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            counts["stopped_by_max_seconds"] = 1
            break
        if link is None or link.is_closed:
            if link is not None:
                counts["reconnects"] += 1
            link = await raw.get(peer)
        pick = rng.random()
        if pick < 0.5:
            data, n = corpus.stream_case()
            await slots.acquire()
            task = asyncio.ensure_future(stream_case(data))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            counts["stream_frames"] += n
            sent += n
        elif pick < 0.75:
            for _ in range(8):
                link._quic.send_datagram_frame(corpus.quic_datagram())
            link.schedule_transmit()
            counts["quic_datagrams"] += 8
            sent += 8
            await asyncio.sleep(0)
        else:
            for _ in range(8):
                try:
                    udp.sendto(corpus.udp_datagram(), (target["host"], target["port"]))
                except BlockingIOError:
                    counts["udp_dropped_locally"] += 1
            counts["udp_datagrams"] += 8
            sent += 8
            await asyncio.sleep(0)
        if sent % 20_000 < 8:
            rate = sent / (time.perf_counter() - started)
            print(json.dumps({"progress": sent, "per_s": round(rate)}), file=sys.stderr,
                  flush=True)
    if tasks:
        await asyncio.wait(list(tasks), timeout=10)
    elapsed = time.perf_counter() - started
    await raw.close(1)
    udp.close()
    print(json.dumps({"frames": sent, "seconds": round(elapsed, 1),
                      "per_s": round(sent / elapsed), "counts": dict(counts),
                      "answers": dict(answers.most_common(16))}), flush=True)


# -- the honest trainer and the orchestration ------------------------------------------------


async def honest(endpoint: Endpoint, target: dict[str, Any], until: asyncio.Future[Any] | None,
                 count: int, mb: list[int]) -> dict[str, Any]:
    """Forward requests one after another (``count`` of them, or until ``until`` is
    done): success rate and latency."""
    peer = PeerAddress(target["peer_id"], target["host"], target["port"])
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    done = 0
    while (until is None and done < count) or (until is not None and not until.done()):
        mb[0] += 1
        hop = HopId(run_id=target["run_id"], trainer=endpoint.peer_id, micro_batch=mb[0],
                    stage=STAGE)
        started = time.perf_counter()
        try:
            reply = await endpoint.request(
                peer, str(Kind.FORWARD),
                to_header(ForwardRequest(hop=hop, budget_s=10, keep_input=False)),
                [torch.randn(B, T, C)], timeout=10,
            )
            assert tuple(reply.tensors[0].shape) == (B, T, C)  # type: ignore[union-attr]
            latencies.append(time.perf_counter() - started)
        except TransportError as exc:
            failures[type(exc).__name__ + ":" + getattr(exc, "code", "")] += 1
        done += 1
        await asyncio.sleep(0.02)
    return {
        "requests": done, "ok": len(latencies),
        "success": round(len(latencies) / done, 4) if done else None,
        "p50_ms": round(1000 * statistics.median(latencies), 2) if latencies else None,
        "p95_ms": round(1000 * sorted(latencies)[int(0.95 * (len(latencies) - 1))], 2)
        if latencies else None,
        "failures": dict(failures),
    }


async def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    here = os.path.abspath(__file__)
    target_proc = await asyncio.create_subprocess_exec(
        sys.executable, here, "--serve", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert target_proc.stdout is not None and target_proc.stdin is not None
    async with asyncio.timeout(120):
        target = json.loads(await target_proc.stdout.readline())
    endpoint = Endpoint(Identity.generate(), transport_config())
    await endpoint.start("127.0.0.1", 0)
    mb = [0]
    try:
        await honest(endpoint, target, None, 5, mb)  # warm-up: connection, first forwards
        baseline = await honest(endpoint, target, None, args.baseline_requests, mb)
        fuzzer = await asyncio.create_subprocess_exec(
            sys.executable, here, "--fuzz", json.dumps(target), "--frames", str(args.frames),
            "--seed", str(args.seed), "--concurrency", str(args.concurrency),
            *(["--max-seconds", str(args.max_seconds)] if args.max_seconds else []),
            stdout=subprocess.PIPE, stderr=None if args.progress else subprocess.DEVNULL)
        assert fuzzer.stdout is not None
        finished = asyncio.ensure_future(fuzzer.wait())
        during = await honest(endpoint, target, finished, 0, mb)
        fuzz_report = json.loads((await fuzzer.stdout.read()).decode().strip().splitlines()[-1])
        after = await honest(endpoint, target, None, 10, mb)
        alive = target_proc.returncode is None
    finally:
        await endpoint.close()
        target_proc.stdin.close()
        async with asyncio.timeout(60):
            out = (await target_proc.stdout.read()).decode().strip().splitlines()
            await target_proc.wait()
    served = json.loads(out[-1]) if out else {}
    crashes = (0 if alive else 1) + int(served.get("tracebacks", 0))
    return {
        "benchmark": "fuzz",
        "frames": fuzz_report["frames"],
        "frames_asked": args.frames,
        "frames_per_s": fuzz_report["per_s"],
        "fuzz_seconds": fuzz_report["seconds"],
        "crashes": crashes,
        "target_alive": alive,
        "honest_baseline": baseline,
        "honest_during_fuzz": during,
        "honest_after": after,
        "fuzzer": fuzz_report,
        "target": served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1_000_000,
                        help="frames and datagrams to generate (default 1,000,000)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop generating after this long (the report says how many "
                        "frames went out and at what rate)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64,
                        help="stream cases in flight at once")
    parser.add_argument("--baseline-requests", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    parser.add_argument("--progress", action="store_true", help="fuzzer progress on stderr")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fuzz", metavar="TARGET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    if args.fuzz:
        asyncio.run(fuzz(json.loads(args.fuzz), args.frames, args.seed, args.concurrency,
                         args.max_seconds))
        return
    result = asyncio.run(orchestrate(args))
    if not args.json:
        print(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
