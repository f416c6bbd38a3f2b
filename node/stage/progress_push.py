"""Progress pushes: the replicas of a stage tell each other their sample counts directly.

With ``averaging.exact_epochs`` an epoch ends when the samples of every replica of the stage
reach ``target_batch_size`` (membership/dht.py's tracker). hivemind carries each replica's
count through the DHT: the replica stores its record, the others read it at their next fetch
(0.5 to 1 s apart). Meanwhile a replica goes on adding micro-batches to an epoch that the
others have already filled, and the step holds more samples than the spec says (about one
micro-batch, +7% of 64, in the two-replica swarm benchmark; docs/averaging.md).

So each replica also pushes its count, as it changes, straight to the others over the
stage's libp2p (the DHT's p2pd: a one-way stream of one small message per change). The DHT
records stay the source of *who* the replicas are; a push only brings a known replica's
count sooner. This module is the pure part: the message format (:func:`encode_push`,
:func:`decode_push`) and :class:`PushBook`, which screens what arrives and merges it with the
DHT's records. The tracker (membership/dht.py) pumps it.

Hostile peers. A push is believed only when:

- it decodes: version 1, exactly :data:`PUSH_BYTES` bytes, a finite sample count;
- its sender (libp2p's authenticated peer id) has a screened progress record of the stage in
  the DHT (progress_guard.py): identities are free, records are screened, pushes from
  anyone else are refused;
- its epoch is within ``max_lead`` of ours and its samples within 0 and
  ``max_samples_factor`` x target (the progress guard's bounds for a record);
- its sequence number (the sender's clock in nanoseconds) is newer than the last one taken
  from that sender, so a reordered push never undoes a newer one;
- the sender stays under ``rate_per_s`` pushes a second (a token bucket per sender).

A believed push can do no more than the sender's own DHT record could (the same bounds); it
expires after ``ttl_s``, after which the record counts again. Refusals are counted by reason.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from ..errors import NodeError

PUSH_VERSION = 1
_PUSH = struct.Struct("!BQQd")  # version, sequence (ns), epoch, samples accumulated
PUSH_BYTES = _PUSH.size  # 25
MAX_EPOCH_ON_WIRE = 2**62


class PushError(NodeError):
    """A progress push that is not one well-formed message (refused, never fatal)."""


@dataclass(frozen=True)
class PushedCount:
    """One replica's count as it pushed it."""

    seq: int
    epoch: int
    samples: float


def encode_push(count: PushedCount) -> bytes:
    return _PUSH.pack(PUSH_VERSION, count.seq, count.epoch, float(count.samples))


def decode_push(data: bytes) -> PushedCount:
    """The count in ``data``; :class:`PushError` for anything but one well-formed push."""
    if len(data) != PUSH_BYTES:
        raise PushError(f"a progress push is {PUSH_BYTES} bytes, got {len(data)}")
    version, seq, epoch, samples = _PUSH.unpack(data)
    if version != PUSH_VERSION:
        raise PushError(f"progress push version {version} (this node speaks {PUSH_VERSION})")
    if epoch > MAX_EPOCH_ON_WIRE or not math.isfinite(samples):
        raise PushError(f"progress push out of range: epoch {epoch}, samples {samples}")
    return PushedCount(seq=seq, epoch=epoch, samples=samples)


@dataclass(frozen=True)
class _Entry:
    count: PushedCount
    received: float  # the receiver's monotonic clock


@dataclass
class PushBook:
    """What the stage's other replicas pushed, screened (module docstring). No I/O: callers
    pass ``now`` (a monotonic clock) and the replicas the DHT knows."""

    target_batch_size: int
    max_lead: int = 2
    max_samples_factor: float = 4.0
    ttl_s: float = 10.0
    rate_per_s: float = 50.0
    entries: dict[bytes, _Entry] = field(default_factory=dict)
    _buckets: dict[bytes, tuple[float, float]] = field(default_factory=dict)  # tokens, at
    received: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def accept(
        self, sender: bytes, data: bytes, *, known: Collection[bytes], local_epoch: int,
        now: float,
    ) -> str | None:
        """Take the push ``data`` from ``sender`` unless it breaks a rule: None when taken,
        else the reason (also counted in ``refused``)."""
        reason = self._check(sender, data, known, local_epoch, now)
        if reason is not None:
            self.refused[reason] = self.refused.get(reason, 0) + 1
        else:
            self.received += 1
        return reason

    def _check(
        self, sender: bytes, data: bytes, known: Collection[bytes], local_epoch: int, now: float
    ) -> str | None:
        if sender not in known:
            return "unknown"  # no screened record of this stage in the DHT
        if not self._within_rate(sender, now):
            return "rate"
        try:
            count = decode_push(data)
        except PushError:
            return "malformed"
        if abs(count.epoch - local_epoch) > self.max_lead:
            return "epoch"
        if not 0.0 <= count.samples <= self.max_samples_factor * self.target_batch_size:
            return "samples"
        old = self.entries.get(sender)
        if old is not None and now - old.received <= self.ttl_s and count.seq <= old.count.seq:
            return "stale"
        # only known replicas get entries; those that left the DHT are dropped here
        for gone in [p for p in self.entries if p not in known]:
            del self.entries[gone]
        self.entries[sender] = _Entry(count, now)
        return None

    def _within_rate(self, sender: bytes, now: float) -> bool:
        burst = self.rate_per_s
        tokens, at = self._buckets.get(sender, (burst, now))
        tokens = min(burst, tokens + (now - at) * self.rate_per_s)
        if len(self._buckets) > 1024:  # senders are known replicas: a handful
            self._buckets.clear()
        if tokens < 1.0:
            self._buckets[sender] = (tokens, now)
            return False
        self._buckets[sender] = (tokens - 1.0, now)
        return True

    def merged(self, records: Mapping[bytes, tuple[int, float]], now: float) -> dict[int, float]:
        """The other replicas' samples summed by epoch: each replica's DHT record
        (``records``: peer -> (epoch, samples)), or its push where that is live and further
        on (a later epoch, or more samples in the same one). Only replicas with a record
        count."""
        out: dict[int, float] = {}
        for peer, (epoch, samples) in records.items():
            entry = self.entries.get(peer)
            if entry is not None and now - entry.received <= self.ttl_s:
                pushed = entry.count
                if (pushed.epoch, pushed.samples) >= (epoch, samples):
                    epoch, samples = pushed.epoch, pushed.samples
            out[epoch] = out.get(epoch, 0.0) + float(samples)
        return out

    def status(self) -> dict[str, object]:
        return {"received": self.received, "refused": dict(self.refused)}
