"""Activations encoded straight from bf16/fp16 into float32 payloads, Triton = reference.

A stage computing in bf16 sends its output as a float32 payload (what the protocol
carries) without making a float32 copy first: the codec reads the bf16 values. The
payload must be byte-identical to the one encoded from the float32 upcast (every bf16
value is exact in float32), and identical between the Triton kernels (under
TRITON_INTERPRET=1) and the reference.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from wanswarm.kernels import ops
from wanswarm.transport import codecs
from wanswarm.transport.codecs import CodecSpec, decode, encode, encode_roundtrip, encodes_directly
from wanswarm.transport.tensors import ReceivedTensor, decode_all

SPECS = [
    CodecSpec("none"),
    CodecSpec("bf16"),
    CodecSpec("int8"),
    CodecSpec("int8", block_size=32, scale_dtype="fp16"),
    CodecSpec("int8", stochastic=True),
    CodecSpec("fp8", block_size=128),
    CodecSpec("int4"),
    CodecSpec("int4", block_size=16, stochastic=True),
]
SOURCES = (torch.bfloat16, torch.float16)


def _activation(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 17, 40, generator=g) * torch.logspace(-3, 2, 40)  # (B, T, C)
    x[0, 0, :] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.to_wire())
@pytest.mark.parametrize("source", SOURCES)
def test_payload_equals_the_one_from_the_float32_upcast(
    spec: CodecSpec, source: torch.dtype
) -> None:
    x = _activation(source)
    direct = encode(x, spec, dtype=torch.float32, generator=torch.Generator().manual_seed(5))
    upcast = encode(x.float(), spec, generator=torch.Generator().manual_seed(5))
    assert direct.dtype == torch.float32 and direct.shape == x.shape
    assert direct.payload == upcast.payload
    back = decode(direct)
    assert back.dtype == torch.float32 and back.shape == x.shape


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("spec", [s for s in SPECS if s.quantizing], ids=lambda s: s.to_wire())
@pytest.mark.parametrize("source", SOURCES)
def test_triton_and_reference_payloads_are_identical(spec: CodecSpec, source: torch.dtype) -> None:
    x = _activation(source)
    payloads, decoded = [], []
    for impl in ("triton", "reference"):
        with ops.use_impl(impl):
            enc, sent = encode_roundtrip(
                x, spec, dtype=torch.float32, generator=torch.Generator().manual_seed(9)
            )
            payloads.append(enc.payload)
            decoded.append(sent)
            decoded.append(decode(enc))
    assert payloads[0] == payloads[1]
    for d in decoded[1:]:
        assert torch.equal(d.view(torch.int32), decoded[0].view(torch.int32))


def test_which_encodings_need_no_cast() -> None:
    int8, none = CodecSpec("int8"), CodecSpec("none")
    assert encodes_directly(int8, torch.bfloat16, torch.float32)
    assert encodes_directly(int8, torch.float16, torch.float32)
    assert encodes_directly(int8, torch.float16, torch.bfloat16)
    assert not encodes_directly(int8, torch.float32, torch.bfloat16)  # bf16's max is lower
    assert not encodes_directly(none, torch.bfloat16, torch.float32)  # raw bytes: a cast
    assert encodes_directly(none, torch.int64, torch.int64)


def test_narrowing_wire_dtype_casts_first() -> None:
    """float32 into a bf16 payload: cast, then encoded; scales stay within bf16's limit."""
    x = torch.tensor([3.0e38, -1.0, 0.5] * 30)
    enc = encode(x, CodecSpec("int8"), dtype=torch.bfloat16)
    assert enc.dtype == torch.bfloat16
    back = decode(enc)
    assert back.dtype == torch.bfloat16 and bool(torch.isfinite(back).all())


def test_received_tensor_decodes_on_the_device_it_is_asked_for() -> None:
    x = _activation(torch.bfloat16)
    enc = encode(x, CodecSpec("int8"), dtype=torch.float32)
    r = ReceivedTensor.of(enc)
    t = r.tensor(device="cpu")
    assert t.device.type == "cpu" and t.dtype == torch.float32
    assert r.tensor() is t  # decoded once
    assert torch.equal(t, decode(enc))


def test_decode_all_takes_a_device() -> None:
    enc = encode(_activation(torch.float16), CodecSpec("fp8"), dtype=torch.float32)
    (t,) = asyncio.run(decode_all([ReceivedTensor.of(enc)], device=torch.device("cpu")))
    assert torch.equal(t, decode(enc))


def test_staging_is_a_plain_copy_off_cuda() -> None:
    from wanswarm.transport import staging

    x = torch.arange(10, dtype=torch.uint8)
    assert torch.equal(staging.to_host(x), x)
    assert torch.equal(staging.to_device(x, torch.device("cpu")), x)
    assert codecs.HEADER_NBYTES == 8
