"""Payload bytes between a device and the host: pinned buffers and a copy stream per GPU.

On CUDA a payload is encoded into device memory and must reach the host (to be sent),
and a received payload must reach the device (to be decoded there). Both copies go
through page-locked (pinned) host memory, which the GPU's copy engines read and write
directly, and run on streams of their own, ordered against the compute stream by events
only: the compute stream is never made to wait for a copy it does not need, and a copy
waits only for the kernels that produced its source.

Each device has one copy stream per direction. A GPU has a copy engine for each, and a
stage's next input (host to device) must not queue behind its last output (device to
host), which waits for that output's kernels: with one stream the next micro-batch's
compute would wait for the last one's reply to reach the host.

A device-to-host copy can be left under way (:func:`start_to_host`): the device thread
that launched it goes on to the next job while another thread waits for the copy.

Everything here is a plain ``Tensor.cpu()`` / ``Tensor.to(device)`` on other devices.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_lock = threading.Lock()
_streams: dict[tuple[torch.device, bool], torch.cuda.Stream] = {}


def copy_stream(device: torch.device, *, to_host: bool) -> torch.cuda.Stream:
    """The copy stream of a CUDA device for one direction (created on first use, then
    shared)."""
    key = (device, to_host)
    with _lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device=device)
        return stream


@dataclass(frozen=True)
class HostCopy:
    """A tensor on its way to the host: ``host`` holds it once ``wait`` returns."""

    host: torch.Tensor
    done: torch.cuda.Event | None  # None: already there (no device, or nothing to copy)

    @property
    def pending(self) -> bool:
        """Whether ``wait`` may block (a device copy was launched)."""
        return self.done is not None

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy is done (blocks the calling thread only)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host


def start_to_host(t: torch.Tensor) -> HostCopy:
    """Launch the copy of ``t`` to the host, without waiting for it: into pinned memory on
    the device's device-to-host copy stream (CUDA), after the kernels that wrote ``t``.
    Elsewhere the copy is made here."""
    if t.device.type != "cuda":
        return HostCopy(t.cpu(), None)
    stream = copy_stream(t.device, to_host=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    produced = torch.cuda.current_stream(t.device).record_event()
    with torch.cuda.stream(stream):
        stream.wait_event(produced)  # the kernels that wrote ``t``, nothing else
        host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator keeps ``t`` until the copy is done
        done = stream.record_event()
    return HostCopy(host, done)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: in pinned memory, copied on the device's copy stream (CUDA)."""
    return start_to_host(t).wait()


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
    stream = copy_stream(device, to_host=False)
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
