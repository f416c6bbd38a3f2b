"""DiLoCo rounds over real hivemind averagers on local DHTs (diloco.py).

Two replicas of the last stage train apart for H inner steps on different data, then run
an outer round through hivemind's DecentralizedAverager: both end bit-identical, at the
same outer round, with the same outer momentum, and each sent its int4 payload with its own
residual kept. A replica alone misses its round within the round's timeout, keeps training
and restores its residual; its checkpoint round-trips through
``import_state``; a newcomer that asks the stage's averagers downloads the latest outer
state from them.

With the node's QUIC endpoint (as a daemon runs it), the gather carries descriptors and
the payloads cross QUIC: a stage whose fp32 pseudo-gradient is over twice the gather's
768 KiB cap takes its rounds, and both replicas end bit-identical.

Loopback tier: hivemind DHTs on 127.0.0.1, each forking its DHT process and a libp2p
daemon, inside this test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.config.runspec import ModelSpec
from wanswarm.node.stage.averaging import (
    AveragingConfig,
    AveragingError,
    CollaborativeOptimizer,
    averaging_run_id,
)
from wanswarm.node.stage.checkpoint import CheckpointError
from wanswarm.node.stage.diloco import (
    MAX_GROUP,
    MAX_GROUP_QUIC,
    MAX_PAYLOAD_BYTES,
    DilocoOptimizer,
    HivemindCarrier,
    make_diloco_optimizer,
)
from wanswarm.node.stage.outer import ANCHOR_PREFIX, RESIDUAL_PREFIX
from wanswarm.node.stage.outer_payloads import PayloadLink
from wanswarm.node.training.model import build_stage
from wanswarm.transport.endpoint import Endpoint, PeerAddress
from wanswarm.transport.identity import Identity

from tests.loopback.hivemind_dhts import hivemind_dhts
from tests.loopback.quic_helpers import config
from tests.loopback.test_averaging import (
    HIVEMIND_PATH_WARNING,
    HIVEMIND_UNRAISABLE_WARNING,
    SPEC,
    STAGE,
    B,
    _accumulate,
    _daemon_sigint,
)

H = 3
DILOCO = SPEC.model_copy(update={"averaging": AveragingSpec(
    mode="diloco", inner_steps=H, compression="int4", block_size=16, round_timeout_s=20.0,
)})
CONFIG = AveragingConfig(matchmaking_time=2.0, averaging_timeout=20.0, load_state_timeout=10.0)
PER_STEP = SPEC.batch.micro_batches_per_step


class _Host:
    """Builds averagers over a raw hivemind DHT, as membership.dht.Dht does over its own."""

    group_sizes: list[int] = []  # every outer averager's target_group_size, in order

    def __init__(self, dht: Any) -> None:
        self._dht = dht

    def hivemind_averager(self, factory: Any, **options: Any) -> Any:
        if str(options.get("prefix", "")).endswith("_outer"):
            _Host.group_sizes.append(options["target_group_size"])
        return factory(dht=self._dht, **options)


def _build(dht: Any, spec: Any = DILOCO, payloads: PayloadLink | None = None
           ) -> tuple[torch.nn.Module, DilocoOptimizer]:
    module = build_stage(spec, STAGE)
    previous = signal.signal(signal.SIGINT, _daemon_sigint)
    try:
        return module, make_diloco_optimizer(module, spec, STAGE, _Host(dht), CONFIG,
                                             payloads=payloads)
    finally:
        assert signal.getsignal(signal.SIGINT) is _daemon_sigint  # hivemind's SIG_IGN undone
        signal.signal(signal.SIGINT, previous)


def _inner_steps(module: torch.nn.Module, opt: DilocoOptimizer, gen: torch.Generator,
                 steps: int, accumulate: Any = _accumulate, batch: int = B) -> None:
    for _ in range(steps * PER_STEP):
        accumulate(module, gen)
        opt.step(batch)


def _round_together(built: list[tuple[torch.nn.Module, DilocoOptimizer]],
                     accumulate: Any = _accumulate, batch: int = B) -> None:
    """Each replica on its own device thread: H - 1 inner steps, then both enter the round
    together (as replicas at network pace would: the H-th inner step starts it) and poll
    until it ended."""
    barrier = threading.Barrier(len(built), timeout=30.0)

    def device_thread(module: torch.nn.Module, opt: DilocoOptimizer, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        _inner_steps(module, opt, gen, H - 1, accumulate, batch)
        barrier.wait()
        _inner_steps(module, opt, gen, 1, accumulate, batch)
        _finish_round(opt)

    with ThreadPoolExecutor(max_workers=len(built), thread_name_prefix="device") as pool:
        runs = [pool.submit(device_thread, m, o, seed) for seed, (m, o) in enumerate(built)]
        for run in runs:
            run.result(timeout=90)


def _finish_round(opt: DilocoOptimizer, timeout: float = 60.0) -> None:
    """Poll as the server's periodic check does until the round's gather ended (the device
    thread trains on meanwhile; here it has nothing else to do)."""
    deadline = time.monotonic() + timeout
    while opt.round_in_progress:
        assert time.monotonic() < deadline, "the outer round did not end"
        opt.step_if_due()
        time.sleep(0.05)


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(120)
def test_replicas_are_identical_after_an_outer_round_and_a_newcomer_starts_there() -> None:
    with hivemind_dhts(2) as dhts:
        _Host.group_sizes.clear()
        built = [(m, dhts.own(opt)) for m, opt in (_build(d) for d in dhts.dhts)]
        assert _Host.group_sizes == [MAX_GROUP, MAX_GROUP]  # payloads in the gather: 4
        initial = [p.detach().clone() for p in built[0][0].parameters()]
        _round_together(built)
        (m_a, a), (m_b, b) = built
        assert a.last_round["ok"] and b.last_round["ok"], (a.last_round, b.last_round)
        assert a.outer.round == b.outer.round == 1 and a.last_round["participants"] == 2
        for p, q, p0 in zip(m_a.parameters(), m_b.parameters(), initial, strict=True):
            assert torch.equal(p, q)
            assert not torch.equal(p, p0)
        for name in a.outer.momentum:
            assert torch.equal(a.outer.momentum[name], b.outer.momentum[name])
        # each kept its own residual (int4 is lossy), and the round's bytes are counted
        assert a.feedback.residuals and not all(
            torch.equal(a.feedback.residuals[n], b.feedback.residuals[n])
            for n in a.feedback.residuals
        )
        numel = sum(p.numel() for p in m_a.parameters())
        assert a.payload_bytes_sent == a.payload_nbytes < numel  # int4: under a byte a value
        status = a.averaging_status()
        assert status["mode"] == "diloco" and status["last_round"] == 1
        assert status["participants"] == 2 and status["bytes_sent"] == a.payload_nbytes
        # the shared state is identical on both (so that a donors' quorum agrees on it)
        ea, eb = a.export_state(), b.export_state()
        assert ea[0] == eb[0] == H and ea[2] == eb[2]
        assert all(torch.equal(ea[1][k], eb[1][k]) for k in ea[1])

        # a newcomer downloads the latest outer state from the stage's averagers (installing
        # the shared state from state transfer: tests/unit/test_diloco_rounds.py)
        asker_module, asker = _build(dhts.add())
        dhts.own(asker)
        assert asker.load_state_from_peers()
        assert asker.outer.round == 1
        for p, q in zip(asker_module.parameters(), m_a.parameters(), strict=True):
            assert torch.equal(p, q)


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(90)
def test_a_replica_alone_misses_its_round_within_the_timeout_and_keeps_training() -> None:
    spec = DILOCO.model_copy(update={"averaging": DILOCO.averaging.model_copy(
        update={"round_timeout_s": 4.0})})
    with hivemind_dhts(1) as dhts:
        module, opt = _build(dhts[0], spec)
        dhts.own(opt)
        gen = torch.Generator().manual_seed(0)
        _inner_steps(module, opt, gen, H - 1)
        # a debt carried from earlier rounds: a missed round must leave it as it was
        opt.feedback.residuals = {n: torch.full_like(a, 1e-3) for n, a in opt.outer.anchor.items()}
        residual_before = {n: r.clone() for n, r in opt.feedback.residuals.items()}
        params_before = [p.detach().clone() for p in module.parameters()]
        _inner_steps(module, opt, gen, 1)
        _finish_round(opt)
        assert not opt.last_round["ok"] and opt.rounds_missed == 1
        limit = spec.averaging.round_timeout_s + CONFIG.load_state_timeout
        assert opt.last_round["seconds"] < limit
        assert opt.outer.round == 0 and set(opt.feedback.residuals) == set(residual_before)
        assert all(torch.equal(opt.feedback.residuals[n], r) for n, r in residual_before.items())
        assert not opt.is_synchronized()
        # its inner step happened, and its parameters were kept (no outer step alone)
        assert any(not torch.equal(p, q) for p, q in zip(module.parameters(), params_before,
                                                        strict=True))
        assert opt.local_epoch == H

        # its checkpoint carries its own state: residuals, anchor, inner AdamW; it round-trips
        epoch, tensors, meta = opt.export_checkpoint()
        assert any(k.startswith(RESIDUAL_PREFIX) for k in tensors)
        assert any(k.startswith(ANCHOR_PREFIX) for k in tensors)
        opt.feedback.reset()
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        opt.import_state(epoch, tensors, meta)
        again = opt.export_checkpoint()
        assert again[0] == epoch and set(again[1]) == set(tensors)
        assert all(torch.equal(again[1][k], tensors[k]) for k in tensors)
        bad = dict(tensors)
        bad[next(k for k in tensors if k.startswith(RESIDUAL_PREFIX))] = torch.zeros(1)
        with pytest.raises(CheckpointError):
            opt.import_state(epoch, bad, meta)
        with pytest.raises(CheckpointError, match="outer_round"):
            opt.import_state(epoch, tensors, meta | {"outer_round": epoch + 1})


@contextlib.contextmanager
def _endpoints_on_a_loop(n: int) -> Iterator[tuple[asyncio.AbstractEventLoop, list[Endpoint]]]:
    """``n`` QUIC endpoints on loopback, served by an event loop on its own thread (the
    daemon's loop, while the test's threads stand for the device threads)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="node-loop", daemon=True)
    thread.start()

    async def start() -> list[Endpoint]:
        eps = [Endpoint(Identity.generate(), config()) for _ in range(n)]
        for ep in eps:
            await ep.start("127.0.0.1", 0)
        return eps

    async def close(eps: list[Endpoint]) -> None:
        for ep in eps:
            await ep.close()

    eps = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield loop, eps
    finally:
        asyncio.run_coroutine_threadsafe(close(eps), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(150)
def test_payloads_over_quic_carry_a_stage_the_gather_cannot() -> None:
    big = DILOCO.model_copy(update={
        "model": ModelSpec(d_model=192, n_heads=2, n_layers=2, seq_len=8),
        "averaging": DILOCO.averaging.model_copy(update={"compression": "none"}),
    })
    b, t, c = big.batch.micro_batch_size, big.model.seq_len, big.model.d_model

    def accumulate(module: torch.nn.Module, gen: torch.Generator) -> None:
        x = torch.randn(b, t, c, generator=gen)
        targets = torch.randint(0, 256, (b, t), generator=gen)
        module.forward_loss(x, targets).backward()  # type: ignore[operator]

    with _endpoints_on_a_loop(2) as (loop, eps), hivemind_dhts(2) as dhts:
        book = [PeerAddress(ep.peer_id, *ep.address) for ep in eps]
        _Host.group_sizes.clear()
        built = [
            (m, dhts.own(opt)) for m, opt in (
                _build(d, big, PayloadLink(ep, loop, lambda: book))
                for d, ep in zip(dhts.dhts, eps, strict=True)
            )
        ]
        # descriptors in the gather, payloads over QUIC: groups of up to 8
        assert _Host.group_sizes == [MAX_GROUP_QUIC, MAX_GROUP_QUIC]
        assert built[0][1].payload_nbytes > 2 * MAX_PAYLOAD_BYTES  # the gather alone refuses it
        _round_together(built, accumulate, b)
        (m_a, a), (m_b, b_opt) = built
        assert a.last_round["ok"] and b_opt.last_round["ok"], (a.last_round, b_opt.last_round)
        assert a.outer.round == b_opt.outer.round == 1 and a.last_round["participants"] == 2
        for p, q in zip(m_a.parameters(), m_b.parameters(), strict=True):
            assert torch.equal(p, q)
        for opt in (a, b_opt):
            status = opt.averaging_status()
            assert status["carrier"] == "quic"
            assert status["payloads_fetched"] == 1
            assert status["payloads_fetched_bytes"] == opt.payload_nbytes
            assert status["bytes_sent"] == opt.payload_nbytes


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(120)
def test_a_round_closes_its_group_once_every_known_replica_joined() -> None:
    """Three replicas that each know of the two others, groups of up to eight: the round's
    group is full at three and ends long before hivemind's matchmaking time (30 s), which a
    group under its target size waits out."""
    slow = CONFIG.model_copy(update={"matchmaking_time": 30.0, "averaging_timeout": 60.0})
    with hivemind_dhts(3) as dhts:
        carriers = [dhts.own(HivemindCarrier(_Host(d), "sizedgroup_outer", lambda: ({}, []),
                                             slow, 60.0, MAX_GROUP_QUIC, others=lambda: 2))
                    for d in dhts.dhts]
        started = time.monotonic()
        pendings = [c.start_gather({"member": i}, 60.0) for i, c in enumerate(carriers)]
        while not all(p.done() for p in pendings):
            assert time.monotonic() - started < slow.matchmaking_time, "the group waited"
            time.sleep(0.05)
        for pending in pendings:
            result = pending.result()
            assert result is not None
            assert sorted(d["member"] for d in result.values()) == [0, 1, 2]


@HIVEMIND_PATH_WARNING
@HIVEMIND_UNRAISABLE_WARNING
@pytest.mark.timeout(120)
def test_a_member_claiming_a_later_round_cannot_hand_the_group_its_state() -> None:
    """Two honest replicas and a liar with a valid identity of its own, on real hivemind
    DHTs: the liar joins their round claiming round 1 and shares a poisoned outer state
    (finite, the right shapes) with the highest state-sharing priority. Before, every
    honest member, seeing a later round, downloaded the state of the averager claiming the
    highest round and installed it. Now the one member ahead is left out and the honest
    pair takes its round: equal parameters, nothing of the liar's."""
    with hivemind_dhts(3) as dhts:
        built = [(m, dhts.own(opt)) for m, opt in (_build(d) for d in dhts.dhts[:2])]
        for _, opt in built:
            opt._others = lambda: 2  # both know the liar as a replica of the stage
        meta, tensors = built[0][1]._shared_state()
        poisoned = [torch.full_like(t, 1e3) for t in tensors]
        liar = dhts.own(HivemindCarrier(
            _Host(dhts[2]), averaging_run_id(DILOCO, STAGE) + "_outer",
            lambda: (meta | {"round": 1}, poisoned), CONFIG, 20.0, others=lambda: 2,
        ))
        liar.set_priority(1e9)
        barrier = threading.Barrier(3, timeout=30.0)

        def device_thread(module: torch.nn.Module, opt: DilocoOptimizer, seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            _inner_steps(module, opt, gen, H - 1)
            barrier.wait()
            _inner_steps(module, opt, gen, 1)
            _finish_round(opt)

        def lie() -> dict[str, Any] | None:
            barrier.wait()
            return liar.gather({"round": 1, "anchor": "f" * 16, "weight": 1.0,
                                "payload": b"\0" * built[0][1].payload_nbytes}, 20.0)

        with ThreadPoolExecutor(max_workers=3, thread_name_prefix="device") as pool:
            runs = [pool.submit(device_thread, m, o, seed) for seed, (m, o) in enumerate(built)]
            lied = pool.submit(lie)
            for run in runs:
                run.result(timeout=90)
            lied.result(timeout=90)
        (m_a, a), (m_b, b) = built
        for opt in (a, b):
            assert opt.last_round["ok"], opt.last_round
            assert opt.last_round["participants"] == 2 and opt.outer.round == 1
            assert opt.members_ahead_left_out == 1  # the liar was in the group
            assert opt.rounds_adopted == 0
        for p, q in zip(m_a.parameters(), m_b.parameters(), strict=True):
            assert torch.equal(p, q)
            assert p.abs().max() < 100


def test_the_mode_picks_the_optimizer() -> None:
    with pytest.raises(AveragingError, match="make_stage_optimizer"):
        CollaborativeOptimizer(build_stage(DILOCO, STAGE), DILOCO, STAGE, None, CONFIG)
    # (gossip: tests/loopback/test_gossip.py builds it through make_stage_optimizer)
