"""The model (the byte-level GPT or the Llama-style decoder) and how it splits into stages.

``architecture = "gpt"``: a pre-LayerNorm decoder (nanoGPT-style): token embeddings,
``n_layers`` blocks of causal self-attention (rotary positions, or a learned position
embedding on stage 0) and a GELU MLP, a final LayerNorm and an untied LM head.
``architecture = "llama"``: the same frame with llama.py's blocks (RMSNorm, grouped-query
attention, SwiGLU) and a final RMSNorm; the head may start tied to the embedding
(``tie_embeddings``), and ``model.pretrained`` loads a Hugging Face checkpoint instead of
the random init (hf_llama.py), each stage reading only its own tensors.
``StageModule`` is one stage of it, as a stage server holds it; ``PipelineModel`` chains
every stage in one process for the single-process reference and for tests.

Parameters are initialized from a generator seeded by ``(spec.run_id, stage)`` so that
every replica of a stage, on any machine, starts bit-identical; building a stage leaves
the global RNG as it was.

Shapes: B batch, T sequence length, C d_model, H heads, D = C // H, V vocabulary.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config.runspec import ModelSpec, RunSpec
from ..stage.layout import StageLayout
from .llama import RESIDUAL_PROJECTIONS, LlamaBlock, RMSNorm, llama_block_parameters
from .subspace import Subspace

INIT_STD = 0.02  # GPT-2's init scale for linear layers (and learned positions)
# Token embeddings start at N(0, 1), torch's default (as in modded-nanogpt), not GPT-2's
# 0.02: the residual stream then starts dominated by the current byte, which the blocks'
# LayerNorms and the final one pass on intact, and the early loss falls measurably faster.
TOKEN_EMBEDDING_STD = 1.0


class StageInputError(ValueError):
    """A stage got an input of the wrong dtype, shape or range (e.g. from a remote peer)."""


def rotary_tables(
    T: int, D: int, base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles, each (T, D/2): position t, frequency base^(-2i/D)."""
    inv_freq = base ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)  # (D/2,)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq  # (T, D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + D/2]) of ``x`` (B, H, T, D) by its position's angle
    (RoFormer, arXiv:2104.09864): q.k then depends on positions only through their offset."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, D)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.rotary = cfg.positions == "rotary"
        self.rope_base = cfg.rope_base
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        if self.rotary:
            cos, sin = rotary_tables(T, C // H, self.rope_base, x.device)  # (T, D/2) each
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> mlp_hidden -> GELU -> C."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # (B, T, C)
        x = x + self.mlp(self.ln_mlp(x))  # (B, T, C)
        return x


class StageModule(nn.Module):
    """One pipeline stage: its span of blocks, plus the embeddings (first) or head (last).

    ``forward(x)`` takes token ids ``(B, T)`` int64 on the first stage and activations
    ``(B, T, C)`` float32 elsewhere; it returns activations ``(B, T, C)``, or logits
    ``(B, T, V)`` on the last stage. The last stage also has ``forward_loss``.
    """

    def __init__(self, spec: RunSpec, stage: int) -> None:
        super().__init__()
        cfg = spec.model
        layout = StageLayout(spec.stages.blocks_per_stage)
        layout.check_stage(stage)
        self.cfg = cfg
        self.stage = stage
        self.run_id = spec.run_id
        self.block_indices = layout.blocks(stage)
        self.is_first = layout.has_embedding(stage)
        self.is_last = layout.has_head(stage)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model) if self.is_first else None
        learned = self.is_first and cfg.positions == "learned"
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if learned else None
        llama = cfg.architecture == "llama"
        self.blocks = nn.ModuleList(
            LlamaBlock(cfg) if llama else Block(cfg) for _ in self.block_indices
        )
        self.ln_f: nn.Module | None = None
        if self.is_last:
            norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps) if llama else nn.LayerNorm(cfg.d_model)
            self.ln_f = norm
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if self.is_last else None
        if self.tied and self.head is not None and self.tok_emb is not None:
            self.head.weight = self.tok_emb.weight  # one stage holds both ends: one matrix
        # With a subspace (subspace.py), stage 0 adds the fixed table E_fixed to its
        # embedding; a plain attribute, not a buffer: it is derived from the seed, never
        # trained, saved or sent.
        self.subspace = Subspace.for_run(spec)

    @property
    def tied(self) -> bool:
        """Whether the head is the token embedding itself (tie_embeddings on a single stage)."""
        return self.cfg.tie_embeddings and self.is_first and self.is_last

    def check_input(self, x: torch.Tensor) -> None:
        """Raise StageInputError unless ``x`` is a valid input of this stage."""
        if self.is_first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise StageInputError(
                    f"stage 0 takes int64 token ids (B, T), got {x.dtype} {tuple(x.shape)}"
                )
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
                raise StageInputError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        elif x.dtype != torch.float32 or x.dim() != 3 or x.shape[2] != self.cfg.d_model:
            raise StageInputError(
                f"stage {self.stage} takes float32 activations (B, T, {self.cfg.d_model}), "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        if x.shape[0] < 1 or not 1 <= x.shape[1] <= self.cfg.seq_len:
            raise StageInputError(
                f"need B >= 1 and 1 <= T <= {self.cfg.seq_len}, got {tuple(x.shape)}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            h = self.tok_emb(x)  # (B, T, C)
            if self.subspace is not None:
                h = h + self.subspace.fixed_embedding(h.device, h.dtype)[x]  # (B, T, C)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(x.shape[1], device=x.device))  # (B, T, C)
        else:
            h = x  # (B, T, C)
        if torch.is_autocast_enabled(h.device.type):
            # under autocast the residual stream stays in its dtype (bf16/fp16), as in
            # Megatron-LM: the stage's output leaves in it (node/stage/precision.py)
            h = h.to(torch.get_autocast_dtype(h.device.type))  # (B, T, C)
        for block in self.blocks:
            h = block(h)  # (B, T, C)
        if self.ln_f is not None and self.head is not None:
            return self.head(self.ln_f(h)) * self.cfg.logit_multiplier  # (B, T, V)
        return h

    def forward_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of the next bytes ``targets`` (B, T) int64."""
        if not self.is_last:
            raise StageInputError(f"stage {self.stage} is not the last stage; it has no loss")
        logits = self.forward(x)  # (B, T, V)
        if targets.shape != logits.shape[:2] or targets.dtype != torch.int64:
            raise StageInputError(
                f"targets must be int64 {tuple(logits.shape[:2])}, "
                f"got {targets.dtype} {tuple(targets.shape)}"
            )
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # ()


class PipelineModel(nn.Module):
    """Every stage chained in one process: ``stages[-1](... stages[0](idx))``.

    With a ``subspace``, each boundary's activations go through ``to_wire`` and
    ``from_wire`` as they do between stage servers (autograd then lifts the gradient as the
    swarm does: ``U U^T g``), so this computes what the swarm computes."""

    def __init__(self, stages: list[StageModule], subspace: Subspace | None = None) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.subspace = subspace

    def _through(self, idx: torch.Tensor, stages: int) -> torch.Tensor:
        h = idx  # (B, T) token ids
        for s in range(stages):
            h = self.stages[s](h)  # (B, T, C), or (B, T, V) out of the last stage
            if self.subspace is not None and s < len(self.stages) - 1:
                c = self.subspace.to_wire(h, idx, s)  # (B, T, k_s)
                h = self.subspace.from_wire(c, idx, s)  # (B, T, C)
        return h

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self._through(idx, len(self.stages))  # (B, T, V)

    def forward_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of ``targets`` (B, T) given ``idx`` (B, T)."""
        h = self._through(idx, len(self.stages) - 1)  # (B, T, C)
        last: StageModule = self.stages[-1]  # type: ignore[assignment]
        return last.forward_loss(h, targets)

    def project_(self) -> None:
        """Put every stage back inside the subspace (after an optimizer step); no-op without."""
        if self.subspace is None:
            return
        for stage in self.stages:
            self.subspace.project_(stage)  # type: ignore[arg-type]


def stage_seed(spec: RunSpec, stage: int) -> int:
    """Seed of a stage's parameter init: a hash of ``(run_id, stage)``, 63 bits."""
    return _seed(spec.run_id, stage)


def _seed(run_id: str, stage: int) -> int:
    digest = hashlib.sha256(f"wanswarm-init:{run_id}:{stage}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@torch.no_grad()
def _init_parameters(module: StageModule, generator: torch.Generator) -> None:
    """GPT-2 init, N(0, 0.02), with residual projections scaled by 1/sqrt(2 n_layers), except
    token embeddings N(0, 1) and the head N(0, 0.02 / logit_multiplier)."""
    residual_std = INIT_STD / math.sqrt(2 * module.cfg.n_layers)
    llama = module.cfg.architecture == "llama"
    residual = (".proj", *(f".{n}" for n in RESIDUAL_PROJECTIONS))
    for name, sub in module.named_modules():  # registration order: deterministic
        if isinstance(sub, nn.LayerNorm):
            sub.weight.fill_(1.0)
            sub.bias.fill_(0.0)
        elif isinstance(sub, RMSNorm):
            sub.weight.fill_(1.0)
        elif isinstance(sub, nn.Linear):
            if name == "head" and module.tied:
                continue  # it is tok_emb's matrix, drawn below
            std = residual_std if name.endswith(residual) else INIT_STD
            if name == "head":  # its output is scaled up by logit_multiplier: same logits at init
                std = INIT_STD / module.cfg.logit_multiplier
            sub.weight.normal_(0.0, std, generator=generator)
        elif isinstance(sub, nn.Embedding):
            # llama: N(0, 0.02) as transformers does, the scale a tied head needs
            std = TOKEN_EMBEDDING_STD if name == "tok_emb" and not llama else INIT_STD
            sub.weight.normal_(0.0, std, generator=generator)
    if module.cfg.tie_embeddings and module.head is not None and not module.tied:
        # The head starts as stage 0's embedding: its first draw from stage 0's generator.
        first = torch.Generator().manual_seed(_seed(module.run_id, 0))
        module.head.weight.normal_(0.0, INIT_STD, generator=first)


def build_stage(spec: RunSpec, stage: int) -> StageModule:
    """Stage ``stage`` of the run, on the CPU in float32, initialized from ``stage_seed``."""
    seed = stage_seed(spec, stage)
    # torch's default init draws from the global RNG: fork it (restored on exit, so building
    # a stage has no side effect) and seed it, then overwrite every parameter explicitly.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = StageModule(spec, stage)
    if spec.model.pretrained is not None:
        from .hf_llama import load_stage_tensors  # reads only this stage's tensors

        tensors = load_stage_tensors(spec, stage)
        if module.tied:
            tensors.setdefault("head.weight", tensors["tok_emb.weight"])
        module.load_state_dict(tensors, strict=True)
        return module
    _init_parameters(module, torch.Generator().manual_seed(seed))
    if module.subspace is not None:
        module.subspace.project_(module)  # a new stage starts inside the constraint
    return module


def build_full_model(spec: RunSpec) -> PipelineModel:
    """All stages chained; its parameters equal those of ``build_stage`` for each stage."""
    stages = [build_stage(spec, s) for s in range(spec.n_stages)]
    return PipelineModel(stages, Subspace.for_run(spec))


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices (dim >= 2) decay, norms and vectors do not."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def count_parameters(module: nn.Module) -> int:
    """Number of scalar parameters in ``module``."""
    return sum(p.numel() for p in module.parameters())


def expected_stage_parameters(spec: RunSpec, stage: int) -> int:
    """Parameter count of a stage from the spec alone (what ``build_stage`` must produce)."""
    cfg = spec.model
    C, V, hidden = cfg.d_model, cfg.vocab_size, cfg.mlp_hidden
    llama = cfg.architecture == "llama"
    per_block = 2 * (2 * C) + 3 * C * C + C * C + 2 * C * hidden  # two LNs, qkv, proj, MLP
    if llama:
        per_block = llama_block_parameters(cfg)
    layout = StageLayout(spec.stages.blocks_per_stage)
    total = len(layout.blocks(stage)) * per_block
    if layout.has_embedding(stage):
        total += V * C + (cfg.seq_len * C if cfg.positions == "learned" else 0)
    if layout.has_head(stage):
        total += (C if llama else 2 * C) + C * V
        if cfg.tie_embeddings and layout.has_embedding(stage):
            total -= C * V  # one matrix for both ends
    return total
