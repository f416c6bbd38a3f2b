"""The trainer: keeps micro-batches moving through the swarm's stages (SWARM, client side).

Up to ``max_in_flight`` micro-batches move at once (one asyncio task each) so that WAN
latency is hidden behind other micro-batches' work; how many exactly is a window that starts
small, grows as micro-batches complete and halves when they fail (window.py: an overloaded
swarm gets fewer new micro-batches, not as many as before); a new one starts only while
every stage has an online server. The pieces:

- pipeline.py: one micro-batch forward through every stage and backward again, the stage
  outputs relayed as they came;
- hops.py: one hop to a server the router picks, re-routed when it fails;
- servers.py: the servers of each stage, as the daemon's peer table and the endpoint's
  path measurements show them;
- window.py: the in-flight window;
- trainer_config.py: the ``[trainer]`` config.

A micro-batch whose hop failed on every attempt is counted and dropped; a completed one
feeds the loss moving average and tokens/s.

``evaluate`` runs validation windows through the swarm (``forward`` without caching, then
``eval_loss``, no gradients anywhere) and returns the mean loss in nats per token.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...transport.error_feedback import ErrorFeedback
from ..config.runspec import RunSpec
from ..logs import get_logger
from ..protocol import BadReply
from ..timing import jittered
from .hops import HopFailed, HopSender, RequestSender
from .pipeline import Pipeline
from .routing import Router
from .servers import ServerSource, ServerView
from .spot_checks import SpotChecker
from .trainer_config import TrainerConfig
from .window import InFlightWindow

log = get_logger(__name__)

_RATE_WINDOW_S = 30.0  # tokens/s is measured over this trailing window


@dataclass
class TrainerCounters:
    """What the trainer did since start."""

    started: int = 0
    completed: int = 0
    failed: int = 0
    retried_hops: int = 0
    backoffs: int = 0  # waits before a retry: no server of the stage left to try at once
    cache_misses: int = 0
    tokens: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    loss_ewma: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None
    hops: Counter[int] = field(default_factory=Counter)  # successful hops per stage
    errors: Counter[str] = field(default_factory=Counter)  # failed attempts by code/exception
    compute_s: float = 0.0  # device seconds servers reported for our successful hops
    spot_check_compute_s: float = 0.0  # of which for spot checks
    spot_checks: int = 0
    spot_checks_skipped: int = 0
    spot_check_disagreements: int = 0
    convicted: int = 0  # peers caught lying by a spot check


def _release(window: InFlightWindow, number: int, task: asyncio.Task[bool]) -> None:
    """A micro-batch's task ended: give its slot back (ok: it completed)."""
    ok = not task.cancelled() and task.exception() is None and task.result()
    window.release(number, ok=ok)


class Trainer:
    """Keeps micro-batches moving through the swarm (see the module docstring). Also a daemon
    ``Component``: ``start`` spawns ``run``; ``drain`` stops it after in-flight work."""

    name = "trainer"

    def __init__(
        self,
        spec: RunSpec,
        config: TrainerConfig,
        *,
        endpoint: RequestSender,
        servers: ServerSource,
        rng: random.Random | None = None,
        data: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None,
        spot_rng: random.Random | None = None,
    ) -> None:
        """``spot_rng`` picks the hops to spot-check; by default the system's randomness,
        so that no server can predict which of its answers will be checked."""
        self.spec, self.config = spec, config
        self.endpoint = endpoint
        self.peer_id = endpoint.peer_id
        self.rng = rng if rng is not None else random.Random()
        self.router = Router(config.router)
        self.view = ServerView(servers, endpoint.path_stats, self.router)
        self.counters = TrainerCounters()
        # error feedback of the gradients re-encoded here (only replies in another codec)
        self._ef = ErrorFeedback(max_entries=max(4, 2 * spec.n_stages), max_bytes=1 << 32)
        hops = HopSender(
            spec,
            config,
            endpoint=endpoint,
            view=self.view,
            router=self.router,
            counters=self.counters,
            rng=self.rng,
        )
        self.spot_checker = SpotChecker(
            config.spot_checks,
            router=self.router,
            counters=self.counters,
            rng=spot_rng if spot_rng is not None else random.SystemRandom(),
            clock=time.monotonic,
            # the per-step all-reduce's replicas answer alike at one epoch; DiLoCo's and
            # gossip's drift apart within a round (their inner steps on their own data)
            by_epoch=spec.averaging.mode == "allreduce",
        )
        self._pipeline = Pipeline(
            spec, config, trainer_id=self.peer_id, hops=hops, ef=self._ef, spot=self.spot_checker
        )
        self._data = data
        self._next_id = self.rng.getrandbits(62)  # ids stay unique across restarts
        self._stopping = False
        self._unpaused = asyncio.Event()  # cleared by pause(): no new micro-batch starts
        self._unpaused.set()
        self._position_path: Path | None = None  # set by start(): the node's state dir
        self._task: asyncio.Task[Any] | None = None
        self._started_at: float | None = None
        self._completions: deque[tuple[float, int]] = deque()
        self.window = InFlightWindow(config.max_in_flight)

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self, ctx: Any) -> None:
        """Component seam: run in the daemon's TaskGroup."""
        # where a streamed dataset keeps this trainer's position, so that a restart resumes
        # instead of reading its shard again (datasets.py; a file of another run is ignored)
        self._position_path = Path(ctx.state_dir) / "data_position.json"
        self._task = ctx.spawn(self.run(), "trainer")

    def pause(self) -> None:
        """``wanswarm pause``: start no new micro-batch (those in flight finish)."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    async def drain(self, deadline: float) -> None:
        """Start no new micro-batch; let in-flight ones finish until ``deadline``."""
        self._stopping = True
        self._unpaused.set()  # a paused run wakes to see that it stops
        if self._task is None or self._task.done():
            return
        remaining = deadline - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({self._task}, timeout=max(0.0, remaining))
        if not done:  # (a failure of the task is the daemon's TaskGroup's to report)
            self._task.cancel()
            log.warning("trainer: drain deadline reached; in-flight micro-batches abandoned")

    async def close(self) -> None:
        self._stopping = True
        self._unpaused.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def stop(self) -> None:
        """Start no new micro-batch (``run`` returns once in-flight ones are done)."""
        self._stopping = True
        self._unpaused.set()

    def status(self) -> dict[str, Any]:
        c = self.counters
        elapsed = time.monotonic() - self._started_at if self._started_at is not None else 0.0
        return {
            "paused": not self._unpaused.is_set(),
            "micro_batches": {"started": c.started, "completed": c.completed, "failed": c.failed},
            "window": self.window.status(),
            "retried_hops": c.retried_hops,
            "backoffs": c.backoffs,
            "cache_misses": c.cache_misses,
            "tokens": c.tokens,
            "tokens_per_s": round(self.tokens_per_s(), 1),
            "tokens_per_s_overall": round(c.tokens / elapsed, 1) if elapsed > 0 else 0.0,
            "loss_ewma": c.loss_ewma,
            "val_loss": c.val_loss,
            "payload_bytes": {"sent": c.payload_bytes_sent, "received": c.payload_bytes_received},
            # per stage boundary: payload bytes per token forward and backward (a subspace
            # run's coefficients and token ids; docs/compression.md)
            "wire_bytes_per_token": self._pipeline.wire_bytes_per_token(),
            "hops": {str(k): v for k, v in sorted(c.hops.items())},
            "errors": dict(c.errors),
            "spot_checks": {
                "checked": c.spot_checks,
                "skipped": c.spot_checks_skipped,
                # why: no other replica answered, the answers came from different epochs,
                # or (the same-epoch comparison off) they promised no equal parameters
                # (docs/hostile.md)
                "skipped_by": dict(self.spot_checker.skipped),
                # the checks that compared answers: with equal promised parameters, or at
                # the same epoch within the looser bound
                "compared_by": dict(self.spot_checker.compared),
                # answers that both other replicas contradicted at the same epoch without
                # equal parameters: a timed ban, not a conviction
                "outvoted": self.spot_checker.outvoted,
                "disagreements": c.spot_check_disagreements,
                "convicted": c.convicted,
                "extra_compute_fraction": (
                    round(c.spot_check_compute_s / (c.compute_s - c.spot_check_compute_s), 4)
                    if c.compute_s > c.spot_check_compute_s
                    else 0.0
                ),
                "evidence": list(self.spot_checker.evidence)[-4:],
            },
        }

    def tokens_per_s(self) -> float:
        """Tokens of completed micro-batches per second over the last 30 s."""
        now = time.monotonic()
        while self._completions and self._completions[0][0] < now - _RATE_WINDOW_S:
            self._completions.popleft()
        if not self._completions or self._started_at is None:
            return 0.0
        span = min(_RATE_WINDOW_S, now - self._started_at)
        return sum(n for _, n in self._completions) / span if span > 0 else 0.0

    # ---- training -----------------------------------------------------------------

    async def run(self, max_micro_batches: int | None = None) -> None:
        """Train until stopped (or ``max_micro_batches`` started and finished)."""
        if self._data is None:
            from .data import TrainStream  # reads the corpus: off the event loop

            seed = self.config.data_seed
            if seed is None:
                digest = hashlib.sha256(f"wanswarm-data:{self.peer_id}".encode()).digest()
                seed = int.from_bytes(digest[:8], "big") >> 1
            self._data = await asyncio.to_thread(
                TrainStream, self.spec, seed, None, self._position_path
            )
        data = self._data
        self._started_at = time.monotonic()
        window = self.window
        async with asyncio.TaskGroup() as tg:
            while not self._stopping and (
                max_micro_batches is None or self.counters.started < max_micro_batches
            ):
                number = await window.acquire()
                await self._unpaused.wait()
                await self._wait_for_every_stage()
                # None: a finite source ran out
                batch = None if self._stopping else next(data, None)
                if batch is None:
                    window.cancel()
                    break
                inputs, targets = batch
                mb = self._new_id()
                self.counters.started += 1
                task = tg.create_task(
                    self._train_one(mb, inputs, targets), name=f"micro-batch {mb}"
                )
                task.add_done_callback(partial(_release, window, number))

    async def _wait_for_every_stage(self) -> None:
        while not self._stopping:
            missing = self.view.missing_stages(self.spec.n_stages)
            if not missing:
                return
            log.info("trainer: waiting for servers of stage(s) %s", missing)
            await asyncio.sleep(jittered(self.config.no_server_wait_s, 0.2, self.rng))

    def _new_id(self) -> int:
        mb = self._next_id
        self._next_id = (self._next_id + 1) % (1 << 63)
        return mb

    async def _train_one(self, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        """One micro-batch through the swarm; False if it failed."""
        try:
            loss = await self._pipeline.forward_backward(mb, inputs, targets)
        except HopFailed as exc:
            self.counters.failed += 1
            log.warning("trainer: micro-batch %d failed: %s", mb, exc)
            return False
        c = self.counters
        tokens = inputs.numel()
        c.completed += 1
        c.tokens += tokens
        c.last_loss = loss
        a = self.config.loss_ewma_alpha
        c.loss_ewma = loss if c.loss_ewma is None else (1 - a) * c.loss_ewma + a * loss
        self._completions.append((time.monotonic(), tokens))
        return True

    # ---- validation -------------------------------------------------------------------

    async def evaluate(self, windows: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Mean validation loss (nats/token) of ``windows`` = (inputs, targets), each (N, T).

        Runs micro-batches of ``micro_batch_size`` windows through the swarm with no
        gradients (``forward`` without caching, then ``eval_loss``), ``max_in_flight`` at a
        time. Raises HopFailed if any of them cannot be evaluated.
        """
        inputs, targets = windows
        B = self.spec.batch.micro_batch_size
        chunks = [
            (inputs[i : i + B], targets[i : i + B]) for i in range(0, int(inputs.shape[0]), B)
        ]
        if not chunks:
            raise ValueError("no validation windows")
        slots = asyncio.Semaphore(self.config.max_in_flight)

        async def one(x: torch.Tensor, y: torch.Tensor) -> float:
            async with slots:
                return await self._pipeline.eval_loss(self._new_id(), x, y)

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(x, y)) for x, y in chunks]
        total = sum(t.result() * int(x.shape[0]) for t, (x, _) in zip(tasks, chunks, strict=False))
        loss = total / int(inputs.shape[0])
        if not math.isfinite(loss):
            raise BadReply("validation loss is not finite")
        self.counters.val_loss = loss
        return loss
