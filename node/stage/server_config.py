"""The stage server's config: how it queues, caches, checkpoints and measures its work.

The ``[stage_server]`` section of the node config; the server (server.py) hands each
part to the piece that uses it: the queue bound to the device queue (device_queue.py),
the caches and error feedback to the device-thread jobs (jobs.py).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .state_plan import StateTransferConfig


class StageServerConfig(BaseModel):
    """How a stage server queues, caches and measures its work."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="'auto' (CUDA if present), 'cpu' or 'cuda[:N]'.",
    )
    queue_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description=(
            "Jobs queued or running on the device; beyond it we answer 'busy'. The last "
            "quarter takes backwards and forward_loss only (they finish micro-batches)."
        ),
    )
    max_in_flight: int = Field(
        default=4,
        ge=0,
        le=1024,
        description=(
            "Micro-batches whose forward activations (autograd graph) the stage keeps until "
            "their backward, which then need not recompute the forward; the memory check "
            "counts this many (0: every backward recomputes)."
        ),
    )
    max_device_memory_mb: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Most device memory (MiB) the stage may use; unset: all that is free. The "
            "memory check before serving counts against min(free, this); on CUDA it is "
            "also enforced (torch.cuda.set_per_process_memory_fraction)."
        ),
    )
    cache_entries: int = Field(
        default=256,
        ge=0,
        le=1_000_000,
        description="Forward inputs kept for backward references (0 disables).",
    )
    cache_bytes: int = Field(
        default=256 * 2**20, ge=0, description="Byte budget of the forward-input cache."
    )
    cache_ttl_s: float = Field(
        default=120.0,
        gt=0.0,
        le=86400.0,
        description="Seconds a cached forward input stays referenceable.",
    )
    applied_entries: int = Field(
        default=200_000,
        ge=1,
        le=10_000_000,
        description=(
            "Applied (trainer, micro-batch) keys remembered to suppress duplicate gradients."
        ),
    )
    reply_cache_entries: int = Field(
        default=64,
        ge=0,
        le=100_000,
        description="Recent backward replies kept to answer a retried hop exactly.",
    )
    error_feedback: bool = Field(
        default=True,
        description="Encode returned input gradients through error feedback (per trainer).",
    )
    error_feedback_bytes: int = Field(
        default=512 * 2**20, ge=0, description="Memory bound of the error-feedback residuals."
    )
    benchmark_iterations: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Timed forward+backward passes of the start-up benchmark.",
    )
    checkpoint_period_s: float = Field(
        default=300.0,
        ge=0.0,
        le=7 * 86400.0,
        description=(
            "Seconds between checkpoints of the stage in <state_dir>/checkpoints (taken after an "
            "optimizer step once the epoch has moved); 0 disables periodic ones (leaving still "
            "saves one)."
        ),
    )
    checkpoint_keep: int = Field(
        default=2,
        ge=1,
        le=1000,
        description="Newest checkpoints of the stage kept on disk; older ones are deleted.",
    )
    step_check_period_s: float = Field(
        default=0.5,
        gt=0.0,
        le=60.0,
        description=(
            "Seconds between checks, on the device thread, whether the stage's epoch step is due "
            "without a micro-batch arriving here (the replica then joins the all-reduce)."
        ),
    )
    state_transfer: StateTransferConfig = Field(
        default=StateTransferConfig(),
        description="Downloading the stage's state from its replicas on open, and donating ours.",
    )
