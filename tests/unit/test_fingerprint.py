"""The parameter sketch: the same function on every replica, linear, and a fair estimate of
the relative distance between two replicas' parameters."""

import math
import threading
from unittest import mock

import pytest
import torch
from wanswarm.node.stage import fingerprint
from wanswarm.node.stage.fingerprint import Fingerprinter, param_sketch, relative_distance
from wanswarm.node.stage.state_tensors import tensors_digest


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.w": torch.randn(300, 200, generator=g),
        "blocks.0.b": torch.randn(200, generator=g),
        "steps": torch.tensor(7),  # not floating point: left out
    }


def test_same_parameters_same_sketch_and_zero_distance() -> None:
    a, b = _state(0), _state(0)
    assert param_sketch(a) == param_sketch(b)
    assert relative_distance(param_sketch(a), param_sketch(b)) == 0.0


def test_sketch_is_linear_and_ignores_integer_tensors() -> None:
    a, b = _state(0), _state(1)
    diff = {k: (a[k] - b[k]) if a[k].is_floating_point() else a[k] for k in a}
    sa, sb, sd = param_sketch(a), param_sketch(b), param_sketch(diff)
    # a - b is rounded to float32 before it is summed: equal to float32's precision
    assert all(math.isclose(x - y, z, rel_tol=1e-6, abs_tol=1e-4)
               for x, y, z in zip(sa, sb, sd, strict=True))
    c = dict(a, steps=torch.tensor(99))
    assert param_sketch(c) == sa


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1e-1])
def test_relative_distance_estimates_the_true_one(scale: float) -> None:
    a = _state(0)
    noise = _state(5)
    b = {k: a[k] + scale * noise[k] if a[k].is_floating_point() else a[k] for k in a}
    flat_a = torch.cat([a["blocks.0.w"].flatten(), a["blocks.0.b"]])
    flat_d = torch.cat([(b[k] - a[k]).flatten() for k in ("blocks.0.w", "blocks.0.b")])
    true = float(flat_d.norm() / flat_a.norm())
    estimate = relative_distance(param_sketch(a), param_sketch(b))
    # 64 buckets: each squared norm within ~18% (1 sigma); the ratio of roots within 2x
    assert true / 2 < estimate < true * 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="buckets"):
        param_sketch(_state(0), buckets=0)
    with pytest.raises(ValueError, match="different sizes"):
        relative_distance([1.0, 2.0], [1.0])
    assert relative_distance([0.0, 0.0], [0.0, 0.0]) == 0.0
    assert relative_distance([0.0, 0.0], [1.0, 0.0]) == math.inf


def test_the_lab_compares_replicas_at_a_common_epoch_by_their_sketches() -> None:
    from wanswarm.node.tools.lab_swarm import replicas_divergence, swarm_figures

    a = _state(0)
    rounded = {k: v + 1e-7 * v if v.is_floating_point() else v for k, v in a.items()}
    stepped = {k: v + 1e-2 * _state(3)[k] if v.is_floating_point() else v for k, v in a.items()}

    def status(stage: int, epoch: int, state: dict[str, torch.Tensor]) -> dict[str, object]:
        server = {"state": "online", "stage": stage, "digest_epoch": epoch,
                  "param_digest": str(epoch), "param_sketch": param_sketch(state)}
        return {"components": {"stage_server": server}, "peers": []}

    figures = swarm_figures([status(0, 4, a), status(0, 4, rounded), status(0, 5, stepped),
                             status(1, 4, a), status(1, 4, stepped)], 2)
    apart = replicas_divergence(figures["sketches"])
    assert apart[0] < 1e-6  # equal up to rounding; the replica at epoch 5 is not compared
    assert 1e-3 < apart[1] < 1e-1  # one replica stepped without the other
    assert replicas_divergence({2: [(1, [1.0]), (2, [1.0])]}) == {}  # no common epoch


def test_fingerprinter_publishes_the_state_as_it_was_at_submit() -> None:
    fp = Fingerprinter()
    try:
        assert fp.latest == (-1, "", [])
        state = _state(0)
        expected = (tensors_digest(state.items()), param_sketch(state))
        assert fp.submit(3, state)
        state["blocks.0.w"].add_(1.0)  # training goes on in place: the copy was taken before
        assert fp.wait(30)
        assert fp.latest == (3, *expected)
        assert fp.submit(4, state)  # the same buffers, reused, now hold the new values
        assert fp.wait(30)
        assert fp.latest == (4, tensors_digest(state.items()), param_sketch(state))
        assert fp.skipped == 0
    finally:
        fp.close()


def test_fingerprinter_skips_an_epoch_while_busy_and_never_mixes_epochs() -> None:
    fp = Fingerprinter()
    release = threading.Event()
    original = fingerprint.tensors_digest

    def slow_digest(named):  # type: ignore[no-untyped-def]
        release.wait(30)
        return original(named)

    try:
        with mock.patch.object(fingerprint, "tensors_digest", slow_digest):
            state = _state(1)
            assert fp.submit(5, state)
            assert not fp.submit(6, _state(2))  # busy with 5: skipped, no second copy
            assert fp.skipped == 1
            assert fp.latest[0] == -1  # nothing published half-way
            release.set()
            assert fp.wait(30)
        assert fp.latest == (5, tensors_digest(state.items()), param_sketch(state))
        assert fp.submit(7, _state(2))
        assert fp.wait(30)
        assert fp.latest[0] == 7
    finally:
        release.set()
        fp.close()


def test_fingerprinter_failure_is_logged_and_the_next_epoch_tries_again() -> None:
    fp = Fingerprinter()
    try:
        with mock.patch.object(fingerprint, "param_sketch", side_effect=RuntimeError("boom")):
            assert fp.submit(1, _state(0))
            assert fp.wait(30)
        assert fp.latest[0] == -1
        assert fp.submit(2, _state(0))
        assert fp.wait(30)
        assert fp.latest[0] == 2
    finally:
        fp.close()


def test_fingerprinter_after_close_submits_nothing() -> None:
    fp = Fingerprinter()
    fp.close()
    assert not fp.submit(1, _state(0))
    assert fp.wait(1)
