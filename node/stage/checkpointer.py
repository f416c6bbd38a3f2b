"""When a stage server writes its checkpoints, the thread that writes them, and the resume.

:class:`CheckpointSchedule` decides when the next periodic checkpoint is due (pure: the
caller passes ``now``). :class:`Checkpointer` owns a stage server's checkpoints: the device
thread exports the state and submits it, a writer thread writes it (checkpoint.py's
format, atomically) so serving never waits on the disk, and at start-up
:meth:`Checkpointer.resume` installs the newest checkpoint that verifies when
:func:`resume_source` prefers it to what the stage's peers gave.

An implausible epoch never wins a restart: when the peers answered, checkpoints more than
``max_epoch_lead`` epochs ahead of them are passed over (an older one within the bound may
still win), and no checkpoint beyond ``MAX_EPOCH`` is read at all. Otherwise a state with
a forged epoch, once checkpointed, would be installed again at every restart and pushed
into hivemind's progress tracker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from ..logs import get_logger
from .checkpoint import CheckpointError, check_run_id, latest, write_checkpoint
from .state_plan import MAX_EPOCH, StateTransferConfig
from .state_tensors import check_counters

log = get_logger(__name__)

ResumeSource = Literal["checkpoint", "peers", "fresh"]
InstallState = Callable[[int, dict[str, torch.Tensor], dict[str, Any]], None]
DEFAULT_MAX_EPOCH_LEAD: int = StateTransferConfig.model_fields["max_epoch_lead"].default


def plausible_epoch(
    peers_answered: bool, peer_epoch: int, max_epoch_lead: int = DEFAULT_MAX_EPOCH_LEAD
) -> int:
    """The highest epoch a starting server may resume from: ``max_epoch_lead`` past the
    peers' when they answered, else ``MAX_EPOCH``."""
    return min(MAX_EPOCH, peer_epoch + max_epoch_lead) if peers_answered else MAX_EPOCH


def resume_source(
    peers_answered: bool,
    peer_epoch: int,
    checkpoint_epoch: int | None,
    max_epoch_lead: int = DEFAULT_MAX_EPOCH_LEAD,
) -> ResumeSource:
    """Where a starting server's state comes from: its own checkpoint when it is newer than
    what the peers gave (or no peer answered) but not implausibly so (``plausible_epoch``),
    else the peers, else a fresh initialization."""
    if (
        checkpoint_epoch is not None
        and (not peers_answered or checkpoint_epoch > peer_epoch)
        and checkpoint_epoch <= plausible_epoch(peers_answered, peer_epoch, max_epoch_lead)
    ):
        return "checkpoint"
    return "peers" if peers_answered else "fresh"


@dataclass
class CheckpointSchedule:
    """When the next periodic checkpoint is due (pure: the caller passes ``now``).

    Due once ``period_s`` has passed since the last one and the epoch has moved since (the
    state within an epoch only gains gradient accumulators, which checkpoints do not hold).
    A period of 0 disables periodic checkpoints."""

    period_s: float
    last_time: float = -math.inf
    last_epoch: int | None = None

    def due(self, now: float, epoch: int) -> bool:
        return (
            self.period_s > 0 and now - self.last_time >= self.period_s and epoch != self.last_epoch
        )

    def mark(self, now: float, epoch: int) -> None:
        self.last_time, self.last_epoch = now, epoch


class Checkpointer:
    """A stage server's checkpoints: when the next is due, and a writer thread that writes them.

    The device thread exports the state (private CPU copies) and calls ``submit``; the disk
    work happens on the writer thread, one checkpoint at a time, so serving never waits on it.
    ``written``, ``failures`` and ``epoch`` are written by the writer thread (and ``epoch`` by
    ``resume``, before any write)."""

    EMPTY_STATUS: ClassVar[dict[str, int]] = {
        "checkpoint_epoch": -1,
        "checkpoints_written": 0,
        "checkpoint_failures": 0,
    }

    def __init__(
        self,
        state_dir: Path,
        run_id: str,
        stage: int,
        *,
        period_s: float,
        keep: int,
        max_epoch_lead: int = DEFAULT_MAX_EPOCH_LEAD,
    ) -> None:
        check_run_id(run_id)
        self.state_dir, self.run_id, self.stage, self.keep = state_dir, run_id, stage, keep
        self.max_epoch_lead = max_epoch_lead
        self.schedule = CheckpointSchedule(period_s)
        self.written = 0
        self.failures = 0
        # epoch of the newest checkpoint written (or resumed from, set by the owner)
        self.epoch = -1
        self._writer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"stage{stage}-checkpoint"
        )
        self._writing: Future[None] | None = None

    def due(self, now: float, epoch: int) -> bool:
        """A periodic checkpoint is due and the previous one is written."""
        return self.schedule.due(now, epoch) and (self._writing is None or self._writing.done())

    def submit(
        self, now: float, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> Future[None]:
        """Queue a write of this state; the future never raises (failures are logged and
        counted)."""
        self.schedule.mark(now, epoch)
        self._writing = self._writer.submit(self._write, epoch, tensors, meta)
        return self._writing

    def _write(self, epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            path = write_checkpoint(
                self.state_dir, self.run_id, self.stage, epoch, tensors, meta, keep=self.keep
            )
        except (OSError, CheckpointError) as exc:
            self.failures += 1
            log.warning("stage %d: checkpoint of epoch %d not written: %s", self.stage, epoch, exc)
            return
        self.written += 1
        self.epoch = epoch
        log.info("stage %d: checkpoint of epoch %d written to %s in %.2fs",
                 self.stage, epoch, path, time.perf_counter() - started)

    def resume(self, install: InstallState, peers_answered: bool, peer_epoch: int) -> ResumeSource:
        """Install our newest checkpoint with ``install`` (the optimizer's ``import_state``, on
        the device thread) when :func:`resume_source` picks it; returns where the state came from.
        A checkpoint that does not fit the stage is logged and left alone; checkpoints beyond
        :func:`plausible_epoch` are passed over for the newest one within it."""
        fallback: ResumeSource = "peers" if peers_answered else "fresh"
        bound = plausible_epoch(peers_answered, peer_epoch, self.max_epoch_lead)
        found = latest(self.state_dir, self.run_id, self.stage, max_epoch=bound)
        if found is None:
            return fallback
        if resume_source(peers_answered, peer_epoch, found.epoch, self.max_epoch_lead) != (
            "checkpoint"
        ):
            log.info(
                "stage %d: the peers' epoch %d is not older than our checkpoint's (%d): "
                "keeping theirs",
                self.stage,
                peer_epoch,
                found.epoch,
            )
            return fallback
        try:
            check_counters(found.epoch, found.tensors)
            install(found.epoch, found.tensors, found.optimizer_meta)
        except CheckpointError as exc:
            log.warning("stage %d: not resuming from %s: %s", self.stage, found.path, exc)
            return fallback
        self.epoch = found.epoch
        log.info(
            "stage %d: resumed from checkpoint %s (epoch %d%s)",
            self.stage,
            found.path.name,
            found.epoch,
            f", peers had {peer_epoch}" if peers_answered else ", no peer answered",
        )
        return "checkpoint"

    def status(self) -> dict[str, int]:
        return {
            "checkpoint_epoch": self.epoch,
            "checkpoints_written": self.written,
            "checkpoint_failures": self.failures,
        }

    def close(self) -> None:
        """Let a write in flight finish (blocking), then stop the writer."""
        self._writer.shutdown(wait=True)
