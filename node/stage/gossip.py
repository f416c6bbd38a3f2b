"""Gossip rounds on a changing topology, and Decent-DP's runtime model (pure).

Decent-DP (ICLR 2025) replaces the all-reduce by averaging with a few neighbours per round
on a topology that changes every round. Its alternating exponential ring: with ``n``
replicas in a fixed order, round ``r`` pairs each replica ``i`` with ``i + 2**(r mod
log2(n))`` (and, with two neighbours, also ``i - 2**(r mod log2(n))``), so that after
``log2(n)`` rounds information from every replica has reached every other. The mixing is
symmetric (each replica averages uniformly with the neighbours it has this round), so the
mean over the replicas is preserved exactly.

The runtime model predicts the speed-up of decentralized over all-reduce training from
three measured numbers:

- ``gamma``: communication time of one all-reduce over computation time of one step;
- ``omega``: communication time of one gossip round over that of one all-reduce;
- ``sigma2``: variance of the per-step computation time over its mean squared.

All-reduce synchronizes every replica at every step: a step costs the slowest replica's
compute, ``1 + c * sqrt(sigma2 * 2 ln n)`` (the expected maximum of ``n`` Gaussian compute
times, in units of the mean) plus ``gamma``. Gossip overlaps a round's communication with the
next step's computation and waits only for its neighbours: a step costs
``max(1 + sqrt(sigma2 * 2 ln(k + 1)), omega * gamma)`` with ``k`` neighbours. The predicted
speed-up is the ratio.
"""

from __future__ import annotations

import math


def exponent_period(n: int) -> int:
    """Rounds before the alternating exponential ring repeats: ``ceil(log2 n)`` (at least 1)."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def neighbours(index: int, n: int, round_: int, k: int = 1) -> list[int]:
    """The peers replica ``index`` of ``n`` averages with in ``round_`` (``k`` of 1 or 2)."""
    if n <= 1:
        return []
    hop = 2 ** (round_ % exponent_period(n)) % n or 1
    if k == 1 and n & (n - 1) == 0:
        return [index ^ hop]  # one-peer exponential graph: pairs, so the mixing stays symmetric
    out = [(index + hop) % n]
    if k >= 2:
        back = (index - hop) % n
        if back not in out and back != index:
            out.append(back)
    return out


def mixing_groups(n: int, round_: int, k: int = 1) -> list[list[int]]:
    """For each replica, the set it averages with this round (itself first), made symmetric:
    if ``j`` is ``i``'s neighbour then ``i`` averages with ``j`` too."""
    links: list[set[int]] = [set() for _ in range(n)]
    for i in range(n):
        for j in neighbours(i, n, round_, k):
            links[i].add(j)
            links[j].add(i)
    return [[i, *sorted(links[i])] for i in range(n)]


def mixing_matrix(n: int, round_: int, k: int = 1) -> list[list[float]]:
    """The round's doubly stochastic mixing matrix (Metropolis weights: ``1 / (1 +
    max(deg i, deg j))`` per link, the rest on the diagonal), which preserves the mean."""
    groups = mixing_groups(n, round_, k)
    degree = [len(g) - 1 for g in groups]
    w = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in groups[i][1:]:
            w[i][j] = 1.0 / (1 + max(degree[i], degree[j]))
        w[i][i] = 1.0 - sum(w[i])
    return w


def predicted_speedup(gamma: float, omega: float, sigma2: float, n: int, k: int = 1) -> float:
    """Decent-DP's runtime model (module docstring): all-reduce step time over gossip's."""
    straggle_all = math.sqrt(max(sigma2, 0.0) * 2 * math.log(max(n, 2)))
    straggle_gossip = math.sqrt(max(sigma2, 0.0) * 2 * math.log(k + 1))
    allreduce = 1.0 + straggle_all + gamma
    gossip = max(1.0 + straggle_gossip, omega * gamma)
    return allreduce / gossip
