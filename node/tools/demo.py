"""``wanswarm demo``: a local swarm of real daemons training the embedded default run.

Starts ``replicas x stages`` daemons as subprocesses (``wanswarm join`` on 127.0.0.1, ports
0, each with its own temporary state directory and log file). The first bootstraps the DHT;
the others start together once it is up and join through its address. Daemon ``i`` serves
stage ``i mod S`` (``node.stage``): the demo knows its layout, so it pins it rather than
waiting for each claim in turn (a swarm of volunteers uses stage_selection instead). With
``--wan PROFILE`` every daemon gets a WAN emulator process in front of its QUIC port and
announces the emulator's address, so every link into it crosses the emulated WAN.

While the swarm trains, a progress line (optimizer epoch, trainer loss, tokens/s, elapsed)
is redrawn in place on a TTY, printed every few seconds otherwise. Validation loss is measured
through the swarm at the start and the end by an evaluation client in this process (its own
QUIC endpoint and identity; servers taken from the daemons' status). The run stops at the
token budget or the duration, whichever comes first, or on Ctrl-C; every daemon then gets
SIGTERM (the graceful leave), then SIGKILL if it outlives the shutdown timeout.

``--run-spec PATH`` trains another run spec (every daemon gets ``node.run_spec``; the
evaluation client uses the same spec). ``run_swarm(options)`` runs the same sequence in
this process and returns the figures as a dict instead of an exit status (what
``benchmarks/swarm.py`` calls): the ``--json`` line's fields plus the traffic of the training
phase (trainer payload bytes and hops, QUIC bytes of every endpoint) and the tokens the
trainers had completed when the final evaluation ended (they keep training while it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..config.runspec import RunSpecError
from ..control import ControlClient
from ..errors import NodeError
from ..logs import get_logger

log = get_logger(__name__)

PROGRESS_PERIOD_S = 2.0  # status polls
PLAIN_LINE_PERIOD_S = 10.0  # progress lines when stdout is not a TTY
STARTUP_TIMEOUT_S = 300.0  # the whole swarm up, every stage served
SHUTDOWN_TIMEOUT_S = 20.0  # node.shutdown_timeout of the demo's daemons
DEMO_MAX_IN_FLIGHT = 1  # trainer.max_in_flight of every daemon (see _spawn_daemon)
# Training time of the default demo: start-up, two evaluations and shutdown took 86 s more
# (6 daemons, 2 idle cores), so the whole demo stays under 10 minutes with a minute to spare;
# the validation loss passed 2.5 after about 340 s of training (docs/tiny_run.md).
DEMO_DURATION_S = 450.0
# the fields of the --json line, in order (run_swarm returns these and more)
JSON_FIELDS = (
    "val_loss_start",
    "val_loss_end",
    "tokens",
    "tokens_per_s",
    "daemons",
    "stages",
    "elapsed_s",
    "epoch",
)


class DemoError(NodeError):
    """The demo swarm could not start or lost its daemons."""


@dataclass(frozen=True)
class DemoOptions:
    replicas: int = 2
    duration_s: float = DEMO_DURATION_S
    tokens: int = 1_500_000
    wan: str | None = None
    json: bool = False
    keep: bool = False
    root: Path | None = None
    eval_windows: int = 64
    extra: tuple[str, ...] = ()  # --set items passed to every daemon
    run_spec: Path | None = (
        None  # run spec TOML of every daemon and the evaluation client; None: embedded tiny run
    )
    data_seed: int | None = (
        None  # daemon i trains on trainer.data_seed = data_seed + i; None: seeds from peer ids
    )
    progress_period_s: float | None = (
        None  # plain progress lines this often (no in-place redraw); None: the default
    )
    label: str = ""  # prefix of every line written (e.g. a benchmark's configuration)


@dataclass
class _Node:
    index: int
    state_dir: Path
    proc: subprocess.Popen[bytes]
    log_file: Path
    emulator: subprocess.Popen[bytes] | None = None
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def client(self) -> ControlClient:
        return ControlClient(self.state_dir / "control.sock", timeout=5.0)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Demo:
    def __init__(self, options: DemoOptions, out: TextIO = sys.stdout) -> None:
        from ..config.runspec import default_run_spec, load_run_spec

        self.options = options
        self.out = out
        self.spec_path = None if options.run_spec is None else options.run_spec.resolve()
        try:
            self.spec = (
                default_run_spec() if self.spec_path is None else load_run_spec(self.spec_path)
            )
        except RunSpecError as exc:
            raise DemoError(str(exc)) from None
        self.n_daemons = options.replicas * self.spec.n_stages
        self.root = Path(tempfile.mkdtemp(prefix="wanswarm-demo-", dir=options.root))
        self.nodes: list[_Node] = []
        self.stop = asyncio.Event()
        self.tty = out.isatty() and not options.json and options.progress_period_s is None
        self.traffic_start: dict[str, Any] = {}  # traffic() when training starts (set by train)
        self.traffic_end: dict[str, Any] = {}  # and when it stops
        self.line_period_s = (
            PLAIN_LINE_PERIOD_S if options.progress_period_s is None else options.progress_period_s
        )

    # ---- output -------------------------------------------------------------------

    def say(self, text: str) -> None:
        if self.options.label:
            text = "\n".join(
                f"{self.options.label} {line}" if line else line for line in text.split("\n")
            )
        if not self.options.json:
            self.out.write(text + "\n")
            self.out.flush()
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    # ---- processes ----------------------------------------------------------------

    def _spawn_daemon(self, index: int, initial: list[str]) -> _Node:
        state_dir = self.root / f"node{index}"
        state_dir.mkdir(mode=0o700)
        log_file = self.root / f"node{index}.log"
        emulator = None
        quic_port = 0
        sets = [
            f"node.shutdown_timeout={SHUTDOWN_TIMEOUT_S}",
            # the layout is known here: daemon i serves stage i mod S, so every stage gets its
            # replicas and all daemons but the first start at once (no claim to wait for)
            f"node.stage={index % self.spec.n_stages}",
            "node.record_ttl=15",
            "node.membership_period=5",
            # micro-batches in flight over the whole swarm make gradients stale by about
            # (in flight / micro-batches per step) epochs: one per trainer keeps that small
            f"trainer.max_in_flight={DEMO_MAX_IN_FLIGHT}",
            "trainer.request_timeout_s=15",  # loopback: a hop that takes longer is stuck
            # each trainer completes only ~100 micro-batches in the demo: a slower average would
            # show the loss of minutes ago in the progress line
            "trainer.loss_ewma_alpha=0.2",
            "averaging.matchmaking_time=2",  # loopback: peers answer at once
            # Synchronous steps: the demo's few, large-lr steps lose more to one epoch of
            # staleness (delayed updates: val loss 2.99 after 237k tokens) than the swarm loses
            # to the all-reduce stall (2.70 after 209k tokens, single-process reference 2.57);
            # docs/tiny_run.md has the figures.
            "averaging.delayed_updates=false",
            # on a loaded machine a peer's chunk can take seconds; dropping it from the round
            # would leave the replicas with different averages
            "averaging.next_chunk_timeout=10",
            # parameters are averaged every 5th epoch: the gradient all-reduce already keeps the
            # replicas together, and each averaging round costs DHT matchmaking on 2 shared cores
            "averaging.average_state_every=5",
        ]
        if self.spec_path is not None:
            sets.append(f"node.run_spec={self.spec_path}")
        if self.options.data_seed is not None:
            sets.append(f"trainer.data_seed={self.options.data_seed + index}")
        if self.options.wan is not None:
            quic_port = _free_udp_port()
            emulator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "wanswarm.transport.wan",
                    "--profile",
                    self.options.wan,
                    "--target",
                    f"127.0.0.1:{quic_port}",
                    "--listen",
                    "127.0.0.1:0",
                    "--seed",
                    str(index),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            assert emulator.stdout is not None
            line = emulator.stdout.readline().decode()  # its first line: the bound address
            try:
                host, _, port = json.loads(line)["address"].rpartition(":")
            except (ValueError, KeyError) as exc:
                emulator.kill()
                raise DemoError(f"WAN emulator did not start: {line!r}") from exc
            sets += [f"node.announce_host={host}", f"node.announce_port={port}"]
        cmd = [
            sys.executable,
            "-m",
            "wanswarm.node.cli",
            "join",
            "--state-dir",
            str(state_dir),
            "--host",
            "127.0.0.1",
            "--dht-port",
            "0",
            "--quic-port",
            str(quic_port),
            "--run",
            "demo",
        ]
        for item in [*sets, *self.options.extra]:
            cmd += ["--set", item]
        if initial:
            cmd += ["--initial-peers", *initial]
        # one compute thread per daemon: several daemons share the machine's cores
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        with open(log_file, "wb") as sink:
            proc = subprocess.Popen(
                cmd,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        node = _Node(index, state_dir, proc, log_file, emulator)
        self.nodes.append(node)
        return node

    async def _poll(self, node: _Node) -> dict[str, Any] | None:
        if node.proc.poll() is not None:
            return None
        try:
            report = await asyncio.to_thread(lambda: node.client.status())
        except NodeError:
            return None
        node.status = report.model_dump(mode="json")
        return node.status

    async def _until(self, what: str, check: Any, timeout: float) -> Any:
        """Poll ``check()`` (async, returns a value or None) until it answers; DemoError on
        timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._check_alive()
            value = await check()
            if value is not None:
                return value
            if loop.time() > deadline:
                raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")
            if self.stop.is_set():
                raise DemoError("interrupted")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.5)

    def _check_alive(self) -> None:
        for node in self.nodes:
            code = node.proc.poll()
            if code is not None:
                tail = node.log_file.read_text(errors="replace").strip().splitlines()[-5:]
                raise DemoError(
                    f"daemon {node.index} exited with status {code}; its log ends:\n  "
                    + "\n  ".join(tail)
                )

    async def start_swarm(self) -> None:
        wan = f" behind WAN emulators ({self.options.wan})" if self.options.wan else ""
        self.say(
            f"starting {self.n_daemons} daemons "
            f"({self.spec.n_stages} stages x {self.options.replicas}){wan} "
            f"on run {self.spec.name} ({self.spec.run_id}); logs in {self.root}"
        )
        first = self._spawn_daemon(0, [])

        async def bootstrap() -> list[str] | None:
            status = await self._poll(first)
            return status["dht_addrs"] if status and status["dht_addrs"] else None

        initial = await self._until("the first daemon's DHT", bootstrap, STARTUP_TIMEOUT_S)
        for index in range(1, self.n_daemons):
            self._spawn_daemon(index, initial)
        await self._until("every daemon online", self._all_online, STARTUP_TIMEOUT_S)
        stages = sorted(n.status["stage"] for n in self.nodes)
        self.say(f"swarm online: stages {stages}")

    async def _all_online(self) -> bool | None:
        statuses = await asyncio.gather(*(self._poll(n) for n in self.nodes))
        if any(s is None or s["state"] != "online" for s in statuses):
            return None
        served = {
            s["stage"]
            for s in statuses
            if s is not None
            and s.get("components", {}).get("stage_server", {}).get("state") == "online"
        }
        return True if served >= set(range(self.spec.n_stages)) else None

    async def shutdown(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S + 15
        for node in self.nodes:
            left = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.to_thread(node.proc.wait, left)
            except subprocess.TimeoutExpired:
                self.say(f"daemon {node.index} did not leave in time: killing it")
                node.proc.kill()
                await asyncio.to_thread(node.proc.wait, 10)
            if node.emulator is not None and node.emulator.poll() is None:
                node.emulator.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(node.emulator.wait, 10)
                except subprocess.TimeoutExpired:
                    node.emulator.kill()

    # ---- evaluation ---------------------------------------------------------------

    def _servers(self) -> dict[int, list[Any]]:
        from ..training.trainer import ServerInfo

        out: dict[int, list[Any]] = {}
        for node in self.nodes:
            status = node.status
            server = status.get("components", {}).get("stage_server", {})
            addr = status.get("quic_addr")
            if not server or addr is None or node.proc.poll() is not None:
                continue
            host, _, port = addr.rpartition(":")
            out.setdefault(server["stage"], []).append(
                ServerInfo(
                    peer_id=status["peer_id"],
                    host=host.strip("[]"),
                    port=int(port),
                    throughput=server["throughput"],
                    queue_len=server["queue"],
                    state=server["state"],
                    rtt=None,
                )
            )
        return out

    async def evaluate(self) -> float:
        """Mean validation loss (nats/byte) through the swarm, from a client of our own."""
        from ...transport.config import TransportConfig
        from ...transport.endpoint import Endpoint
        from ...transport.identity import Identity
        from ..training.data import validation_set
        from ..training.trainer import Trainer, TrainerConfig

        await asyncio.gather(*(self._poll(n) for n in self.nodes))
        inputs, targets = await asyncio.to_thread(validation_set, self.spec)
        n = min(self.options.eval_windows, int(inputs.shape[0]))
        servers = self._servers()
        async with Endpoint(
            Identity.generate(), TransportConfig(host="127.0.0.1", port=0)
        ) as endpoint:
            trainer = Trainer(
                self.spec, TrainerConfig(), endpoint=endpoint, servers=lambda: servers
            )
            try:
                return await trainer.evaluate((inputs[:n], targets[:n]))
            except NodeError as exc:
                raise DemoError(f"validation through the swarm failed: {exc}") from None
            except ExceptionGroup as group:
                first = group.exceptions[0]
                while isinstance(first, ExceptionGroup):
                    first = first.exceptions[0]
                raise DemoError(f"validation through the swarm failed: {first}") from None

    # ---- training -----------------------------------------------------------------

    def _totals(self) -> dict[str, Any]:
        trainers = [
            n.status.get("components", {}).get("trainer", {}) for n in self.nodes if n.status
        ]
        servers = [
            n.status.get("components", {}).get("stage_server", {}) for n in self.nodes if n.status
        ]
        losses = [t["loss_ewma"] for t in trainers if t.get("loss_ewma") is not None]
        return {
            "tokens": sum(t.get("tokens", 0) for t in trainers),
            "tokens_per_s": sum(t.get("tokens_per_s", 0.0) for t in trainers),
            "loss": sum(losses) / len(losses) if losses else None,
            "epoch": max((s.get("epoch", 0) for s in servers), default=0),
            "completed": sum(t.get("micro_batches", {}).get("completed", 0) for t in trainers),
            "failed": sum(t.get("micro_batches", {}).get("failed", 0) for t in trainers),
        }

    def traffic(self) -> dict[str, Any]:
        """Cumulative traffic counters summed over the daemons (from their last polled status).

        Trainer payload bytes count the encoded tensors of every successful hop, both
        directions, as the trainers' status reports them; hops are successful hops per stage;
        QUIC bytes are UDP payload bytes of every daemon's endpoint (trainer and server
        traffic, FEC repair symbols, retransmissions, acknowledgements and pings included).
        """
        trainers = [
            n.status.get("components", {}).get("trainer", {}) for n in self.nodes if n.status
        ]
        endpoints = [
            n.status.get("components", {}).get("endpoint", {}) for n in self.nodes if n.status
        ]
        hops = [0] * self.spec.n_stages
        for t in trainers:
            for stage, count in t.get("hops", {}).items():
                if 0 <= int(stage) < len(hops):
                    hops[int(stage)] += int(count)
        return {
            "tokens": sum(t.get("tokens", 0) for t in trainers),
            "payload_bytes_sent": sum(t.get("payload_bytes", {}).get("sent", 0) for t in trainers),
            "payload_bytes_received": sum(
                t.get("payload_bytes", {}).get("received", 0) for t in trainers
            ),
            "hops": hops,
            "retried_hops": sum(t.get("retried_hops", 0) for t in trainers),
            "cache_misses": sum(t.get("cache_misses", 0) for t in trainers),
            "failed_micro_batches": sum(
                t.get("micro_batches", {}).get("failed", 0) for t in trainers
            ),
            "quic_bytes_out": sum(e.get("bytes_out") or 0 for e in endpoints),
            "quic_bytes_in": sum(e.get("bytes_in") or 0 for e in endpoints),
        }

    async def train(self) -> tuple[float, int]:
        """Show progress until the budget, the duration or a stop; (seconds, tokens at the start).

        ``self.traffic_start`` and ``self.traffic_end`` hold ``traffic()`` at both ends.
        """
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._poll(n) for n in self.nodes))
        started = loop.time()
        last_line = -math.inf
        base = self._totals()["tokens"]
        self.traffic_start = self.traffic()
        while not self.stop.is_set():
            self._check_alive()
            await asyncio.gather(*(self._poll(n) for n in self.nodes))
            t = self._totals()
            elapsed = loop.time() - started
            loss = "-" if t["loss"] is None else f"{t['loss']:.3f}"
            line = (
                f"epoch {t['epoch']:>4}  loss {loss:>6}  {t['tokens_per_s']:>7.0f} tok/s  "
                f"{t['tokens'] / 1e3:>7.0f}k tokens  "
                f"{t['completed']} micro-batches ({t['failed']} failed)  "
                f"{elapsed:>5.0f}s / {self.options.duration_s:.0f}s"
            )
            if self.tty:
                self.out.write(
                    "\r"
                    + self.options.label
                    + (" " if self.options.label else "")
                    + line
                    + "\x1b[K"
                )
                self.out.flush()
            elif elapsed - last_line >= self.line_period_s:
                self.say(line)
                last_line = elapsed
            if t["tokens"] >= self.options.tokens or elapsed >= self.options.duration_s:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), PROGRESS_PERIOD_S)
        if self.tty:
            self.out.write("\n")
        elapsed = loop.time() - started
        await asyncio.gather(*(self._poll(n) for n in self.nodes))
        self.traffic_end = self.traffic()
        return elapsed, base

    def stage_table(self) -> list[dict[str, Any]]:
        rows = []
        for stage in range(self.spec.n_stages):
            members = [n for n in self.nodes if n.status.get("stage") == stage]
            ids = {n.status["peer_id"] for n in members}
            rtts = [
                p["rtt_ms"]
                for n in self.nodes
                for p in n.status.get("peers", [])
                if p["peer_id"] in ids and p.get("rtt_ms") is not None
            ]
            comp = [n.status.get("components", {}) for n in members]
            rows.append(
                {
                    "stage": stage,
                    "peers": len(members),
                    "micro_batches": sum(c.get("stage_server", {}).get("applied", 0) for c in comp),
                    "bytes_sent": sum(c.get("endpoint", {}).get("bytes_out", 0) for c in comp),
                    "mean_rtt_ms": sum(rtts) / len(rtts) if rtts else None,
                    # device-thread seconds, summed over the stage's servers: running requests, and
                    # inside the optimizer, from requests or the periodic step check (a synchronous
                    # step waits there for the all-reduce)
                    "compute_s": round(
                        sum(c.get("stage_server", {}).get("compute_s", 0.0) for c in comp), 1
                    ),
                    "optimizer_s": round(
                        sum(c.get("stage_server", {}).get("optimizer_s", 0.0) for c in comp), 1
                    ),
                    "epoch": max(
                        (c.get("stage_server", {}).get("epoch", 0) for c in comp), default=0
                    ),
                }
            )
        return rows

    async def measure(self) -> dict[str, Any]:
        """Start the swarm, evaluate, train, evaluate again; the figures (DemoError on failure).

        Prints the progress and the per-stage table as ``wanswarm demo`` does. The caller
        shuts the daemons down (``shutdown``) whatever happens.
        """
        await self.start_swarm()
        val_start = await self.evaluate()
        self.say(f"validation loss at start: {val_start:.3f} nats/byte")
        elapsed, start_tokens = await self.train()
        totals = self._totals()
        val_end = await self.evaluate()
        tokens_at_eval_end = self._totals()[
            "tokens"
        ]  # evaluate() polled: trainers went on meanwhile
        self.say(
            f"validation loss at end:   {val_end:.3f} nats/byte after {elapsed:.0f}s, "
            f"{totals['tokens'] / 1e3:.0f}k tokens, optimizer epoch {totals['epoch']}"
        )
        rows = self.stage_table()
        self.say(
            f"{'stage':>5} {'peers':>5} {'micro-batches':>13} {'bytes sent':>12} {'mean RTT':>10} "
            f"{'device s':>9} {'in step s':>9} {'epoch':>6}"
        )
        for r in rows:
            rtt = "-" if r["mean_rtt_ms"] is None else f"{r['mean_rtt_ms']:.1f} ms"
            self.say(
                f"{r['stage']:>5} {r['peers']:>5} {r['micro_batches']:>13} "
                f"{_bytes(r['bytes_sent']):>12} "
                f"{rtt:>10} {r['compute_s']:>9.1f} {r['optimizer_s']:>9.1f} {r['epoch']:>6}"
            )
        self.say(
            "(device s: seconds the stage's servers ran requests, summed; in step s: seconds "
            "inside the optimizer, from requests and from the periodic step check, where a "
            "synchronous step waits for the stage's all-reduce)"
        )
        start, end = self.traffic_start, self.traffic_end
        training = {
            key: (
                [b - a for a, b in zip(start[key], end[key], strict=True)]
                if isinstance(start[key], list)
                else end[key] - start[key]
            )
            for key in start
        }
        return {
            # the fields of the --json line
            "val_loss_start": round(val_start, 4),
            "val_loss_end": round(val_end, 4),
            "tokens": totals["tokens"],
            "tokens_per_s": round((totals["tokens"] - start_tokens) / elapsed, 1)
            if elapsed > 0
            else 0.0,
            "daemons": self.n_daemons,
            "stages": rows,
            "elapsed_s": round(elapsed, 1),
            "epoch": totals["epoch"],
            # what only the programmatic API returns
            "run_id": self.spec.run_id,
            "codecs": self.spec.codecs.model_dump(),
            "wan": self.options.wan,
            "replicas": self.options.replicas,
            "tokens_at_eval_end": tokens_at_eval_end,
            "failed_micro_batches": totals["failed"],
            # traffic() deltas over the training phase (between the evaluations)
            "training": training,
            "interrupted": self.stop.is_set(),
        }

    async def run(self) -> int:
        """``wanswarm demo``: measure, print (``--json``: one last JSON line), always shut down."""
        self._install_signal_handlers()
        code = 1
        try:
            result = await self.measure()
            if self.options.json:
                self.out.write(json.dumps({key: result[key] for key in JSON_FIELDS}) + "\n")
                self.out.flush()
            code = 0 if not self.stop.is_set() else 130
        except DemoError as exc:
            self.say(f"wanswarm demo: {exc}")
            code = 130 if self.stop.is_set() else 1
        finally:
            await self._stop_daemons()
        return code

    async def run_to_result(self) -> dict[str, Any]:
        """``measure`` with the daemons always shut down afterwards (DemoError on failure)."""
        self._install_signal_handlers()
        try:
            return await self.measure()
        finally:
            await self._stop_daemons()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._interrupt)

    async def _stop_daemons(self) -> None:
        self.say("stopping the daemons (SIGTERM)...")
        await self.shutdown()
        if self.options.keep:
            self.say(f"kept state dirs and logs in {self.root}")
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    def _interrupt(self) -> None:
        if self.stop.is_set():
            return
        self.stop.set()
        self.say("\ninterrupted: stopping")


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def run_demo(options: DemoOptions) -> int:
    """Run the demo to the end; returns the exit status (0 done, 1 failure, 130 interrupted)."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return asyncio.run(Demo(options).run())


def run_swarm(options: DemoOptions, out: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the demo swarm in this process and return its figures (``Demo.measure``).

    Progress and the per-stage table go to ``out``; no JSON line is written. Raises
    DemoError when the swarm cannot start or a daemon dies; an interrupt (SIGINT/SIGTERM)
    ends training early and the result says ``"interrupted": true``.
    """
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return asyncio.run(Demo(options, out).run_to_result())


__all__ = ["JSON_FIELDS", "Demo", "DemoError", "DemoOptions", "run_demo", "run_swarm"]
