"""ReceivedTensor and the endpoint's tensor helpers (pure: no sockets)."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, decode, encode
from wanswarm.transport.errors import CodecError, PayloadError, ProtocolError
from wanswarm.transport.framing import TensorPlan, tensor_spec
from wanswarm.transport.tensors import (
    PAYLOAD_ERROR_CODES,
    THREAD_BYTES,
    ReceivedTensor,
    decode_all,
    encode_all,
    off_loop,
    sendable_nbytes,
)

INT8 = CodecSpec.from_wire("int8/b64/f32")
NONE = CodecSpec("none")


def test_decoded_on_first_access_once_and_relayed_without_a_copy() -> None:
    e = encode(torch.randn(3, 70), INT8)
    r = ReceivedTensor.of(e, sender="peerA")
    assert (r.shape, r.dtype, r.codec, r.numel) == ((3, 70), torch.float32, INT8, 210)
    assert r.nbytes == len(e.payload) and r.decoded_nbytes == 210 * 4 and r.sender == "peerA"
    assert not r.is_decoded
    assert r.encoded.payload is e.payload  # relayed as it came
    assert r.encoded == e
    t = r.tensor()
    assert r.is_decoded and r.tensor() is t and torch.equal(t, decode(e))


def test_header_checks_on_receipt() -> None:
    e = encode(torch.randn(100), INT8)
    plan = TensorPlan(tensor_spec(e), INT8, torch.float32, 100)
    with pytest.raises(PayloadError):  # truncated
        ReceivedTensor(plan, e.payload[:-1])
    with pytest.raises(CodecError):  # the payload's own header names another codec
        ReceivedTensor(
            plan,
            bytes(encode(torch.randn(100), CodecSpec.from_wire("int8/b64/f16")).payload[:8])
            + bytes(e.payload[8:]),
        )
    with pytest.raises(CodecError):  # int8 does not carry int64
        ReceivedTensor.of(EncodedTensor(INT8, (4,), torch.int64, e.payload))
    wrong_shape = EncodedTensor(INT8, (99,), torch.float32, e.payload)
    with pytest.raises(PayloadError):
        ReceivedTensor.of(wrong_shape)


def test_values_are_checked_on_decode_and_the_error_is_kept() -> None:
    nan = encode(torch.tensor([1.0, math.nan]), NONE)
    r = ReceivedTensor.of(nan)  # the header is fine
    for _ in range(2):
        with pytest.raises(PayloadError) as info:
            r.tensor()
        assert info.value.code in PAYLOAD_ERROR_CODES and info.value.code == "non_finite"
    assert r.is_decoded
    allowed = ReceivedTensor.of(nan, allow_nonfinite=True)
    assert math.isnan(float(allowed.tensor()[1]))
    # a blockwise payload with a NaN scale: refused by the codec's own checks
    e = encode(torch.ones(64), INT8)
    payload = bytearray(e.payload)
    payload[8:12] = torch.tensor([math.nan], dtype=torch.float32).numpy().tobytes()
    bad = ReceivedTensor.of(EncodedTensor(INT8, e.shape, e.dtype, bytes(payload)))
    with pytest.raises(ProtocolError) as refused:
        bad.tensor()
    assert refused.value.code in PAYLOAD_ERROR_CODES


def test_decoding_from_several_threads_happens_once() -> None:
    r = ReceivedTensor.of(encode(torch.randn(4096), INT8))
    out: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: out.append(r.tensor())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(out) == 4 and all(t is out[0] for t in out)


def test_encode_all_and_decode_all() -> None:
    x = torch.randn(10)
    pre = encode(torch.ones(3), NONE)
    relayed = ReceivedTensor.of(encode(torch.randn(64), INT8))
    encoded = asyncio.run(encode_all([x, pre, relayed], INT8))
    assert encoded[0].spec == INT8 and encoded[1] is pre and encoded[2] == relayed.encoded
    assert not relayed.is_decoded
    assert [sendable_nbytes(t) for t in (x, pre, relayed)] == [40, len(pre.payload), relayed.nbytes]
    back = asyncio.run(decode_all([ReceivedTensor.of(e) for e in encoded]))
    assert torch.equal(back[1], torch.ones(3)) and (back[0] - x).abs().max() < 0.05
    assert asyncio.run(encode_all([], None)) == []


def test_large_codec_work_runs_off_the_loop() -> None:
    here = threading.get_ident()

    async def main() -> tuple[int, int]:
        small = await off_loop(THREAD_BYTES, threading.get_ident)
        large = await off_loop(THREAD_BYTES + 1, threading.get_ident)
        return small, large

    small, large = asyncio.run(main())
    assert small == here and large != here


@settings(max_examples=200, deadline=None)
@given(
    codec=st.sampled_from(["none", "bf16", "int8/b64/f32", "int4/b32/f16", "fp8/b64/f32"]),
    numel=st.integers(0, 300),
    data=st.data(),
)
def test_random_payloads_only_ever_raise_protocol_errors(
    codec: str, numel: int, data: st.DataObject
) -> None:
    spec = CodecSpec.from_wire(codec)
    length = spec.payload_nbytes(numel, torch.float32)
    # mostly the right length with the right header, so that decoding is reached
    head = (
        spec.header(torch.float32)
        if data.draw(st.booleans())
        else data.draw(st.binary(min_size=8, max_size=8))
    )
    body = data.draw(st.binary(min_size=length - 8, max_size=length - 8))
    payload = (head + body)[: data.draw(st.sampled_from([length, length, max(0, length - 1)]))]
    try:
        r = ReceivedTensor.of(EncodedTensor(spec, (numel,), torch.float32, payload))
        t = r.tensor()
    except ProtocolError:
        return
    assert t.shape == (numel,) and bool(torch.isfinite(t).all())
