"""Exact epochs whose ends differ between replicas (averaging.StepSizeLoop lowers each one's
end by the overshoot it measured) still end together: the replica that reaches its end
publishes a signed mark in the real DHT, and a replica with a higher end follows it."""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from wanswarm.node.membership.dht import tidy_optimizer_class

from tests.loopback.test_averaging import HIVEMIND_PATH_WARNING, HIVEMIND_UNRAISABLE_WARNING
from tests.waiting import wait_for

TARGET = 64


def _tracker(dht: Any) -> Any:
    from hivemind.utils.crypto import RSAPrivateKey

    owner = SimpleNamespace(
        dht=dht, run_id="marks", client_mode=False, status_loglevel=logging.DEBUG
    )
    # a key of its own: by default every tracker of a process signs with the same one
    tracker = tidy_optimizer_class()._make_progress_tracker(
        owner, target_batch_size=TARGET, min_refresh_period=0.1, private_key=RSAPrivateKey()
    )
    tracker.exact_epochs = True
    return tracker


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(90)
def test_a_replica_with_a_higher_end_follows_the_mark_of_one_that_reached_its_own() -> None:
    hivemind = pytest.importorskip("hivemind")
    dhts: list[Any] = []
    trackers: list[Any] = []
    try:
        first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dhts.append(first)
        dhts.append(
            hivemind.DHT(
                start=True,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=first.get_visible_maddrs(),
            )
        )
        low, high = _tracker(dhts[0]), _tracker(dhts[1])
        trackers += [low, high]
        low.end_at = 40.0  # measured an overshoot of 24 samples
        low.report_local_progress(0, 24)
        high.report_local_progress(0, 16)
        # each sees 40 reported samples: the low end is reached, the high one (64) is not
        wait_for(
            lambda: all(t.global_progress.samples_accumulated >= 40 for t in (low, high)) or None,
            30.0,
            "both trackers to read both reports",
        )
        assert not high.ready_to_update_epoch  # no mark yet: 40 < 64
        assert low.ready_to_update_epoch  # reaches its end and publishes the mark
        wait_for(lambda: high.ready_to_update_epoch or None, 30.0, "the mark to reach the other")
        assert 0 in high.ended and not low.ended  # a replica does not follow its own mark
        # a mark of this epoch is not followed before half a step was reported
        high.report_local_progress(0, 0)
        low.report_local_progress(0, 0)
        wait_for(
            lambda: high.global_progress.samples_accumulated == 0 or None, 30.0, "the reset"
        )
        assert not high.ready_to_update_epoch
    finally:
        for tracker in trackers:
            tracker.shutdown(timeout=5)
        for dht in dhts:
            dht.shutdown()
        del dhts, trackers
        gc.collect()
