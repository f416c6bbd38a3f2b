"""The run spec's ``[averaging]`` section: how the replicas of a stage combine their work.

Every peer of a run must average the same way (a DiLoCo replica and an all-reduce replica
cannot share a round), so the mode is part of the run spec, not of a node's config; the
node's own ``[averaging]`` config (node/stage/averaging.py ``AveragingConfig``) holds only
timeouts and hivemind's wire compression of the per-step all-reduce.

Modes (docs/averaging.md):

- ``allreduce``: hivemind's collaborative Optimizer, one all-reduce of gradients per
  optimizer step (the behaviour before this section existed, and the default);
- ``diloco``: each replica takes ``inner_steps`` (H) local AdamW steps on its own
  micro-batches, then the replicas average the pseudo-gradient (the parameters' change
  since the last outer step) and take one outer Nesterov step (``outer_lr``,
  ``outer_momentum``); the pseudo-gradient may be compressed (``compression``) with error
  feedback; with ``fragments`` > 1 the stage's parameters are split into that many fragments
  and each outer round carries one of them, in turn, every ``inner_steps / fragments`` inner
  steps (Streaming DiLoCo): each fragment still takes its round every H steps;
- ``gossip``: ``inner_steps`` local AdamW steps, then each replica averages its parameters
  with ``gossip_neighbours`` other replicas, a different group every round, instead of with
  every replica (Decent-DP; the daemon forms random groups, benchmarks/averaging.py the
  alternating exponential ring); uncompressed.

The inner steps of ``diloco`` and ``gossip`` take the run's AdamW, or with
``inner_optimizer = "accum_adamw"`` Decent-DP's AccumAdam (node/stage/optimizer.py
``AccumAdamW``: Adam's moments advance every ``accum_steps`` steps on the mean gradient).

This module is pure (pydantic only); ``runspec.RunSpec.averaging`` holds the section and
leaves it out of the run id while it holds its defaults, so existing runs keep their id.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AveragingMode = Literal["allreduce", "diloco", "gossip"]
InnerOptimizer = Literal["adamw", "accum_adamw"]
PseudoGradientCompression = Literal["none", "int8", "int4", "sign", "topk"]


class AveragingSpec(BaseModel):
    """How a stage's replicas average (the run spec's ``[averaging]`` section)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: AveragingMode = Field(
        default="allreduce",
        description=(
            "'allreduce': average gradients at every optimizer step (hivemind's Optimizer); "
            "'diloco': inner_steps local AdamW steps, then an outer Nesterov step on the "
            "averaged pseudo-gradient; 'gossip': inner_steps local steps, then a parameter "
            "average with gossip_neighbours peers, a different group every round."
        ),
    )
    inner_steps: int = Field(
        default=50,
        ge=1,
        le=100_000,
        description=(
            "H: local optimizer steps between two outer steps (diloco and gossip); each inner "
            "step takes batch.target_batch_size samples on one replica."
        ),
    )
    outer_lr: float = Field(
        default=0.7,
        gt=0.0,
        le=10.0,
        description="Learning rate of the outer Nesterov step (DiLoCo: 0.7).",
    )
    outer_momentum: float = Field(
        default=0.9,
        ge=0.0,
        lt=1.0,
        description="Momentum of the outer Nesterov step (DiLoCo: 0.9); 0 with outer_lr 1 is "
        "plain parameter averaging.",
    )
    compression: PseudoGradientCompression = Field(
        default="none",
        description=(
            "What a replica sends of its pseudo-gradient, with error feedback (the residual is "
            "kept per replica and added to the next round's): 'none' (float32), 'int8' or 'int4' "
            "(blockwise, block_size values per scale), 'sign' (1 bit per value and one scale per "
            "block), 'topk' (the topk_density largest values and their indices)."
        ),
    )
    block_size: int = Field(
        default=64,
        ge=8,
        le=4096,
        description="Values per scale of the int8, int4 and sign codecs (a power of two).",
    )
    topk_density: float = Field(
        default=0.02,
        gt=0.0,
        le=1.0,
        description="Fraction of each tensor's values that 'topk' sends (SparseLoCo: 1-3%).",
    )
    gossip_neighbours: Literal[1, 2] = Field(
        default=1,
        description="Peers a gossip round averages with (Decent-DP: one or two).",
    )
    fragments: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Streaming DiLoCo (diloco only): the stage's parameters in this many fragments of "
            "about equal size; an outer round carries one fragment, in turn, every "
            "inner_steps / fragments inner steps (a multiple of it), so each fragment is "
            "averaged every inner_steps steps and a round sends 1/fragments of the stage."
        ),
    )
    inner_optimizer: InnerOptimizer = Field(
        default="adamw",
        description=(
            "The inner steps' optimizer (diloco and gossip): 'adamw', or 'accum_adamw', "
            "Decent-DP's AccumAdam (ICLR 2025) with decoupled weight decay: every step "
            "moves the parameters with its own gradient, but Adam's moments advance only "
            "every accum_steps steps, on the mean of those steps' gradients, so a replica "
            "whose inner steps see few samples does not estimate the second moment from "
            "single noisy gradients."
        ),
    )
    accum_steps: int = Field(
        default=4,
        ge=1,
        le=1024,
        description=(
            "accum_adamw: inner steps per update of Adam's moments (1 is AdamW exactly). "
            "Decent-DP scales it with the number of workers."
        ),
    )
    round_timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        le=3600.0,
        description=(
            "Seconds an outer round waits for the stage's replicas; a replica that misses it "
            "keeps training and joins a later round (or downloads the latest outer state)."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> AveragingSpec:
        if self.mode == "allreduce" and self.compression != "none":
            raise ValueError(
                f"averaging.compression = {self.compression!r} compresses pseudo-gradients, which "
                "only 'diloco' and 'gossip' send; set averaging.mode or use the node's "
                "averaging.grad_compression for the per-step all-reduce"
            )
        if self.mode == "gossip" and self.compression != "none":
            raise ValueError(
                f"averaging.compression = {self.compression!r} compresses pseudo-gradients, which "
                "'gossip' does not send (it averages float32 parameters); use mode = 'diloco' "
                "for a compressed exchange"
            )
        if self.fragments > 1 and self.mode != "diloco":
            raise ValueError(
                f"averaging.fragments = {self.fragments} streams DiLoCo's outer rounds; "
                f"mode {self.mode!r} has none: set averaging.fragments = 1 or mode = 'diloco'"
            )
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"averaging.inner_steps ({self.inner_steps}) must be a multiple of "
                f"averaging.fragments ({self.fragments}): a round comes every "
                "inner_steps / fragments inner steps"
            )
        if self.inner_optimizer != "adamw" and self.mode == "allreduce":
            raise ValueError(
                f"averaging.inner_optimizer = {self.inner_optimizer!r} is the optimizer of "
                "'diloco' and 'gossip' inner steps; 'allreduce' steps hivemind's AdamW on the "
                "stage's whole batch: set averaging.mode or inner_optimizer = 'adamw'"
            )
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"averaging.block_size must be a power of two, got {self.block_size}"
            )
        return self
