"""``wanswarm demo``: a local swarm of real daemons training the embedded default run.

Starts ``replicas x stages`` daemons as subprocesses (``wanswarm join`` on 127.0.0.1, ports
0, each with its own temporary state directory and log file). The first bootstraps the DHT;
the others start together once it is up and join through its address. Daemon ``i`` serves
stage ``i mod S`` (``node.stage``): the demo knows its layout, so it pins it rather than
waiting for each claim in turn (a swarm of volunteers uses stage_selection instead). With
``--wan PROFILE`` every daemon gets a WAN emulator process in front of its QUIC port and
its DHT port and announces the emulator's addresses, so every link into it, the stage
traffic and the libp2p traffic (DHT, averaging, state downloads) alike, crosses the
emulated WAN.

While the swarm trains, a progress line (optimizer epoch, trainer loss, tokens/s, elapsed,
the time left) is redrawn in place on a TTY, printed every few seconds otherwise. Validation
loss is measured through the swarm at the start and the end by an evaluation client in this
process (its own QUIC endpoint and identity; servers taken from the daemons' status). The
run stops at the token budget (``DEMO_TOKENS`` by default, so that runs compare at equal
training) or at the duration, a cap, whichever comes first, or on Ctrl-C; every daemon then
gets SIGTERM (the graceful leave), then SIGKILL if it outlives the shutdown timeout.

Daemons may die while it trains: the supervisor (demo_supervisor.py) reports each death and
training goes on; with ``--chaos`` it also kills and restarts daemons on a seeded plan
(demo_chaos.py). Before the final evaluation every killed daemon is restarted and every
stage must be served again. With a loss-curve path (the CLI's default), the single-process
reference trains alongside (demo_reference.py) and, once the daemons are stopped, the
swarm's and the reference's losses are drawn into a PNG (demo_plot.py).

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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..config.runspec import RunSpecError
from ..errors import NodeError
from ..logs import get_logger
from . import demo_figures
from .demo_chaos import ChaosConfig, chaos_schedule, describe
from .demo_daemons import (
    DemoDaemon,
    DemoError,
    check_alive,
    describe_wan_links,
    spawn_daemon,
    stop_daemons,
    wan_link_totals,
)
from .demo_reference import ReferenceRun
from .demo_supervisor import Supervisor

log = get_logger(__name__)

PROGRESS_PERIOD_S = 2.0  # status polls
PLAIN_LINE_PERIOD_S = 10.0  # progress lines when stdout is not a TTY
STARTUP_TIMEOUT_S = 300.0  # the whole swarm up, every stage served
# The default demo trains to a token budget, so that two runs (calm and --chaos, an idle
# and a loaded machine) end at the same point of training and their losses compare; the
# duration is a cap for a machine too slow to reach it. On 2 idle cores the 6 daemons train
# at 1000-1400 tokens/s (docs/tiny_run.md): 500k tokens in 6-8 minutes, plus start-up, two
# evaluations and shutdown.
DEMO_TOKENS = 500_000
DEMO_DURATION_S = 900.0
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
    "wire_bytes_per_token",
)
# and after them, when the run has them: faults (demo_supervisor.py), the loss curve
EXTRA_JSON_FIELDS = (
    "kills",
    "restarts",
    "exits",
    "stage_empty_s",
    "wan_links",
    "reference_val_loss",
    "loss_curve_png",
)
# the longest the demo waits, once its daemons are stopped, for the reference to reach the
# swarm's token count (it then draws what the reference has)
REFERENCE_WAIT_S = 300.0
FINAL_EVAL_ATTEMPTS = 4  # the final evaluation, when a stage answers busy
FINAL_EVAL_RETRY_S = 20.0


@dataclass(frozen=True)
class DemoOptions:
    replicas: int = 2
    duration_s: float = DEMO_DURATION_S
    tokens: int = DEMO_TOKENS
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
    chaos: ChaosConfig | None = None  # kill and restart daemons on a plan (demo_chaos.py)
    chaos_seed: int = 0  # the plan's seed
    loss_curve: Path | None = None  # PNG of the swarm's and the reference's loss; None: none


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
        self.supervisor: Supervisor | None = None  # set by train
        self._line_shown = False  # a progress line is on the TTY without its newline
        self.curve: list[tuple[float, float]] = []  # (tokens, trainers' mean loss) while training
        self.reference: ReferenceRun | None = None  # when a loss curve is drawn
        self.traffic_end: dict[str, Any] = {}  # and when it stops
        self.line_period_s = (
            PLAIN_LINE_PERIOD_S if options.progress_period_s is None else options.progress_period_s
        )

    # ---- output -------------------------------------------------------------------

    def say(self, text: str) -> None:
        self._end_line()
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

    def _end_line(self) -> None:
        """End the progress line redrawn in place, before other text."""
        if self._line_shown:
            self.out.write("\n")
            self._line_shown = False

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

    async def _until(self, what: str, check: Any, timeout: float, strict: bool = True) -> Any:
        """Poll ``check()`` (async, returns a value or None) until it answers; DemoError on
        timeout, and when ``strict`` as soon as a daemon has exited (start-up)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if strict:
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

    async def shutdown(self) -> dict[str, int] | None:
        """Stop every daemon; with ``--wan``, what crossed the emulated links."""
        stats = await stop_daemons(self.nodes, self.say)
        return wan_link_totals(stats) if self.options.wan else None

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

    def _retired(self) -> list[dict[str, Any]]:
        """The last statuses of daemon processes that ended (killed, crashed)."""
        return [] if self.supervisor is None else self.supervisor.retired

    def _totals(self) -> dict[str, Any]:
        return demo_figures.totals(self._statuses(), self._retired())

    def traffic(self) -> dict[str, Any]:
        """Cumulative traffic counters summed over the daemons, from their last polled status
        and the last status of every process that ended (``demo_figures.traffic``)."""
        return demo_figures.traffic(self._statuses() + self._retired(), self.spec.n_stages)

    def _progress(self, line: str, elapsed: float, last_line: float) -> float:
        """Show the progress line (in place on a TTY); returns when a plain line was last
        printed."""
        if self.tty:
            label = self.options.label + (" " if self.options.label else "")
            self.out.write("\r" + label + line + "\x1b[K")
            self.out.flush()
            self._line_shown = True
        elif elapsed - last_line >= self.line_period_s:
            self.say(line)
            return elapsed
        return last_line

    async def train(self) -> tuple[float, int]:
        """Show progress until the budget, the duration or a stop; (seconds, tokens at the start).

        Daemons that die are reported and training goes on (``self.supervisor``, which also
        carries out the ``--chaos`` plan). ``self.traffic_start`` and ``self.traffic_end`` hold
        ``traffic()`` at both ends; ``self.curve`` the trainers' mean loss at every poll.
        """
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(n.poll() for n in self.nodes))
        chaos = self.options.chaos
        schedule = []
        if chaos is not None:
            schedule = chaos_schedule(
                self.spec.n_stages,
                self.options.replicas,
                self.options.duration_s,
                self.options.chaos_seed,
                chaos,
            )
            kills = sum(1 for e in schedule if e.action == "kill")
            self.say(
                f"{describe(chaos)}; seed {self.options.chaos_seed}: {kills} kill(s) planned "
                f"within {self.options.duration_s:.0f}s"
            )

        def counters() -> dict[str, int]:
            t = self._totals()
            return {"retried": t["retried"], "failed": t["failed"]}

        self.supervisor = Supervisor(
            self.nodes,
            self.spec.n_stages,
            self.say,
            counters,
            schedule,
            allow_empty=chaos is not None and chaos.allow_empty,
        )
        started = loop.time()
        last_line = -math.inf
        base = self._totals()["tokens"]
        self.traffic_start = self.traffic()
        if self.reference is not None:
            self.reference.start()
        while not self.stop.is_set():
            await asyncio.gather(*(n.poll() for n in self.nodes))
            elapsed = loop.time() - started
            await self.supervisor.tick(elapsed)
            t = self._totals()
            if t["loss"] is not None:
                self.curve.append((t["tokens"], t["loss"]))
            eta = demo_figures.eta_s(
                t["tokens"], base, self.options.tokens, elapsed, self.options.duration_s
            )
            line = demo_figures.progress_line(t, elapsed, eta, self.supervisor.progress())
            last_line = self._progress(line, elapsed, last_line)
            if t["tokens"] >= self.options.tokens or elapsed >= self.options.duration_s:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), PROGRESS_PERIOD_S)
        self._end_line()
        elapsed = loop.time() - started
        await asyncio.gather(*(n.poll() for n in self.nodes))
        self.traffic_end = self.traffic()
        return elapsed, base

    async def _every_stage_served(self, elapsed: float) -> None:
        """After training: restart the daemons the chaos plan left down and wait until they
        serve again and every stage is served (the final evaluation routes through each;
        a stage's surviving replica may still be stalled by its partner's death)."""
        assert self.supervisor is not None
        self.supervisor.finish(elapsed)

        async def served() -> bool | None:
            await asyncio.gather(*(n.poll() for n in self.nodes))
            assert self.supervisor is not None
            await self.supervisor.tick(elapsed)
            every = self.supervisor.served() >= set(range(self.spec.n_stages))
            return True if every and not self.supervisor.restarting() else None

        await self._until("every stage served again", served, STARTUP_TIMEOUT_S, strict=False)

    async def _final_evaluation(self) -> float:
        """``evaluate`` after training, tried again when a stage is busy (a replica that lost
        its partner can stall until the stage's averaging gives up on it)."""
        for attempt in range(1, FINAL_EVAL_ATTEMPTS + 1):
            try:
                return await self.evaluate()
            except DemoError as exc:
                if attempt == FINAL_EVAL_ATTEMPTS or self.stop.is_set():
                    raise
                self.say(f"{exc}; evaluating again in {FINAL_EVAL_RETRY_S:.0f}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), FINAL_EVAL_RETRY_S)
        raise AssertionError("unreachable")

    async def measure(self) -> dict[str, Any]:
        """Start the swarm, evaluate, train, evaluate again; the figures (DemoError on failure).

        Prints the progress and the per-stage table as ``wanswarm demo`` does. The caller
        shuts the daemons down (``shutdown``) whatever happens.
        """
        await self.start_swarm()
        if self.options.loss_curve is not None:
            self.reference = ReferenceRun(
                self.spec, self.spec_path, self.options.tokens, self.options.eval_windows, self.root
            )
        val_start = await self.evaluate()
        self.say(f"validation loss at start: {val_start:.3f} nats/byte")
        elapsed, start_tokens = await self.train()
        totals = self._totals()
        if not self.stop.is_set():
            await self._every_stage_served(elapsed)
        val_end = await self._final_evaluation()
        # evaluate() polled: trainers went on meanwhile
        tokens_at_eval_end = self._totals()["tokens"]
        self.say(
            f"validation loss at end:   {val_end:.3f} nats/byte after {elapsed:.0f}s, "
            f"{totals['tokens'] / 1e3:.0f}k tokens, optimizer epoch {totals['epoch']}"
        )
        statuses = self._statuses()  # one poll for the table and the wire figures
        rows = demo_figures.stage_rows(statuses, self.spec.n_stages)
        for line in demo_figures.stage_table(rows):
            self.say(line)
        assert self.supervisor is not None
        faults = self.supervisor.summary()
        if faults["outages"] or faults["kills"]:
            self.say(
                f"faults: {faults['kills']} daemon(s) killed by --chaos, {faults['restarts']} "
                f"restarted, {faults['exits']} other exit(s), {faults['skipped_kills']} planned "
                f"kill(s) skipped; seconds each stage had no server: {faults['stage_empty_s']}"
            )
        spot = totals["spot_checks"]
        why, tier = spot["skipped_by"], spot["compared_by"]
        self.say(
            f"spot checks: {spot['checked']} checked, {tier.get('params', 0)} compared at "
            f"equal parameters and {tier.get('epoch', 0)} at the same epoch; "
            f"{spot['skipped']} skipped ({why.get('no_other_replica', 0)} no other "
            f"replica, {why.get('other_epoch', 0)} other epochs, "
            f"{why.get('unpromised', 0) + why.get('other_params', 0)} without equal "
            f"parameters); {spot['disagreements']} disagreement(s), {spot['convicted']} "
            "peer(s) convicted"
        )
        wire = demo_figures.wire_bytes_per_token(statuses)
        bf16 = 2 * self.spec.model.d_model
        for b, figures in enumerate(wire):
            self.say(
                f"boundary {b}->{b + 1}: {figures['forward']:.1f} B/token forward, "
                f"{figures['backward']:.1f} B/token backward on the wire "
                f"({bf16 / max(figures['forward'], 1e-9):.1f}x smaller than bf16 forward)"
            )
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
            "wire_bytes_per_token": wire,
            # and these ones after them
            "kills": faults["kills"],
            "restarts": faults["restarts"],
            "exits": faults["exits"],
            "stage_empty_s": faults["stage_empty_s"],
            # what only the programmatic API returns
            "run_id": self.spec.run_id,
            "codecs": self.spec.codecs.model_dump(),
            "wan": self.options.wan,
            "replicas": self.options.replicas,
            "tokens_at_eval_end": tokens_at_eval_end,
            "failed_micro_batches": totals["failed"],
            "spot_checks": totals["spot_checks"],
            "faults": faults,
            "curve": list(self.curve),
            # traffic() deltas over the training phase (between the evaluations)
            "training": training,
            "interrupted": self.stop.is_set(),
        }

    # ---- the loss curve -----------------------------------------------------------

    async def draw_loss_curve(self, result: dict[str, Any]) -> None:
        """Wait for the reference (the daemons are stopped: it has the cores), draw the PNG,
        say where it is; sets ``loss_curve_png`` and ``reference_val_loss`` in ``result``."""
        from .demo_plot import PlotUnavailable, write_loss_curve

        path = self.options.loss_curve
        if path is None or self.reference is None:
            return
        tokens = float(result["tokens"])
        points, done = self.reference.points()
        if not done and (not points or points[-1]["tokens"] < tokens):
            have = points[-1]["tokens"] if points else 0
            self.say(
                f"waiting for the single-process reference to reach {tokens / 1e3:.0f}k tokens "
                f"({have / 1e3:.0f}k so far; at most {REFERENCE_WAIT_S:.0f}s)"
            )
        points, done = await self.reference.wait(tokens, REFERENCE_WAIT_S)
        self.reference.stop()
        reference = [(p["tokens"], p["val_loss"]) for p in points]
        result["reference_val_loss"] = demo_figures.interpolate(reference, tokens)
        swarm_val = [
            (self.curve[0][0] if self.curve else 0.0, result["val_loss_start"]),
            (tokens, result["val_loss_end"]),
        ]
        title = f"wanswarm demo: {self.n_daemons} daemons, run {self.spec.name}" + (
            f", --chaos ({result['kills']} kills)" if self.options.chaos else ""
        )
        try:
            written = await asyncio.to_thread(
                write_loss_curve,
                path,
                swarm_train=self.curve,
                swarm_val=swarm_val,
                reference_val=reference,
                reference_train=[(p["tokens"], p["train_loss"]) for p in points],
                title=title,
            )
        except PlotUnavailable as exc:
            self.say(f"no loss curve: {exc}; pip install matplotlib to draw it")
            return
        except OSError as exc:
            self.say(f"no loss curve: cannot write {path}: {exc}")
            return
        result["loss_curve_png"] = str(written.resolve())
        ref = result["reference_val_loss"]
        against = "" if ref is None else f" (reference at as many tokens: {ref:.3f})"
        self.say(f"loss curve (swarm vs single-process reference{against}): {written.resolve()}")

    # ---- the whole run ------------------------------------------------------------

    async def run(self) -> int:
        """``wanswarm demo``: measure, print (``--json``: one last JSON line), always shut down."""
        self._install_signal_handlers()
        code = 1
        result: dict[str, Any] | None = None
        try:
            result = await self.measure()
            code = 0 if not self.stop.is_set() else 130
        except DemoError as exc:
            self.say(f"wanswarm demo: {exc}")
            code = 130 if self.stop.is_set() else 1
        finally:
            await self._stop_daemons(result)
        if result is not None and self.options.json:
            fields = JSON_FIELDS + tuple(k for k in EXTRA_JSON_FIELDS if k in result)
            self.out.write(json.dumps({key: result[key] for key in fields}) + "\n")
            self.out.flush()
        return code

    async def run_to_result(self) -> dict[str, Any]:
        """``measure`` with the daemons always shut down afterwards (DemoError on failure)."""
        self._install_signal_handlers()
        result: dict[str, Any] | None = None
        try:
            result = await self.measure()
            return result
        finally:
            await self._stop_daemons(result)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._interrupt)

    async def _stop_daemons(self, result: dict[str, Any] | None = None) -> None:
        self.say("stopping the daemons (SIGTERM)...")
        try:
            links = await self.shutdown()
            if links is not None:
                self.say(f"through the WAN emulators (the whole run): {describe_wan_links(links)}")
                if result is not None:
                    result["wan_links"] = links
            if result is not None:
                await self.draw_loss_curve(result)
        finally:
            if self.reference is not None:
                self.reference.stop()
        if self.options.keep:
            self.say(f"kept state dirs and logs in {self.root}")
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    def _interrupt(self) -> None:
        if self.stop.is_set():
            return
        self.stop.set()
        self.say("\ninterrupted: stopping")


def demo_chaos(on: bool, period_s: float, down_s: float, allow_empty: bool) -> ChaosConfig | None:
    """The ``--chaos`` plan's settings (None without ``--chaos``): the first kill half a
    period into training."""
    if not on:
        return None
    return ChaosConfig(
        period_s=period_s, down_s=down_s, first_kill_s=period_s / 2, allow_empty=allow_empty
    )


def loss_curve_path(path: Path | None) -> Path:
    """``path``, or ``wanswarm-demo-<date>-<time>.png`` in the current directory."""
    if path is not None:
        return path
    return Path.cwd() / time.strftime("wanswarm-demo-%Y%m%d-%H%M%S.png")


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


__all__ = [
    "DEMO_DURATION_S",
    "DEMO_TOKENS",
    "EXTRA_JSON_FIELDS",
    "JSON_FIELDS",
    "Demo",
    "DemoOptions",
    "demo_chaos",
    "loss_curve_path",
    "run_demo",
    "run_swarm",
]
