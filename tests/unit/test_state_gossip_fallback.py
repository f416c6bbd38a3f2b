"""StageStateSharing.load when the donors disagree (state.py): an optimizer whose replicas
hold the same state (all-reduce, DiLoCo) refuses the download, asks again
``open_refusals`` times and then leaves it to the optimizer's last resort
(``load_state_from_one``), never to hivemind's averagers' download (which would trust a
single donor at once); a gossip optimizer, whose replicas differ between rounds by design,
asks one of the stage's gossip averagers at once. No sockets: the download is replaced by
one that finds no quorum."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any

import pytest
import torch
from wanswarm.node.stage import state as state_module
from wanswarm.node.stage.state import StageStateSharing
from wanswarm.node.stage.state_plan import StateTransferConfig, UntrustedStateError
from wanswarm.transport.endpoint import PeerAddress


class _Optimizer:
    def __init__(self, differ: bool) -> None:
        if differ:
            self.replicas_differ = True
        self.asked = 0
        self.last_resort = 0

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        return 0, {"model.w": torch.zeros(4)}, {}

    def load_state_from_peers(self) -> bool:
        self.asked += 1
        return True

    def load_state_from_one(self) -> bool:
        self.last_resort += 1
        return False


class _Endpoint:
    def register(self, *args: Any, **kwargs: Any) -> None:
        return None


@pytest.mark.parametrize("differ", [False, True])
def test_donors_that_disagree_send_only_a_gossip_replica_to_the_averagers(
    differ: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []

    async def no_quorum(*args: Any, **kwargs: Any) -> Any:
        calls.append(asyncio.get_running_loop().time())
        raise UntrustedStateError("no state is held by a quorum (2 of 2 reachable donors)")

    monkeypatch.setattr(state_module, "download_state", no_quorum)
    optimizer = _Optimizer(differ)
    donors = [PeerAddress(peer_id=f"peer{i}", host="127.0.0.1", port=4000 + i) for i in range(2)]
    config = StateTransferConfig(open_refusals=2, snapshot_reuse_s=0.05, preparing_retry_s=0.05)
    waits: list[Any] = []
    with ThreadPoolExecutor(1) as executor:
        sharing = StageStateSharing(
            _Endpoint(), 1, optimizer, executor, config,  # type: ignore[arg-type]
            donors=lambda: donors, serving=lambda: True,
        )

        async def load() -> bool:
            task = asyncio.ensure_future(sharing.load())
            while not task.done():
                waits.append(sharing.waiting)
                await asyncio.sleep(0.01)
            return await task

        loaded = asyncio.run(load())
    if differ:  # at once, to the gossip averagers
        assert loaded and optimizer.asked == 1 and len(calls) == 1
        assert optimizer.last_resort == 0 and not sharing.opened_by_last_resort
        return
    # asked three times, snapshot_reuse_s + preparing_retry_s apart, then the last resort
    assert len(calls) == 3 and all(b - a >= 0.09 for a, b in pairwise(calls))
    assert not loaded and optimizer.asked == 0 and optimizer.last_resort == 1
    assert sharing.opened_by_last_resort and sharing.waiting is None
    seen = [w for w in waits if w]
    assert {(w["refusals"], w["of"]) for w in seen} == {(1, 2), (2, 2)}
    assert all("quorum" in w["reason"] for w in seen)
