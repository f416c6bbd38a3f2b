"""Trustworthy state: what a hostile donor or a poisoned checkpoint can no longer do.

One test (or a few) per rule of docs/hostile.md, "State": manifests checked against the
stage's own layout before anything is allocated; hyperparameters always the run spec's;
epochs bounded; a quorum of donors must agree; non-finite checkpoints neither written nor
read, absurd epochs not preferred; a donor's work bounded; a failed open forgets stage.json.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save
from wanswarm.node.config.runspec import BatchSpec, ModelSpec, OptimizerSpec, RunSpec, StagesSpec
from wanswarm.node.config.sections import RebalanceConfig
from wanswarm.node.stage import placement
from wanswarm.node.stage.averaging import AveragingConfig
from wanswarm.node.stage.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_name,
    latest,
    list_checkpoints,
    write_checkpoint,
)
from wanswarm.node.stage.checkpointer import Checkpointer, plausible_epoch, resume_source
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.stage.placement import (
    STAGE_CLAIM_FILE,
    forget_stage_claim,
    read_stage_claim,
    write_stage_claim,
)
from wanswarm.node.stage.server_config import StageServerConfig
from wanswarm.node.stage.state_donor import StateDonor
from wanswarm.node.stage.state_plan import (
    MAX_EPOCH,
    MIN_CHUNK_BYTES,
    PLANS_PER_SNAPSHOT,
    ChunkRequest,
    Manifest,
    ManifestRequest,
    Snapshot,
    StateErrorCode,
    StateTransferConfig,
    TensorEntry,
    byte_view,
    choose_quorum,
    choose_stand_in,
    chunk_digests,
    group_manifests,
    is_chunk_size,
    layout_mismatch,
    manifest_kind,
    plan_chunks,
    quorum_size,
    state_layout,
)
from wanswarm.node.stage.state_tensors import check_counters, checked_epoch
from wanswarm.node.training.model import build_stage
from wanswarm.transport.endpoint import PeerAddress, Request
from wanswarm.transport.errors import RemoteError

SPEC = RunSpec(
    name="hostile",
    seed=3,
    model=ModelSpec(d_model=16, n_heads=2, n_layers=2, seq_len=8),
    stages=StagesSpec(blocks_per_stage=(1, 1)),
    batch=BatchSpec(micro_batch_size=2, target_batch_size=2),
    optimizer=OptimizerSpec(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=20),
)
RUN = SPEC.run_id
STAGE = 1


def _trained(epochs: int) -> LocalOptimizer:
    gen = torch.Generator().manual_seed(0)
    module = build_stage(SPEC, STAGE)
    opt = LocalOptimizer(module, SPEC)
    while opt.local_epoch < epochs:
        x = torch.randn(2, SPEC.model.seq_len, SPEC.model.d_model, generator=gen)
        targets = torch.randint(0, 256, (2, SPEC.model.seq_len), generator=gen)
        module.forward_loss(x, targets).backward()  # type: ignore[operator]
        opt.step(2)
    return opt


def _manifest(state: dict[str, torch.Tensor], epoch: int = 3, snapshot_id: int = 1) -> Manifest:
    views = [byte_view(t.contiguous()) for t in state.values()]
    chunks = plan_chunks([t.nbytes for t in state.values()], MIN_CHUNK_BYTES)
    return Manifest(
        epoch=epoch, snapshot_id=snapshot_id, chunk_bytes=MIN_CHUNK_BYTES,
        total_bytes=sum(t.nbytes for t in state.values()),
        tensors=tuple(
            TensorEntry(name=k, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape),
                        nbytes=t.nbytes)
            for k, t in state.items()
        ),
        digests=tuple(chunk_digests(views, chunks)), meta={},
    )


STATE = {"w": torch.ones(100, 10), "b": torch.zeros(10, dtype=torch.bfloat16)}


# ---- 1. the manifest must be this stage's layout, checked before allocation ---------------


def test_a_manifest_fitting_the_stage_passes_and_others_are_refused_with_reasons() -> None:
    expected = state_layout(STATE)
    assert layout_mismatch(_manifest(STATE), expected) is None
    wrong_shape = {"w": torch.ones(10, 100), "b": STATE["b"]}
    assert "mismatched w" in str(layout_mismatch(_manifest(wrong_shape), expected))
    wrong_dtype = {"w": torch.ones(100, 10, dtype=torch.float16), "b": STATE["b"]}
    assert "want float32" in str(layout_mismatch(_manifest(wrong_dtype), expected))
    extra = {**STATE, "evil": torch.zeros(1)}
    assert "unexpected evil" in str(layout_mismatch(_manifest(extra), expected))
    assert "missing b" in str(layout_mismatch(_manifest({"w": STATE["w"]}), expected))


def test_a_60_gib_tensor_is_refused_from_the_manifest_alone() -> None:
    """The manifest is JSON: a hostile donor names a 60 GiB tensor without sending it. The
    check reads only the manifest (a real allocation of it would fail this test's machine)."""
    n = 60 * (1 << 30) // 4
    digests = ["0" * 64] * -(-n * 4 // (64 << 20))
    huge = Manifest(
        epoch=1, snapshot_id=1, chunk_bytes=64 << 20, total_bytes=n * 4,
        tensors=(TensorEntry(name="w", dtype="float32", shape=(n,), nbytes=n * 4),),
        digests=tuple(digests), meta={},
    )
    reason = layout_mismatch(huge, {"w": ("float32", (1000,))})
    assert reason is not None and "mismatched w float32[16106127360]" in reason


# ---- 2. hyperparameters always from the run spec ------------------------------------------


def test_hostile_hyperparameters_are_ignored_and_the_lr_follows_the_spec_schedule() -> None:
    donor = _trained(epochs=3)
    epoch, tensors, meta = donor.export_state()
    hostile = json.loads(json.dumps(meta))
    for group in hostile["param_groups"]:
        group.update(lr=1e6, betas=[0.0, 0.0], maximize=True, weight_decay=5.0, eps=1.0)
    fresh = LocalOptimizer(build_stage(SPEC, STAGE), SPEC)
    spec_groups = [{k: v for k, v in g.items() if k != "params"} for g in fresh._opt.param_groups]
    fresh.import_state(epoch, tensors, hostile)
    for group, spec_group in zip(fresh._opt.param_groups, spec_groups, strict=True):
        assert group["maximize"] is False and group["betas"] == spec_group["betas"]
        assert group["weight_decay"] == spec_group["weight_decay"]
        assert group["eps"] == spec_group["eps"]
        assert group["lr"] == group["initial_lr"] * SPEC.optimizer.lr_multiplier(epoch)
    # and exactly the lr the donor had stepped to
    assert fresh._schedule.get_last_lr() == donor._schedule.get_last_lr()


# ---- 3. epochs bounded ----------------------------------------------------------------------


def test_absurd_epochs_are_refused_everywhere() -> None:
    assert checked_epoch(MAX_EPOCH) == MAX_EPOCH
    for bad in (MAX_EPOCH + 1, 2**63 - 1, -1, True, 1.0):
        with pytest.raises(CheckpointError):
            checked_epoch(bad)
    raw = json.loads(_manifest(STATE).model_dump_json())
    with pytest.raises(ValidationError):
        Manifest.model_validate({**raw, "epoch": 2**63 - 1})
    with pytest.raises(ValidationError):
        ChunkRequest(epoch=MAX_EPOCH + 1, snapshot_id=1, chunk_bytes=MIN_CHUNK_BYTES, index=0)
    opt = LocalOptimizer(build_stage(SPEC, STAGE), SPEC)
    epoch, tensors, meta = opt.export_state()
    with pytest.raises(CheckpointError, match="epoch"):
        opt.import_state(2**63 - 1, tensors, meta)
    assert opt.local_epoch == 0


def test_step_counters_must_be_whole_numbers_no_larger_than_the_epoch() -> None:
    ok = {"opt.state.0.step": torch.tensor(3.0), "model.w": torch.tensor([1e30])}
    check_counters(3, ok)
    for value in (4.0, -1.0, 2.5, float("nan")):
        with pytest.raises(CheckpointError, match="step counter"):
            check_counters(3, {"opt.state.0.step": torch.tensor(value)})


def test_an_absurd_epoch_from_a_minority_is_not_chosen() -> None:
    d = [PeerAddress(f"peer{i}", "127.0.0.1", 1000 + i) for i in range(3)]
    same = _manifest(STATE, epoch=50)
    forged = _manifest(STATE, epoch=MAX_EPOCH)
    decision = choose_quorum(group_manifests([(d[0], forged), (d[1], same), (d[2], same)]))
    assert decision.group is not None and decision.group.manifest.epoch == 50
    assert decision.median_epoch == 50 and len(decision.outvoted) == 1


# ---- 4. a quorum of donors must agree -------------------------------------------------------


def test_quorum_size_is_a_strict_majority_and_at_least_two_of_two() -> None:
    assert [quorum_size(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


def test_a_single_donor_wins_only_when_it_is_the_only_one() -> None:
    d = [PeerAddress(f"peer{i}", "127.0.0.1", 1000 + i) for i in range(4)]
    honest = _manifest(STATE, epoch=5)
    forged = _manifest({"w": torch.full((100, 10), 9.0), "b": STATE["b"]}, epoch=7)
    alone = choose_quorum(group_manifests([(d[0], forged)]))
    assert alone.group is not None and alone.group.manifest.epoch == 7
    # two reachable, disagreeing: neither is used (both digests in the reason)
    split = choose_quorum(group_manifests([(d[0], forged), (d[1], honest)]))
    assert split.group is None and split.needed == 2
    assert forged.content_key()[:16] in split.reason and honest.content_key()[:16] in split.reason
    # the newest epoch no longer wins: 2 of 3 agree on epoch 5
    two = choose_quorum(group_manifests([(d[0], forged), (d[1], honest), (d[2], honest)]))
    assert two.group is not None and two.group.manifest.epoch == 5
    assert [g.members[0][0] for g in two.outvoted] == [d[0]]
    # 2 of 4 is not a majority
    four = choose_quorum(
        group_manifests([(d[0], forged), (d[3], forged), (d[1], honest), (d[2], honest)])
    )
    assert four.group is None and four.needed == 3


def test_a_stand_in_is_the_lower_median_epochs_state_most_donors_hold() -> None:
    """choose_stand_in, where no quorum agrees (a backstop after refusals in a row)."""
    d = [PeerAddress(f"peer{i}", "127.0.0.1", 1000 + i) for i in range(5)]

    def at(epoch: int, value: float) -> Manifest:
        return _manifest({"w": torch.full((100, 10), value), "b": STATE["b"]}, epoch=epoch)

    def stand_in(*pairs: tuple[PeerAddress, Manifest]) -> Manifest | None:
        group = choose_stand_in(choose_quorum(group_manifests(pairs)))
        return None if group is None else group.manifest

    # two apart: the lower median is the lower epoch, whoever claims more
    assert stand_in((d[0], at(9, 9.0)), (d[1], at(6, 1.0))) == at(6, 1.0)
    # a liar far ahead among replicas that drifted apart at one epoch: never the liar; of
    # the two at the median, the one more donors hold
    drifted = stand_in((d[0], at(99, 9.0)), (d[1], at(6, 1.0)), (d[2], at(6, 2.0)),
                       (d[3], at(6, 2.0)), (d[4], at(5, 3.0)))
    assert drifted == at(6, 2.0)
    # equal counts at the median: the lowest content digest, the same choice everywhere
    a, b = at(6, 1.0), at(6, 2.0)
    tie = stand_in((d[0], a), (d[1], b))
    assert tie == min((a, b), key=Manifest.content_key)
    assert stand_in((d[1], b), (d[0], a)) == tie
    # a quorum holds one: no stand-in (the quorum's is used); nobody answered: none
    assert choose_stand_in(choose_quorum(group_manifests([(d[0], a), (d[1], a)]))) is None
    assert choose_stand_in(choose_quorum([])) is None


# ---- 5. checkpoints: non-finite refused, absurd epochs not preferred -------------------------


def test_a_non_finite_state_is_not_written(tmp_path: Path) -> None:
    opt = _trained(epochs=1)
    epoch, tensors, meta = opt.export_state()
    name = next(n for n in tensors if n.startswith("model."))
    bad = {**tensors, name: tensors[name].clone()}
    bad[name].view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError, match="non-finite"):
        write_checkpoint(tmp_path, RUN, STAGE, epoch, bad, meta, keep=2)
    with pytest.raises(CheckpointError, match="epoch"):
        write_checkpoint(tmp_path, RUN, STAGE, MAX_EPOCH + 1, tensors, meta, keep=2)
    assert list_checkpoints(tmp_path, RUN, STAGE) == []
    writer = Checkpointer(tmp_path, RUN, STAGE, period_s=0, keep=2)
    try:
        writer.submit(0.0, epoch, bad, meta).result(timeout=30)
        assert writer.failures == 1 and writer.written == 0
    finally:
        writer.close()


def _forge(tmp_path: Path, opt: LocalOptimizer, epoch: int, poison: bool) -> None:
    """A checkpoint on disk at ``epoch`` (as a hostile install or a bad disk would leave it),
    written by hand past write_checkpoint's own checks."""
    _, tensors, meta = opt.export_state()
    if poison:
        name = next(n for n in tensors if n.startswith("model."))
        tensors[name].view(-1)[0] = float("inf")
    good = write_checkpoint(tmp_path, RUN, STAGE, 1, opt.export_state()[1], meta, keep=10)
    target = tmp_path / CHECKPOINTS_DIR / checkpoint_name(RUN, STAGE, epoch)
    target.mkdir()
    data = save(tensors)
    manifest = json.loads((good / MANIFEST_FILE).read_text())
    manifest.update(epoch=epoch, state_sha256=hashlib.sha256(data).hexdigest(),
                    state_bytes=len(data))
    (target / "state.safetensors").write_bytes(data)
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_non_finite_checkpoint_is_not_loaded_and_an_older_one_is(tmp_path: Path) -> None:
    opt = _trained(epochs=1)
    _forge(tmp_path, opt, epoch=2, poison=True)
    found = latest(tmp_path, RUN, STAGE)
    assert found is not None and found.epoch == 1


def test_an_absurd_checkpoint_epoch_does_not_win_the_restart(tmp_path: Path) -> None:
    opt = _trained(epochs=1)
    _forge(tmp_path, opt, epoch=10**6, poison=False)
    assert [e for e, _ in list_checkpoints(tmp_path, RUN, STAGE)] == [10**6, 1]
    assert plausible_epoch(True, 1, 16) == 17 and plausible_epoch(False, 0, 16) == MAX_EPOCH
    assert resume_source(True, 1, 10**6, 16) == "peers"
    assert resume_source(True, 1, 17, 16) == "checkpoint"
    # peers answered at epoch 0: the forged 10^6 is passed over, the epoch-1 one wins
    reader = Checkpointer(tmp_path, RUN, STAGE, period_s=0, keep=10, max_epoch_lead=16)
    fresh = LocalOptimizer(build_stage(SPEC, STAGE), SPEC)
    try:
        assert reader.resume(fresh.import_state, peers_answered=True, peer_epoch=0) == (
            "checkpoint"
        )
        assert fresh.local_epoch == 1
    finally:
        reader.close()
    # with no peer to compare with, only MAX_EPOCH bounds it; a 19-digit epoch does not even
    # name a checkpoint
    (tmp_path / CHECKPOINTS_DIR / checkpoint_name(RUN, STAGE, 2**63 - 1)).mkdir()
    found = latest(tmp_path, RUN, STAGE)
    assert found is not None and found.epoch == 10**6
    assert latest(tmp_path, RUN, STAGE, max_epoch=17) is not None


# ---- 6. donor work bounded -------------------------------------------------------------------


class _Registry:
    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def register(self, kind: str, handler: Any) -> None:
        self.handlers[kind] = handler


def test_chunk_sizes_are_a_fixed_set_of_powers_of_two() -> None:
    sizes = [n for n in range(MIN_CHUNK_BYTES, (64 << 20) + 1, 4096) if is_chunk_size(n)]
    assert len(sizes) == 15
    with pytest.raises(ValidationError):
        ManifestRequest(chunk_bytes=3 * MIN_CHUNK_BYTES)
    with pytest.raises(ValidationError):
        StateTransferConfig(chunk_bytes=3 << 20)


def test_a_donor_hashes_a_snapshot_for_a_bounded_number_of_chunk_sizes() -> None:
    registry, hashed = _Registry(), []
    snap = Snapshot(1, {"w": torch.ones(1 << 16)}, {})

    async def take() -> Snapshot:
        return snap

    donor = StateDonor(registry, take, kind_prefix="state.s1",  # type: ignore[arg-type]
                       rng=random.Random(1))
    plan = donor._plan

    def counting_plan(retained: Any, chunk_bytes: int) -> Any:
        hashed.append(chunk_bytes)
        return plan(retained, chunk_bytes)

    donor._plan = counting_plan  # type: ignore[method-assign]

    async def ask(chunk_bytes: int, peer: str = "p") -> Any:
        req = Request(peer, manifest_kind("state.s1"), {"v": 1, "chunk_bytes": chunk_bytes}, [])
        return await registry.handlers[manifest_kind("state.s1")](req)

    async def main() -> None:
        sizes = [MIN_CHUNK_BYTES << i for i in range(PLANS_PER_SNAPSHOT + 2)]
        for _ in range(3):  # cycling through sizes
            for n in sizes:
                try:
                    await ask(n)
                except RemoteError as exc:
                    assert exc.code == StateErrorCode.BUSY and n in sizes[PLANS_PER_SNAPSHOT:]
        assert hashed == sizes[:PLANS_PER_SNAPSHOT]  # each once, never again
        assert donor.counts["snapshots"] == 1

    asyncio.run(main())


def test_one_manifest_request_per_peer_at_a_time() -> None:
    registry = _Registry()
    entered, gate = asyncio.Event(), asyncio.Event()
    snap = Snapshot(1, {"w": torch.ones(10)}, {})

    async def slow() -> Snapshot:
        entered.set()
        await gate.wait()  # the snapshot under way: what a second request must not queue behind
        return snap

    StateDonor(registry, slow, kind_prefix="state.s1")  # type: ignore[arg-type]
    handler = registry.handlers[manifest_kind("state.s1")]

    def req(peer: str) -> Request:
        return Request(peer, manifest_kind("state.s1"), {"v": 1, "chunk_bytes": 4096}, [])

    async def main() -> None:
        first = asyncio.create_task(handler(req("p")))
        await asyncio.wait_for(entered.wait(), timeout=10)
        other = asyncio.create_task(handler(req("q")))  # another peer is not refused
        with pytest.raises(RemoteError) as err:
            await handler(req("p"))
        assert err.value.code == StateErrorCode.BUSY
        gate.set()
        async with asyncio.timeout(10):
            await first
            await other
        await asyncio.wait_for(handler(req("p")), timeout=10)  # served again once done

    asyncio.run(main())


# ---- stage.json: a failed open does not loop ---------------------------------------------


def test_a_forgotten_claim_makes_the_restart_choose_anew(tmp_path: Path) -> None:
    write_stage_claim(tmp_path, RUN, 1)
    assert read_stage_claim(tmp_path) is not None
    forget_stage_claim(tmp_path)
    assert not (tmp_path / STAGE_CLAIM_FILE).exists() and read_stage_claim(tmp_path) is None
    forget_stage_claim(tmp_path)  # nothing stored: nothing to do


def test_a_stage_that_fails_to_open_is_not_claimed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FailingServer:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def start(self, ctx: Any) -> None:
            raise RuntimeError("the stage crashed while opening")

    monkeypatch.setattr(placement, "StageServer", FailingServer)
    component = placement.ServerComponent(
        SPEC, SimpleNamespace(endpoint=object()), random.Random(0),  # type: ignore[arg-type]
        config=StageServerConfig(), averaging=AveragingConfig(), rebalance=RebalanceConfig(),
        pinned_stage=None, join_backoff=0.0,
    )
    write_stage_claim(tmp_path, RUN, STAGE)
    ctx = SimpleNamespace(dht=None, state_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="crashed"):
        asyncio.run(component._serve(ctx, STAGE))  # type: ignore[arg-type]
    assert read_stage_claim(tmp_path) is None  # the restart chooses anew
