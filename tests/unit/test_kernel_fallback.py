"""Triton that cannot run falls back to the reference on the same device, logged once.

The Triton launchers are made to fail on purpose (as a missing C compiler or an old GPU
makes them fail at their first launch); kernels run on CPU tensors under
TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch
from wanswarm.kernels import ops, quant_triton, registry
from wanswarm.kernels import reference as R
from wanswarm.kernels.errors import NonFiniteInput
from wanswarm.kernels.registry import Codec, Layout, TritonKernels
from wanswarm.transport.codecs import CodecSpec, decode, encode
from wanswarm.transport.errors import PayloadError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.fixture(autouse=True)
def _fresh_failures() -> Iterator[None]:
    ops.reset_triton_failures()
    yield
    ops.reset_triton_failures()


class _Broken(RuntimeError):
    """What a launch raises where Triton cannot build its kernels."""


def _break(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def quantize(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("quantize")
        raise _Broken("failed to compile the launcher: gcc: not found")

    def dequantize(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("dequantize")
        raise _Broken("failed to compile the launcher: gcc: not found")

    monkeypatch.setattr(quant_triton, "quantize", quantize)
    monkeypatch.setattr(quant_triton, "dequantize", dequantize)
    return calls


def _x(n: int = 1000, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)


@pytest.mark.parametrize("fmt", R.FORMATS)
def test_failing_triton_gives_the_reference_result(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fmt: R.Format
) -> None:
    calls = _break(monkeypatch)
    x = _x()
    with caplog.at_level(logging.WARNING, logger="wanswarm.kernels.ops"):
        with ops.use_impl("triton"):
            codes, scales = ops.quantize(x, fmt, 64)
            out = ops.dequantize(codes, scales, fmt, 64, x.numel(), torch.bfloat16)
    c_ref, s_ref = R.quantize(x, fmt, 64)
    assert torch.equal(codes, c_ref) and torch.equal(scales, s_ref)
    d_ref = R.dequantize(c_ref, s_ref, fmt, 64, x.numel(), torch.bfloat16)
    assert torch.equal(out.view(torch.int16), d_ref.view(torch.int16))
    assert calls == ["quantize", "dequantize"]  # forced: Triton was tried each time
    warnings = [r for r in caplog.records if "Triton kernels failed" in r.getMessage()]
    assert len(warnings) == 1, "logged once per device"
    assert "gcc: not found" in warnings[0].getMessage()
    assert "cpu" in ops.triton_failures()


def test_failure_writes_the_reference_into_the_output_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _break(monkeypatch)
    x = _x(300, torch.float32)
    codes_out = torch.empty(300, dtype=torch.int8)
    scales_out = torch.empty(R.num_blocks(300, 32), dtype=torch.float16)
    with ops.use_impl("triton"):
        codes, scales = ops.quantize(
            x, "int8", 32, torch.float16, codes_out=codes_out, scales_out=scales_out
        )
    assert codes is codes_out and scales is scales_out
    c_ref, s_ref = R.quantize(x, "int8", 32, torch.float16)
    assert torch.equal(codes_out, c_ref) and torch.equal(scales_out, s_ref)


def test_kernel_errors_are_answers_not_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x(200, torch.float32)
    x[17] = float("nan")
    with ops.use_impl("triton"), pytest.raises(NonFiniteInput):
        ops.quantize(x, "int8", 64)
    assert ops.triton_failures() == {}  # NaN input is no reason to stop using Triton


def test_codecs_encode_and_decode_through_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport's encode/decode keep working, and give the reference's bytes."""
    _break(monkeypatch)
    x = _x(4160).view(64, 65)
    spec = CodecSpec("int4", block_size=32)
    with ops.use_impl("triton"):
        broken = encode(x, spec, dtype=torch.float32)
        back = decode(broken)
    with ops.use_impl("reference"):
        expected = encode(x, spec, dtype=torch.float32)
    assert broken.payload == expected.payload
    assert back.dtype == torch.float32 and back.shape == (64, 65)
    bad = bytearray(expected.payload)
    bad[8:12] = torch.tensor([float("nan")]).view(torch.uint8).numpy().tobytes()
    with ops.use_impl("triton"), pytest.raises(PayloadError):
        decode(type(expected)(spec, expected.shape, expected.dtype, bytes(bad)))


def test_automatic_choice_skips_a_device_where_triton_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the first failure on a device, automatic dispatch goes to the reference there
    without trying Triton again (CUDA tensors are chosen automatically; a CPU tensor is
    made to look chosen by forcing the resolution)."""
    calls = _break(monkeypatch)
    monkeypatch.setattr(ops, "resolve_impl", lambda t, impl=None, codec=None: "triton")
    x = _x(500, torch.float32)
    ops.quantize(x, "fp8", 64)
    ops.quantize(x, "fp8", 64)
    ops.quantize(x, "int8", 64)
    assert calls == ["quantize"]


def test_a_registered_codec_with_broken_kernels_falls_back() -> None:
    def ref_q(
        x: torch.Tensor, block_size: int, scale_dtype: torch.dtype, *, seed: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return R.quantize(x, "int8", block_size, scale_dtype)

    def ref_d(
        codes: torch.Tensor, scales: torch.Tensor, bs: int, n: int, out: torch.dtype
    ) -> torch.Tensor:
        return R.dequantize(codes, scales, "int8", bs, n, out)

    def bad_q(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise OSError("libcuda.so.1: cannot open shared object file")

    def bad_d(*args: object, **kwargs: object) -> torch.Tensor:
        raise OSError("libcuda.so.1: cannot open shared object file")

    layout = Layout(blockwise=True, code_bits=8, code_dtype=torch.int8, qmax=127.0)
    codec = Codec("brokenint8", 201, layout, ref_q, ref_d, TritonKernels(bad_q, bad_d))
    with registry.registered(codec), ops.use_impl("triton"):
        x = _x(256, torch.float32)
        codes, scales = ops.quantize(x, "brokenint8", 64)
        out = ops.dequantize(codes, scales, "brokenint8", 64, 256)
    assert torch.equal(out, R.dequantize(*R.quantize(x, "int8", 64), "int8", 64, 256))
    assert "libcuda" in ops.triton_failures()["cpu"]
