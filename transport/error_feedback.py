"""Error feedback for lossy gradient codecs (Seide et al. 2014; Karimireddy et al. 2019).

For each key (the node uses ``(peer, stage, tensor_name)``) we keep the residual ``r``,
what earlier sends failed to transmit. Each send encodes ``g + r`` and keeps
``r' = (g + r) - decode(sent)``. By telescoping, after T sends::

    sum(sent_t) = sum(g_t) + r_0 - r_T

so the sum of what was sent tracks the sum of the true gradients up to one residual,
whose size is bounded by one step's quantization error, instead of drifting by the sum
of all the errors as a plain quantizer does.

Memory is bounded: residuals live in an LRU map capped by entry count and bytes;
evicting one forgets at most one step's error for that key. :meth:`reset` drops all
residuals, or those whose tuple key starts with a prefix (e.g. ``(peer, stage)`` when
the node changes stage).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from . import codecs
from .codecs import CodecSpec, EncodedTensor
from .errors import ConfigError

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Per-key residuals added before quantization and updated after; thread-safe."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 1 << 30) -> None:
        if max_entries < 1:
            raise ConfigError(f"max_entries must be at least 1, got {max_entries}")
        if max_bytes < 0:
            raise ConfigError(f"max_bytes must be non-negative, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._residuals: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held by the residuals (float32, on their tensors' devices)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._residuals)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._residuals

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The residual currently held for ``key`` (float32), or None."""
        with self._lock:
            return self._residuals.get(key)

    def encode(
        self,
        key: Hashable,
        t: torch.Tensor,
        spec: CodecSpec,
        *,
        generator: torch.Generator | None = None,
        accept: Callable[[EncodedTensor], None] | None = None,
    ) -> EncodedTensor:
        """Encode ``t + residual[key]`` with ``spec`` and keep the new residual.

        The payload keeps ``t``'s dtype and shape. Lossless codecs (``none``) keep no
        residual. If encoding fails (e.g. PayloadError on NaN), the old residual stays.
        ``accept`` sees the payload before the new residual is kept: whatever it raises
        propagates and the old residual stays (a sender that refuses to send what it
        encoded, e.g. a value beyond a bound, must not count it as sent).
        """
        with self._lock:
            prev = self._residuals.get(key)
        if prev is not None and (
            prev.shape != t.shape or prev.device != t.device
        ):  # the key now names another tensor (layout change): its residual is meaningless
            logger.debug("error feedback: dropping residual of %r (shape/device changed)", key)
            prev = None
        if spec.name == "none":
            encoded = codecs.encode(t, spec, generator=generator)
            if accept is not None:
                accept(encoded)
            self._drop(key)
            return encoded
        target = t.detach().to(torch.float32)
        if prev is not None:
            target = target + prev
        encoded, sent = codecs.encode_roundtrip(target.to(t.dtype), spec, generator=generator)
        if accept is not None:
            accept(encoded)
        residual = target - sent.to(torch.float32)  # what the receiver did not get
        self._store(key, residual)
        return encoded

    def reset(self, prefix: tuple[Hashable, ...] | None = None) -> None:
        """Drop every residual, or those whose tuple key starts with ``prefix``."""
        with self._lock:
            if prefix is None:
                self._residuals.clear()
                self._nbytes = 0
                return
            k = len(prefix)
            doomed = [
                key for key in self._residuals if isinstance(key, tuple) and key[:k] == prefix
            ]
            for key in doomed:
                self._nbytes -= _size(self._residuals.pop(key))

    def _drop(self, key: Hashable) -> None:
        with self._lock:
            old = self._residuals.pop(key, None)
            if old is not None:
                self._nbytes -= _size(old)

    def _store(self, key: Hashable, residual: torch.Tensor) -> None:
        with self._lock:
            old = self._residuals.pop(key, None)
            if old is not None:
                self._nbytes -= _size(old)
            size = _size(residual)
            if size > self.max_bytes:
                logger.debug("error feedback: residual of %r (%d B) exceeds max_bytes", key, size)
                return
            self._residuals[key] = residual
            self._nbytes += size
            while len(self._residuals) > self.max_entries or self._nbytes > self.max_bytes:
                evicted_key, evicted = self._residuals.popitem(last=False)
                self._nbytes -= _size(evicted)
                logger.debug("error feedback: evicted residual of %r", evicted_key)


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
