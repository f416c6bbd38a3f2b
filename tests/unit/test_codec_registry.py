"""The codec registry's rules, and a codec that is not blockwise added by one registration.

The toy codec here is ``negate``: the body is ``-x`` as float32, four bytes per element.
tests/loopback/test_codec_registry.py sends a blockwise toy codec through real QUIC.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from wanswarm.kernels import ops, registry
from wanswarm.kernels.errors import RegistrationError, UnsupportedInput
from wanswarm.kernels.registry import Codec, Layout
from wanswarm.transport.codecs import CodecSpec, EncodedTensor, decode, encode, parse_codec
from wanswarm.transport.errors import CodecError

NEGATE_ID = 201


def _negate_quantize(
    x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return -x.to(torch.float32), x.new_empty(0, dtype=scale_dtype)


def _negate_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, numel: int, out_dtype: torch.dtype
) -> torch.Tensor:
    return (-codes).to(out_dtype)


def _negate(name: str = "negate", codec_id: int = NEGATE_ID, **layout: object) -> Codec:
    fields: dict[str, object] = {"blockwise": False, "code_bits": 32, "code_dtype": torch.float32}
    fields.update(layout)
    return Codec(
        name=name,
        codec_id=codec_id,
        layout=Layout(**fields),  # type: ignore[arg-type]
        quantize=_negate_quantize,
        dequantize=_negate_dequantize,
    )


@pytest.fixture
def negate_codec() -> Iterator[Codec]:
    with registry.registered(_negate()) as codec:
        yield codec


def test_builtin_codecs_and_their_header_ids() -> None:
    ids = {c.name: c.codec_id for c in registry.codecs()}
    assert ids == {"none": 0, "bf16": 1, "int8": 2, "fp8": 3, "int4": 4}  # docs/codecs.md
    assert registry.codec_names() == ("none", "bf16", "int8", "fp8", "int4")
    stochastic = [c.name for c in registry.codecs() if c.layout.stochastic]
    assert stochastic == ["int8", "int4"]


def test_a_codec_that_is_not_blockwise(negate_codec: Codec) -> None:
    spec = parse_codec("negate")
    assert spec == CodecSpec.from_wire("negate") and spec.to_wire() == "negate"
    assert not spec.quantizing and spec.codec is negate_codec
    x = torch.tensor([[1.5, -2.0], [0.0, 3.25]], dtype=torch.bfloat16)
    e = encode(x, spec)
    assert e.payload[:8] == bytes([1, NEGATE_ID, 0, 0, 3, 0, 0, 0])
    assert torch.frombuffer(bytearray(e.payload[8:]), dtype=torch.float32).tolist() == [
        -1.5,
        2.0,
        -0.0,
        -3.25,
    ]
    assert len(e.payload) == spec.payload_nbytes(4, torch.bfloat16) == 8 + 16
    y = decode(e)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x)
    with pytest.raises(CodecError, match="takes no block size"):
        parse_codec("negate:b16")
    for bad in ("negate/b64/f32", "negate/sr"):
        with pytest.raises(CodecError):
            CodecSpec.from_wire(bad)
    with pytest.raises(CodecError):
        decode(EncodedTensor(e.spec, e.shape, e.dtype, e.payload[:-4]))


def test_registry_refuses_duplicate_names_and_ids(negate_codec: Codec) -> None:
    with pytest.raises(RegistrationError, match="already registered"):
        registry.register_codec(_negate())
    with pytest.raises(RegistrationError, match="already registered"):
        registry.register_codec(_negate("int8", 202))
    with pytest.raises(RegistrationError, match="taken by 'negate'"):
        registry.register_codec(_negate("negate2", NEGATE_ID))
    with pytest.raises(RegistrationError, match="taken by 'int8'"):
        registry.register_codec(_negate("negate2", 2))
    assert registry.codec_names().count("negate") == 1
    assert "negate2" not in registry.codec_names()


@pytest.mark.parametrize(
    "name", ["Negate", "neg-sr", "neg:b16", "a/b", "", "x" * 17, "1bit", "raw"]
)
def test_registry_refuses_bad_names(name: str) -> None:
    with pytest.raises(RegistrationError):
        _negate(name)


@pytest.mark.parametrize("codec_id", [-1, 256, True, 1.5])
def test_registry_refuses_bad_ids(codec_id: object) -> None:
    with pytest.raises(RegistrationError):
        _negate("negate", codec_id)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"blockwise": True, "code_bits": None},  # raw bytes have no blocks
        {"blockwise": False, "code_bits": None, "code_dtype": torch.float32},
        {"blockwise": True, "code_bits": 3, "qmax": 1.0},  # not a divisor of a byte
        {"blockwise": True, "code_bits": 0, "qmax": 1.0},
        {"blockwise": False, "code_bits": 4, "code_dtype": torch.int16},  # packed in bytes
        {"blockwise": False, "code_bits": 8, "code_dtype": torch.float16},  # 8 != 16 bits
        {"blockwise": True, "code_bits": 16, "code_dtype": torch.float16, "qmax": 1.0},
        {"blockwise": True, "code_bits": 8},  # no qmax
        {"blockwise": True, "code_bits": 8, "qmax": math.inf},
        {"blockwise": True, "code_bits": 8, "qmax": -1.0},
        {"blockwise": True, "code_bits": 8, "qmax": 1.0, "float_only": False},
        {"blockwise": False, "code_bits": 8, "stochastic": True},  # needs scales
        {"blockwise": False, "code_bits": 8, "qmax": 1.0},
        {"blockwise": False, "code_bits": 8, "code_dtype": torch.bool},
        {"blockwise": False, "code_bits": 8, "code_dtype": "uint8"},
    ],
)
def test_registry_refuses_bad_layouts(kwargs: dict[str, object]) -> None:
    with pytest.raises(RegistrationError):
        Layout(**kwargs)  # type: ignore[arg-type]


def test_builtins_stay_and_unregistered_codecs_are_gone() -> None:
    with pytest.raises(RegistrationError, match="built-in"):
        registry.unregister_codec("int8")
    with pytest.raises(RegistrationError, match="not registered"):
        registry.unregister_codec("negate")
    with registry.registered(_negate()):
        spec = parse_codec("negate")
    assert "negate" not in registry.codec_names()
    with pytest.raises(CodecError, match="unknown codec"):
        CodecSpec.from_wire("negate")
    with pytest.raises(CodecError, match="unknown codec"):
        spec.payload_nbytes(10, torch.float32)
    with pytest.raises(UnsupportedInput, match="known codecs: none, bf16, int8, fp8, int4"):
        ops.quantize(torch.zeros(4), "negate", 64)


def test_codec_functions_that_break_their_layout_are_caught() -> None:
    def short(
        x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = _negate_quantize(x, block_size, scale_dtype, seed=seed)
        return codes[:-1], scales

    layout = Layout(blockwise=False, code_bits=32, code_dtype=torch.float32)
    bad = Codec("short", NEGATE_ID, layout, short, _negate_dequantize)
    with registry.registered(bad), pytest.raises(CodecError, match="layout says"):
        encode(torch.ones(8), parse_codec("short"))


def test_parse_codec_of_an_unknown_name_lists_the_known_codecs(negate_codec: Codec) -> None:
    with pytest.raises(CodecError) as info:
        parse_codec("lz4")
    message = str(info.value)
    assert "unknown codec 'lz4'" in message
    assert "known codecs: none, bf16, int8, fp8, int4, negate" in message
    with pytest.raises(CodecError, match="known codecs: none, bf16, int8, fp8, int4, negate"):
        CodecSpec("lz4")
    with pytest.raises(CodecError, match="unknown codec identifier 'lz4'"):
        CodecSpec.from_wire("lz4")
