"""The run spec's ``[subspace]`` section: Protocol Models' subspace compression of the boundaries.

With a subspace (arXiv 2506.01260; docs/compression.md), what crosses the boundary between
stage ``b`` and ``b + 1`` is ``k_b`` coefficients per token plus the token ids instead of
``d_model`` activations: every peer derives the same orthonormal basis ``U`` (``d_model`` x
``k``) and the same fixed token-embedding table ``E_fixed`` from the run's seed, stage 0 adds
``E_fixed[tokens]`` to its trainable embedding, and after every optimizer step every parameter
that writes into the residual stream on stages ``0 .. S-2`` is projected onto ``span(U)``.
The residual stream at every boundary is then ``E_fixed[tokens] + U c`` and the receiver
rebuilds it exactly from ``c`` and the ids; gradients travel back as ``U^T g``. The last
stage is left free: its output never crosses a boundary. The arithmetic is
node/training/subspace.py's.

Every peer of a run must hold the same section (it changes the model), so it is part of the
run spec; ``runspec.RunSpec.subspace`` leaves it out of the run id while it holds its
defaults (off), so existing runs keep their id. ``RunSpec`` checks it against the model
(``k`` at most ``d_model``, one width per boundary, more than one stage, no pretrained start).

This module is pure (pydantic only).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_K = 16384  # model.d_model's own bound


class SubspaceSpec(BaseModel):
    """Subspace compression of the stage boundaries (the run spec's ``[subspace]`` section)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    k: int | tuple[int, ...] | None = Field(
        default=None,
        description=(
            "Coefficients per token at each boundary: one width for every boundary (e.g. 32), "
            "or one per boundary in pipeline order, non-decreasing (e.g. [16, 32]: boundary "
            "b's basis is the first k_b columns of one master basis, since a residual written "
            "by stage 0 crosses every later boundary); at most model.d_model. Unset: no "
            "subspace, activations cross the boundaries whole (the default)."
        ),
    )
    embedding_std: float = Field(
        default=0.5,
        gt=0.0,
        le=100.0,
        allow_inf_nan=False,
        description=(
            "Standard deviation of the fixed token-embedding table E_fixed (V x d_model, "
            "drawn from the run's seed and added to stage 0's trainable embedding). 0.5 "
            "measured better than 1.0, the GPT's own token-embedding scale (docs/compression.md: "
            "1.2 and 2.6 points of validation loss at k = 16 and 32, one run each)."
        ),
    )

    @field_validator("k")
    @classmethod
    def _widths(cls, value: int | tuple[int, ...] | None) -> int | tuple[int, ...] | None:
        if value is None:
            return None
        widths = (value,) if isinstance(value, int) else value
        if not widths:
            raise ValueError("subspace.k is an empty list; give one width per boundary or one int")
        for b, width in enumerate(widths):
            if isinstance(width, bool) or not 1 <= width <= MAX_K:
                where = "" if isinstance(value, int) else f"[{b}]"
                raise ValueError(f"subspace.k{where} = {width}; each width must be in [1, {MAX_K}]")
        for b in range(1, len(widths)):
            if widths[b] < widths[b - 1]:
                raise ValueError(
                    f"subspace.k = {list(widths)} decreases at boundary {b}: the bases are "
                    "nested (a residual written by stage 0 crosses every later boundary), "
                    "so the widths must be non-decreasing"
                )
        return value

    @property
    def enabled(self) -> bool:
        """Whether the run compresses its boundaries with a subspace."""
        return self.k is not None

    def widths(self, n_boundaries: int) -> tuple[int, ...]:
        """``k_b`` for each of the ``n_boundaries`` boundaries (the single ``k`` repeated)."""
        if self.k is None:
            raise ValueError("subspace.k is unset: the run has no subspace")
        if isinstance(self.k, int):
            return (self.k,) * n_boundaries
        if len(self.k) != n_boundaries:
            raise ValueError(
                f"subspace.k has {len(self.k)} widths but the run has {n_boundaries} boundaries"
            )
        return self.k
