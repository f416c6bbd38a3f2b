"""StageStateSharing.load when the donors disagree (state.py): an optimizer whose replicas
hold the same state (all-reduce, DiLoCo) refuses the download, asks again
``open_refusals`` times, then asks for a stand-in (``choose_stand_in``, checked like a
quorum's state) and never goes to hivemind's averagers' download (which would trust a
single donor, unchecked); without even a stand-in it opens with its own state. A gossip
optimizer, whose replicas differ between rounds by design, asks one of the stage's gossip
averagers at once. No sockets: the download is replaced by one that finds no quorum."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any

import pytest
import torch
from wanswarm.node.stage import state as state_module
from wanswarm.node.stage.state import StageStateSharing
from wanswarm.node.stage.state_plan import Snapshot, StateTransferConfig, UntrustedStateError
from wanswarm.transport.endpoint import PeerAddress


class _Optimizer:
    def __init__(self, differ: bool) -> None:
        if differ:
            self.replicas_differ = True
        self.asked = 0
        self.installed: list[int] = []

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        return 0, {"model.w": torch.zeros(4)}, {}

    def import_state(self, epoch: int, tensors: dict[str, torch.Tensor], meta: Any) -> None:
        self.installed.append(epoch)

    def load_state_from_peers(self) -> bool:
        self.asked += 1
        return True


class _Endpoint:
    def register(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Report:
    stand_in: str | None = None


def _no_quorum(calls: list[tuple[float, bool]], stand_in_found: bool) -> type:
    class Download:
        """A StateDownload whose donors never agree; a stand-in, if found, at epoch 4."""

        def __init__(self, *args: Any, stand_in: bool = False, **kwargs: Any) -> None:
            self.stand_in = stand_in
            self.report = _Report()

        async def run(self) -> Snapshot:
            calls.append((asyncio.get_running_loop().time(), self.stand_in))
            if self.stand_in and stand_in_found:
                self.report.stand_in = "epoch 4 digest ab from 1 donor(s) [peer0]"
                return Snapshot(4, {"model.w": torch.ones(4)}, {})
            raise UntrustedStateError("no state is held by a quorum (2 of 2 reachable donors)")

    return Download


@pytest.mark.parametrize(("differ", "stand_in_found"),
                         [(True, False), (False, True), (False, False)])
def test_donors_that_disagree_send_only_a_gossip_replica_to_the_averagers(
    differ: bool, stand_in_found: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[float, bool]] = []
    monkeypatch.setattr(state_module, "StateDownload", _no_quorum(calls, stand_in_found))
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
        assert loaded and optimizer.asked == 1 and calls[0][1] is False and len(calls) == 1
        assert optimizer.installed == [] and sharing.stand_in is None
        return
    # asked three times, snapshot_reuse_s + preparing_retry_s apart, then for a stand-in
    assert [stand_in for _, stand_in in calls] == [False, False, False, True]
    assert all(b - a >= 0.09 for (a, _), (b, _) in pairwise(calls[:3]))
    assert optimizer.asked == 0  # never hivemind's download
    assert loaded is stand_in_found and optimizer.installed == ([4] if stand_in_found else [])
    assert (sharing.stand_in is not None) is stand_in_found and sharing.waiting is None
    seen = [w for w in waits if w]
    assert {(w["refusals"], w["of"]) for w in seen} == {(1, 2), (2, 2)}
    assert all("quorum" in w["reason"] for w in seen)
