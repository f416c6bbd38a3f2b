"""RunSpec: what one training run is (model shape, stage layout, optimizer, codecs, data).

Every peer of a run must hold the same spec: it decides parameter shapes, how the model
splits into stages, how gradients are combined and which bytes are trained on. The spec's
``run_id`` is a short hash of its canonical JSON; the node publishes it under
``{name}.spec`` and refuses to mix with peers whose ``run_id`` differs
(``describe_mismatch`` names the fields that differ). The ``[limits]`` section (the value
bounds of docs/hostile.md) is left out of the canonical JSON while it holds its defaults,
so that adding it changed no existing run's id.

Run specs are TOML files (``configs/runs/*.toml``); ``default_run_spec()`` is the embedded
tiny run (package data ``runs/tiny.toml``, a byte-identical copy of
``configs/runs/tiny.toml``). This module is pure: no I/O besides reading a file; codec
names are checked with ``wanswarm.transport.codecs.parse_codec``, imported on first use.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .averaging_spec import AveragingSpec
from .subspace_spec import SubspaceSpec

# Bumped when the meaning of a field changes, so that old and new peers get different ids.
RUN_SPEC_VERSION = 1
VOCAB_SIZE = 256  # byte-level: one token per byte, nothing to download
STDLIB_CORPUS = "stdlib"  # sentinel: the Python standard library's own *.py files
# <files>f-<bytes>b-<16 hex> (node/training/fingerprint.py writes them)
FINGERPRINT_PATTERN = r"^[0-9]{1,9}f-[0-9]{1,19}b-[0-9a-f]{16}$"


class RunSpecError(ValueError):
    """A run spec file is missing, not TOML, or names an unusable value (message says which)."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSpec(_Section):
    """Shape of the model: the byte-level GPT block or a Llama-style one (docs/models.md)."""

    architecture: Literal["gpt", "llama"] = Field(
        default="gpt",
        description=(
            "'gpt': pre-LayerNorm blocks with a GELU MLP; 'llama': RMSNorm, SwiGLU, rotary "
            "and grouped-query attention, as Hugging Face's LlamaForCausalLM."
        ),
    )
    vocab_size: int = Field(
        default=VOCAB_SIZE,
        ge=2,
        le=1 << 20,
        description=(
            "Vocabulary size: 256 for byte-level data (no data.tokenizer); otherwise at least "
            "the tokenizer's (and the pretrained checkpoint's when model.pretrained is set)."
        ),
    )
    d_model: int = Field(
        default=128, ge=8, le=16384, description="Width of the residual stream (C)."
    )
    n_heads: int = Field(
        default=4, ge=1, le=256, description="Attention heads; must divide d_model."
    )
    n_layers: int = Field(
        default=6, ge=1, le=512, description="Transformer blocks in the whole model."
    )
    seq_len: int = Field(
        default=128, ge=2, le=65536, description="Tokens (bytes) per training window (T)."
    )
    positions: Literal["rotary", "learned"] = Field(
        default="rotary",
        description=(
            "'rotary': RoPE on queries and keys in every block (no position parameters); "
            "'learned': a learned position embedding added on stage 0."
        ),
    )
    rope_base: float = Field(
        default=10000.0,
        gt=1.0,
        description="RoPE base (wavelengths up to 2*pi*base); 'rotary' only.",
    )
    logit_multiplier: float = Field(
        default=4.0,
        gt=0.0,
        le=1024.0,
        description=(
            "The LM head's output is multiplied by this and its init divided by it; under Adam "
            "the head then learns this many times faster than lr (muP's output multiplier)."
        ),
    )
    mlp_ratio: float = Field(
        default=4.0, gt=0.0, le=16.0, description="MLP hidden width as a multiple of d_model."
    )
    dropout: float = Field(
        default=0.0,
        description=(
            "Dropout probability. Must be 0: backward requests recompute the forward on "
            "whichever peer serves them, so the forward must be deterministic."
        ),
    )

    n_kv_heads: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description=(
            "Key/value heads of grouped-query attention ('llama' only); must divide n_heads; "
            "unset: n_heads (plain multi-head attention)."
        ),
    )
    intermediate_size: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="MLP hidden width; unset: round(mlp_ratio * d_model).",
    )
    rms_norm_eps: float = Field(
        default=1e-5, gt=0.0, le=1.0, description="Epsilon of RMSNorm ('llama' only)."
    )
    tie_embeddings: bool = Field(
        default=False,
        description=(
            "'llama' only: the LM head starts as the token embedding. With one stage they are "
            "one parameter; across stages each end holds its own copy, trained separately "
            "(docs/models.md). Needs logit_multiplier = 1."
        ),
    )
    pretrained: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=(
            "Local Hugging Face Llama checkpoint directory (config.json + safetensors) to "
            "start from instead of a random init; relative paths resolve against the "
            "current directory. Each stage reads only its own tensors."
        ),
    )
    pretrained_fingerprint: str | None = Field(
        default=None,
        pattern=FINGERPRINT_PATTERN,
        description=(
            "Fingerprint of the pretrained checkpoint's files (wanswarm fingerprint); "
            "required with model.pretrained, checked when a stage loads it."
        ),
    )

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(
                "set dropout = 0.0: servers recompute the forward pass on backward, "
                "which must give the same activations"
            )
        return value

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads}); "
                "change one of them"
            )
        if self.architecture == "llama":
            self._check_llama()
        else:
            for name in ("n_kv_heads", "pretrained"):
                if getattr(self, name) is not None:
                    raise ValueError(f"model.{name} needs architecture = 'llama'")
            if self.tie_embeddings:
                raise ValueError("model.tie_embeddings needs architecture = 'llama'")
        return self

    def _check_llama(self) -> None:
        if self.positions != "rotary":
            raise ValueError("architecture 'llama' uses rotary positions; set positions = 'rotary'")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head width d_model / n_heads = {self.head_dim} must be even (RoPE)")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads})"
            )
        if self.tie_embeddings and self.logit_multiplier != 1.0:
            raise ValueError("tie_embeddings needs logit_multiplier = 1.0 (one matrix, two uses)")
        if (self.pretrained is None) != (self.pretrained_fingerprint is None):
            raise ValueError(
                "model.pretrained and model.pretrained_fingerprint go together; "
                "`wanswarm fingerprint --run-spec FILE` prints the fingerprint"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head (D)."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when unset."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of each MLP."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return max(1, round(self.mlp_ratio * self.d_model))


class StagesSpec(_Section):
    """How the blocks split into pipeline stages (contiguous spans, in order)."""

    blocks_per_stage: tuple[int, ...] = Field(
        default=(2, 2, 2),
        min_length=1,
        max_length=256,
        description=(
            "Blocks held by each stage, in pipeline order; must sum to model.n_layers. "
            "Stage 0 also holds the embeddings, the last stage the final norm, head and loss."
        ),
    )

    @field_validator("blocks_per_stage")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for stage, blocks in enumerate(value):
            if blocks < 1:
                raise ValueError(f"stage {stage} has {blocks} blocks; give every stage at least 1")
        return value

    @property
    def n_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.blocks_per_stage)


class BatchSpec(_Section):
    """Micro-batches (what one request carries) and the collaborative batch."""

    micro_batch_size: int = Field(
        default=8,
        ge=1,
        le=65536,
        description="Windows (samples) per micro-batch sent through the swarm.",
    )
    target_batch_size: int = Field(
        default=64,
        ge=1,
        description=(
            "Samples per collaborative optimizer step of each stage (hivemind.Optimizer's "
            "target_batch_size); a multiple of micro_batch_size."
        ),
    )

    @model_validator(mode="after")
    def _whole_micro_batches(self) -> BatchSpec:
        if self.target_batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"target_batch_size ({self.target_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size}) so that a step is whole micro-batches"
            )
        return self

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches that make one optimizer step."""
        return self.target_batch_size // self.micro_batch_size


class OptimizerSpec(_Section):
    """AdamW with linear warmup then a cosine or constant schedule, per-stage grad clipping."""

    lr: float = Field(
        default=1e-3, gt=0.0, le=10.0, description="Peak learning rate (after warmup)."
    )
    betas: tuple[float, float] = Field(
        default=(0.9, 0.95), description="AdamW (beta1, beta2), each in [0, 1)."
    )
    eps: float = Field(default=1e-8, gt=0.0, le=1.0, description="AdamW epsilon.")
    weight_decay: float = Field(
        default=0.1,
        ge=0.0,
        le=10.0,
        description="Decoupled weight decay, applied to matrices only.",
    )
    warmup_steps: int = Field(
        default=10, ge=0, description="Optimizer steps of linear warmup from lr/warmup_steps to lr."
    )
    schedule: Literal["cosine", "constant"] = Field(
        default="cosine",
        description="After warmup: 'cosine' decay to min_lr_ratio*lr, or 'constant'.",
    )
    decay_steps: int = Field(
        default=1000,
        ge=1,
        description=(
            "Optimizer step at which the cosine reaches its floor (counted from step 0, "
            "warmup included); the lr stays at the floor afterwards. Unused by 'constant'."
        ),
    )
    min_lr_ratio: float = Field(
        default=0.1, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr."
    )
    grad_clip: float = Field(
        default=1.0,
        ge=0.0,
        description=(
            "Clip each stage's gradient to this global L2 norm before its step (each stage "
            "steps on its own in the swarm, so clipping is per stage); 0 disables clipping."
        ),
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        for i, beta in enumerate(value):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] = {beta}; each beta must be in [0, 1)")
        return value

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> OptimizerSpec:
        if self.schedule == "cosine" and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must exceed warmup_steps "
                f"({self.warmup_steps}) for the cosine schedule; raise decay_steps"
            )
        return self

    def lr_multiplier(self, step: int) -> float:
        """Learning-rate factor for optimizer step ``step`` (0-based), for torch's LambdaLR."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def adamw_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.optim.AdamW`` (weight decay goes in param groups)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps}


class CodecsSpec(_Section):
    """Codec strings per direction, parsed by ``wanswarm.transport.codecs.parse_codec``."""

    forward_activations: str = Field(
        default="int8",
        min_length=1,
        max_length=64,
        description="Codec of activations sent forward.",
    )
    backward_gradients: str = Field(
        default="int8", min_length=1, max_length=64, description="Codec of gradients sent backward."
    )

    @field_validator("forward_activations", "backward_gradients")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        if value != value.strip() or any(c.isspace() for c in value):
            raise ValueError(f"codec {value!r} contains whitespace; write e.g. 'int8'")
        # Imported here: the codec parser pulls in torch, which a spec without codecs to
        # check (and this module's import) should not need.
        from ...transport.codecs import parse_codec
        from ...transport.errors import CodecError

        try:
            parse_codec(value)
        except CodecError as exc:
            raise ValueError(str(exc)) from None
        return value


class DataSpec(_Section):
    """Where the training bytes come from and how validation is held out."""

    corpus: tuple[str, ...] = Field(
        default=(STDLIB_CORPUS,),
        min_length=1,
        description=(
            "Files or glob patterns (relative ones resolve against the data root), or the "
            "single entry 'stdlib' for this Python's own standard-library *.py sources."
        ),
    )
    validation_fraction: float = Field(
        default=0.05,
        gt=0.0,
        lt=1.0,
        description="Fraction of files (chosen by a hash of their relative path) held out.",
    )
    validation_windows: int = Field(
        default=64, ge=1, le=1_000_000, description="Fixed, seeded validation windows for val loss."
    )
    format: Literal["bytes", "text", "jsonl", "parquet", "hf_disk"] = Field(
        default="bytes",
        description=(
            "'bytes': the corpus read whole into memory, one token per byte (windows drawn "
            "at random). Streamed and tokenized on the fly (docs/models.md): 'text' (plain "
            "text files or directories), 'jsonl' (JSON lines with text_field), 'parquet' "
            "(column text_field), 'hf_disk' (a Hugging Face dataset saved with save_to_disk)."
        ),
    )
    text_field: str = Field(
        default="text",
        min_length=1,
        max_length=256,
        description="The text field of 'jsonl' records and the text column of 'parquet'/'hf_disk'.",
    )
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=(
            "Hugging Face tokenizers JSON file (local path; `wanswarm tokenizer train` writes "
            "one); unset: byte-level (UTF-8 bytes, vocabulary 256). Streamed formats only."
        ),
    )
    tokenizer_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of the tokenizer file; required with tokenizer, checked on load.",
    )
    eos_token: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description=(
            "Special token appended after each document (must be in the tokenizer); unset: "
            "documents are joined by a newline."
        ),
    )
    fingerprint: str | None = Field(
        default=None,
        pattern=FINGERPRINT_PATTERN,
        description=(
            "Content fingerprint of the data files (sizes and hashes of a sample of each; "
            "`wanswarm fingerprint --run-spec FILE` prints it). When set, a trainer whose "
            "local data differs refuses to join, naming the difference."
        ),
    )
    shards: int = Field(
        default=1,
        ge=1,
        le=1_000_000,
        description=(
            "Streamed formats: records split into this many disjoint shards; a trainer reads "
            "shard (trainer.data_seed mod shards) first, then the others in turn."
        ),
    )

    @field_validator("corpus")
    @classmethod
    def _entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if not entry.strip():
                raise ValueError("corpus has an empty entry; remove it")
        if STDLIB_CORPUS in value and len(value) > 1:
            raise ValueError(f"'{STDLIB_CORPUS}' must be the only corpus entry when used")
        return value

    @model_validator(mode="after")
    def _tokenizer_fields(self) -> DataSpec:
        if (self.tokenizer is None) != (self.tokenizer_sha256 is None):
            raise ValueError(
                "data.tokenizer and data.tokenizer_sha256 go together; "
                "`wanswarm tokenizer train` prints both"
            )
        if self.format == "bytes" and (self.tokenizer is not None or self.eos_token is not None):
            raise ValueError("format 'bytes' is byte-level: no tokenizer or eos_token")
        if self.eos_token is not None and self.tokenizer is None:
            raise ValueError("data.eos_token needs data.tokenizer")
        return self


class LimitsSpec(_Section):
    """Bounds on the values peers exchange (docs/hostile.md, "Values").

    A stage server refuses a request whose tensors exceed them (``out_of_range``) before
    computing on it, and a micro-batch whose loss or parameter gradients exceed them before
    adding anything to its accumulated gradients; the trainer refuses a reply that exceeds
    them instead of relaying it. The defaults lie orders of magnitude above what a healthy
    run shows (the tiny run: activations below 11, dL/dx below 2e-3, micro-batch gradient
    norms below 10, loss below 6) and far enough below float32's 3.4e38 that no finite
    value within them overflows on the way through a stage.
    """

    max_activation: float = Field(
        default=1e4,
        gt=0.0,
        le=1e30,
        allow_inf_nan=False,
        description=(
            "Largest |value| of an activation between stages (the residual stream a stage "
            "takes and returns)."
        ),
    )
    max_gradient: float = Field(
        default=1e3,
        gt=0.0,
        le=1e30,
        allow_inf_nan=False,
        description="Largest |value| of a gradient dL/dx or dL/dy between stages.",
    )
    max_grad_norm: float = Field(
        default=1e3,
        gt=0.0,
        le=1e30,
        allow_inf_nan=False,
        description=(
            "Largest L2 norm of one micro-batch's parameter gradients on one stage; above "
            "it the micro-batch is refused, not clipped (optimizer.grad_clip clips the "
            "accumulated step)."
        ),
    )
    max_loss: float = Field(
        default=1e3,
        gt=0.0,
        le=1e30,
        allow_inf_nan=False,
        description="Largest loss (mean cross-entropy, nats per token) a stage may report.",
    )


class PrecisionSpec(_Section):
    """The arithmetic of the stages' compute (docs/gpu.md). Master weights and optimizer
    state stay float32 in every mode; activations cross the wire as the codecs say."""

    compute: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto",
        description=(
            "'auto': bf16 autocast on CUDA (fp16 with a loss scaler on GPUs without bf16), "
            "fp32 on the CPU; 'bf16' or 'fp16' (with a loss scaler): that autocast on every "
            "device; 'fp32': no autocast."
        ),
    )


class RunSpec(_Section):
    """One training run. Every peer of the run holds the same spec (same ``run_id``)."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description=(
            "Run name, the DHT key prefix ('{name}.spec', '{name}.servers'); letters, digits, "
            "'_' and '-' only (hivemind run ids may not contain '.')."
        ),
    )
    seed: int = Field(
        default=0, ge=0, lt=2**63, description="Seed of parameter init and validation set."
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model shape.")
    stages: StagesSpec = Field(default_factory=StagesSpec, description="Stage layout.")
    batch: BatchSpec = Field(default_factory=BatchSpec, description="Micro-batch and step sizes.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="Optimizer.")
    codecs: CodecsSpec = Field(default_factory=CodecsSpec, description="Wire codecs.")
    data: DataSpec = Field(default_factory=DataSpec, description="Corpus and validation.")
    limits: LimitsSpec = Field(
        default_factory=LimitsSpec,
        description="Bounds on exchanged values; left out of run_id while at the defaults.",
    )
    averaging: AveragingSpec = Field(
        default_factory=AveragingSpec,
        description="How a stage's replicas average; left out of run_id while at the defaults.",
    )
    precision: PrecisionSpec = Field(
        default_factory=PrecisionSpec,
        description="Compute precision of the stages; left out of run_id while at the defaults.",
    )
    subspace: SubspaceSpec = Field(
        default_factory=SubspaceSpec,
        description=(
            "Subspace compression of the stage boundaries (off by default); left out of "
            "run_id while at the defaults."
        ),
    )

    @model_validator(mode="after")
    def _layout_matches_model(self) -> RunSpec:
        total = sum(self.stages.blocks_per_stage)
        if total != self.model.n_layers:
            raise ValueError(
                f"stages.blocks_per_stage {list(self.stages.blocks_per_stage)} sums to {total} "
                f"but model.n_layers = {self.model.n_layers}; make them agree"
            )
        if self.data.tokenizer is None and self.model.vocab_size != VOCAB_SIZE:
            raise ValueError(
                f"model.vocab_size = {self.model.vocab_size} but the data is byte-level "
                f"(no data.tokenizer): set vocab_size = {VOCAB_SIZE} or name a tokenizer"
            )
        self._check_subspace()
        return self

    def _check_subspace(self) -> None:
        k = self.subspace.k
        if k is None:
            return
        if self.n_stages < 2:
            raise ValueError(
                "subspace.k is set but the run has a single stage: there is no boundary to "
                "compress; unset subspace.k or split the model into stages"
            )
        widths = (k,) if isinstance(k, int) else k
        if not isinstance(k, int) and len(k) != self.n_stages - 1:
            raise ValueError(
                f"subspace.k has {len(k)} widths but the run has {self.n_stages - 1} "
                f"boundaries (n_stages - 1 = {len(self.stages.blocks_per_stage)} - 1); give "
                "one width per boundary or a single int"
            )
        d_model = self.model.d_model
        if max(widths) > d_model:
            shown = k if isinstance(k, int) else list(k)
            raise ValueError(
                f"subspace.k = {shown} exceeds model.d_model = {d_model}; lower subspace.k"
            )
        if self.model.pretrained is not None:
            raise ValueError(
                "subspace.k is set with model.pretrained: projecting a pretrained checkpoint's "
                "residual writers onto a random subspace destroys its weights; start from a "
                "random init or unset subspace.k"
            )

    @property
    def n_stages(self) -> int:
        """Number of pipeline stages."""
        return self.stages.n_stages

    def canonical_json(self) -> str:
        """The spec as canonical JSON (sorted keys, no spaces), prefixed by the format version.

        ``limits`` appears only when it differs from the defaults: specs written before it
        existed keep their run id, and peers that predate it can still read ours."""
        spec = self.model_dump(mode="json")
        if self.limits == LimitsSpec():
            del spec["limits"]
        for section, names in _ADDED_FIELDS.items():  # omitted at their defaults, as limits
            defaults = _ADDED_DEFAULTS[section]
            for name in names:
                if spec[section][name] == defaults[name]:
                    del spec[section][name]
        if self.averaging == AveragingSpec():
            del spec["averaging"]
        if self.precision == PrecisionSpec():
            del spec["precision"]
        if self.subspace == SubspaceSpec():
            del spec["subspace"]
        payload = {"run_spec_version": RUN_SPEC_VERSION, "spec": spec}
        return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @property
    def run_id(self) -> str:
        """16 hex characters of the SHA-256 of ``canonical_json()``: equal iff specs equal."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


# Fields added after run ids were first published: left out of the canonical JSON while at
# their defaults, so that every earlier spec keeps its run id.
_ADDED_FIELDS: dict[str, tuple[str, ...]] = {
    "model": (
        "architecture", "n_kv_heads", "intermediate_size", "rms_norm_eps", "tie_embeddings",
        "pretrained", "pretrained_fingerprint",
    ),
    "data": (
        "format", "text_field", "tokenizer", "tokenizer_sha256", "eos_token", "fingerprint",
        "shards",
    ),
    "averaging": ("fragments", "inner_optimizer", "accum_steps"),
}
_ADDED_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": ModelSpec().model_dump(mode="json"),
    "data": DataSpec().model_dump(mode="json"),
    "averaging": AveragingSpec().model_dump(mode="json"),
}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def differing_fields(a: RunSpec, b: RunSpec) -> list[str]:
    """Dotted names of the fields whose values differ between two specs, sorted."""
    fa, fb = _flatten(a.model_dump(mode="json")), _flatten(b.model_dump(mode="json"))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def describe_mismatch(ours: RunSpec, theirs: RunSpec) -> str:
    """One line naming each differing field with both values; '' when the specs are equal."""
    fields = differing_fields(ours, theirs)
    if not fields:
        return ""
    fa, fb = _flatten(ours.model_dump(mode="json")), _flatten(theirs.model_dump(mode="json"))
    parts = [f"{k}: ours={fa.get(k)!r} theirs={fb.get(k)!r}" for k in fields]
    return (
        f"run spec mismatch (ours {ours.name}/{ours.run_id}, theirs {theirs.name}/"
        f"{theirs.run_id}): " + "; ".join(parts)
    )


def _format_errors(error: ValidationError, source: str) -> str:
    lines = [f"invalid run spec {source}:"]
    for item in error.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"  {loc}: {item['msg']}")
    return "\n".join(lines)


def parse_run_spec(text: str, source: str = "<string>") -> RunSpec:
    """Parse TOML text into a RunSpec; errors name the file and each offending field."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RunSpecError(f"run spec {source} is not valid TOML: {exc}") from exc
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as exc:
        raise RunSpecError(_format_errors(exc, source)) from exc


def load_run_spec(path: str | Path) -> RunSpec:
    """Read and validate a run spec TOML file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RunSpecError(f"cannot read run spec {path}: {exc.strerror or exc}") from exc
    return parse_run_spec(text, str(path))


def default_run_spec() -> RunSpec:
    """The embedded default run (package data ``runs/tiny.toml``)."""
    text = (
        resources.files("wanswarm.node").joinpath("runs", "tiny.toml").read_text(encoding="utf-8")
    )
    return parse_run_spec(text, "<embedded runs/tiny.toml>")
