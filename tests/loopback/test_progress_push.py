"""Progress pushes between two real progress trackers on real hivemind DHTs (127.0.0.1).

Each tracker reads the DHT once a minute here, so a count that reaches the other tracker
within seconds came by the push (stage/progress_channel.py), not by the DHT. A stranger (a
peer with no progress record of the stage) and a replica pushing an absurd count are refused
and counted; neither moves the count.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from wanswarm.node.membership.dht import tidy_optimizer_class
from wanswarm.node.stage.progress_channel import HANDLER_SUFFIX
from wanswarm.node.stage.progress_push import PushBook, PushedCount, encode_push

from tests.loopback.hivemind_dhts import hivemind_dhts
from tests.loopback.test_averaging import HIVEMIND_PATH_WARNING, HIVEMIND_UNRAISABLE_WARNING
from tests.waiting import wait_for

PREFIX = "pushtest_stage1"
TARGET = 64


async def _push_from(_dht: Any, node: Any, peer: bytes, data: bytes) -> None:
    """Runs in a DHT's process: one raw push from that DHT's peer id to ``peer``."""
    from hivemind.p2p import PeerID

    _, _, writer = await node.p2p.call_binary_stream_handler(PeerID(peer), PREFIX + HANDLER_SUFFIX)
    writer.write(data)
    await writer.drain()
    writer.close()


def _records_seen(tracker: Any, dht: Any) -> bool:
    """Parse the stage's records now (as the tracker's next fetch would); True once the
    other replica's record is among them."""
    from hivemind.utils.timed_storage import ValueWithExpiration

    found = dht.get(f"{PREFIX}_progress", latest=True)
    metadata = found.value if isinstance(found, ValueWithExpiration) else None
    with tracker.lock_global_progress:
        tracker.global_progress = tracker._parse_swarm_progress_data(metadata)
    return bool(tracker.replica_records)


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(90)
def test_a_replicas_count_arrives_pushed_long_before_the_dht_would_bring_it() -> None:
    pytest.importorskip("hivemind")
    from hivemind.utils.crypto import RSAPrivateKey

    tracker_class = tidy_optimizer_class().tracker_class
    with hivemind_dhts(3) as dhts:
        a_dht, b_dht, stranger_dht = dhts.dhts
        trackers: list[Any] = []
        for dht in (a_dht, b_dht):
            tracker = tracker_class(
                dht=dht, prefix=PREFIX, target_batch_size=TARGET, start=True,
                private_key=RSAPrivateKey(), min_refresh_period=60.0, max_refresh_period=60.0,
                default_refresh_period=60.0, push_book=PushBook(target_batch_size=TARGET),
            )
            trackers.append(dhts.own(tracker, partial(tracker.shutdown, timeout=5)))
        a, b = trackers
        a.report_local_progress(0, 8)
        b.report_local_progress(0, 8)
        wait_for(lambda: _records_seen(a, a_dht), 30.0, "B's progress record in A's DHT")
        wait_for(lambda: _records_seen(b, b_dht), 30.0, "A's progress record in B's DHT")
        assert b.others_samples == {0: 8.0}
        wait_for(lambda: all(t.channel is not None and t.channel._loop is not None
                             for t in trackers), 20.0, "both progress channels to start")

        a.report_local_progress(0, 40)
        wait_for(lambda: b.others_samples == {0: 40.0}, 10.0, "A's pushed count at B",
                 interval=0.05, explain=lambda: f"B sees {b.others_samples}, {b.channel.status()}")
        # B's DHT view is still the old record: the count came by the push
        a_id = a_dht.peer_id.to_bytes()
        assert b.replica_records[a_id] == (0, 8.0)
        assert a.channel.sent >= 1 and b.push_book.received >= 1

        # a stranger (no progress record of the stage) and a replica pushing an absurd count
        b_id = b_dht.peer_id.to_bytes()
        forged = encode_push(PushedCount(seq=2**63, epoch=0, samples=60.0))
        stranger_dht.run_coroutine(partial(_push_from, peer=b_id, data=forged))
        absurd = encode_push(PushedCount(seq=2**63, epoch=0, samples=1e6))
        a_dht.run_coroutine(partial(_push_from, peer=b_id, data=absurd))
        book = b.push_book
        wait_for(lambda: book.refused.get("unknown") and book.refused.get("samples"), 10.0,
                 "both hostile pushes to be refused", explain=lambda: str(book.refused))
        assert b.others_samples == {0: 40.0}
        assert b.channel.status()["refused"] == {"unknown": 1, "samples": 1}


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(90)
def test_the_record_of_a_replica_that_stopped_serving_does_not_count() -> None:
    """A replica's progress record lives on for hivemind's metadata_expiration (60 s) after
    it dies; the membership knows within node.record_ttl. Once it names the replica as
    departed, B's counts leave it out at once, and hivemind's number of peers (which decides
    whether a step looks for a round at all) from B's next read; once it serves again, both
    count it."""
    pytest.importorskip("hivemind")
    from hivemind.utils.crypto import RSAPrivateKey

    tracker_class = tidy_optimizer_class().tracker_class
    departed: set[bytes] = set()
    with hivemind_dhts(2) as dhts:
        a_dht, b_dht = dhts.dhts
        trackers: list[Any] = []
        for dht, gone in ((a_dht, None), (b_dht, lambda: frozenset(departed))):
            tracker = tracker_class(
                dht=dht, prefix=PREFIX, target_batch_size=TARGET, start=True,
                private_key=RSAPrivateKey(), min_refresh_period=60.0, max_refresh_period=60.0,
                default_refresh_period=60.0, departed=gone,
            )
            trackers.append(dhts.own(tracker, partial(tracker.shutdown, timeout=5)))
        a, b = trackers
        a.report_local_progress(3, 24)
        b.report_local_progress(4, 8)
        # both records: hivemind's number of peers counts B's own too, which B's reporter
        # thread stores on its own time (the wait on A's alone lost that race once)
        wait_for(lambda: _records_seen(b, b_dht) and b.global_progress.num_peers == 2, 30.0,
                 "A's and B's progress records in B's DHT")
        assert b.others_samples == {3: 24.0}
        assert b.global_progress.num_peers == 2 and b.departed_records == 0

        departed.add(a_dht.peer_id.to_bytes())  # A's server record expired: it died
        # at once, before B's next read of the DHT (none happens while a step waits)
        assert b.others_samples == {}
        assert not _records_seen(b, b_dht)
        assert b.others_samples == {} and b.global_progress.num_peers == 1
        assert b.departed_records == 1

        departed.clear()  # A serves again
        assert _records_seen(b, b_dht) and b.global_progress.num_peers == 2
        assert b.departed_records == 0
