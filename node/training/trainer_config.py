"""The trainer's config: how it drives micro-batches through the swarm.

The ``[trainer]`` section of the node config, read by the trainer (trainer.py), the hops
it sends (hops.py) and the pipeline walk (pipeline.py).
"""

from __future__ import annotations

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from .routing import RouterConfig
from .spot_checks import SpotCheckConfig


class TrainerConfig(BaseModel):
    """How the trainer drives micro-batches through the swarm."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_in_flight: int = Field(
        default=8,
        ge=1,
        le=4096,
        description=(
            "Micro-batches moving through the swarm at once, at most: the number starts at 2, "
            "grows as micro-batches complete and halves when one fails."
        ),
    )
    request_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description="Deadline of one hop attempt (request and reply), seconds.",
    )
    max_attempts: int = Field(
        default=5,
        ge=1,
        le=100,
        description=(
            "Attempts per hop (on different servers when possible) before the micro-batch fails."
        ),
    )
    no_server_wait_s: float = Field(
        default=2.0,
        gt=0.0,
        le=600.0,
        description="Back-off while a stage has no online server, seconds (jittered).",
    )
    retry_backoff_s: float = Field(
        default=0.25,
        gt=0.0,
        le=60.0,
        # its name until the back-off covered failures as well as busy answers
        validation_alias=AliasChoices("retry_backoff_s", "busy_backoff_s"),
        description=(
            "First back-off when a failed attempt leaves no server of the stage to try at "
            "once (each one refused the hop as busy, draining or still loading, failed it, "
            "or is banned), seconds; doubled at each further attempt, jittered, at most 16x. "
            "A hop with another server left to try goes there at once instead."
        ),
    )
    loss_ewma_alpha: float = Field(
        default=0.05,
        gt=0.0,
        le=1.0,
        description="Weight of the newest loss in the loss moving average.",
    )
    data_seed: int | None = Field(
        default=None,
        ge=0,
        description="Seed of this trainer's data stream; unset: derived from the peer id.",
    )
    error_feedback: bool = Field(
        default=True, description="Send output gradients through error feedback (per stage)."
    )
    eval_period_s: float = Field(
        default=0.0,
        ge=0.0,
        le=86400.0,
        description=(
            "Measure the validation loss through the swarm this often, seconds (the first "
            "once every stage has a server), shown by 'wanswarm status'; 0: never."
        ),
    )
    eval_windows: int = Field(
        default=16, ge=1, le=4096, description="Validation windows each measurement runs."
    )
    router: RouterConfig = Field(default=RouterConfig(), description="Server choice per hop.")
    spot_checks: SpotCheckConfig = Field(
        default=SpotCheckConfig(),
        description="Hops re-run on a second replica and compared (docs/hostile.md).",
    )
