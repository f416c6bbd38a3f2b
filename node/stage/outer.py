"""DiLoCo's outer step (Douillard et al. 2023, arXiv:2311.08105), as pure tensor arithmetic.

Between two outer steps each replica of a stage trains alone (``inner_steps`` AdamW steps on
its own micro-batches). An outer round then:

1. computes the replica's pseudo-gradient, ``delta = anchor - params`` (the anchor is the
   parameters every replica held after the last outer step);
2. compresses it with error feedback (pseudo_gradient.py) and averages what the replicas
   sent: the mean over the round's participants, each weighted by the samples it trained on
   since the last round (a replica that trained on nothing has nothing to say);
3. takes one Nesterov SGD step on the anchor with that mean as the gradient, exactly as
   ``torch.optim.SGD(nesterov=True)``::

       m      = mu * m + g
       anchor = anchor - lr * (g + mu * m)

4. sets the replica's parameters to the new anchor.

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) splits the stage's parameters into
fragments (:func:`split_fragments`) and takes each round on one of them, in turn: the round is
the same arithmetic on the fragment's view of the state (:func:`fragment_view`, the same
tensors), and ``round`` counts every fragment's round.

Every participant computes the same mean from the same bits and applies the same step to
the same anchor and momentum, so the replicas are bit-identical after a round. The outer
state (anchor, momentum, round number) and the replica's own residuals are named tensors
(``outer.anchor.<param>``, ``outer.momentum.<param>``, ``outer.residual.<param>``) that
checkpoints and state transfer carry beside the inner optimizer's (state_tensors.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

ANCHOR_PREFIX = "outer.anchor."
MOMENTUM_PREFIX = "outer.momentum."
RESIDUAL_PREFIX = "outer.residual."


@dataclass
class OuterState:
    """The outer optimizer's state for one stage: shared by every replica after a round."""

    anchor: dict[str, torch.Tensor]  # float32, the parameters after the last outer step
    momentum: dict[str, torch.Tensor]  # float32, Nesterov's buffer
    round: int = 0
    history: list[int] = field(default_factory=list)  # not exported: per-process bookkeeping

    @classmethod
    def start(cls, params: Mapping[str, torch.Tensor]) -> OuterState:
        """The outer state before the first round: the anchor is ``params``, momentum zero."""
        anchor = {n: p.detach().to(torch.float32).clone() for n, p in params.items()}
        return cls(anchor=anchor, momentum={n: torch.zeros_like(a) for n, a in anchor.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The outer state as named tensors (live: copying into them installs)."""
        out = {ANCHOR_PREFIX + n: t for n, t in self.anchor.items()}
        return out | {MOMENTUM_PREFIX + n: t for n, t in self.momentum.items()}


def split_fragments(sizes: Mapping[str, int], n: int) -> list[list[str]]:
    """The names of ``sizes`` (name -> number of values) in at most ``n`` fragments of about
    equal size: the largest tensor goes to the lightest fragment first, ties by name, so
    every replica splits the same way; each fragment's names sorted, empty ones dropped."""
    if n < 1:
        raise ValueError(f"fragments must be at least 1, got {n}")
    order = sorted(((numel, name) for name, numel in sizes.items()), reverse=True)
    frags: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for numel, name in order:
        i = min(range(n), key=lambda k: (load[k], k))
        frags[i].append(name)
        load[i] += numel
    return [sorted(f) for f in frags if f]


def fragment_view(state: OuterState, names: Sequence[str]) -> OuterState:
    """``state`` restricted to ``names``: the same tensors, so a step on the view steps the
    state (its ``round`` is the view's own: the caller advances the state's)."""
    return OuterState(
        anchor={n: state.anchor[n] for n in names},
        momentum={n: state.momentum[n] for n in names},
        round=state.round,
    )


@torch.no_grad()
def pseudo_gradient(
    anchor: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``anchor - params`` per name (float32): the replica's change since the last round,
    signed as a gradient (a step against it moves toward ``params``)."""
    return {n: a - params[n].detach().to(torch.float32) for n, a in anchor.items()}


@torch.no_grad()
def weighted_mean(
    contributions: Sequence[tuple[Mapping[str, torch.Tensor], float]],
) -> dict[str, torch.Tensor]:
    """The weighted mean of the participants' (decoded) pseudo-gradients, computed in a fixed
    order (the caller sorts participants by peer id) so that every replica gets the same bits.
    Weights must be positive; a round with none is an error of the caller."""
    total = sum(w for _, w in contributions)
    if not contributions or total <= 0:
        raise ValueError("an outer round needs at least one participant with positive weight")
    names = list(contributions[0][0])
    out = {}
    for name in names:
        acc = torch.zeros_like(contributions[0][0][name], dtype=torch.float32)
        for sent, weight in contributions:
            acc.add_(sent[name].to(torch.float32), alpha=weight / total)
        out[name] = acc
    return out


@torch.no_grad()
def nesterov_step(
    state: OuterState, grad: Mapping[str, torch.Tensor], lr: float, momentum: float
) -> None:
    """One outer Nesterov SGD step on ``state.anchor`` with ``grad`` (torch's SGD, nesterov,
    no dampening, no weight decay); advances ``state.round``."""
    for name, anchor in state.anchor.items():
        g = grad[name].to(torch.float32)
        buf = state.momentum[name]
        if momentum > 0:
            buf.mul_(momentum).add_(g)
            update = g.add(buf, alpha=momentum)
        else:
            update = g
        anchor.add_(update, alpha=-lr)
    state.round += 1


@torch.no_grad()
def load_anchor(params: Mapping[str, torch.Tensor], state: OuterState) -> None:
    """Copy the anchor into the replica's parameters (after a round, or to catch up)."""
    for name, p in params.items():
        p.copy_(state.anchor[name].to(p.dtype))


def max_divergence(replicas: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """The largest absolute difference of any parameter between any replica and the first."""
    worst = 0.0
    for other in replicas[1:]:
        for name, t in replicas[0].items():
            gap = other[name].detach().float() - t.detach().float()
            worst = max(worst, float(gap.abs().max()))
    return worst
