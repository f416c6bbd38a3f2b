"""Jittered periods for every periodic loop of the node.

Loops that many peers run on the same period synchronise unless each waits a randomised
interval (the "periodic message synchronisation" of Floyd & Jacobson, 1994).
"""

from __future__ import annotations

import random


def jittered(period: float, fraction: float, rng: random.Random) -> float:
    """``period`` scaled by a uniform factor in [1 - fraction, 1 + fraction]."""
    if period < 0 or not 0 <= fraction < 1:
        raise ValueError(f"need period >= 0 and 0 <= fraction < 1 (got {period}, {fraction})")
    return period * (1 + rng.uniform(-fraction, fraction))
