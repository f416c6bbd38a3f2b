"""Payload bytes between a device and the host: pinned buffers and a copy stream per GPU.

On CUDA a payload is encoded into device memory and must reach the host (to be sent),
and a received payload must reach the device (to be decoded there). Both copies go
through page-locked (pinned) host memory, which the GPU's copy engines read and write
directly, and run on a stream of their own per device, ordered against the compute
stream by events only: the compute stream is never made to wait for a copy it does not
need, and a copy waits only for the kernels that produced its source.

Everything here is a plain ``Tensor.cpu()`` / ``Tensor.to(device)`` on other devices.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_streams: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of a CUDA device (created on first use, then shared)."""
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: in pinned memory, copied on the device's copy stream (CUDA)."""
    if t.device.type != "cuda":
        return t.cpu()
    stream = copy_stream(t.device)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    produced = torch.cuda.current_stream(t.device).record_event()
    with torch.cuda.stream(stream):
        stream.wait_event(produced)  # the kernels that wrote ``t``, nothing else
        host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator keeps ``t`` until the copy is done
        done = stream.record_event()
    done.synchronize()
    return host


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: staged through pinned memory and the copy stream (CUDA).

    The result is ready for the current stream of ``device``: it waits on the copy's
    event before any kernel it runs later reads the result. The host does not wait for
    the copy (no synchronization), unless ``t`` is itself pinned: then it is the caller's
    buffer, which it may write again as soon as this returns.
    """
    if device.type != "cuda":
        return t.to(device)
    device = torch.device("cuda", device.index if device.index is not None else 0)
    own = not t.is_pinned()
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if own else t
    if own:
        pinned.copy_(t)
    stream = copy_stream(device)
    with torch.cuda.stream(stream):
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        # a non-blocking copy from a block of torch's pinned-memory allocator records an
        # event on this stream there; the allocator reuses the block only once it has
        # passed, so our staging buffer may be dropped while the copy is still running
        out.copy_(pinned, non_blocking=True)
        done = stream.record_event()
    current = torch.cuda.current_stream(device)
    current.wait_event(done)
    out.record_stream(current)
    if not own:
        done.synchronize()
    return out
