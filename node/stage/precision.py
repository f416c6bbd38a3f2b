"""The arithmetic a stage computes in: fp32, or bf16/fp16 autocast over fp32 master weights.

The run spec's ``[precision] compute`` names it; :func:`resolve_precision` turns it into a
:class:`ComputePrecision` for the device the stage runs on:

- ``auto``: bf16 autocast on CUDA, fp16 (with a loss scaler) on a GPU without bf16, fp32
  on the CPU (CPU bf16 matmuls are rarely faster than fp32 ones);
- ``bf16`` / ``fp16``: that autocast on every device (``bf16`` on a GPU without it becomes
  ``fp16``, logged once);
- ``fp32``: no autocast.

Parameters and optimizer state stay float32 whatever the mode (autocast casts weights per
op). Under autocast the residual stream between blocks is kept in the compute dtype (as
Megatron-LM keeps it by default), so a stage's output leaves it in bf16/fp16 and the
codecs quantize it from there, without a float32 copy. A stage's input activations and
the gradients it receives are cast to that dtype on arrival (:meth:`activation_dtype`).

fp16 has too few exponent bits for small gradients: :class:`LossScaler` multiplies the
seed of the backward pass by a dynamic scale and divides the gradients by it, inside the
stage. Gradients on the wire are never scaled, so replicas and neighbours in other modes
interoperate. A scale that overflows halves and the backward is redone (at most
:data:`MAX_RETRIES` times); a run of ``growth_interval`` clean steps doubles it
(torch.amp.GradScaler's policy, applied per micro-batch).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Literal

import torch

logger = logging.getLogger(__name__)

# torch's autograd thread for a CUDA device makes its first cuBLAS call before the thread has
# made the primary context current, warns, and makes it current itself: nothing to act on
warnings.filterwarnings(
    "ignore",
    message="Attempting to run cuBLAS, but there was no current CUDA context",
    category=UserWarning,
)

Requested = Literal["auto", "fp32", "bf16", "fp16"]
Mode = Literal["fp32", "bf16", "fp16"]

MAX_RETRIES: Final[int] = 24  # halvings from 2**16 down to below 2**-8: then give up
_DTYPES: Final[dict[str, torch.dtype]] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Dynamic loss scale (pure): ``update(found_inf)`` after every scaled backward.

    Halves on overflow, doubles after ``growth_interval`` clean backward passes in a row;
    stays within ``[min_scale, max_scale]``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-8,
        max_scale: float = 2.0**24,
    ) -> None:
        if not 0 < min_scale <= init_scale <= max_scale:
            raise ValueError("need 0 < min_scale <= init_scale <= max_scale")
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.min_scale, self.max_scale = min_scale, max_scale
        self.clean = 0  # clean backward passes since the last change
        self.overflows = 0  # total

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.overflows += 1
            self.clean = 0
            self.scale = max(self.min_scale, self.scale / 2)
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.clean = 0
            self.scale = min(self.max_scale, self.scale * 2)

    @property
    def exhausted(self) -> bool:
        """The scale is at its floor: another overflow is the gradients' own."""
        return self.scale <= self.min_scale


@dataclass
class ComputePrecision:
    """How one stage computes on one device (see the module docstring)."""

    mode: Mode
    device_type: str
    scaler: LossScaler | None = field(default=None)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: float32, bfloat16 or float16."""
        return _DTYPES.get(self.mode, torch.float32)

    @property
    def autocast_enabled(self) -> bool:
        return self.mode != "fp32"

    def activation_dtype(self) -> torch.dtype:
        """Dtype of the activations and gradients a stage computes with."""
        return self.dtype

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast to the compute dtype inside (nothing for fp32)."""
        if not self.autocast_enabled:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def describe(self) -> str:
        scaled = " with loss scaling" if self.scaler is not None else ""
        return f"{self.mode}{scaled} on {self.device_type}"


_warned: set[str] = set()


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively (every CPU torch runs; CUDA sm_80+)."""
    if device.type != "cuda":
        return True
    try:  # emulated bf16 (pre-Ampere) is slower than fp16: not "supported" here
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch before 2.5 has no including_emulation
        return torch.cuda.get_device_capability(device)[0] >= 8


def resolve_precision(requested: Requested, device: torch.device) -> ComputePrecision:
    """The precision a stage runs in on ``device`` for the run spec's ``requested`` one."""
    mode: Mode
    if requested == "auto":
        mode = "bf16" if device.type == "cuda" else "fp32"
    else:
        mode = requested
    if mode == "bf16" and not bf16_supported(device):
        if str(device) not in _warned:
            _warned.add(str(device))
            logger.warning("%s has no bf16: computing in fp16 with a loss scaler", device)
        mode = "fp16"
    scaler = LossScaler() if mode == "fp16" else None
    return ComputePrecision(mode, device.type, scaler)
