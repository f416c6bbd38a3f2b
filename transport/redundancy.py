"""How much redundancy to send: the path's loss estimate and the binomial repair budget.

Pure arithmetic, no clocks. A transfer's datagrams are modelled as independent
Bernoulli trials that survive with probability ``1 - p``; a block of k source symbols
decodes once k + h distinct symbols of it arrive (RaptorQ: failure about 1/256^(h+1)).
For a block we send the smallest n with ``P(Binomial(n, 1 - p) >= k + h) >= q``, where q
is the per-block share of the transfer's target, ``q_transfer ** (1 / blocks)``, so that
the whole transfer decodes without a repair round with probability ``q_transfer``. The
loss rate ``p`` used for budgeting is the path estimate times a safety margin, clamped to
[min, max] (see FecConfig): losses burstier than Bernoulli, and estimation error, are what
the margin and the senders' interleaving across blocks are for; repair rounds catch the
rest.

Examples (q_transfer = 0.99, p = 1.5%, h = 1): one block of 1024 symbols gets 27 repair
symbols (2.6%); each of twelve such blocks (16 MB) gets 31 (3.0%); a lone 50-symbol block 4.

The path estimate is an EWMA of per-transfer loss (lost / sent datagrams, as counted by
the receiver), weighted by the transfer's size so that small transfers move it less; the
first samples are averaged with the prior (the configured initial rate, counted as one
full-size transfer) instead of being smoothed away, as RFC 6298 does for the first RTT.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist
from typing import NamedTuple

from .config import FecConfig
from .errors import FecError

_STANDARD_NORMAL = NormalDist()


def _cdf_losses(n: int, p: float, s: int) -> float:
    """P(Binomial(n, p) <= s): probability that at most ``s`` of ``n`` symbols are lost."""
    if s >= n:
        return 1.0
    mean = n * p
    spread = math.sqrt(n * p * (1.0 - p))
    # Terms more than 12 standard deviations below the mean add up to less than 1e-30,
    # far below the resolution of any target we accept (<= 1 - 1e-6).
    j = max(0, int(mean - 12.0 * spread - 1.0))
    if j > s:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_term = (
        math.lgamma(n + 1)
        - math.lgamma(j + 1)
        - math.lgamma(n - j + 1)
        + j * log_p
        + (n - j) * log_q
    )
    log_ratio = log_p - log_q
    total = 0.0
    while True:
        total += math.exp(log_term)
        if j == s:
            return min(total, 1.0)
        log_term += math.log((n - j) / (j + 1)) + log_ratio
        j += 1


@functools.lru_cache(maxsize=1024)
def symbols_needed(need: int, loss_rate: float, target: float) -> int:
    """Smallest n with ``P(Binomial(n, 1 - loss_rate) >= need) >= target``.

    That is how many symbols to send so that ``need`` of them arrive with probability
    ``target`` when each is lost independently with probability ``loss_rate``.
    """
    if need < 0 or not 0.0 <= loss_rate < 1.0 or not 0.0 < target < 1.0:
        raise FecError(f"bad budget request: need={need} loss={loss_rate} target={target}")
    if need == 0:
        return 0
    if loss_rate == 0.0:
        return need

    def enough(slack: int) -> bool:
        return _cdf_losses(need + slack, loss_rate, slack) >= target

    # Start from the normal approximation, then bracket and bisect on the exact tail
    # (enough() is monotone: one more symbol sent may absorb one more loss).
    z = _STANDARD_NORMAL.inv_cdf(target)
    n_guess = need / (1.0 - loss_rate)
    guess = max(
        0, math.ceil(n_guess * loss_rate + z * math.sqrt(n_guess * loss_rate * (1.0 - loss_rate)))
    )
    step = 1
    if enough(guess):
        high = guess
        low = guess - step
        while low >= 0 and enough(low):
            high, step = low, step * 2
            low = high - step
        low = max(low, -1)  # -1: "not enough" sentinel below zero
    else:
        low = guess
        high = guess + step
        while not enough(high):
            low, step = high, step * 2
            high = low + step
    while high - low > 1:
        mid = (low + high) // 2
        if enough(mid):
            high = mid
        else:
            low = mid
    return need + high


def block_target(transfer_target: float, blocks: int) -> float:
    """Per-block success probability so that all ``blocks`` succeed with ``transfer_target``."""
    if blocks < 1:
        raise FecError(f"bad block count {blocks}")
    return float(transfer_target ** (1.0 / blocks))


def budget_loss_rate(estimate: float, config: FecConfig) -> float:
    """The loss rate repair symbols are budgeted for: estimate x margin, clamped."""
    return min(config.max_loss_rate, max(config.min_loss_rate, estimate * config.loss_margin))


def repair_count(k: int, loss_rate: float, target: float, overhead: int) -> int:
    """Repair symbols to send with a block's k source symbols, up front."""
    return symbols_needed(k + overhead, loss_rate, target) - k


class LossSample(NamedTuple):
    """What one transfer saw: datagrams the sender sent (as far as the receiver knows)
    and how many of them never arrived."""

    sent: int
    lost: int


class LossEstimator:
    """Smoothed datagram loss rate of one path (one peer), fed one sample per transfer.

    The endpoint keeps one per peer, passes :attr:`loss_rate` to each new SenderTransfer
    and feeds back the transfer's :attr:`~wanswarm.transport.session.SenderTransfer.loss_sample`.
    """

    __slots__ = ("_config", "_mass", "_rate", "samples")

    def __init__(self, config: FecConfig) -> None:
        self._config = config
        self._rate = config.initial_loss_rate
        self._mass = 1.0  # the prior counts as one full-size transfer
        self.samples = 0

    @property
    def loss_rate(self) -> float:
        """Current estimate of the fraction of datagrams lost on this path."""
        return self._rate

    def add(self, sample: LossSample) -> None:
        """Fold in one transfer's loss; samples with nothing sent are ignored."""
        if sample.sent <= 0:
            return
        rate = min(1.0, max(0.0, sample.lost / sample.sent))
        size = min(1.0, sample.sent / self._config.loss_sample_symbols)
        self._mass += size
        weight = size * max(self._config.loss_ewma_weight, 1.0 / self._mass)
        self._rate += weight * (rate - self._rate)
        self.samples += 1


__all__ = [
    "LossEstimator",
    "LossSample",
    "block_target",
    "budget_loss_rate",
    "repair_count",
    "symbols_needed",
]
