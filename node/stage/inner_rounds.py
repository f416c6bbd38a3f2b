"""What DiLoCo (diloco.py) and gossip (gossip_optimizer.py) share: local inner steps, and a
round in the background every H of them.

A replica trains alone on the micro-batches it serves with the run's AdamW
(:class:`~.optimizer.LocalOptimizer`: one inner step per ``target_batch_size`` of its own
samples). After ``inner_steps`` inner steps it starts a round (the subclass's
``_start_round``: an outer round's gather, a gossip all-reduce), which runs in hivemind's
averager process while the device thread trains on; each later ``step`` and the server's
periodic ``step_if_due`` finish it once it ended (``_poll_round``). A round that found no
group is retried after one more inner step, ``RETRIES_AFTER_ONE_STEP`` times in a row, then
after H again: replicas count their own inner steps, so their rounds come due at different
times, and the retry is where they meet.

Inner steps run under ``_lock``, which the averager's state requests (hivemind's thread)
take too, so that a newcomer's download never sees half a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config.runspec import RunSpec
from .optimizer import LocalOptimizer

RETRIES_AFTER_ONE_STEP = 3


class InnerStepsOptimizer:
    """The shared half of a :class:`~.optimizer.StageOptimizer` whose rounds come every H
    inner steps; subclasses define ``round_in_progress``, ``_start_round`` and
    ``_poll_round``, and set ``_carrier`` (its ``shutdown`` is called once)."""

    _carrier: Any

    def __init__(self, module: nn.Module, spec: RunSpec,
                 others: Callable[[], int] | None) -> None:
        self._others = others  # the stage's other replicas this node knows of
        self.spec, self.averaging = spec, spec.averaging
        self._module = module
        self._inner = LocalOptimizer(module, spec)
        self._names = [n for n, p in module.named_parameters() if p.requires_grad]
        self._lock = threading.Lock()
        self._since_round = 0  # inner steps since the last round (or failed attempt)
        self._missed_in_a_row = 0
        self.rounds_missed = 0
        self.last_round: dict[str, Any] = {}
        self._shut = False

    # ---- what a subclass defines ------------------------------------------------------------

    @property
    def round_in_progress(self) -> bool:
        """A round is under way (finished by ``step`` or ``step_if_due``)."""
        raise NotImplementedError

    def _start_round(self) -> None:
        raise NotImplementedError

    def _poll_round(self) -> None:
        raise NotImplementedError

    def _accumulated(self, batch_size: int) -> None:
        """``batch_size`` samples went into the inner optimizer (a hook)."""

    # ---- the StageOptimizer contract ----------------------------------------------------

    def step(self, batch_size: int) -> None:
        self._poll_round()
        before = self._inner.local_epoch
        with self._lock:
            self._inner.step(batch_size)
        self._accumulated(batch_size)
        if self._inner.local_epoch == before:
            return
        self._since_round += 1
        if self._since_round >= self.round_every and not self.round_in_progress:
            self._since_round = 0
            self._start_round()

    def step_if_due(self) -> bool:
        # rounds come due after this replica's own inner steps, never idle; a round that
        # ended while no micro-batch came is finished here
        self._poll_round()
        return False

    @property
    def round_every(self) -> int:
        """Inner steps between two rounds (H; DiLoCo's fragments divide it)."""
        return int(self.averaging.inner_steps)

    @property
    def local_epoch(self) -> int:
        return self._inner.local_epoch

    def is_behind(self, epoch: int, meta: dict[str, Any]) -> bool:
        return epoch > self.local_epoch

    @property
    def samples_accumulated(self) -> int:
        return self._inner.samples_accumulated

    def flush(self) -> None:
        return None

    def background_busy(self) -> bool:
        return False

    def params_version(self) -> int | None:
        # every replica takes its inner steps on its own micro-batches: between rounds no
        # two hold the same parameters, so none promises to (params_version.py)
        return None

    def hold_for_snapshot(self, waiting: bool) -> None:
        return None

    def shutdown(self) -> None:
        if not self._shut:
            self._shut = True
            self._carrier.shutdown()

    # ---- helpers ------------------------------------------------------------------------

    def _round_status(self) -> dict[str, Any]:
        """The status fields every mode with rounds reports (``averaging_status``)."""
        last = self.last_round
        return {
            "inner_steps": self.averaging.inner_steps,
            "last_round_ok": last.get("ok"),
            "participants": last.get("participants", 0),
            "bytes_sent": last.get("bytes_sent", 0),
            "round_s": last.get("seconds"),
            "rounds_missed": self.rounds_missed,
            "round_in_progress": self.round_in_progress,
        }

    def _params(self) -> dict[str, torch.Tensor]:
        named = dict(self._module.named_parameters())
        return {n: named[n] for n in self._names}

    def _alone(self) -> bool:
        """No other replica of the stage is known: a round would find nobody."""
        return self._others is not None and self._others() == 0

    def _missed(self) -> None:
        """A round found no group (or was refused): retried soon, then after H again."""
        self.rounds_missed += 1
        self._missed_in_a_row += 1
        if self._missed_in_a_row < RETRIES_AFTER_ONE_STEP:
            self._since_round = max(self._since_round, self.round_every - 1)
