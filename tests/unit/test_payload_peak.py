"""A payload's largest |value|, read on the host from its bytes (codecs.payload_peak), and
what it lets a receiver skip: searching the decoded tensor for NaN/Inf or its maximum."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from wanswarm.kernels import reference as R
from wanswarm.transport import codecs
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, decode, encode, payload_peak
from wanswarm.transport.error_feedback import ErrorFeedback
from wanswarm.transport.errors import PayloadError
from wanswarm.transport.framing import TensorPlan, tensor_spec
from wanswarm.transport.tensors import ReceivedTensor

WIRES = ["int8", "int8:f16", "int4:b32", "fp8", "fp8:f16", "int8:b256", "none", "bf16"]


def _data(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 50, generator=g) * torch.logspace(-3, 3, 50)  # decades per column
    return x.to(dtype)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_peak_is_the_decoded_tensors_largest_value(wire: str, dtype: torch.dtype) -> None:
    """Round to nearest: exactly the decoded maximum, for every codec and source dtype."""
    spec = codecs.parse_codec(wire)
    for seed in range(5):
        e = encode(_data(seed, dtype), spec, dtype=torch.float32)
        assert payload_peak(e) == float(decode(e).abs().max())


@pytest.mark.parametrize("wire", ["int8:sr", "int4:b32:sr"])
def test_stochastic_rounding_never_exceeds_the_peak(wire: str) -> None:
    spec = codecs.parse_codec(wire)
    g = torch.Generator().manual_seed(3)
    for seed in range(20):
        e = encode(_data(seed), spec, generator=g)
        peak = payload_peak(e)
        assert peak is not None and float(decode(e).abs().max()) <= peak


def test_nan_inf_integers_and_empty() -> None:
    none = CodecSpec("none")
    nan = payload_peak(encode(torch.tensor([1.0, math.nan]), none))
    assert nan is not None and math.isnan(nan)
    assert payload_peak(encode(torch.tensor([-math.inf, 1.0]), none)) == math.inf
    assert payload_peak(encode(torch.arange(5), none)) is None
    assert payload_peak(encode(torch.empty(0, 4), codecs.parse_codec("int8"))) == 0.0


def _hostile_int8(scale: float) -> EncodedTensor:
    """An int8 payload no encoder makes: code -128 in a block whose scale is ``scale``."""
    spec = codecs.parse_codec("int8:b64")
    e = encode(torch.randn(2, 64), spec)
    b = bytearray(e.payload)
    struct.pack_into("<f", b, codecs.HEADER_NBYTES, scale)  # block 0's scale
    b[codecs.HEADER_NBYTES + 2 * 4] = 0x80  # element 0's code: -128
    return EncodedTensor(spec, e.shape, e.dtype, bytes(b))


def test_a_hostile_code_decodes_finite_and_within_the_peak() -> None:
    """-128 at the largest scale the decoder accepts would be -Inf; it decodes as -127
    times the scale, so the payload needs no search for NaN/Inf once its scales passed."""
    limit = R.scale_limit_for(127.0, torch.float32, torch.float32)
    e = _hostile_int8(limit)
    received = ReceivedTensor.of(e)
    t = received.tensor()  # checked: would raise non_finite if anything were not finite
    assert bool(torch.isfinite(t).all())
    assert t[0, 0].item() == pytest.approx(-127.0 * limit)
    assert received.peak == float(t.abs().max())
    mild = _hostile_int8(0.5)
    assert float(decode(mild).abs().max()) <= (payload_peak(mild) or 0.0)


def test_a_received_tensor_tells_its_peak_only_once_checked() -> None:
    e = encode(torch.randn(8, 8), codecs.parse_codec("int8"))
    plan = TensorPlan(tensor_spec(e), e.spec, e.dtype, e.numel)
    received = ReceivedTensor(plan, e.payload)
    with pytest.raises(RuntimeError, match="not been decoded"):
        _ = received.peak
    t = received.tensor()
    assert received.peak == float(t.abs().max())


def test_error_feedback_keeps_its_residual_when_the_payload_is_refused() -> None:
    """A sender that refuses what it encoded (a value beyond its bound) must not count it
    as sent: the residual stays what it was."""
    ef = ErrorFeedback()
    spec = codecs.parse_codec("int8")
    key = ("trainer", 1, "grad_input")
    ef.encode(key, torch.randn(4, 64), spec)
    before = ef.residual(key)
    assert before is not None

    def refuse(payload: EncodedTensor) -> None:
        raise ValueError(f"peak {payload_peak(payload)}")

    with pytest.raises(ValueError, match="peak"):
        ef.encode(key, torch.randn(4, 64) * 1e6, spec, accept=refuse)
    after = ef.residual(key)
    assert after is before
    seen: list[float | None] = []
    ef.encode(key, torch.randn(4, 64), spec, accept=lambda p: seen.append(payload_peak(p)))
    assert len(seen) == 1 and ef.residual(key) is not before


def test_a_relayed_payload_is_checked_without_keeping_a_decoded_copy() -> None:
    """ReceivedTensor.checked_peak, what a trainer checks before relaying a stage's output:
    int8/int4 from their scales alone (nothing decoded), fp8 and raw payloads through a
    scratch copy; a payload the decoder refuses is refused here with the same error."""
    x = torch.randn(16, 96) * 5
    for wire in ("int8", "int4:b32", "fp8", "none"):
        e = encode(x, codecs.parse_codec(wire))
        received = ReceivedTensor.of(e)
        assert received.checked_peak() == float(decode(e).abs().max())
        assert not received.is_decoded  # the payload goes on as it came
    bad_scale = bytearray(encode(x, codecs.parse_codec("int8")).payload)
    struct.pack_into("<f", bad_scale, codecs.HEADER_NBYTES + 4, -1.0)  # block 1's scale
    nan_code = bytearray(encode(x, codecs.parse_codec("fp8")).payload)
    nan_code[-1] = 0x7F
    raw_nan = encode(torch.tensor([1.0, math.nan]), CodecSpec("none"))
    for spec, payload, match in (
        (codecs.parse_codec("int8"), bytes(bad_scale), "scale outside"),
        (codecs.parse_codec("fp8"), bytes(nan_code), "NaN"),
    ):
        e = EncodedTensor(spec, (16, 96), torch.float32, payload)
        with pytest.raises(PayloadError, match=match):
            ReceivedTensor.of(e).checked_peak()
        with pytest.raises(PayloadError, match=match):
            ReceivedTensor.of(e).tensor()
    with pytest.raises(PayloadError, match="NaN or Inf"):
        ReceivedTensor.of(raw_nan).checked_peak()
