"""A stage's parameters in a few numbers: a sketch that tells how far two replicas are apart.

A SHA-256 digest says whether two replicas are bit-identical, and nothing else: two replicas
that averaged through hivemind's all-reduce hold the same average up to rounding (each adds
its own ``average - local`` delta back to its local copy, and lossy compression of the
parts rounds differently on each side), so their digests differ although the replicas agree
to the seventh digit. The sketch measures the distance instead.

It is a count sketch (Charikar, Chen and Farach-Colton, 2002): every scalar parameter is
added, with a random sign, to one of ``m`` buckets, both drawn from a generator seeded by
the parameter's position in ``state_dict`` order, so every replica on every machine uses
the same buckets and signs. The sketch is linear: ``sketch(a) - sketch(b) = sketch(a - b)``,
and ``E ||sketch(x)||^2 = ||x||^2`` with a relative standard deviation of about
``sqrt(2 / m)`` (16% at the default 64 buckets; the figure is a magnitude, not a proof of
equality). ``relative_distance`` therefore estimates ``||a - b|| / ||a||`` from two
sketches of 64 floats, small enough to travel in ``wanswarm status``.

Cost: one pass over the parameters with a bucket and sign drawn per scalar, in chunks of
at most ``CHUNK`` elements (about 1 s per 100 M parameters on one CPU core); it runs after
an optimizer epoch, on the device thread, like the digest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

DEFAULT_BUCKETS = 64
CHUNK = 1 << 22  # elements drawn at once: bounds the sketch's scratch memory (~100 MiB)
_SEED = 0x5EED_F1_9E  # fixed: the sketch must be the same function on every replica


def param_sketch(
    state: Mapping[str, torch.Tensor], buckets: int = DEFAULT_BUCKETS
) -> list[float]:
    """The count sketch of every floating-point tensor of ``state`` (a ``state_dict``), in
    its order, as ``buckets`` float64 sums."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    out = torch.zeros(buckets, dtype=torch.float64)
    for index, tensor in enumerate(state.values()):
        if not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
        generator = torch.Generator().manual_seed(_SEED + index)
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start : start + CHUNK]  # (n,)
            where = torch.randint(buckets, (part.numel(),), generator=generator)  # (n,)
            sign = torch.randint(2, (part.numel(),), generator=generator) * 2 - 1  # (n,)
            out.index_add_(0, where, part * sign)
    return [float(v) for v in out.tolist()]


def relative_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """Estimated ``||A - B|| / ||A||`` of the parameter vectors whose sketches are ``a`` and
    ``b`` (``inf`` when ``a`` is all zeros and ``b`` is not; 0 when both are)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"sketches of different sizes: {len(a)} and {len(b)}")
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    norm = math.sqrt(sum(x * x for x in a))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


__all__ = ["DEFAULT_BUCKETS", "param_sketch", "relative_distance"]
