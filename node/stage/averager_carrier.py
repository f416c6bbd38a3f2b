"""A hivemind ``DecentralizedAverager`` on the node's DHT that shares a state of ours.

DiLoCo's outer rounds (diloco.py) and gossip rounds (gossip_optimizer.py) both run over an
averager of their own: matchmaking forms the round's group, a newcomer downloads the state
the averager shares (``load_state_from_peers``), and the state comes from a callable of the
optimizer (read on hivemind's thread). :class:`AveragerCarrier` starts it and holds what the
two carriers share; each adds its round (a gather, or an all-reduce of parameters).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from ..logs import get_logger
from .averaging import AveragingConfig, AveragingError

log = get_logger(__name__)

SharedState = Callable[[], tuple[Any, list[torch.Tensor]]]


@cache
def shared_state_averager_class() -> type:
    """hivemind's DecentralizedAverager whose shared state is ``state()``, a keyword argument."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import CompressionInfo

    class SharedStateAverager(DecentralizedAverager):
        def __init__(self, *args: Any, state: SharedState, **kwargs: Any) -> None:
            self._shared_state = state
            # the group size the next round's matchmaking closes at (``group_target``);
            # shared with the averager's process, which forks in super().__init__
            self._group_target = mp.Value(ctypes.c_int, kwargs.get("target_group_size") or 0)
            super().__init__(*args, **kwargs)

        @property
        def group_target(self) -> int:
            return int(self._group_target.value)

        @group_target.setter
        def group_target(self, size: int) -> None:
            self._group_target.value = size

        async def _step(self, **kwargs: Any) -> Any:
            # hivemind reads Matchmaking.target_group_size only where a leader decides
            # whether its group is full (a join, and refusing one). Its GroupKeyManager
            # keeps the constructor's size: it samples buckets for a group as large as any
            # other leader's target.
            target = self.group_target  # read once: the device thread may set it meanwhile
            if target >= 2:
                self._matchmaking.target_group_size = target
            return await super()._step(**kwargs)

        async def add_p2p_handlers(self, *args: Any, **kwargs: Any) -> Any:
            # Runs in the averager's process, just after hivemind registered its command
            # pipe with uvloop's add_reader, which makes the pipe non-blocking. A command
            # longer than the pipe's buffer (a step whose gathered payload is hundreds of
            # KiB) then reads half, raises EAGAIN, and the next read unpickles garbage: the
            # averager's thread dies (seen in real daemons). A blocking pipe reads whole
            # messages; readiness still comes from the reader.
            os.set_blocking(self._inner_pipe.fileno(), True)
            return await super().add_p2p_handlers(*args, **kwargs)

        def get_current_state(self) -> tuple[Any, list[torch.Tensor], list[Any]]:
            meta, tensors = self._shared_state()
            return meta, tensors, [CompressionInfo.from_tensor(t, key=i)
                                   for i, t in enumerate(tensors)]

    return SharedStateAverager


class AveragerCarrier:
    """An averager started on ``host``'s DHT (``host.hivemind_averager(factory, **options)``),
    uncompressed, in groups of 2 to ``group_size``; ``what`` names its rounds in logs.

    ``others`` counts the replicas of the stage this node knows of besides itself: a round
    then closes its group as soon as all of them joined (at most ``group_size``) rather than
    waiting out ``matchmaking_time`` for members that do not exist. Without it (or when
    it counts more than joined) matchmaking waits, as hivemind does."""

    def __init__(
        self, host: Any, prefix: str, averaged_tensors: list[torch.Tensor], state: SharedState,
        config: AveragingConfig, *, group_size: int, round_timeout: float, what: str,
        others: Callable[[], int] | None = None,
    ) -> None:
        from hivemind.compression import NoCompression

        self.what = what
        self.group_size = group_size
        self._others = others
        sigint = signal.getsignal(signal.SIGINT)
        try:
            self._averager = host.hivemind_averager(
                shared_state_averager_class(),
                averaged_tensors=averaged_tensors,
                prefix=prefix,
                start=True,
                state=state,
                min_group_size=2,
                target_group_size=group_size,
                min_matchmaking_time=config.matchmaking_time,
                request_timeout=config.matchmaking_time / 2,
                allreduce_timeout=round_timeout,
                next_chunk_timeout=config.next_chunk_timeout,
                compression=NoCompression(),
                state_compression=NoCompression(),
                shutdown_timeout=config.shutdown_timeout,
            )
        except (ValueError, RuntimeError, OSError, TimeoutError) as exc:
            raise AveragingError(f"cannot start the {what} averager {prefix}: {exc}") from exc
        finally:
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)

    def set_priority(self, value: float) -> None:
        self._averager.state_sharing_priority = value

    def size_next_round(self) -> int:
        """Sets, and returns, the size at which the next round's group is full: every replica
        known (``others() + 1``), between 2 and ``group_size``. A replica not yet known when
        a round starts joins the next one (a late joiner finds the group full)."""
        size = self.group_size
        if self._others is not None:
            size = max(2, min(size, 1 + self._others()))
        self._averager.group_target = size
        return size

    def newer_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """The state another member shares (metadata, tensors), or None (logged)."""
        try:
            found = self._averager.load_state_from_peers(timeout=timeout)
        except Exception as exc:  # a donor's failure is hivemind's to report; we try later
            log.info("downloading the %s state failed: %r", self.what, exc)
            return None
        if not found or not isinstance(found[0], dict):
            return None
        return found[0], list(found[1])

    def shutdown(self) -> None:
        try:
            self._averager.shutdown()
        except (RuntimeError, OSError, TimeoutError, ValueError) as exc:
            log.warning("%s averager shutdown failed: %s", self.what, exc)
