"""Bounds on the progress records hivemind's ProgressTracker reads (hostile peers, #13 point 7).

Each replica of a stage publishes ``{run_id}_progress`` records in the DHT (its epoch, the
samples it accumulated, its samples per second, a timestamp); hivemind signs each subkey
with the publisher's RSA key, so a peer can only write its own record, but identities are
free. hivemind's tracker takes the largest epoch it reads as the stage's epoch: one record
with an epoch of 10^15 makes every replica believe it is behind, download state from peers
that are not ahead either, and loop. Samples and rates are summed into the ETA of the
next epoch, so an absurd one ends or stalls epochs at will.

:func:`screen` (pure) keeps a record only when:

- its epoch is at most ``MAX_EPOCH`` and at most ``max_lead`` ahead of the honest majority's
  epoch: the lower median of the other replicas' records (so forgers that are no more than
  the honest replicas cannot move it). This replica's own epoch does not vote: when it
  did, a replica more than ``max_lead`` epochs behind (after a stall, or while its state
  was still loading after a move) out-voted a single honest peer, never learnt the stage's
  epoch and trained on alone at its own (the network lab showed it). The price: beside a
  single other peer, that peer's epoch is taken as it is, bounded only by ``MAX_EPOCH``;
  two replicas cannot out-vote each other either way;
- its ``samples_accumulated`` is a finite number from 0 up. Above ``max_samples_factor`` x
  ``target_batch_size`` it is clamped to that bound, not refused: an honest replica whose
  epoch is held while a slow round runs (averaging.py) accumulates past it, and refusing
  its record hid it from its stage (replicas_seen 1, rounds of one) in the compose swarm
  at a load of 14 on 2 cores. A clamped count weighs no more than the largest count the
  screen accepts, so a forger gains nothing by a bigger one;
- its ``samples_per_second`` is at most ``max_samples_per_second``;
- its timestamp is finite and not more than ``max_clock_skew_s`` in the future.

:func:`guard_tracker` puts :func:`screen` in front of a live tracker's parser and parses the
current records again, so that a record read during the tracker's construction is screened
too. The refused records are counted and logged (once per publisher and reason).

hivemind internals relied on (pinned hivemind==1.1.12; tests/unit/test_hivemind_internals.py
checks them): ``ProgressTracker._parse_swarm_progress_data(metadata)``, called by the
tracker's fetcher with the DHT value (a dict of subkey -> ``ValueWithExpiration`` whose
``value`` is a ``LocalTrainingProgress`` dict or None), ``ProgressTracker.local_progress``,
``.lock_global_progress``, ``.global_progress``, ``.training_progress_key`` and ``.dht``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..logs import get_logger
from .state_plan import MAX_EPOCH

log = get_logger(__name__)


@dataclass(frozen=True)
class ProgressBounds:
    """What a believable progress record of a stage's replica looks like."""

    target_batch_size: int
    max_lead: int = 2  # epochs ahead of the majority's (delayed updates: one; slack: one)
    max_samples_factor: float = 4.0
    max_samples_per_second: float = 1e6
    max_clock_skew_s: float = 300.0


@dataclass
class ProgressScreen:
    """Refusals so far (per reason) and the publishers already logged."""

    refused: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    clamped: int = 0  # records kept with their sample count clamped to the bound
    logged: set[tuple[bytes, str]] = field(default_factory=set)
    # the stage's state transfer found a quorum of its replicas at an epoch not ahead of
    # ours: a record beyond that epoch + 1 is not believed until ``cap_until`` (DHT time)
    cap_epoch: float = math.inf
    cap_until: float = -math.inf
    capped: int = 0  # times a quorum set the cap

    def believe_at_most(self, epoch: int, until: float) -> None:
        """Records claiming more than ``epoch`` are refused until ``until`` (DHT time)."""
        self.cap_epoch, self.cap_until = float(epoch), until
        self.capped += 1

    def refuse(self, publisher: bytes, reason: str, detail: str) -> None:
        self.refused += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self._first(publisher, reason):
            log.warning("ignoring a progress record (%s): %s", reason, detail)

    def clamp(self, publisher: bytes, detail: str) -> None:
        self.clamped += 1
        if self._first(publisher, "clamped"):
            log.info("clamping a progress record's count: %s", detail)

    def _first(self, publisher: bytes, reason: str) -> bool:
        """Whether this is the first time for ``publisher`` and ``reason`` (logged once)."""
        if (publisher, reason) in self.logged or len(self.logged) >= 10_000:
            return False
        self.logged.add((publisher, reason))
        return True


def _field(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, Mapping) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def screen(
    metadata: Any,
    *,
    local_epoch: int,
    own_peer_id: bytes,
    now: float,
    bounds: ProgressBounds,
    tally: ProgressScreen,
) -> Any:
    """``metadata`` (the tracker's DHT value) without the records that break ``bounds``.

    Records that hivemind would skip anyway (``value`` None) and our own are kept as they
    are; anything that is not a dict of records is returned unchanged for hivemind to
    handle (it treats it as no peers)."""
    if not isinstance(metadata, dict):
        return metadata
    parsed: list[tuple[Any, Any, float | None]] = []
    for subkey, item in metadata.items():
        value = getattr(item, "value", None)
        parsed.append((subkey, item, _number(_field(value, "epoch"))))
    others = [
        epoch
        for _, item, epoch in parsed
        if epoch is not None
        and _field(getattr(item, "value", None), "peer_id") != own_peer_id
        and _field(getattr(item, "value", None), "client_mode") is not True
    ]
    # this replica's own epoch does not vote: a replica that fell behind (or a newcomer whose
    # state is still loading) would otherwise out-vote the stage and never learn its epoch
    majority = statistics.median_low(others) if others else float(local_epoch)
    limit = min(float(MAX_EPOCH), majority + bounds.max_lead)
    if now < tally.cap_until:  # what a quorum of the stage's replicas holds bounds it too
        limit = min(limit, tally.cap_epoch)
    kept = {}
    for subkey, item, epoch in parsed:
        value = getattr(item, "value", None)
        if value is None or _field(value, "peer_id") == own_peer_id:
            kept[subkey] = item
            continue
        publisher = subkey if isinstance(subkey, bytes) else repr(subkey).encode()
        problem = _problem(value, epoch, limit, now, bounds)
        if problem is not None:
            tally.refuse(publisher, problem[0], problem[1])
            continue
        # an int: hivemind's LocalTrainingProgress takes strict integers only
        cap = int(bounds.max_samples_factor * bounds.target_batch_size)
        samples = _number(_field(value, "samples_accumulated"))
        if samples is not None and samples > cap:
            tally.clamp(publisher, f"{samples:.0f} samples accumulated, counted as {cap} "
                        f"(target {bounds.target_batch_size})")
            item = _with_value(item, {**value, "samples_accumulated": cap})
        kept[subkey] = item
    return kept


def _with_value(item: Any, value: Any) -> Any:
    """A copy of ``item`` (hivemind's ValueWithExpiration, a dataclass) holding ``value``."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.replace(item, value=value)
    duplicate = copy.copy(item)
    duplicate.value = value
    return duplicate


def _problem(
    value: Any, epoch: float | None, limit: float, now: float, bounds: ProgressBounds
) -> tuple[str, str] | None:
    samples = _number(_field(value, "samples_accumulated"))
    rate = _number(_field(value, "samples_per_second"))
    stamp = _number(_field(value, "time"))
    if epoch is None or samples is None or rate is None or stamp is None:
        return "malformed", f"not a progress record: {str(value)[:120]}"
    if epoch > limit:
        return "epoch", (f"epoch {epoch:.0f} is beyond the stage's majority + lead, or what "
                         f"a quorum of its replicas holds + 1 ({limit:.0f})")
    if not (0 <= samples < math.inf):  # NaN too; above the bound: clamped by screen()
        return "samples", f"{samples} samples accumulated (target {bounds.target_batch_size})"
    if not math.isfinite(rate) or rate > bounds.max_samples_per_second:
        return "rate", f"{rate} samples/s (at most {bounds.max_samples_per_second:g})"
    if not math.isfinite(stamp) or stamp > now + bounds.max_clock_skew_s:
        return "time", f"timestamp {stamp} is {stamp - now:.0f} s ahead"
    return None


def guard_tracker(tracker: Any, bounds: ProgressBounds) -> ProgressScreen:
    """Screen every progress record ``tracker`` (a live hivemind ``ProgressTracker``) parses
    from now on, and re-parse the current records screened. Returns the tally."""
    from hivemind.utils.timed_storage import get_dht_time

    tally = ProgressScreen()
    original = tracker._parse_swarm_progress_data

    def parse(metadata: Any) -> Any:
        screened = screen(
            metadata,
            local_epoch=int(tracker.local_progress.epoch),
            own_peer_id=bytes(tracker.local_progress.peer_id),
            now=get_dht_time(),
            bounds=bounds,
            tally=tally,
        )
        try:
            return original(screened)
        except ValueError as exc:  # pydantic's ValidationError: a record hivemind cannot parse
            # the DHT's schema validator should have refused it; never let it end the tracker
            # (or, during the optimizer's construction, the daemon): count the stage as empty
            tally.refuse(b"", "unparsable", f"hivemind could not parse the records: {exc}")
            return original({})

    tracker._parse_swarm_progress_data = parse
    # the constructor already parsed what the DHT held, unscreened: parse it again
    reparse(tracker)
    return tally


def reparse(tracker: Any) -> None:
    """Parse the records the DHT holds now into ``tracker``'s global progress (through the
    screen, once :func:`guard_tracker` installed it): the stage's epoch as the screen sees
    it now, not at the tracker's next refresh. A blocking DHT read."""
    from hivemind.utils.timed_storage import ValueWithExpiration

    found = tracker.dht.get(tracker.training_progress_key, latest=True)
    metadata = found.value if isinstance(found, ValueWithExpiration) else None
    with tracker.lock_global_progress:
        tracker.global_progress = tracker._parse_swarm_progress_data(metadata)
