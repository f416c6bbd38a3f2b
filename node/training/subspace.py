"""Subspace compression of the stage boundaries (Protocol Models, arXiv 2506.01260).

Every peer derives, from the run's seed and nothing else, one orthonormal master basis
``M`` (``d_model`` x ``k_max``) and one fixed token-embedding table ``E_fixed`` (V x
``d_model``, N(0, ``embedding_std``^2)). Boundary ``b`` (between stage ``b`` and ``b + 1``)
uses ``U_b = M[:, :k_b]``; the widths never decrease along the pipeline, so the bases are
nested: ``span(U_0) ⊆ span(U_1) ⊆ ...``.

The constraint (``project_``, after every optimizer step and on a fresh stage): stage ``s <
S - 1`` writes into the residual stream only inside ``span(U_s)`` -- its token embedding
(and learned position embedding) rows and each block's residual projections (GPT
``attn.proj`` / ``mlp.proj``, Llama ``o_proj`` / ``down_proj``, weights and biases) are
replaced by ``U_s U_s^T W``. Stage 0 adds ``E_fixed[tokens]`` to its embedding output, so at
boundary ``b`` the residual stream is ``h = E_fixed[tokens] + U_b c`` exactly, because every
write of stages ``0..b`` lies in ``span(U_s) ⊆ span(U_b)``. The last stage is free.

On the wire (per token, boundary ``b``)::

    forward   c  = U_b^T (h - E_fixed[tokens])      k_b values, plus the token id
              h  = U_b c + E_fixed[tokens]          rebuilt by stage b + 1
    backward  gc = U_b^T g                          k_b values (g = dL/dh at stage b + 1)
              g' = U_b gc                           lifted by stage b

``g' = U_b U_b^T g`` is the exact gradient of the composition ``h -> from_wire(to_wire(h))``
(its Jacobian is ``U_b U_b^T``), which is what stage ``b`` computed on: nothing is
approximated beyond float rounding and the codec that carries ``c`` and ``gc``.

Arithmetic runs in float32 (float64 for float64 inputs, so that gradcheck can test it) with
autocast off, whatever the dtype of the tensors coming and going. The basis and the table
are drawn in float64 on the CPU from a generator seeded by a hash of ``(seed, d_model,
vocab_size)`` and rounded to float32: the same bits on every peer (QR runs in LAPACK, whose
last float64 bits may differ between BLAS builds; the rounding to float32 absorbs that
unless a value falls within 1e-16 of a rounding boundary, see docs/compression.md). The
prefix property makes every ``k`` of one seed share its leading columns, and lets the
benchmark compare widths on the same basis.

Every tensor these functions take may come from a peer: shapes, dtypes and token ids are
checked, and anything wrong raises ``ValueError`` (which the wiring turns into a refusal).
No I/O, no asyncio.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config.runspec import RunSpec

if TYPE_CHECKING:
    from .model import StageModule

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def token_id_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest dtype that carries token ids of this vocabulary on the wire."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 256:
        return torch.uint8
    if vocab_size <= 32767:
        return torch.int16
    return torch.int32


def _derived_seed(tag: str, seed: int, d_model: int, vocab_size: int) -> int:
    key = f"wanswarm-subspace-{tag}:{seed}:{d_model}:{vocab_size}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def master_basis(seed: int, d_model: int, vocab_size: int, k: int) -> torch.Tensor:
    """``(d_model, k)`` float32 orthonormal columns; a wider ``k`` extends a narrower one.

    Column ``j`` is Gram-Schmidt of the ``j``-th Gaussian draw against the earlier ones
    (QR with the signs fixed so that R's diagonal is positive), so the first columns do not
    depend on ``k``.
    """
    generator = torch.Generator().manual_seed(_derived_seed("basis", seed, d_model, vocab_size))
    draws = torch.randn(k, d_model, generator=generator, dtype=torch.float64)  # (k, C): row j
    q, r = torch.linalg.qr(draws.T)  # (C, k), (k, k)
    signs = torch.sign(torch.diagonal(r))  # (k,)
    signs[signs == 0] = 1.0
    return (q * signs).to(torch.float32).contiguous()  # (C, k)


def fixed_table(seed: int, d_model: int, vocab_size: int, std: float) -> torch.Tensor:
    """``(vocab_size, d_model)`` float32 N(0, std^2): the fixed token embedding E_fixed."""
    generator = torch.Generator().manual_seed(_derived_seed("embed", seed, d_model, vocab_size))
    draws = torch.randn(vocab_size, d_model, generator=generator, dtype=torch.float64)  # (V, C)
    return (draws * std).to(torch.float32).contiguous()  # (V, C)


def residual_writers(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """The parameters of a stage that write into the residual stream.

    Each entry is ``(name, parameter, rows)``: ``rows`` is True when each row is a vector in
    the residual stream (embedding tables, ``(n, C)``), False when each column is (a
    ``Linear``'s weight ``(C, in)``) or the tensor itself is (a bias ``(C,)``).
    """
    out: list[tuple[str, torch.Tensor, bool]] = []
    for name in ("tok_emb", "pos_emb"):
        table = getattr(module, name, None)
        if isinstance(table, nn.Embedding):
            out.append((f"{name}.weight", table.weight, True))
    blocks = getattr(module, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return out
    for i, block in enumerate(blocks):
        for path in ("attn.proj", "mlp.proj", "self_attn.o_proj", "mlp.down_proj"):
            sub: nn.Module | None = block
            for part in path.split("."):
                sub = getattr(sub, part, None)
            if not isinstance(sub, nn.Linear):
                continue
            out.append((f"blocks.{i}.{path}.weight", sub.weight, False))
            if sub.bias is not None:
                out.append((f"blocks.{i}.{path}.bias", sub.bias, False))
    return out


class Subspace:
    """The basis, the fixed table and the boundary transforms of one run (module docstring)."""

    def __init__(
        self,
        *,
        seed: int,
        d_model: int,
        vocab_size: int,
        widths: tuple[int, ...],
        embedding_std: float = 0.5,
    ) -> None:
        if not widths:
            raise ValueError("a subspace needs at least one boundary")
        if any(not 1 <= k <= d_model for k in widths):
            raise ValueError(f"widths {list(widths)} must lie in [1, d_model = {d_model}]")
        if any(b < a for a, b in zip(widths, widths[1:], strict=False)):
            raise ValueError(f"widths {list(widths)} must be non-decreasing (nested bases)")
        self.seed = seed
        self.d_model = d_model
        self.vocab_size = vocab_size
        self.widths = tuple(widths)
        self.n_boundaries = len(widths)
        self.embedding_std = embedding_std
        self._lock = threading.Lock()  # stage servers call from a device thread and the loop
        self._basis: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._table: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def __deepcopy__(self, memo: dict[int, object]) -> Subspace:
        return self  # immutable (derived from the seed): copies of a stage share it

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        for name in ("_lock", "_basis", "_table"):  # rebuilt on demand
            del state[name]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._basis = {}
        self._table = {}

    @staticmethod
    def for_run(spec: RunSpec) -> Subspace | None:
        """The run's subspace, or None when ``spec.subspace.k`` is unset."""
        section = spec.subspace
        if section.k is None:
            return None
        return _shared(
            spec.seed,
            spec.model.d_model,
            spec.model.vocab_size,
            section.widths(spec.n_stages - 1),
            section.embedding_std,
        )

    def k_at(self, boundary: int) -> int:
        """``k_b``: coefficients per token at boundary ``b`` (between stage b and b + 1)."""
        self._check_boundary(boundary)
        return self.widths[boundary]

    # -- cached tensors ------------------------------------------------------------------

    def basis(self, boundary: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """``U_b`` (C, k_b) on ``device`` in ``dtype`` (a view of the cached master basis)."""
        self._check_boundary(boundary)
        key = (torch.device(device), dtype)
        with self._lock:
            master = self._basis.get(key)
            if master is None:
                cpu = self._basis.get((torch.device("cpu"), torch.float32))
                if cpu is None:
                    cpu = master_basis(self.seed, self.d_model, self.vocab_size, self.widths[-1])
                    self._basis[(torch.device("cpu"), torch.float32)] = cpu
                master = cpu.to(device=key[0], dtype=dtype)
                self._basis[key] = master
        return master[:, : self.widths[boundary]]  # (C, k_b)

    def fixed_embedding(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """E_fixed, (V, C), on ``device`` in ``dtype`` (cached; never modify it)."""
        key = (torch.device(device), dtype)
        with self._lock:
            table = self._table.get(key)
            if table is None:
                cpu = self._table.get((torch.device("cpu"), torch.float32))
                if cpu is None:
                    cpu = fixed_table(self.seed, self.d_model, self.vocab_size, self.embedding_std)
                    self._table[(torch.device("cpu"), torch.float32)] = cpu
                table = cpu.to(device=key[0], dtype=dtype)
                self._table[key] = table
        return table

    # -- the wire ------------------------------------------------------------------------

    def to_wire(self, h: torch.Tensor, tokens: torch.Tensor, boundary: int) -> torch.Tensor:
        """``c = U_b^T (h - E_fixed[tokens])``: (B, T, C), (B, T) -> (B, T, k_b) in h's dtype."""
        self._check_boundary(boundary)
        self._check_float(h, "activations", self.d_model)
        self._check_tokens(tokens, h.shape[:2])
        dtype = _compute_dtype(h.dtype)
        with _no_autocast(h.device):
            e = self.fixed_embedding(h.device, dtype)[tokens.to(h.device, torch.int64)]  # (B, T, C)
            c = (h.to(dtype) - e) @ self.basis(boundary, h.device, dtype)  # (B, T, k)
        return c.to(h.dtype)

    def from_wire(self, c: torch.Tensor, tokens: torch.Tensor, boundary: int) -> torch.Tensor:
        """``h = U_b c + E_fixed[tokens]``: (B, T, k_b), (B, T) -> (B, T, C) in c's dtype."""
        self._check_boundary(boundary)
        self._check_float(c, "coefficients", self.widths[boundary])
        self._check_tokens(tokens, c.shape[:2])
        dtype = _compute_dtype(c.dtype)
        with _no_autocast(c.device):
            u = self.basis(boundary, c.device, dtype)  # (C, k)
            e = self.fixed_embedding(c.device, dtype)[tokens.to(c.device, torch.int64)]  # (B, T, C)
            h = c.to(dtype) @ u.T + e  # (B, T, C)
        return h.to(c.dtype)

    def grad_to_wire(self, g: torch.Tensor, boundary: int) -> torch.Tensor:
        """``U_b^T g``: dL/dh (B, T, C) -> (B, T, k_b) in g's dtype (sent back by stage b+1)."""
        self._check_boundary(boundary)
        self._check_float(g, "gradients", self.d_model)
        dtype = _compute_dtype(g.dtype)
        with _no_autocast(g.device):
            gc = g.to(dtype) @ self.basis(boundary, g.device, dtype)  # (B, T, k)
        return gc.to(g.dtype)

    def grad_from_wire(self, gc: torch.Tensor, boundary: int) -> torch.Tensor:
        """``U_b gc``: (B, T, k_b) -> dL/dh (B, T, C) in gc's dtype (lifted by stage b)."""
        self._check_boundary(boundary)
        self._check_float(gc, "gradient coefficients", self.widths[boundary])
        dtype = _compute_dtype(gc.dtype)
        with _no_autocast(gc.device):
            g = gc.to(dtype) @ self.basis(boundary, gc.device, dtype).T  # (B, T, C)
        return g.to(gc.dtype)

    # -- the constraint ------------------------------------------------------------------

    @torch.no_grad()
    def project_(self, module: StageModule) -> None:
        """Project the stage's residual writers onto ``span(U_stage)``, in place.

        The last stage is free and left untouched. Runs after every optimizer step, on a
        freshly built stage, and on parameters loaded from a peer or a checkpoint.
        """
        stage = self._stage_of(module)
        if stage >= self.n_boundaries:
            return
        for _, param, rows in residual_writers(module):
            data = param.data
            dtype = _compute_dtype(data.dtype)
            u = self.basis(stage, data.device, dtype)  # (C, k)
            with _no_autocast(data.device):
                w = data.to(dtype)
                # rows: (n, C) tables; otherwise (C, in) weights or (C,) biases
                projected = (w @ u) @ u.T if rows else u @ (u.T @ w)
            data.copy_(projected)

    @torch.no_grad()
    def constraint_error(self, module: StageModule) -> float:
        """Largest ``|W - U U^T W| / |W|`` over the stage's residual writers (0.0 when all
        lie in the subspace, and on the last stage, which is free)."""
        stage = self._stage_of(module)
        if stage >= self.n_boundaries:
            return 0.0
        worst = 0.0
        for _, param, rows in residual_writers(module):
            w = param.detach().to(torch.float64)
            u = self.basis(stage, w.device, torch.float64)  # (C, k)
            inside = (w @ u) @ u.T if rows else u @ (u.T @ w)
            norm = float(torch.linalg.vector_norm(w))
            if norm > 0.0:
                worst = max(worst, float(torch.linalg.vector_norm(w - inside)) / norm)
        return worst

    # -- checks --------------------------------------------------------------------------

    def _stage_of(self, module: StageModule) -> int:
        stage = getattr(module, "stage", None)
        if not isinstance(stage, int) or not 0 <= stage <= self.n_boundaries:
            raise ValueError(
                f"module stage {stage!r} is not a stage of this run "
                f"(0..{self.n_boundaries})"
            )
        d_model = getattr(getattr(module, "cfg", None), "d_model", None)
        if d_model != self.d_model:
            raise ValueError(f"module d_model {d_model} != the subspace's {self.d_model}")
        return stage

    def _check_boundary(self, boundary: int) -> None:
        if (
            not isinstance(boundary, int)
            or isinstance(boundary, bool)
            or not 0 <= boundary < self.n_boundaries
        ):
            raise ValueError(
                f"boundary {boundary!r} out of range: the run has boundaries "
                f"0..{self.n_boundaries - 1}"
            )

    @staticmethod
    def _check_float(t: torch.Tensor, what: str, width: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what} must be a tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{what} must be floating point, got {t.dtype}")
        if t.dim() != 3 or t.shape[2] != width:
            raise ValueError(f"{what} must be (B, T, {width}), got {tuple(t.shape)}")

    def _check_tokens(self, tokens: torch.Tensor, batch_shape: torch.Size) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"token ids must be a tensor, got {type(tokens).__name__}")
        if tokens.dtype not in TOKEN_DTYPES:
            raise ValueError(f"token ids must be an integer tensor, got {tokens.dtype}")
        if tuple(tokens.shape) != tuple(batch_shape):
            raise ValueError(
                f"token ids must be (B, T) = {tuple(batch_shape)}, got {tuple(tokens.shape)}"
            )
        if tokens.numel() and (
            int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size
        ):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")


@functools.lru_cache(maxsize=8)
def _shared(
    seed: int, d_model: int, vocab_size: int, widths: tuple[int, ...], embedding_std: float
) -> Subspace:
    """One Subspace per distinct run in a process: its stages share the cached tensors."""
    return Subspace(
        seed=seed,
        d_model=d_model,
        vocab_size=vocab_size,
        widths=widths,
        embedding_std=embedding_std,
    )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 tensors (tests check gradients in float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _no_autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, enabled=False)
