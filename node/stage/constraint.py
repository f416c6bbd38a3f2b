"""The subspace constraint inside a stage's optimizer: every step leaves the weights in span(U).

A subspace run (run spec ``[subspace]``, docs/compression.md) is exact only while every
parameter that writes into the residual stream on stages ``0 .. S-2`` lies in the span of
the stage's boundary basis ``U`` (node/training/subspace.py). AdamW's update is elementwise,
so it leaves that span on every step; the step therefore ends with a projection.

The projection runs inside the optimizer (:class:`SubspaceConstraint`, called by
``optimizer.ClippedAdamW.step``) rather than on the served module, because the optimizer
does not always hold the module's tensors: hivemind's collaborative optimizer steps
offloaded copies (``offload_optimizer=True``) and copies them into the module afterwards,
possibly from a background thread (delayed updates). Projecting the tensors the optimizer
itself steps keeps both in the subspace whichever tensors those are. The optimizer receives
its parameters as ``param_groups(module)`` lists them, and hivemind builds its offloaded
groups in the same order, so the constraint addresses parameters by their position in the
flattened groups.

Averaging and state transfer need no projection of their own: a mean of parameters in the
span is in the span, and a downloaded state was projected by the replica that stepped it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..training.model import StageModule, param_groups
from ..training.subspace import Subspace, residual_writers


@dataclass(frozen=True)
class _Rule:
    position: int  # in the flattened parameter groups
    name: str
    rows: bool  # each row is a residual vector (embeddings); else each column (weights, biases)


class SubspaceConstraint:
    """Projects the residual writers among an optimizer's parameters onto ``span(U_b)``, where
    ``b`` is the stage's output boundary (the last stage has none and no constraint)."""

    def __init__(self, subspace: Subspace, boundary: int, rules: Sequence[_Rule]) -> None:
        self.subspace = subspace
        self.boundary = boundary
        self.rules = tuple(rules)

    @classmethod
    def for_stage(cls, module: nn.Module, weight_decay: float) -> SubspaceConstraint | None:
        """The constraint of ``module``'s optimizer, whose groups are
        ``param_groups(module, weight_decay)``; None without a subspace, on the last stage,
        and for a module that is not a stage (tests' stand-ins)."""
        if not isinstance(module, StageModule):
            return None
        subspace = module.subspace
        if subspace is None or module.stage >= subspace.n_boundaries:
            return None
        writers = {id(p): (name, rows) for name, p, rows in residual_writers(module)}
        flat = [p for group in param_groups(module, weight_decay) for p in group["params"]]
        rules = [
            _Rule(i, *writers[id(p)]) for i, p in enumerate(flat) if id(p) in writers
        ]
        if len(rules) != len(writers):  # a writer the optimizer does not step: a bug of ours
            raise RuntimeError(
                f"stage {module.stage}: {len(writers) - len(rules)} residual writers are not "
                "among the optimizer's parameters"
            )
        return cls(subspace, module.stage, rules)

    @torch.no_grad()
    def apply_(self, groups: Iterable[dict[str, Any]]) -> None:
        """Project the constrained tensors among ``groups`` (an optimizer's param_groups, in
        the order ``for_stage`` saw), in place."""
        flat = [p for group in groups for p in group["params"]]
        for rule in self.rules:
            data = flat[rule.position].data
            dtype = torch.float64 if data.dtype == torch.float64 else torch.float32
            u = self.subspace.basis(self.boundary, data.device, dtype)  # (C, k)
            w = data.to(dtype)
            if rule.rows:
                if w.shape[-1] != u.shape[0]:
                    raise RuntimeError(f"{rule.name}: rows of {w.shape[-1]}, not {u.shape[0]}")
                projected = (w @ u) @ u.T  # (n, C)
            else:
                if w.shape[0] != u.shape[0]:
                    raise RuntimeError(f"{rule.name}: {w.shape[0]} rows, not {u.shape[0]}")
                projected = u @ (u.T @ w)  # (C, in) or (C,)
            data.copy_(projected)
