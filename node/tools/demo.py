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

This module runs that sequence; the daemons' processes (settings, WAN emulators, polling,
stopping) are demo_daemons.py's, and the figures read from their statuses (totals, traffic,
the per-stage table) are demo_figures.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..config.runspec import RunSpecError
from ..errors import NodeError
from ..logs import get_logger
from . import demo_figures
from .demo_daemons import DemoDaemon, DemoError, check_alive, spawn_daemon, stop_daemons

log = get_logger(__name__)

PROGRESS_PERIOD_S = 2.0  # status polls
PLAIN_LINE_PERIOD_S = 10.0  # progress lines when stdout is not a TTY
STARTUP_TIMEOUT_S = 300.0  # the whole swarm up, every stage served
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
        self.nodes: list[DemoDaemon] = []
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

    def _spawn_daemon(self, index: int, initial: list[str]) -> DemoDaemon:
        daemon = spawn_daemon(
            self.root,
            index,
            initial,
            n_stages=self.spec.n_stages,
            spec_path=self.spec_path,
            data_seed=self.options.data_seed,
            wan=self.options.wan,
            extra=self.options.extra,
        )
        self.nodes.append(daemon)
        return daemon

    def _statuses(self) -> list[dict[str, Any]]:
        """Every daemon's last polled status (``{}`` before its first answer)."""
        return [n.status for n in self.nodes]

    async def _until(self, what: str, check: Any, timeout: float) -> Any:
        """Poll ``check()`` (async, returns a value or None) until it answers; DemoError on
        timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            check_alive(self.nodes)
            value = await check()
            if value is not None:
                return value
            if loop.time() > deadline:
                raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")
            if self.stop.is_set():
                raise DemoError("interrupted")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.5)

    async def start_swarm(self) -> None:
        wan = f" behind WAN emulators ({self.options.wan})" if self.options.wan else ""
        self.say(
            f"starting {self.n_daemons} daemons "
            f"({self.spec.n_stages} stages x {self.options.replicas}){wan} "
            f"on run {self.spec.name} ({self.spec.run_id}); logs in {self.root}"
        )
        first = self._spawn_daemon(0, [])

        async def bootstrap() -> list[str] | None:
            status = await first.poll()
            return status["dht_addrs"] if status and status["dht_addrs"] else None

        initial = await self._until("the first daemon's DHT", bootstrap, STARTUP_TIMEOUT_S)
        for index in range(1, self.n_daemons):
            self._spawn_daemon(index, initial)
        await self._until("every daemon online", self._all_online, STARTUP_TIMEOUT_S)
        stages = sorted(n.status["stage"] for n in self.nodes)
        self.say(f"swarm online: stages {stages}")

    async def _all_online(self) -> bool | None:
        statuses = await asyncio.gather(*(n.poll() for n in self.nodes))
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
        await stop_daemons(self.nodes, self.say)

    # ---- evaluation ---------------------------------------------------------------

    async def evaluate(self) -> float:
        """Mean validation loss (nats/byte) through the swarm, from a client of our own."""
        from ...transport.config import TransportConfig
        from ...transport.endpoint import Endpoint
        from ...transport.identity import Identity
        from ..training.data import validation_set
        from ..training.trainer import Trainer
        from ..training.trainer_config import TrainerConfig

        await asyncio.gather(*(n.poll() for n in self.nodes))
        inputs, targets = await asyncio.to_thread(validation_set, self.spec)
        n = min(self.options.eval_windows, int(inputs.shape[0]))
        servers = demo_figures.stage_servers(
            [daemon.status for daemon in self.nodes if daemon.proc.poll() is None]
        )
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

    def traffic(self) -> dict[str, Any]:
        """Cumulative traffic counters summed over the daemons, from their last polled status
        (``demo_figures.traffic``)."""
        return demo_figures.traffic(self._statuses(), self.spec.n_stages)

    async def train(self) -> tuple[float, int]:
        """Show progress until the budget, the duration or a stop; (seconds, tokens at the start).

        ``self.traffic_start`` and ``self.traffic_end`` hold ``traffic()`` at both ends.
        """
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(n.poll() for n in self.nodes))
        started = loop.time()
        last_line = -math.inf
        base = demo_figures.totals(self._statuses())["tokens"]
        self.traffic_start = self.traffic()
        while not self.stop.is_set():
            check_alive(self.nodes)
            await asyncio.gather(*(n.poll() for n in self.nodes))
            t = demo_figures.totals(self._statuses())
            elapsed = loop.time() - started
            line = demo_figures.progress_line(t, elapsed, self.options.duration_s)
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
        await asyncio.gather(*(n.poll() for n in self.nodes))
        self.traffic_end = self.traffic()
        return elapsed, base

    async def measure(self) -> dict[str, Any]:
        """Start the swarm, evaluate, train, evaluate again; the figures (DemoError on failure).

        Prints the progress and the per-stage table as ``wanswarm demo`` does. The caller
        shuts the daemons down (``shutdown``) whatever happens.
        """
        await self.start_swarm()
        val_start = await self.evaluate()
        self.say(f"validation loss at start: {val_start:.3f} nats/byte")
        elapsed, start_tokens = await self.train()
        totals = demo_figures.totals(self._statuses())
        val_end = await self.evaluate()
        # evaluate() polled: trainers went on meanwhile
        tokens_at_eval_end = demo_figures.totals(self._statuses())["tokens"]
        self.say(
            f"validation loss at end:   {val_end:.3f} nats/byte after {elapsed:.0f}s, "
            f"{totals['tokens'] / 1e3:.0f}k tokens, optimizer epoch {totals['epoch']}"
        )
        rows = demo_figures.stage_rows(self._statuses(), self.spec.n_stages)
        for line in demo_figures.stage_table(rows):
            self.say(line)
        training = demo_figures.traffic_delta(self.traffic_start, self.traffic_end)
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


__all__ = ["JSON_FIELDS", "Demo", "DemoOptions", "run_demo", "run_swarm"]
