"""StageStateSharing.load when the donors disagree (state.py): an optimizer whose replicas
hold the same state (all-reduce, DiLoCo) refuses the download and does not ask hivemind's
averagers, which would trust a single donor; a gossip optimizer, whose replicas differ
between rounds by design, asks one of the stage's gossip averagers instead. No sockets:
the download is replaced by one that finds no quorum."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
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

    def export_state(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        return 0, {"model.w": torch.zeros(4)}, {}

    def load_state_from_peers(self) -> bool:
        self.asked += 1
        return True


class _Endpoint:
    def register(self, *args: Any, **kwargs: Any) -> None:
        return None


@pytest.mark.parametrize("differ", [False, True])
def test_donors_that_disagree_send_only_a_gossip_replica_to_the_averagers(
    differ: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_quorum(*args: Any, **kwargs: Any) -> Any:
        raise UntrustedStateError("no state is held by a quorum (2 of 2 reachable donors)")

    monkeypatch.setattr(state_module, "download_state", no_quorum)
    optimizer = _Optimizer(differ)
    donors = [PeerAddress(peer_id=f"peer{i}", host="127.0.0.1", port=4000 + i) for i in range(2)]
    with ThreadPoolExecutor(1) as executor:
        sharing = StageStateSharing(
            _Endpoint(), 1, optimizer, executor, StateTransferConfig(),  # type: ignore[arg-type]
            donors=lambda: donors, serving=lambda: True,
        )
        loaded = asyncio.run(sharing.load())
    assert loaded is differ and optimizer.asked == int(differ)
