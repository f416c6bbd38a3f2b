"""What a replica sends of its pseudo-gradient: compression with error feedback (pure).

DiLoCo and gossip rounds (outer.py) average each replica's pseudo-gradient, the change of
its parameters since the last outer step. A :class:`PseudoGradientCodec` says what the
others receive of a tensor and how many bytes that costs; an :class:`ErrorFeedback`
carries, per parameter, the part of the pseudo-gradient that earlier rounds failed to
send and adds it to the next one (Seide et al. 2014, 1-bit SGD; Karimireddy et al. 2019,
EF-SignSGD)::

    target = delta + residual
    sent   = decode(encode(target))
    residual' = target - sent

so that over T rounds the sum of what was sent equals the sum of the pseudo-gradients up to
one residual. The codecs:

``none``   float32, 4 bytes a value;
``int8``   blockwise symmetric int8 with an fp32 scale per ``block_size`` values
           (transport/codecs.py's ``int8`` codec, byte for byte what it puts on the wire);
``int4``   the same with 4-bit codes (transport/codecs.py's ``int4``);
``sign``   1 bit a value and one fp16 scale per block, the block's mean absolute value
           (scaled sign, as 1-bit Adam and EF-SignSGD);
``topk``   the ``ceil(density * n)`` largest magnitudes as (int32 index, fp16 value) pairs
           (SparseLoCo's top-k, without its 2-bit values).

Every function here is deterministic: replicas that hold the same inputs compute the same
bits, which is what makes replicas equal after a round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from ..config.averaging_spec import PseudoGradientCompression
from ..errors import NodeError


class PseudoGradientError(NodeError):
    """A pseudo-gradient could not be compressed (non-finite values, unknown codec)."""


class PseudoGradientCodec:
    """Compress-and-decode of one tensor as the receivers see it, and its payload size."""

    def __init__(
        self, kind: PseudoGradientCompression, block_size: int = 64, density: float = 0.02
    ) -> None:
        if kind not in ("none", "int8", "int4", "sign", "topk"):
            raise PseudoGradientError(f"unknown pseudo-gradient compression {kind!r}")
        if block_size < 1 or not 0.0 < density <= 1.0:
            raise PseudoGradientError(f"bad block_size {block_size} or density {density}")
        self.kind = kind
        self.block_size = block_size
        self.density = density
        self._spec = None
        if kind in ("int8", "int4"):
            from ...transport import codecs

            self._spec = codecs.parse_codec(f"{kind}:b{block_size}")

    def payload_nbytes(self, numel: int) -> int:
        """Bytes a tensor of ``numel`` values costs on the wire with this codec."""
        if self.kind == "none":
            return 4 * numel
        blocks = math.ceil(numel / self.block_size)
        if self.kind == "int8":
            return 8 + numel + 4 * blocks  # header, codes, fp32 scales (docs/codecs.md)
        if self.kind == "int4":
            return 8 + math.ceil(numel / 2) + 4 * blocks
        if self.kind == "sign":
            return math.ceil(numel / 8) + 2 * blocks
        return 6 * self._k(numel)

    def _k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density * numel)))

    @torch.no_grad()
    def encode(self, t: torch.Tensor) -> bytes:
        """The payload of ``t`` (exactly :meth:`payload_nbytes` long); :meth:`decode` of it
        equals :meth:`roundtrip` of ``t`` bit for bit."""
        x = t.detach().to(torch.float32).contiguous()
        if not bool(torch.isfinite(x).all()):
            raise PseudoGradientError("pseudo-gradient holds NaN or infinity")
        if self._spec is not None:
            from ...transport import codecs

            return bytes(codecs.encode(x, self._spec).payload)  # hivemind's messages want bytes
        flat = x.reshape(-1)
        if self.kind == "none":
            return flat.numpy().tobytes()
        if self.kind == "sign":
            n, b = flat.numel(), self.block_size
            padded = torch.nn.functional.pad(flat, (0, (-n) % b)).view(-1, b)  # (blocks, b)
            valid = torch.ones_like(padded)
            valid.view(-1)[n:] = 0.0
            scale = (padded.abs().sum(dim=1) / valid.sum(dim=1)).half()  # (blocks,)
            bits = np.packbits((flat >= 0).numpy())
            return scale.numpy().tobytes() + bits.tobytes()
        index = flat.abs().topk(self._k(flat.numel()), sorted=False).indices
        index = index.sort().values.to(torch.int32)
        values = flat[index.long()].half()
        return index.numpy().tobytes() + values.numpy().tobytes()

    @torch.no_grad()
    def decode(self, payload: bytes, shape: tuple[int, ...]) -> torch.Tensor:
        """A peer's payload as float32 of ``shape``; ``PseudoGradientError`` when it is not one
        (wrong length, indices out of range, non-finite values): untrusted input."""
        n = math.prod(shape)
        if not isinstance(payload, bytes) or len(payload) != self.payload_nbytes(n):
            raise PseudoGradientError(
                f"a {self.kind} payload of {n} values is {self.payload_nbytes(n)} bytes"
            )
        if self._spec is not None:
            from ...transport import codecs
            from ...transport.errors import CodecError, PayloadError

            try:
                out = codecs.decode(codecs.EncodedTensor(
                    spec=self._spec, shape=tuple(shape), dtype=torch.float32, payload=payload
                ))
            except (CodecError, PayloadError) as exc:
                raise PseudoGradientError(f"bad {self.kind} payload: {exc}") from exc
        elif self.kind == "none":
            out = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(shape)
        elif self.kind == "sign":
            blocks = math.ceil(n / self.block_size)
            raw = np.frombuffer(payload, dtype=np.float16, count=blocks)
            scale = torch.from_numpy(raw.astype(np.float32))  # (blocks,)
            bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8, offset=2 * blocks))
            signs = torch.from_numpy(bits[:n].astype(np.float32)) * 2.0 - 1.0  # (n,)
            out = (signs * scale.repeat_interleave(self.block_size)[:n]).view(shape)
        else:
            k = self._k(n)
            index = torch.from_numpy(np.frombuffer(payload, dtype=np.int32, count=k).astype(
                np.int64))
            values = torch.from_numpy(
                np.frombuffer(payload, dtype=np.float16, offset=4 * k).astype(np.float32)
            )
            if k and (int(index.min()) < 0 or int(index.max()) >= n):
                raise PseudoGradientError("top-k index out of range")
            flat = torch.zeros(n)
            flat[index] = values
            out = flat.view(shape)
        if not bool(torch.isfinite(out).all()):
            raise PseudoGradientError(f"a {self.kind} payload decodes to NaN or infinity")
        return out

    @torch.no_grad()
    def roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        """What the receivers decode of ``t`` (float32, same shape)."""
        x = t.detach().to(torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise PseudoGradientError("pseudo-gradient holds NaN or infinity")
        if self.kind == "none":
            return x.clone()
        if self._spec is not None:
            from ...transport import codecs

            _, sent = codecs.encode_roundtrip(x.contiguous(), self._spec)
            return sent.to(torch.float32)
        flat = x.reshape(-1)
        if self.kind == "sign":
            n, b = flat.numel(), self.block_size
            padded = torch.nn.functional.pad(flat, (0, (-n) % b)).view(-1, b)  # (blocks, b)
            valid = torch.ones_like(padded)
            valid.view(-1)[n:] = 0.0
            scale = (padded.abs().sum(dim=1) / valid.sum(dim=1)).half().float()  # (blocks,)
            signs = torch.where(padded >= 0, 1.0, -1.0)
            return (signs * scale[:, None]).view(-1)[:n].view_as(x)
        k = self._k(flat.numel())
        index = flat.abs().topk(k, sorted=False).indices
        out = torch.zeros_like(flat)
        out[index] = flat[index].half().float()
        return out.view_as(x)


class ErrorFeedback:
    """Per-name residuals of one replica's pseudo-gradients, carried across rounds."""

    def __init__(self, codec: PseudoGradientCodec) -> None:
        self.codec = codec
        self.residuals: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def compress(self, name: str, delta: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(sent, nbytes)``: what the others receive of ``delta + residual[name]``; the
        residual becomes what they did not receive. A lossless codec keeps no residual."""
        target = delta.detach().to(torch.float32)
        prev = self.residuals.get(name)
        if prev is not None and prev.shape == target.shape:
            target = target + prev
        sent = self.codec.roundtrip(target)
        if self.codec.kind == "none":
            self.residuals.pop(name, None)
        else:
            self.residuals[name] = target - sent
        return sent, self.codec.payload_nbytes(target.numel())

    @torch.no_grad()
    def encode(self, name: str, delta: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """``(payload, sent)`` of ``delta + residual[name]``, the residual updated as in
        :meth:`compress`; ``sent`` is what :meth:`PseudoGradientCodec.decode` gives of it."""
        target = delta.detach().to(torch.float32)
        prev = self.residuals.get(name)
        if prev is not None and prev.shape == target.shape:
            target = target + prev
        payload = self.codec.encode(target)
        sent = self.codec.roundtrip(target)
        if self.codec.kind != "none":
            self.residuals[name] = target - sent
        return payload, sent

    def compress_all(
        self, deltas: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Every tensor of ``deltas`` through :meth:`compress`; the total payload bytes."""
        sent, total = {}, 0
        for name, delta in deltas.items():
            sent[name], nbytes = self.compress(name, delta)
            total += nbytes
        return sent, total

    def reset(self, names: Iterable[str] | None = None) -> None:
        """Forget every residual (or those of ``names``)."""
        if names is None:
            self.residuals.clear()
            return
        for name in names:
            self.residuals.pop(name, None)
