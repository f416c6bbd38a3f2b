"""The inbound memory budget's accounting (transport/budget.py)."""

from __future__ import annotations

import pytest
from wanswarm.transport.budget import InboundBudget
from wanswarm.transport.errors import FramingError


def test_reserve_refuses_what_does_not_fit_and_release_gives_it_back() -> None:
    budget = InboundBudget(100)
    budget.reserve(60)
    budget.reserve(40)
    with pytest.raises(FramingError) as refused:
        budget.reserve(1)
    assert refused.value.code == "busy" and "max_inbound_bytes=100" in str(refused.value)
    assert (budget.used, budget.free, budget.peak) == (100, 0, 100)
    assert budget.counts == {"reserved": 2, "refused": 1}
    budget.release(60)
    budget.reserve(50)  # fits again
    budget.release(1000)  # never below zero
    assert budget.used == 0 and budget.peak == 100


def test_a_refusal_reserves_nothing_and_negative_sizes_are_bugs() -> None:
    budget = InboundBudget(10)
    with pytest.raises(FramingError):
        budget.reserve(11)
    assert budget.used == 0
    with pytest.raises(ValueError):
        budget.reserve(-1)
    with pytest.raises(ValueError):
        InboundBudget(-1)
