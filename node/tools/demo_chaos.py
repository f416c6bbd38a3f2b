"""``wanswarm demo --chaos``: when the demo kills its daemons and when it restarts them.

A pure, seeded plan (:func:`chaos_schedule`): the same seed, layout and settings give the
same events, with no clock and no processes involved; the demo's supervisor
(demo_supervisor.py) carries them out as training time passes.

The plan, for ``replicas x stages`` daemons where daemon ``i`` serves stage ``i mod S``:

- the first kill comes ``first_kill_s`` after training starts, the next ones every
  ``period_s`` on average (each gap drawn uniformly from 0.5 to 1.5 times it);
- each kill picks one daemon at random among those it may kill (SIGKILL: no graceful
  leave, no record withdrawn, as a crash or a power cut);
- the killed daemon is restarted ``down_s`` later with its own state directory (same
  identity; it downloads its stage's state from the stage's other replicas);
- a daemon counts as down from its kill until ``rejoin_s`` after its restart (the time a
  restarted daemon takes to start, join and download its state), and a daemon is never
  killed while it is down or while every other replica of its stage is: a stage always
  keeps a server, unless ``allow_empty`` lets the plan kill a stage's last replica. With
  one replica per stage, no kill is possible without ``allow_empty``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

ChaosAction = Literal["kill", "restart"]


@dataclass(frozen=True)
class ChaosConfig:
    """How often ``--chaos`` kills a daemon and how long it stays down."""

    period_s: float = 60.0  # mean seconds between two kills
    down_s: float = 20.0  # seconds between a kill and the restart of the same daemon
    first_kill_s: float = 30.0  # seconds of training before the first kill
    rejoin_s: float = 30.0  # a restarted daemon counts as down this long after its restart
    allow_empty: bool = False  # may a kill take a stage's last replica down?

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.down_s <= 0:
            raise ValueError(
                f"chaos period and down time must be > 0 (got {self.period_s}, {self.down_s})"
            )
        if self.first_kill_s < 0 or self.rejoin_s < 0:
            raise ValueError(
                f"chaos first kill and rejoin time must be >= 0 "
                f"(got {self.first_kill_s}, {self.rejoin_s})"
            )


@dataclass(frozen=True, order=True)
class ChaosEvent:
    """At ``at_s`` seconds of training, kill or restart daemon ``daemon`` (of ``stage``)."""

    at_s: float
    action: ChaosAction
    daemon: int
    stage: int


def chaos_schedule(
    n_stages: int,
    replicas: int,
    horizon_s: float,
    seed: int,
    config: ChaosConfig = ChaosConfig(),  # noqa: B008 - frozen
) -> list[ChaosEvent]:
    """The kills and restarts of a ``horizon_s``-second training phase, sorted by time.

    Kills fall before ``horizon_s``; a restart may fall after it (the demo restarts every
    killed daemon when training ends anyway).
    """
    if n_stages < 1 or replicas < 1:
        raise ValueError(f"need at least one stage and replica (got {n_stages}, {replicas})")
    rng = random.Random(seed)
    n = n_stages * replicas
    down: list[tuple[float, float]] = [(-1.0, -1.0)] * n  # daemon -> (killed at, up again at)

    def is_down(daemon: int, t: float) -> bool:
        start, end = down[daemon]
        return start <= t < end

    events: list[ChaosEvent] = []
    t = config.first_kill_s
    while t < horizon_s:
        candidates = []
        for daemon in range(n):
            if is_down(daemon, t):
                continue
            others_up = sum(
                1
                for other in range(daemon % n_stages, n, n_stages)
                if other != daemon and not is_down(other, t)
            )
            if others_up > 0 or config.allow_empty:
                candidates.append(daemon)
        if candidates:
            victim = rng.choice(candidates)
            restart = t + config.down_s
            down[victim] = (t, restart + config.rejoin_s)
            stage = victim % n_stages
            events.append(ChaosEvent(round(t, 3), "kill", victim, stage))
            events.append(ChaosEvent(round(restart, 3), "restart", victim, stage))
        t += config.period_s * rng.uniform(0.5, 1.5)
    return sorted(events)


def describe(config: ChaosConfig) -> str:
    """One sentence on the plan, for the demo's first lines."""
    empty = (
        "may take a stage's last replica down"
        if config.allow_empty
        else "never takes a stage's last replica down"
    )
    return (
        f"chaos: SIGKILL a random daemon after {config.first_kill_s:.0f}s, then every "
        f"~{config.period_s:.0f}s; each restarts {config.down_s:.0f}s later with its own state "
        f"dir; {empty}"
    )


__all__ = ["ChaosAction", "ChaosConfig", "ChaosEvent", "chaos_schedule", "describe"]
