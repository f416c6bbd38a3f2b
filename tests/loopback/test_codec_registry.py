"""The codec registry: a codec added by one registration travels through real QUIC.

The toy codec is sign-and-scale (1-bit signSGD with a per-block scale): per block of
``block_size`` elements, ``scale = mean |x|`` over the block's elements, one bit per
element (1 for ``x < 0``, packed eight to a byte, element ``8j + k`` in bit ``k`` of
byte ``j``), and ``x' = (-1 if bit else 1) * scale``. The registry's own rules
(duplicates, layouts, names) are tested in tests/unit/test_codec_registry.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
import torch
from wanswarm.kernels import ops, registry
from wanswarm.kernels import reference as kref
from wanswarm.kernels.errors import NonFiniteInput
from wanswarm.kernels.registry import Codec, Layout
from wanswarm.transport.codecs import (
    CodecSpec,
    EncodedTensor,
    decode,
    encode,
    parse_codec,
)
from wanswarm.transport.endpoint import Request, Response
from wanswarm.transport.errors import CodecError, PayloadError

from .quic_helpers import address, endpoint, run

SIGN_ID = 200


def _sign_quantize(
    x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    nb = kref.num_blocks(n, block_size)
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise NonFiniteInput("sign: NaN or Inf in the input")
    xb = torch.nn.functional.pad(xf, (0, nb * block_size - n)).view(nb, block_size)
    counts = (n - torch.arange(nb) * block_size).clamp(max=block_size).to(x.device)  # (nb,)
    limit = kref.scale_limit_for(1.0, x.dtype, scale_dtype)
    scales = (xb.abs().sum(dim=1) / counts).clamp(max=limit).to(scale_dtype)  # (nb,)
    bits = (xb < 0).to(torch.int64).view(-1, 8)  # (nb * bs / 8, 8): bs is a multiple of 8
    weights = torch.tensor([1 << k for k in range(8)], device=x.device)
    packed = (bits * weights).sum(dim=1).to(torch.uint8)
    return packed[: math.ceil(n / 8)].contiguous(), scales


def _sign_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, out_dtype: torch.dtype
) -> torch.Tensor:
    shifts = torch.arange(8, device=codes.device)
    bits = ((codes.to(torch.int64)[:, None] >> shifts) & 1).flatten()[:numel]  # (numel,)
    s = scales.to(torch.float32).repeat_interleave(block_size)[:numel]
    return ((1 - 2 * bits).to(torch.float32) * s).to(out_dtype)


def _sign_codec() -> Codec:
    return Codec(
        name="sign",
        codec_id=SIGN_ID,
        layout=Layout(blockwise=True, code_bits=1, qmax=1.0),
        quantize=_sign_quantize,
        dequantize=_sign_dequantize,
        summary="1-bit sign with a per-block mean |x| scale",
    )


@pytest.fixture
def sign_codec() -> Iterator[Codec]:
    """The toy codec, registered for one test: its single registration."""
    with registry.registered(_sign_codec()) as codec:
        yield codec


def _expected(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """What the toy codec specifies, computed element by element (exact for these inputs)."""
    flat = x.flatten().tolist()
    out = []
    for start in range(0, len(flat), block_size):
        block = flat[start : start + block_size]
        scale = sum(abs(v) for v in block) / len(block)
        out += [-scale if v < 0 else scale for v in block]
    return torch.tensor(out, dtype=x.dtype).view(x.shape)


def _integers(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Small integers (block means of 16 or 8 of them are exact in float32)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(torch.float32)


# -- one registration is a codec everywhere --------------------------------------------


def test_registered_codec_has_a_wire_form_layout_and_header(sign_codec: Codec) -> None:
    spec = parse_codec("sign:b16")
    assert spec.to_wire() == "sign/b16/f32" and CodecSpec.from_wire("sign/b16/f32") == spec
    assert parse_codec("sign:b32:f16").to_wire() == "sign/b32/f16"
    assert spec.codec is sign_codec and spec.quantizing
    n = 40  # 3 blocks of 16 (the last one short): 3 fp32 scales, 5 code bytes
    assert spec.payload_nbytes(n, torch.float32) == 8 + 3 * 4 + 5
    assert spec.header(torch.bfloat16) == bytes([1, SIGN_ID, 4, 0, 3, 0, 0, 0])
    assert "sign" in registry.codec_names()
    with pytest.raises(CodecError, match="stochastic rounding exists for int8, int4 only"):
        parse_codec("sign-sr")
    with pytest.raises(CodecError):
        encode(torch.arange(4), spec)  # float tensors only


def test_registered_codec_round_trips_as_specified(sign_codec: Codec) -> None:
    spec = parse_codec("sign:b16")
    x = _integers((5, 8), 1)
    e = encode(x, spec)
    assert e.payload[:8] == spec.header(torch.float32)
    assert torch.equal(decode(e), _expected(x, 16))
    bits = "".join(f"{b:08b}"[::-1] for b in e.payload[8 + 3 * 4 :])
    assert bits[:40] == "".join("1" if v < 0 else "0" for v in x.flatten().tolist())
    with pytest.raises(PayloadError, match="NaN or Inf"):
        encode(torch.tensor([1.0, math.nan]), spec)


def test_untrusted_payloads_of_a_registered_codec(sign_codec: Codec) -> None:
    e = encode(_integers((40,), 2), parse_codec("sign:b16"))
    with pytest.raises(CodecError):
        decode(EncodedTensor(e.spec, e.shape, e.dtype, e.payload[:-1]))
    raw = bytearray(e.payload)
    raw[8:12] = bytes([0, 0, 0x80, 0xFF])  # -inf as the first scale
    with pytest.raises(PayloadError):
        decode(EncodedTensor(e.spec, e.shape, e.dtype, bytes(raw)))


def test_codec_without_triton_kernels_runs_its_reference(sign_codec: Codec) -> None:
    x = _integers((64,), 3)
    assert ops.resolve_impl(x, "triton", codec="sign") == "reference"
    with ops.use_impl("triton"):
        codes, scales = ops.quantize(x, "sign", 16)
    assert torch.equal(ops.dequantize(codes, scales, "sign", 16, 64), _expected(x, 16))


# -- through a real QUIC endpoint pair ------------------------------------------------------


def test_registered_codec_through_quic_endpoints(sign_codec: Codec) -> None:
    spec = parse_codec("sign:b16")
    x = _integers((3, 40), 4)

    async def main() -> tuple[torch.Tensor, torch.Tensor]:
        received: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()

        async def handler(request: Request) -> Response:
            got = request.tensors[0]
            received.set_result(got)
            return Response(header={}, tensors=[got * 2], codec=spec)

        async with endpoint() as server, endpoint() as client:
            server.register("toy", handler)
            reply = await client.request(address(server), "toy", {}, [x], codec=spec, timeout=20)
            got = await asyncio.wait_for(received, timeout=5)
            back = reply.tensors[0]
            assert isinstance(back, torch.Tensor)
            return got, back

    got, back = run(main())
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.equal(got, _expected(x, 16))  # the server decoded the toy payload
    assert torch.equal(back, _expected(got * 2, 16))  # and encoded its reply with it
