"""What a stage server remembers between the hops of a micro-batch (pure, takes ``now``).

- ``InputCache``: forward inputs by ``(trainer, micro_batch)``, so that a backward may name
  its input instead of carrying it; LRU, bounded by entries and bytes, entries expire.
- ``AppliedLog``: the ``(trainer, micro_batch, stage)`` keys whose gradients were applied,
  oldest forgotten first, with the replies of the most recent ones, so that a retried hop
  gets the same answer and never accumulates twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ...transport.endpoint import Response


@dataclass
class _CacheEntry:
    tensor: torch.Tensor
    nbytes: int
    expires: float


class InputCache:
    """Forward inputs by key: LRU, bounded by entries and bytes, entries expire (pure)."""

    def __init__(self, max_entries: int, max_bytes: int, ttl: float) -> None:
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        self._entries: OrderedDict[Hashable, _CacheEntry] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, tensor: torch.Tensor, now: float) -> bool:
        """Keep ``tensor`` until ``now + ttl``; False if it cannot fit at all."""
        self.pop(key)
        nbytes = tensor.numel() * tensor.element_size()
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return False
        self._expire(now)
        self._entries[key] = _CacheEntry(tensor, nbytes, now + self.ttl)
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, key: Hashable, now: float) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= now:
            self.pop(key)
            return None
        self._entries.move_to_end(key)
        return entry.tensor

    def pop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            self.pop(key)


class AppliedLog:
    """Keys whose gradients were applied, oldest forgotten first, with a few cached replies."""

    def __init__(self, max_keys: int, max_replies: int) -> None:
        self.max_keys, self.max_replies = max_keys, max_replies
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._replies: OrderedDict[Hashable, Response] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable, reply: Response | None) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            old, _ = self._keys.popitem(last=False)
            self._replies.pop(old, None)
        if reply is not None and self.max_replies > 0:
            self._replies[key] = reply
            while len(self._replies) > self.max_replies:
                self._replies.popitem(last=False)

    def reply(self, key: Hashable) -> Response | None:
        return self._replies.get(key)

    def keys(self) -> frozenset[Hashable]:
        """The remembered keys (at most ``max_keys``, the most recent)."""
        return frozenset(self._keys)
