"""The epoch rule of ``averaging.exact_epochs`` (membership/dht.py's progress tracker).

hivemind sums the replicas' published progress records at each fetch, this replica's own
included, and adds this replica's samples accumulated after the fetch: what it accumulated
between publishing its record and the fetch is missing from the sum until the next one, so
the epoch ended up to a micro-batch late. The rule now takes the other replicas' records and
this replica's samples as they are. No DHT: the tracker's state is set by hand on an
instance built without hivemind's constructor.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from wanswarm.node.membership.dht import others_samples, tidy_optimizer_class

OWN, OTHER, CLIENT = b"own", b"other", b"client"


def _record(peer: bytes, epoch: Any, samples: Any, client: bool = False) -> Any:
    return SimpleNamespace(value={"peer_id": peer, "epoch": epoch, "samples_accumulated": samples,
                                  "client_mode": client, "samples_per_second": 1.0, "time": 0.0})


def test_others_samples_sums_the_other_replicas_by_epoch_and_skips_the_rest() -> None:
    metadata = {
        b"a": _record(OWN, 3, 40),  # ours: taken from local progress instead
        b"b": _record(OTHER, 3, 16),
        b"c": _record(b"third", 3, 8.0),
        b"d": _record(b"late", 2, 56),
        b"e": _record(CLIENT, 3, 24, client=True),  # clients accumulate no gradients here
        b"f": _record(b"junk", "3", 8),
        b"g": _record(b"nan", 3, float("nan")),
        b"h": _record(b"bool", True, 8),
        b"i": SimpleNamespace(value=None),
    }
    assert others_samples(metadata, OWN) == {3: 24.0, 2: 56.0}
    assert others_samples(None, OWN) == {}


def _ready(local_epoch: int, local_samples: int, global_epoch: int, reported: int,
           others: dict[int, float]) -> bool:
    """The tracker's ``ready_to_update_epoch`` over a stand-in holding that state (a real
    tracker needs a DHT and a thread)."""
    rule = tidy_optimizer_class().tracker_class.ready_to_update_epoch.fget
    state = SimpleNamespace(
        hold_epoch=None, exact_epochs=True, target_batch_size=64, global_epoch=global_epoch,
        local_progress=SimpleNamespace(epoch=local_epoch, samples_accumulated=local_samples),
        global_progress=SimpleNamespace(epoch=global_epoch, samples_accumulated=reported),
        others_samples=others,
    )
    return bool(rule(state))


def test_an_epoch_ends_on_the_others_records_plus_our_samples_as_they_are() -> None:
    # our record said 24 at the fetch, we have 40 now; the other replica reported 24:
    # hivemind's sum is 48 (+ nothing since the fetch), the samples are 64
    assert _ready(5, 40, 5, 48, {5: 24.0})
    assert not _ready(5, 32, 5, 48, {5: 24.0})
    # a replica at a later epoch ends ours whatever the samples
    assert _ready(5, 0, 6, 0, {6: 8.0})
    # right after our step: the others' records of the epoch we left do not count
    assert not _ready(6, 8, 5, 0, {5: 64.0})
    # hivemind's sum still counts when it is the larger (never later than before)
    assert _ready(5, 0, 5, 64, {})


def test_a_replica_already_past_our_epoch_ends_it() -> None:
    # its push says epoch 6 before the DHT does (global epoch still 5): its samples left
    # epoch 5's count, and the epoch is over all the same
    assert _ready(5, 24, 5, 24, {6: 0.0})
    assert not _ready(5, 24, 5, 24, {5: 16.0, 4: 8.0})
