"""The averaging modes' arithmetic (outer.py, pseudo_gradient.py, gossip.py), the run spec's
``[averaging]`` section, and the screen of hivemind progress records (progress_guard.py).

Pure: no DHT, no sockets. The outer step is checked against torch's own Nesterov SGD, the
error feedback against its telescoping identity, the codecs' byte counts against
transport/codecs.py's payloads, and replicas against each other bit for bit.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from wanswarm.node.config.averaging_spec import AveragingSpec
from wanswarm.node.config.runspec import RunSpecError, default_run_spec, parse_run_spec
from wanswarm.node.stage import gossip, outer
from wanswarm.node.stage.progress_guard import ProgressBounds, ProgressScreen, screen
from wanswarm.node.stage.pseudo_gradient import (
    ErrorFeedback,
    PseudoGradientCodec,
    PseudoGradientError,
)
from wanswarm.node.stage.state_plan import MAX_EPOCH
from wanswarm.transport import codecs

# ---- the run spec's [averaging] section ------------------------------------------------------


def test_default_section_keeps_the_run_id() -> None:
    spec = default_run_spec()
    assert spec.averaging == AveragingSpec()
    assert "averaging" not in spec.canonical_json()
    diloco = spec.model_copy(update={"averaging": AveragingSpec(mode="diloco")})
    assert "averaging" in diloco.canonical_json() and diloco.run_id != spec.run_id


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('mode = "ring"', "averaging.mode"),
        ("inner_steps = 0", "averaging.inner_steps"),
        ("outer_lr = -1.0", "averaging.outer_lr"),
        ("outer_momentum = 1.0", "averaging.outer_momentum"),
        ('compression = "int3"', "averaging.compression"),
        ("topk_density = 0.0", "averaging.topk_density"),
        ("gossip_neighbours = 3", "averaging.gossip_neighbours"),
        ("round_timeout_s = 0", "averaging.round_timeout_s"),
        ('compression = "int4"', "averaging.compression"),  # with mode allreduce
        ('mode = "diloco"\nblock_size = 48', "averaging.block_size"),
        ("inner_step = 5", "averaging.inner_step"),  # misspelt: extra fields are refused
    ],
)
def test_spec_refuses_bad_values_naming_the_field(body: str, field: str) -> None:
    with pytest.raises(RunSpecError) as info:
        parse_run_spec(f'name = "t"\n[averaging]\n{body}\n')
    assert field in str(info.value)


def test_spec_accepts_a_diloco_section() -> None:
    spec = parse_run_spec(
        'name = "t"\n[averaging]\nmode = "diloco"\ninner_steps = 100\ncompression = "sign"\n'
    )
    assert spec.averaging.mode == "diloco" and spec.averaging.inner_steps == 100


# ---- the outer step ----------------------------------------------------------------------


def test_outer_nesterov_step_is_torch_sgd_nesterov_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    state = outer.OuterState.start(start)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        grad = {n: torch.randn(t.shape, generator=gen) for n, t in start.items()}
        outer.nesterov_step(state, grad, lr=0.7, momentum=0.9)
        for n, p in ref.items():
            p.grad = grad[n].clone()
        sgd.step()
        for n, p in ref.items():
            assert torch.equal(state.anchor[n], p.detach()), n
    assert state.round == 4


def test_outer_step_with_lr_one_and_no_momentum_is_parameter_averaging() -> None:
    gen = torch.Generator().manual_seed(1)
    anchor = {"w": torch.randn(64, generator=gen)}
    replicas = [{"w": anchor["w"] + torch.randn(64, generator=gen)} for _ in range(3)]
    state = outer.OuterState.start(anchor)
    deltas = [(outer.pseudo_gradient(state.anchor, r), 1.0) for r in replicas]
    outer.nesterov_step(state, outer.weighted_mean(deltas), lr=1.0, momentum=0.0)
    mean = torch.stack([r["w"] for r in replicas]).mean(0)
    torch.testing.assert_close(state.anchor["w"], mean, rtol=0, atol=1e-6)


def test_weighted_mean_weighs_by_samples_and_refuses_an_empty_round() -> None:
    a, b = {"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([4.0, 8.0])}
    got = outer.weighted_mean([(a, 1.0), (b, 3.0)])
    assert torch.equal(got["x"], torch.tensor([3.25, 6.5]))
    with pytest.raises(ValueError):
        outer.weighted_mean([(a, 0.0)])


@pytest.mark.parametrize("kind", ["none", "int8", "int4", "sign", "topk"])
def test_replicas_are_bit_identical_after_a_round(kind: str) -> None:
    """Three replicas train apart, then one outer round: each computes the mean of what the
    others sent itself, and all end with the same bits (and the same outer momentum)."""
    gen = torch.Generator().manual_seed(2)
    init = {"w": torch.randn(300, generator=gen), "v": torch.randn(10, 7, generator=gen)}
    codec = PseudoGradientCodec(kind, block_size=64, density=0.05)  # type: ignore[arg-type]
    replicas = []
    for _ in range(3):
        params = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in init.items()}
        replicas.append((params, outer.OuterState.start(init), ErrorFeedback(codec)))
    sent = []
    for params, state, feedback in replicas:
        decoded, _ = feedback.compress_all(outer.pseudo_gradient(state.anchor, params))
        sent.append((decoded, 8.0))
    for params, state, _ in replicas:
        mean = outer.weighted_mean(sent)  # computed by every replica from the same bits
        outer.nesterov_step(state, mean, lr=0.7, momentum=0.9)
        outer.load_anchor(params, state)
    first = replicas[0]
    for params, state, _ in replicas[1:]:
        for n in init:
            assert torch.equal(params[n], first[0][n])
            assert torch.equal(state.momentum[n], first[1].momentum[n])
    assert outer.max_divergence([r[0] for r in replicas]) == 0.0


# ---- codecs and error feedback ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_blockwise_codecs_are_the_transport_codecs_byte_for_byte(kind: str) -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    codec = PseudoGradientCodec(kind, block_size=64)  # type: ignore[arg-type]
    encoded, decoded = codecs.encode_roundtrip(t, codecs.parse_codec(f"{kind}:b64"))
    assert codec.payload_nbytes(t.numel()) == len(encoded.payload)
    assert torch.equal(codec.roundtrip(t), decoded)


def test_sign_and_topk_payloads() -> None:
    t = torch.tensor([3.0, -1.0, 0.5, -0.5, 2.0, 0.0, -4.0, 1.0])
    sign = PseudoGradientCodec("sign", block_size=4)
    # block means of |t|: 1.25 and 1.75; signs of 0 are +
    assert torch.equal(sign.roundtrip(t), torch.tensor(
        [1.25, -1.25, 1.25, -1.25, 1.75, 1.75, -1.75, 1.75]
    ))
    assert sign.payload_nbytes(8) == 1 + 2 * 2
    topk = PseudoGradientCodec("topk", density=0.25)
    assert torch.equal(topk.roundtrip(t), torch.tensor([3.0, 0, 0, 0, 0, 0, -4.0, 0]))
    assert topk.payload_nbytes(8) == 2 * 6
    assert PseudoGradientCodec("none").payload_nbytes(8) == 32


def test_codecs_refuse_non_finite_and_unknown() -> None:
    with pytest.raises(PseudoGradientError):
        PseudoGradientCodec("sign").roundtrip(torch.tensor([1.0, math.nan]))
    with pytest.raises(PseudoGradientError):
        PseudoGradientCodec("int3")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["int4", "sign", "topk"])
def test_error_feedback_carries_the_residual_across_rounds(kind: str) -> None:
    """sum(sent) = sum(deltas) - final residual, exactly up to float rounding; the residual
    stays one round's error while a plain quantizer's error grows with the rounds."""
    gen = torch.Generator().manual_seed(4)
    codec = PseudoGradientCodec(kind, block_size=32, density=0.1)  # type: ignore[arg-type]
    feedback = ErrorFeedback(codec)
    total_delta, total_sent, total_plain = (torch.zeros(256) for _ in range(3))
    for _ in range(50):
        delta = torch.randn(256, generator=gen) * 0.1 + 0.05  # a steady drift, as training has
        sent, _ = feedback.compress("w", delta)
        total_delta += delta
        total_sent += sent
        total_plain += codec.roundtrip(delta)
    residual = feedback.residuals["w"]
    torch.testing.assert_close(total_sent + residual, total_delta, rtol=0, atol=1e-4)
    assert float((total_sent - total_delta).abs().max()) < float(
        (total_plain - total_delta).abs().max()
    )
    feedback.reset()
    assert not feedback.residuals


# ---- gossip --------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(2, 1), (4, 1), (4, 2), (3, 2), (8, 1)])
def test_gossip_mixing_is_doubly_stochastic_and_changes_each_round(n: int, k: int) -> None:
    for rnd in range(4):
        w = gossip.mixing_matrix(n, rnd, k)
        for i in range(n):
            assert math.isclose(sum(w[i]), 1.0)
            assert math.isclose(sum(w[j][i] for j in range(n)), 1.0)
            assert sum(1 for j in range(n) if j != i and w[i][j]) <= 2 * k
    if n == 8:  # one-peer exponential graph: neighbours 1, 2, 4 apart, then again
        assert [gossip.neighbours(0, 8, r) for r in range(4)] == [[1], [2], [4], [1]]
        # after log2(n) rounds every replica holds the exact mean
        values = torch.arange(8, dtype=torch.float64)
        for rnd in range(3):
            values = torch.tensor(gossip.mixing_matrix(8, rnd), dtype=torch.float64) @ values
        torch.testing.assert_close(values, torch.full((8,), 3.5, dtype=torch.float64))


def test_runtime_model() -> None:
    # no communication and no variance: nothing to gain
    assert gossip.predicted_speedup(0.0, 0.5, 0.0, 4) == 1.0
    # communication-bound all-reduce, cheap overlapped gossip: a large gain
    assert gossip.predicted_speedup(2.0, 0.25, 0.0, 4) == pytest.approx(3.0)
    # compute variance alone favours gossip (fewer replicas to wait for)
    assert gossip.predicted_speedup(0.0, 0.5, 0.1, 16) > 1.0


# ---- hivemind progress records ---------------------------------------------------------


def _record(peer: bytes, epoch: Any, samples: Any = 4, rate: Any = 10.0, at: Any = 100.0) -> Any:
    value = {
        "peer_id": peer, "epoch": epoch, "samples_accumulated": samples,
        "samples_per_second": rate, "time": at, "client_mode": False,
    }
    return SimpleNamespace(value=value)


def _screen(records: dict[bytes, Any], local_epoch: int = 7) -> tuple[dict[bytes, Any], Any]:
    tally = ProgressScreen()
    kept = screen(
        records, local_epoch=local_epoch, own_peer_id=b"me", now=100.0,
        bounds=ProgressBounds(target_batch_size=64), tally=tally,
    )
    return kept, tally


def test_screen_ignores_an_absurd_epoch_and_keeps_honest_leads() -> None:
    records = {
        b"me": _record(b"me", 7), b"a": _record(b"a", 8), b"b": _record(b"b", 7),
        b"evil": _record(b"evil", 10**15),
    }
    kept, tally = _screen(records)
    assert set(kept) == {b"me", b"a", b"b"}
    assert tally.refused == 1 and tally.reasons == {"epoch": 1}
    # a forger is out-voted by as many honest replicas; our own epoch does not vote, so a
    # replica far behind still learns the stage's epoch from a single honest peer
    kept, _ = _screen({b"me": _record(b"me", 7), b"a": _record(b"a", 7),
                       b"evil": _record(b"evil", 10**6)})
    assert set(kept) == {b"me", b"a"}
    kept, _ = _screen({b"me": _record(b"me", 0), b"a": _record(b"a", 16)}, local_epoch=0)
    assert set(kept) == {b"me", b"a"}
    kept, _ = _screen({b"me": _record(b"me", 7), b"evil": _record(b"evil", MAX_EPOCH + 1)})
    assert set(kept) == {b"me"}  # beyond any run's epochs: refused even alone


def test_a_quorums_epoch_bounds_the_records_believed_for_a_while() -> None:
    records = {b"me": _record(b"me", 7), b"a": _record(b"a", 7), b"b": _record(b"b", 8),
               b"evil": _record(b"evil", 9)}  # within the lead of two: believed
    for now, kept_evil in ((100.0, False), (129.9, False), (130.0, True)):
        tally = ProgressScreen()
        tally.believe_at_most(8, until=130.0)  # a quorum held epoch 7: 8 may have stepped
        kept = screen(records, local_epoch=7, own_peer_id=b"me", now=now,
                      bounds=ProgressBounds(target_batch_size=64), tally=tally)
        assert (b"evil" in kept) is kept_evil and {b"me", b"a", b"b"} <= set(kept)
        assert tally.capped == 1 and tally.refused == (0 if kept_evil else 1)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (_record(b"x", 7, samples=math.inf), "samples"),
        (_record(b"x", 7, samples=math.nan), "samples"),
        (_record(b"x", 7, samples=-8), "samples"),
        (_record(b"x", 7, rate=1e30), "rate"),
        (_record(b"x", 7, rate=math.inf), "rate"),
        (_record(b"x", 7, at=1e18), "time"),
        (_record(b"x", 7, at=math.nan), "time"),
        (SimpleNamespace(value={"peer_id": b"x"}), "malformed"),
        (SimpleNamespace(value="junk"), "malformed"),
        (_record(b"x", True), "malformed"),
    ],
)
def test_screen_ignores_absurd_counts(record: Any, reason: str) -> None:
    kept, tally = _screen({b"me": _record(b"me", 7), b"x": record})
    assert set(kept) == {b"me"} and tally.reasons == {reason: 1}


def test_screen_clamps_a_count_above_the_bound_and_keeps_the_record() -> None:
    """A replica whose epoch is held while a slow round runs accumulates past the bound
    (4 x 64 here); its record stays, its count is taken as the bound."""
    from hivemind.utils.timed_storage import ValueWithExpiration

    held = ValueWithExpiration(_record(b"x", 7, samples=264).value, 123.0)
    forged = _record(b"y", 7, samples=10**12)
    records = {b"me": _record(b"me", 7), b"x": held, b"y": forged}
    kept, tally = _screen(records)
    assert set(kept) == {b"me", b"x", b"y"} and tally.refused == 0 and tally.clamped == 2
    assert isinstance(kept[b"x"], ValueWithExpiration) and kept[b"x"].expiration_time == 123.0
    assert kept[b"x"].value["samples_accumulated"] == 256
    assert kept[b"y"].value["samples_accumulated"] == 256
    # what hivemind's tracker parses next takes strict integers: a float 256.0 here ended a
    # restarted daemon in the network lab
    from hivemind.optim.progress_tracker import LocalTrainingProgress

    for peer in (b"x", b"y"):
        assert LocalTrainingProgress.parse_obj(kept[peer].value).samples_accumulated == 256
    assert held.value["samples_accumulated"] == 264  # the DHT's own copy is left alone
    kept, tally = _screen({b"x": _record(b"x", 7, samples=256)})
    assert kept[b"x"].value["samples_accumulated"] == 256 and tally.clamped == 0


def test_screen_passes_what_hivemind_handles_itself() -> None:
    assert _screen(None)[0] is None  # type: ignore[arg-type]
    kept, tally = _screen({b"gone": SimpleNamespace(value=None)})
    assert set(kept) == {b"gone"} and tally.refused == 0


@pytest.mark.parametrize("kind", ["none", "int8", "int4", "sign", "topk"])
def test_payload_bytes_decode_to_the_roundtrip(kind: str) -> None:
    """What a peer decodes from the bytes is what the sender's error feedback assumed."""
    codec = PseudoGradientCodec(kind, block_size=32, density=0.1)  # type: ignore[arg-type]
    for shape in [(7, 13), (1,), (64,)]:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        payload = codec.encode(t)
        assert len(payload) == codec.payload_nbytes(t.numel())
        assert torch.equal(codec.decode(payload, shape), codec.roundtrip(t))


@pytest.mark.parametrize("kind", ["none", "int8", "int4", "sign", "topk"])
def test_hostile_payloads_are_refused(kind: str) -> None:
    codec = PseudoGradientCodec(kind, block_size=32, density=0.1)  # type: ignore[arg-type]
    good = codec.encode(torch.randn(100))
    for junk in (good[:-1], good + b"\0", b"", "text"):
        with pytest.raises(PseudoGradientError):
            codec.decode(junk, (100,))  # type: ignore[arg-type]
    if kind == "topk":
        bad = (10**6).to_bytes(4, "little") + good[4:]
        with pytest.raises(PseudoGradientError, match="index"):
            codec.decode(bad, (100,))
    if kind in ("none", "sign", "topk"):
        nan = bytearray(good)
        if kind == "none":
            nan[0:4] = b"\x00\x00\xc0\x7f"  # float32 NaN
        elif kind == "sign":
            nan[0:2] = b"\x00\x7e"  # float16 NaN scale
        else:
            nan[40:42] = b"\x00\x7e"  # a float16 NaN value
        with pytest.raises(PseudoGradientError, match="NaN"):
            codec.decode(bytes(nan), (100,))


# ---- wanswarm status --------------------------------------------------------------------------


def test_status_shows_the_averaging_mode_round_participants_and_bytes() -> None:
    from wanswarm.node.status import StatusReport, render_text

    averaging = {"mode": "diloco", "last_round": 7, "participants": 3, "bytes_sent": 12345}
    report = StatusReport(
        peer_id="12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", run="tiny", stage=0,
        state="online", server=True, trainer=False, pid=1, version="0.1.0", uptime_s=10.0,
        dht_addrs=[], quic_addr=None, peers=[], n_stages=3,
        components={"stage_server": {"stage": 0, "state": "online", "throughput": 4.0,
                                     "applied": 5, "averaging": averaging}},
    )
    line = next(x for x in render_text(report).splitlines() if x.startswith("averaging"))
    assert line == "averaging mode diloco   last_round 7   participants 3   bytes_sent 12345"


def test_a_record_hivemind_cannot_parse_counts_the_stage_as_empty_not_a_crash() -> None:
    """guard_tracker: should hivemind's parser still refuse what the screen kept, the
    tracker sees no peers (and the refusal is counted) instead of raising in the daemon."""
    import threading

    from wanswarm.node.stage.progress_guard import guard_tracker

    parsed: list[Any] = []

    class Tracker:
        local_progress = SimpleNamespace(epoch=7, peer_id=b"me")
        lock_global_progress = threading.Lock()
        training_progress_key = "run_progress"
        dht = SimpleNamespace(get=lambda key, latest: None)
        global_progress: Any = None

        def _parse_swarm_progress_data(self, metadata: Any) -> Any:
            if metadata:
                raise ValueError("1 validation error for LocalTrainingProgress")
            parsed.append(metadata)
            return "no peers"

    tracker = Tracker()
    tally = guard_tracker(tracker, ProgressBounds(target_batch_size=64))
    assert tracker._parse_swarm_progress_data({b"x": _record(b"x", 7)}) == "no peers"
    assert tally.reasons.get("unparsable") == 1 and parsed[-1] == {}
