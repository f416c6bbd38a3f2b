"""The Llama-style block (``model.architecture = "llama"``), as Hugging Face's Llama computes it.

RMSNorm before attention and before the MLP, rotary positions on queries and keys,
grouped-query attention (``n_kv_heads`` key/value heads shared by ``n_heads / n_kv_heads``
query heads each) and a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``; no biases. Submodule
names are those of ``transformers``' ``LlamaDecoderLayer`` (``self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm``, ...), so that a checkpoint's tensors map onto a
stage's by renaming the layer index alone (hf_llama.py). model.py builds stages of these
blocks; this module knows one block.

Shapes: B batch, T sequence length, C d_model, H query heads, K key/value heads,
D = C // H, F the MLP's hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.runspec import ModelSpec


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in float32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()  # (..., C)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., C)
        return self.weight * h.to(dtype)


def rope_cos_sin(
    T: int, D: int, base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, D): the D/2 frequencies
    ``1 / base^(2i/D)`` twice over, as transformers computes them (float32)."""
    exponents = torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D  # (D/2,)
    inv_freq = 1.0 / (base**exponents)  # (D/2,)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq  # (T, D/2)
    both = torch.cat((angles, angles), dim=-1)  # (T, D)
    return both.cos(), both.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` (B, heads, T, D), cos/sin (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, heads, T, D/2) each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # (B, heads, T, D)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.rope_base = cfg.rope_base
        C, D = cfg.d_model, cfg.head_dim
        self.q_proj = nn.Linear(C, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(C, self.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(C, self.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, C, bias=False)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        v = self.v_proj(x).view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        cos, sin = rope_cos_sin(T, D, self.rope_base, x.device)  # (T, D) each
        q, k = (
            rotate(q, cos.to(q.dtype), sin.to(q.dtype)),
            rotate(k, cos.to(k.dtype), sin.to(k.dtype)),
        )
        if K != H:  # each key/value head serves H / K consecutive query heads
            k = k.repeat_interleave(H // K, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(H // K, dim=1)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.o_proj(y)  # (B, T, C)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: C -> (silu(gate) * up, F wide) -> C."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)  # residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


class LlamaBlock(nn.Module):
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x))."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))  # (B, T, C)
        x = x + self.mlp(self.post_attention_layernorm(x))  # (B, T, C)
        return x


def llama_block_parameters(cfg: ModelSpec) -> int:
    """Parameters of one LlamaBlock: two norms, q/k/v/o, gate/up/down."""
    C, D, F_ = cfg.d_model, cfg.head_dim, cfg.mlp_hidden
    attention = C * cfg.n_heads * D * 2 + C * cfg.kv_heads * D * 2
    return 2 * C + attention + 3 * C * F_


RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")  # scaled down at init, as GPT-2's ".proj"
