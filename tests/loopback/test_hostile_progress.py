"""A forged hivemind progress record (#13 point 7) in a live DHT does not move a stage's epoch.

A hostile peer publishes, under the stage's ``{run_id}_progress`` key and signed with its own
fresh RSA key as hivemind requires, a record claiming epoch 10^15. Unscreened, hivemind's
tracker would take that as the stage's epoch: the replica would see itself 10^15 epochs
behind, try to download state at every step and never step again. The replica here (a real
CollaborativeOptimizer on a real DHT on 127.0.0.1) ignores the record, counts it, keeps the
stage's epoch, stays synchronized and steps normally.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from functools import partial
from typing import Any

import pytest
import torch
from wanswarm.node.stage.averaging import AveragingConfig, CollaborativeOptimizer
from wanswarm.node.stage.optimizer import Caught

from tests.loopback.hivemind_dhts import hivemind_dhts
from tests.loopback.test_averaging import (
    HIVEMIND_PATH_WARNING,
    HIVEMIND_UNRAISABLE_WARNING,
    SPEC,
    STAGE,
    B,
    _accumulate,
    _daemon_sigint,
    _Host,
)
from tests.waiting import wait_for

FORGED_EPOCH = 10**15


@contextmanager
def _victim_beside_a_forger(epoch: int) -> Iterator[tuple[Any, Any, torch.nn.Module]]:
    """A real CollaborativeOptimizer on a real DHT, and a forger's record claiming ``epoch``
    (signed by hivemind's own tracker on a second DHT) once the victim's DHT holds it:
    yields (the optimizer, the record as the victim's DHT holds it, the stage module)."""
    pytest.importorskip("hivemind")
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils.crypto import RSAPrivateKey
    from hivemind.utils.timed_storage import ValueWithExpiration
    from wanswarm.node.training.model import build_stage

    config = AveragingConfig(
        matchmaking_time=1.0, averaging_timeout=5.0, load_state_timeout=5.0,
        delayed_updates=False, grad_compression="none", state_compression="none",
    )
    with hivemind_dhts(2) as dhts:
        dht, evil_dht = dhts.dhts
        module = build_stage(SPEC, STAGE)
        previous = signal.signal(signal.SIGINT, _daemon_sigint)
        try:
            opt = dhts.own(CollaborativeOptimizer(module, SPEC, STAGE, _Host(dht), config))
        finally:
            signal.signal(signal.SIGINT, previous)
        # the forger: hivemind's own tracker, so the record is signed and fits the schema
        attacker = ProgressTracker(
            evil_dht, opt.run_id, SPEC.batch.target_batch_size, start=True,
            private_key=RSAPrivateKey(), min_refresh_period=0.1,
        )
        dhts.own(attacker, partial(attacker.shutdown, timeout=5))
        attacker.report_local_progress(epoch, 2)
        key = f"{opt.run_id}_progress"

        def forged_visible() -> Any:
            found = dht.get(key, latest=True)
            if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
                return None
            epochs = [getattr(v, "value", None) for v in found.value.values()]
            if any(isinstance(e, dict) and e.get("epoch") == epoch for e in epochs):
                return found.value
            return None

        metadata = wait_for(forged_visible, 30.0, "the forged record in the victim's DHT")
        yield opt, metadata, module


def _steps_one_epoch(opt: Any, module: torch.nn.Module) -> None:
    """One epoch of the replica's own micro-batches steps it (alone), to finite values."""
    gen = torch.Generator().manual_seed(0)
    before = [p.detach().clone() for p in module.parameters()]
    deadline = time.monotonic() + 40.0
    while opt.local_epoch < 1 and time.monotonic() < deadline:
        _accumulate(module, gen)
        opt.step(B)
    assert opt.local_epoch == 1, "the replica could not step beside the forged record"
    assert any(not torch.equal(p, q) for p, q in zip(module.parameters(), before, strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(90)
def test_a_forged_epoch_in_the_dht_leaves_the_stage_epoch_alone() -> None:
    with _victim_beside_a_forger(FORGED_EPOCH) as (opt, metadata, module):
        tracker = opt._opt.tracker
        # what hivemind alone would make of it: the forged epoch (the record is live and valid)
        from hivemind.optim.progress_tracker import ProgressTracker as Unscreened

        assert Unscreened._parse_swarm_progress_data(tracker, metadata).epoch == FORGED_EPOCH
        # the screened tracker fetches it (and refuses it) without adopting it
        tally = opt.progress_screen
        wait_for(lambda: tally.reasons.get("epoch"), 30.0,
                 "the tracker to fetch and refuse the forged record")
        assert opt.global_epoch == 0 and opt.is_synchronized()
        _steps_one_epoch(opt, module)
        assert opt.global_epoch == 1 and opt.is_synchronized()


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(90)
def test_a_believable_forged_epoch_is_not_followed_when_the_quorum_is_not_ahead() -> None:
    """A forged epoch of 2 is believable (the screen lets a record lead the others by two,
    and beside one other record takes it as it is): hivemind sees the replica two epochs
    behind and asks for the stage's state. Our catch-up (here: a quorum of the stage's
    replicas that answered at our epoch, as state.py's resync asks ``is_behind``) finds
    nothing ahead: hivemind's one-donor download is not tried (it would take the state of
    whichever averager claims the most), the screen refuses records beyond the quorum's
    epoch + 1 for a while, and the replica steps on."""
    with _victim_beside_a_forger(2) as (opt, _, module):
        wait_for(lambda: opt.global_epoch == 2, 30.0, "the tracker to take the forged epoch")
        assert not opt.is_synchronized()

        def quorum_at_our_epoch() -> Caught:
            assert not opt.is_behind(opt.local_epoch, {})  # the quorum's manifest
            return Caught.NOT_BEHIND

        opt.catch_up_with(quorum_at_our_epoch)
        _steps_one_epoch(opt, module)
        counts = opt.catch_up.counts
        assert counts["not_behind"] == 1 and counts["hivemind"] == counts["failed"] == 0
        assert opt.progress_screen.capped == 1 and opt.progress_screen.reasons.get("epoch")


@contextmanager
def _stage_sharing(victim: Any, donor_opts: list[Any]) -> Iterator[tuple[Any, list[Any]]]:
    """The stage servers' state sharing over real QUIC endpoints on a loop of its own: each
    donor optimizer serving, and the victim's catch-up (``StageStateSharing.resync``, to be
    called on the victim's device thread). Yields (the catch-up, the donors' sharings)."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from wanswarm.node.stage.state import StageStateSharing
    from wanswarm.node.stage.state_plan import StateTransferConfig

    from tests.loopback.quic_helpers import address, config, endpoint

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sharing-loop", daemon=True)
    thread.start()
    pools = [ThreadPoolExecutor(1) for _ in range(len(donor_opts) + 1)]
    transfer = StateTransferConfig(timeout_s=20.0, manifest_timeout_s=5.0, chunk_timeout_s=5.0)
    stack = AsyncExitStack()

    async def start() -> tuple[Any, list[Any]]:
        cfg = config(connect_timeout_s=10.0, handshake_timeout_s=10.0)
        eps = [await stack.enter_async_context(endpoint(cfg)) for _ in range(len(donor_opts) + 1)]
        donors = [StageStateSharing(e, STAGE, o, p, transfer, donors=None, serving=lambda: True)
                  for e, o, p in zip(eps, donor_opts, pools, strict=False)]
        ours = StageStateSharing(eps[-1], STAGE, victim, pools[-1], transfer,
                                 donors=lambda: [address(e) for e in eps[:-1]],
                                 serving=lambda: True)
        for sharing in (*donors, ours):
            stack.callback(sharing.close)
        return ours, donors

    try:
        ours, donors = asyncio.run_coroutine_threadsafe(start(), loop).result(30.0)
        yield (lambda only=None, stand_in=False: ours.resync(loop, 20.0, only, stand_in)), donors
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(30.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10.0)
        loop.close()
        for pool in pools:
            pool.shutdown()


def _replica_at(module: torch.nn.Module, epoch: int, shift: float) -> Any:
    """A LocalOptimizer holding ``module``'s layout at ``epoch``, its parameters moved by
    ``shift`` (0: the victim's own; a forger's otherwise)."""
    from wanswarm.node.stage.optimizer import LocalOptimizer
    from wanswarm.node.training.model import build_stage

    copy = build_stage(SPEC, STAGE)
    copy.load_state_dict(module.state_dict())
    opt = LocalOptimizer(copy, SPEC)
    _, tensors, meta = opt.export_state()
    opt.import_state(epoch, {k: v + shift if k.startswith("model.") else v
                             for k, v in tensors.items()}, meta)
    return opt


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(120)
def test_one_honest_replica_beside_a_forger_leaves_no_state_to_take_from_either() -> None:
    """The case no quorum decides: the stage's two other replicas answer the catch-up, one
    honest at our epoch and the forger, whose record (epoch 2) made hivemind believe us
    behind, sharing a state of epoch 2 with other parameters. The two agree on nothing;
    the lower median of their epochs is ours, so the replica is not behind: no chunk is
    fetched from either, hivemind's one-donor download (the forger can announce the most)
    is not tried, and the replica steps on with its own parameters. Before, the missing
    quorum sent it to hivemind's download."""
    with _victim_beside_a_forger(2) as (opt, _, module):
        wait_for(lambda: opt.global_epoch == 2, 30.0, "the tracker to take the forged epoch")
        honest, forged = _replica_at(module, 0, 0.0), _replica_at(module, 2, 50.0)
        with _stage_sharing(opt, [honest, forged]) as (catch_up, donors):
            opt.catch_up_with(catch_up)
            _steps_one_epoch(opt, module)
            assert [d.donor.counts["chunks"] for d in donors] == [0, 0]
            assert all(d.donor.counts["manifests"] >= 1 for d in donors)
        counts = opt.catch_up.counts
        assert counts["not_behind"] >= 1
        assert counts["hivemind"] == counts["failed"] == counts["refused"] == 0
        assert opt.progress_screen.capped >= 1
        assert all(p.abs().max() < 40 for p in module.parameters())  # never the forger's


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(120)
def test_a_poisoned_state_from_hiveminds_download_is_put_back() -> None:
    """hivemind's download, the catch-up's path where our transport reached no donor, copies
    one averager's state in without a look at its values. A peer whose averager shares a
    state of epoch 3 holding a NaN (through hivemind's real state sharing, on real DHTs):
    the download installs it, the per-step optimizer's check finds the NaN and puts the
    replica's own state (epoch 0, its parameters) back."""
    pytest.importorskip("hivemind")
    from wanswarm.node.training.model import build_stage

    config = AveragingConfig(
        matchmaking_time=1.0, averaging_timeout=5.0, load_state_timeout=15.0,
        delayed_updates=False, grad_compression="none", state_compression="none",
    )
    with hivemind_dhts(2) as dhts:
        modules = [build_stage(SPEC, STAGE) for _ in range(2)]
        previous = signal.signal(signal.SIGINT, _daemon_sigint)
        try:
            forger, victim = (dhts.own(CollaborativeOptimizer(m, SPEC, STAGE, _Host(d), config))
                              for m, d in zip(modules, dhts.dhts, strict=True))
        finally:
            signal.signal(signal.SIGINT, previous)
        _, tensors, meta = forger.export_state()
        forger.import_state(3, tensors, meta)  # announces priority 3 to hivemind's download
        with torch.no_grad():
            first = next(t for t in forger._live_tensors().values() if t.is_floating_point())
            first.view(-1)[0] = float("nan")
        _, ours, _ = victim.export_state()
        reached: list[int] = []
        victim.catch_up_with(lambda only=None, stand_in=False: reached.append(1)
                             or Caught.UNREACHED)
        deadline = time.monotonic() + 60.0
        while victim.downloads_refused == 0 and time.monotonic() < deadline:
            victim._opt.load_state_from_peers()  # as hivemind's step calls it when behind
            victim.catch_up._next_try = None  # (no spacing between these attempts)
        assert victim.downloads_refused == 1, "hivemind's download never brought the state"
        assert victim.catch_up.counts["hivemind"] == 0 and victim.catch_up.counts["failed"] >= 1
        epoch, after, _ = victim.export_state()
        assert epoch == 0 and reached
        assert all(torch.equal(after[name], t) for name, t in ours.items())
