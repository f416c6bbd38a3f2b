"""The stream wire format: round trips, truncation, limits, versions, random bytes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wanswarm.transport.codecs import CodecSpec, encode
from wanswarm.transport.config import LimitsConfig
from wanswarm.transport.errors import CodecError, FramingError, PayloadError, ProtocolError
from wanswarm.transport.framing import (
    PREFIX,
    WIRE_VERSION,
    AuthReceived,
    ControlReceived,
    FrameType,
    HeaderReceived,
    MessageHeader,
    PayloadReceived,
    StreamDecoder,
    StreamEnded,
    TensorSpec,
    decode_header,
    decode_prefix,
    decode_tensor,
    encode_frame,
    encode_header,
    error_header,
    plan_tensors,
    tensor_spec,
)

LIMITS = LimitsConfig()


def _request(tensors: list[torch.Tensor], codec: str = "none") -> tuple[bytes, list[bytes]]:
    encoded = [encode(t, CodecSpec.from_wire(codec)) for t in tensors]
    header = MessageHeader(
        version=WIRE_VERSION,
        type="request",
        request_id=7,
        kind="forward",
        header={"micro_batch": [1, 2], "stage": 0, "note": "é", "nested": {"x": None}},
        tensors=tuple(tensor_spec(e) for e in encoded),
    )
    return encode_header(header, LIMITS), [e.payload for e in encoded]


def _decode_all(data: bytes, chunk: int | None = None) -> list[object]:
    decoder = StreamDecoder(LIMITS, allow_auth=True)
    events: list[object] = []
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        events += decoder.feed(data[i : i + step])
    events += decoder.feed_eof()
    return events


def _raw_header(obj: dict[str, object]) -> bytes:
    return encode_frame(FrameType.HEADER, json.dumps(obj).encode())


def _spec(**overrides: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "shape": [2, 3], "dtype": "float32", "codec": "none", "nbytes": 8 + 24,
        "transport": "stream",
    }
    spec.update(overrides)
    return spec


def _header_obj(**overrides: object) -> dict[str, object]:
    obj: dict[str, object] = {
        "version": WIRE_VERSION, "type": "request", "request_id": 1, "kind": "forward",
        "header": {}, "tensors": [],
    }
    obj.update(overrides)
    return obj


# -- round trips ----------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 7, 1000])
def test_round_trip_with_tensors_any_chunking(chunk: int | None) -> None:
    tensors = [torch.randn(3, 5), torch.arange(10, dtype=torch.int64), torch.zeros(0, 4)]
    frame, payloads = _request(tensors)
    control = encode_frame(FrameType.CONTROL, b"\x01repair")
    events = _decode_all(control + frame + b"".join(payloads) + control, chunk)
    assert isinstance(events[0], ControlReceived) and events[0].body == b"\x01repair"
    head = events[1]
    assert isinstance(head, HeaderReceived)
    assert head.header.kind == "forward" and head.header.request_id == 7
    assert head.header.header["note"] == "é" and head.header.header["nested"] == {"x": None}
    got = {e.index: e for e in events if isinstance(e, PayloadReceived)}
    assert sorted(got) == [0, 1, 2]
    for i, t in enumerate(tensors):
        out = decode_tensor(head.plans[i], got[i].data, allow_nonfinite=False)
        assert out.dtype == t.dtype and torch.equal(out, t)
    assert isinstance(events[-2], ControlReceived)
    assert isinstance(events[-1], StreamEnded)


def test_round_trip_quantized_codec() -> None:
    t = torch.randn(4, 64)
    frame, payloads = _request([t], codec="int8/b64/f32")
    events = _decode_all(frame + payloads[0])
    head = events[0]
    assert isinstance(head, HeaderReceived) and head.plans[0].codec.name == "int8"
    payload = events[1]
    assert isinstance(payload, PayloadReceived)
    out = decode_tensor(head.plans[0], payload.data, allow_nonfinite=False)
    assert out.shape == t.shape and (out - t).abs().max() < 0.05


def test_error_header_round_trip() -> None:
    frame = encode_header(error_header(9, "busy", "queue full"), LIMITS)
    (head, end) = _decode_all(frame)
    assert isinstance(head, HeaderReceived) and isinstance(end, StreamEnded)
    assert head.header.type == "error" and head.header.error_code == "busy"
    assert head.header.error_message == "queue full" and head.plans == ()


def test_auth_frames_only_when_allowed() -> None:
    frame = encode_frame(FrameType.AUTH, b"\x01\x01hello")
    assert _decode_all(frame)[0] == AuthReceived(b"\x01\x01hello")
    with pytest.raises(FramingError, match="not allowed"):
        StreamDecoder(LIMITS).feed(frame)


def test_datagram_tensors_are_not_on_the_stream() -> None:
    datagram = _spec(transport="datagram", transfer_id=3, symbol_size=1024, block_symbols=64)
    obj = _header_obj(tensors=[datagram, _spec()])
    events = _decode_all(_raw_header(obj) + bytes(8 + 24))
    names = [type(e).__name__ for e in events]
    assert names == ["HeaderReceived", "PayloadReceived", "StreamEnded"]
    payload = events[1]
    assert isinstance(payload, PayloadReceived) and payload.index == 1


# -- truncation, versions, limits ---------------------------------------------------------


def test_truncation_at_every_offset_is_a_framing_error() -> None:
    frame, payloads = _request([torch.randn(2, 3), torch.ones(4, dtype=torch.int32)])
    data = frame + b"".join(payloads)
    for cut in range(1, len(data)):
        decoder = StreamDecoder(LIMITS)
        decoder.feed(data[:cut])
        with pytest.raises(FramingError) as info:
            decoder.feed_eof()
        assert info.value.code == "truncated"
    assert isinstance(_decode_all(data)[-1], StreamEnded)


def test_decoder_stays_dead_after_an_error() -> None:
    decoder = StreamDecoder(LIMITS)
    with pytest.raises(FramingError):
        decoder.feed(PREFIX.pack(99, 1, 0))
    with pytest.raises(FramingError):
        decoder.feed(b"")
    with pytest.raises(FramingError):
        decoder.feed_eof()


def test_unknown_prefix_version() -> None:
    with pytest.raises(FramingError) as info:
        StreamDecoder(LIMITS).feed(PREFIX.pack(WIRE_VERSION + 1, FrameType.HEADER, 2) + b"{}")
    assert info.value.code == "unsupported_version"


def test_unknown_header_version() -> None:
    with pytest.raises(FramingError) as info:
        _decode_all(_raw_header(_header_obj(version=2)))
    assert info.value.code == "unsupported_version"


def test_unknown_frame_type() -> None:
    with pytest.raises(FramingError, match="unknown frame type"):
        decode_prefix(PREFIX.pack(WIRE_VERSION, 42, 0))


def test_oversize_header_rejected_from_the_prefix_alone() -> None:
    limits = LimitsConfig(max_header_bytes=256)
    decoder = StreamDecoder(limits)
    with pytest.raises(FramingError) as info:  # only the 6-byte prefix: nothing buffered
        decoder.feed(PREFIX.pack(WIRE_VERSION, FrameType.HEADER, 257))
    assert info.value.code == "too_large"


def test_oversize_header_refused_on_encode() -> None:
    header = MessageHeader(
        version=WIRE_VERSION, type="request", request_id=1, kind="k", header={"x": "y" * 300}
    )
    with pytest.raises(FramingError) as info:
        encode_header(header, LimitsConfig(max_header_bytes=256))
    assert info.value.code == "too_large"


def test_oversize_control_frame() -> None:
    decoder = StreamDecoder(LIMITS, max_control_bytes=300)
    with pytest.raises(FramingError) as info:
        decoder.feed(PREFIX.pack(WIRE_VERSION, FrameType.CONTROL, 301))
    assert info.value.code == "too_large"


def test_too_many_tensors() -> None:
    limits = LimitsConfig(max_tensors=2)
    obj = _header_obj(tensors=[_spec(), _spec(), _spec()])
    with pytest.raises(FramingError) as info:
        plan_tensors(decode_header(json.dumps(obj).encode(), limits), limits)
    assert info.value.code == "too_large"


def test_too_many_elements_checked_without_overflow() -> None:
    huge = [1 << 40] * 16
    obj = _header_obj(tensors=[_spec(shape=huge, nbytes=1)])
    with pytest.raises(FramingError) as info:
        _decode_all(_raw_header(obj))
    assert info.value.code == "too_large"


def test_total_bytes_limit() -> None:
    limits = LimitsConfig(max_message_bytes=1024)
    spec = _spec(shape=[200], nbytes=8 + 800)
    header = decode_header(json.dumps(_header_obj(tensors=[spec, spec])).encode(), limits)
    with pytest.raises(FramingError) as info:
        plan_tensors(header, limits)
    assert info.value.code == "too_large"


def test_shape_inconsistent_with_byte_length() -> None:
    with pytest.raises(PayloadError) as info:
        _decode_all(_raw_header(_header_obj(tensors=[_spec(nbytes=8 + 20)])))
    assert info.value.code == "bad_payload"


@pytest.mark.parametrize(
    "spec, error",
    [
        (_spec(codec="zstd"), CodecError),
        (_spec(dtype="complex64"), CodecError),
        (_spec(codec="int8/b64/f32", dtype="int64"), CodecError),
        (_spec(shape=[-1, 3]), FramingError),
        (_spec(shape=[True, 3]), FramingError),
        (_spec(transport="datagram"), FramingError),
        (_spec(transfer_id=4), FramingError),
        (_spec(transport="datagram", transfer_id=4, symbol_size=1024), FramingError),
        (_spec(symbol_size=1024), FramingError),

        (_spec(extra=1), FramingError),
    ],
)
def test_bad_tensor_specs(spec: dict[str, object], error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        _decode_all(_raw_header(_header_obj(tensors=[spec])))


@pytest.mark.parametrize(
    "obj",
    [
        _header_obj(type="telegram"),
        _header_obj(kind=""),
        _header_obj(kind="bad kind"),
        _header_obj(request_id=-1),
        _header_obj(request_id=1 << 62),
        _header_obj(type="error"),
        _header_obj(error_code="busy"),
        _header_obj(header=[1, 2]),
        _header_obj(surprise=True),
    ],
)
def test_bad_headers(obj: dict[str, object]) -> None:
    with pytest.raises(FramingError) as info:
        _decode_all(_raw_header(obj))
    assert info.value.code == "bad_frame"


def test_not_json() -> None:
    with pytest.raises(FramingError):
        _decode_all(encode_frame(FrameType.HEADER, b"\xff{not json"))


def test_second_header_and_trailing_bytes() -> None:
    frame = encode_header(error_header(1, "busy", ""), LIMITS)
    with pytest.raises(FramingError, match="second"):
        _decode_all(frame + frame)
    with pytest.raises(FramingError):
        _decode_all(frame + b"\x01")


def test_non_finite_values() -> None:
    t = torch.tensor([1.0, float("nan"), 2.0])
    frame, payloads = _request([t])
    head, payload, _ = _decode_all(frame + payloads[0])
    assert isinstance(head, HeaderReceived) and isinstance(payload, PayloadReceived)
    with pytest.raises(PayloadError) as info:
        decode_tensor(head.plans[0], payload.data, allow_nonfinite=False)
    assert info.value.code == "non_finite"
    out = decode_tensor(head.plans[0], payload.data, allow_nonfinite=True)
    assert torch.isnan(out[1]) and out[0] == 1.0


def test_corrupt_payload_is_a_codec_error() -> None:
    frame, payloads = _request([torch.randn(3)])
    bad = b"\x07" + payloads[0][1:]  # unknown payload layout version
    head, payload, _ = _decode_all(frame + bad)
    assert isinstance(head, HeaderReceived) and isinstance(payload, PayloadReceived)
    with pytest.raises(CodecError):
        decode_tensor(head.plans[0], payload.data, allow_nonfinite=False)


def test_tensor_spec_model_is_strict() -> None:
    with pytest.raises(ValueError):
        TensorSpec(shape=(2,), dtype="float32", codec="none", nbytes=16, transport="datagram")


# -- property tests ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512), st.integers(min_value=1, max_value=64))
def test_random_bytes_raise_only_protocol_errors(data: bytes, chunk: int) -> None:
    decoder = StreamDecoder(LIMITS, allow_auth=True)
    try:
        for i in range(0, len(data), chunk):
            decoder.feed(data[i : i + chunk])
        decoder.feed_eof()
    except ProtocolError:
        pass


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(max_size=8), _json_values, max_size=4),
    st.lists(
        st.sampled_from(["request_id", "kind", "type", "version", "tensors", "header"]),
        max_size=3,
    ),
    st.binary(max_size=64),
)
def test_mutated_headers_raise_only_protocol_errors(
    header: dict[str, object], drop: list[str], tail: bytes
) -> None:
    obj = _header_obj(header=header, tensors=[_spec()])
    for key in drop:
        obj.pop(key, None)
    frame = _raw_header(obj)
    try:
        events = _decode_all(frame + tail)
    except ProtocolError:
        return
    heads = [e for e in events if isinstance(e, HeaderReceived)]
    # A frame without the optional "header" field decodes to the documented default, {}.
    expected = {} if "header" in drop else header
    assert len(heads) == 1 and heads[0].header.header == expected


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0, max_value=200))
def test_corrupted_valid_stream_raises_only_protocol_errors(noise: bytes, at: int) -> None:
    frame, payloads = _request([torch.randn(2, 2)])
    data = bytearray(frame + payloads[0])
    at %= len(data)
    data[at : at + len(noise)] = noise
    try:
        events = _decode_all(bytes(data))
        for event in events:
            if isinstance(event, PayloadReceived):
                head = events[0]
                assert isinstance(head, HeaderReceived)
                decode_tensor(head.plans[event.index], event.data, allow_nonfinite=True)
    except ProtocolError:
        pass


def test_prefix_layout_is_explicit() -> None:
    assert encode_frame(FrameType.CONTROL, b"ab") == struct.pack("!BBI", 1, 2, 2) + b"ab"
