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
at most ``CHUNK`` elements (about 1 s per 100 M parameters on one CPU core), and the
digest's SHA-256 pass. Both run after every optimizer epoch, but not on the device thread
(``Fingerprinter``): there they cost 0.1-0.5 s a step for a stage of 4-21 M parameters,
time in which the stage served nothing (on an H100 the stage server's path ran at 0.07 of
plain PyTorch's speed, most of the difference these two); the device thread only queues a
copy of the parameters into a reused host buffer, and a worker thread hashes and sketches
that copy.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ..logs import get_logger
from .state_tensors import tensors_digest

log = get_logger(__name__)

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


class Fingerprinter:
    """The digest and sketch of a stage's parameters after each epoch, computed off the
    device thread.

    ``submit`` (device thread) copies the state into one host buffer per tensor, reused
    from step to step (pinned memory, and on CUDA a copy queued on the current stream: the
    device thread does not wait for it, and a later in-place update of a parameter on that
    stream runs after it), and hands the copy to a worker thread, which waits for the copy,
    hashes and sketches it, and publishes ``(epoch, digest, sketch)`` as one value
    (``latest``). While the worker is still busy with an earlier epoch, ``submit`` skips the
    new one (``skipped``): the host memory is bounded by one copy of the state, and status
    shows the latest epoch fingerprinted, with its epoch, never a digest of one epoch beside
    a sketch of another."""

    def __init__(self, buckets: int = DEFAULT_BUCKETS) -> None:
        self.buckets = buckets
        self.skipped = 0  # epochs not fingerprinted: the worker was busy
        self._lock = threading.Lock()
        self._latest: tuple[int, str, list[float]] = (-1, "", [])
        self._busy = False
        self._host: dict[str, torch.Tensor] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="wanswarm-fingerprint")

    @property
    def latest(self) -> tuple[int, str, list[float]]:
        """``(epoch, digest, sketch)`` of the latest epoch fingerprinted (``(-1, "", [])``
        before the first)."""
        with self._lock:
            return self._latest

    def submit(self, epoch: int, state: Mapping[str, torch.Tensor]) -> bool:
        """Fingerprint ``state`` (a ``state_dict``) as it is now, for ``epoch``; False when
        skipped (the worker is busy, or closed). Call on the device thread."""
        with self._lock:
            if self._closed:
                return False
            if self._busy:
                self.skipped += 1
                return False
            self._busy = True
            self._idle.clear()
        try:
            host, event = self._copy(state)
            self._worker.submit(self._compute, epoch, host, event)
        except BaseException as exc:
            self._done()
            if isinstance(exc, RuntimeError) and self._closed:
                return False  # closed meanwhile (the executor refused): the stage is going away
            raise
        return True

    def _copy(
        self, state: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        event: torch.cuda.Event | None = None
        cuda: torch.device | None = None
        if set(self._host) != set(state) or any(
            self._host[k].shape != t.shape or self._host[k].dtype != t.dtype
            for k, t in state.items()
        ):
            self._host = {
                name: torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                for name, t in state.items()
            }
        for name, tensor in state.items():
            self._host[name].copy_(tensor.detach(), non_blocking=tensor.is_cuda)
            if tensor.is_cuda:
                cuda = tensor.device
        if cuda is not None:
            event = torch.cuda.current_stream(cuda).record_event()
        # the worker reads the buffers in state order, as param_sketch and the digest do
        return {name: self._host[name] for name in state}, event

    def _compute(
        self, epoch: int, host: dict[str, torch.Tensor], event: torch.cuda.Event | None
    ) -> None:
        try:
            if event is not None:
                event.synchronize()
            digest = tensors_digest(host.items())
            sketch = param_sketch(host, self.buckets)
            with self._lock:
                if epoch >= self._latest[0]:
                    self._latest = (epoch, digest, sketch)
        except Exception:  # a torch failure: the next epoch tries again
            log.exception("fingerprinting the parameters of epoch %d failed", epoch)
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._busy = False
            self._idle.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the fingerprint in progress (if any) is published; False on timeout."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        """Stop the worker; a fingerprint in progress finishes, nothing new starts."""
        self._closed = True
        self._worker.shutdown(wait=False, cancel_futures=True)


__all__ = ["DEFAULT_BUCKETS", "Fingerprinter", "param_sketch", "relative_distance"]
