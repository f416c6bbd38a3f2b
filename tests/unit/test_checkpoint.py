"""Checkpoints: round trip, atomic writes, damaged or foreign files skipped, pruning, fit checks.

The state comes from a real LocalOptimizer trained a few epochs on a two-stage toy run, so
the optimizer naming and metadata are the real ones; a restored optimizer must continue
training bit for bit like the original.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wanswarm.node.config.runspec import BatchSpec, ModelSpec, OptimizerSpec, RunSpec, StagesSpec
from wanswarm.node.errors import NodeError
from wanswarm.node.stage.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_name,
    latest,
    list_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from wanswarm.node.stage.checkpointer import Checkpointer, CheckpointSchedule, resume_source
from wanswarm.node.stage.optimizer import LocalOptimizer
from wanswarm.node.training.model import build_stage

SPEC = RunSpec(
    name="ckpttest",
    model=ModelSpec(d_model=16, n_heads=2, n_layers=2, seq_len=8),
    stages=StagesSpec(blocks_per_stage=(1, 1)),
    batch=BatchSpec(micro_batch_size=2, target_batch_size=4),
    optimizer=OptimizerSpec(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=20),
)
RUN = SPEC.run_id
STAGE = 1
B, T, C = SPEC.batch.micro_batch_size, SPEC.model.seq_len, SPEC.model.d_model


def _train(module: torch.nn.Module, opt: LocalOptimizer, gen: torch.Generator, epochs: int) -> None:
    target = opt.local_epoch + epochs
    while opt.local_epoch < target:
        x = torch.randn(B, T, C, generator=gen)
        targets = torch.randint(0, 256, (B, T), generator=gen)
        module.forward_loss(x, targets).backward()  # type: ignore[operator]
        opt.step(B)


@functools.cache
def _exported(epochs: int) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
    module = build_stage(SPEC, STAGE)
    opt = LocalOptimizer(module, SPEC)
    _train(module, opt, torch.Generator().manual_seed(0), epochs)
    return opt.export_state()


def _trained(epochs: int) -> tuple[torch.nn.Module, LocalOptimizer]:
    """A stage and optimizer after ``epochs`` epochs of training (trained once per count, then
    installed by import_state, which the round-trip test checks against real training)."""
    module = build_stage(SPEC, STAGE)
    opt = LocalOptimizer(module, SPEC)
    epoch, tensors, meta = _exported(epochs)
    opt.import_state(epoch, tensors, meta)
    return module, opt


def _write(
    state_dir: Path, opt: LocalOptimizer, keep: int = 2, stage: int = STAGE, run: str = RUN
) -> Path:
    epoch, tensors, meta = opt.export_state()
    return write_checkpoint(state_dir, run, stage, epoch, tensors, meta, keep=keep, now=1.7e9)


def _assert_same_state(a: LocalOptimizer, b: LocalOptimizer) -> None:
    ea, ta, ma = a.export_state()
    eb, tb, mb = b.export_state()
    assert ea == eb and ma == mb and ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def test_round_trip_restores_a_state_that_trains_on_identically(tmp_path: Path) -> None:
    module = build_stage(SPEC, STAGE)
    opt = LocalOptimizer(module, SPEC)
    _train(module, opt, torch.Generator().manual_seed(0), 2)
    path = _write(tmp_path, opt)
    assert path == tmp_path / CHECKPOINTS_DIR / checkpoint_name(RUN, STAGE, 2)
    assert (path / STATE_FILE).stat().st_mode & 0o777 == 0o600
    found = latest(tmp_path, RUN, STAGE)
    assert found is not None and found.epoch == 2 and found.manifest.created == 1.7e9
    n_params = len(list(module.parameters()))
    expected = {f"model.{n}" for n in module.state_dict()} | {
        f"opt.state.{i}.{key}" for i in range(n_params) for key in ("step", "exp_avg", "exp_avg_sq")
    }
    assert set(found.tensors) == expected

    fresh_module = build_stage(SPEC, STAGE)
    fresh = LocalOptimizer(fresh_module, SPEC)
    fresh.import_state(found.epoch, found.tensors, found.optimizer_meta)
    _assert_same_state(opt, fresh)
    assert fresh._schedule.get_last_lr() == opt._schedule.get_last_lr()
    assert fresh._schedule.last_epoch == opt._schedule.last_epoch == 2
    assert isinstance(fresh._opt.param_groups[0]["betas"], tuple)

    # the same micro-batches from here on give the same parameters, bit for bit (lr schedule,
    # Adam's bias correction from the step counts and the moments all came back)
    _train(module, opt, torch.Generator().manual_seed(7), 2)
    _train(fresh_module, fresh, torch.Generator().manual_seed(7), 2)
    for p, q in zip(module.parameters(), fresh_module.parameters(), strict=True):
        assert torch.equal(p, q)


def test_import_clears_gradients_accumulated_toward_the_old_epoch() -> None:
    module = build_stage(SPEC, STAGE)
    opt = LocalOptimizer(module, SPEC)
    gen = torch.Generator().manual_seed(3)
    module.forward_loss(
        torch.randn(B, T, C, generator=gen), torch.randint(0, 256, (B, T), generator=gen)
    ).backward()  # type: ignore[operator]
    opt.step(B)  # half an epoch accumulated
    assert opt.samples_accumulated == B
    opt.import_state(*_exported(1))
    assert opt.samples_accumulated == 0 and opt.local_epoch == 1
    # the next epoch sees only its own micro-batches: as a replica that never accumulated
    ref_module, ref = _trained(epochs=1)
    _train(module, opt, torch.Generator().manual_seed(9), 1)
    _train(ref_module, ref, torch.Generator().manual_seed(9), 1)
    _assert_same_state(ref, opt)


def test_a_crash_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    _, opt = _trained(epochs=2)
    _write(tmp_path, opt)
    root = tmp_path / CHECKPOINTS_DIR
    good = (root / checkpoint_name(RUN, STAGE, 2) / STATE_FILE).read_bytes()
    # a writer killed before its rename: a hidden temp dir with a truncated tensor file
    partial = root / f".tmp-{checkpoint_name(RUN, STAGE, 3)}-dead"
    partial.mkdir()
    (partial / STATE_FILE).write_bytes(good[: len(good) // 3])
    # and a checkpoint-named dir whose tensor file is truncated (a disk that lied about fsync)
    torn = root / checkpoint_name(RUN, STAGE, 4)
    torn.mkdir()
    (torn / STATE_FILE).write_bytes(good[: len(good) // 2])
    (torn / MANIFEST_FILE).write_text(
        (root / checkpoint_name(RUN, STAGE, 2) / MANIFEST_FILE)
        .read_text()
        .replace('"epoch": 2', '"epoch": 4')
    )
    found = latest(tmp_path, RUN, STAGE)
    assert found is not None and found.epoch == 2

    _, newer = _trained(epochs=2)
    newer.import_state(5, *_exported(2)[1:])  # stands for the state three epochs later
    _write(tmp_path, newer, keep=2)
    assert not partial.exists()  # leftovers of interrupted writes of this stage are cleaned up
    assert [e for e, _ in list_checkpoints(tmp_path, RUN, STAGE)] == [5, 4]
    assert not any(p.name.startswith((".tmp-", ".old-")) for p in root.iterdir())


def test_a_checkpoint_whose_hash_does_not_match_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, opt = _trained(epochs=1)
    _write(tmp_path, opt, keep=5)
    _train(opt._module, opt, torch.Generator().manual_seed(1), 1)
    newest = _write(tmp_path, opt, keep=5)
    data = bytearray((newest / STATE_FILE).read_bytes())
    data[-1] ^= 0x01  # same size, one bit off in the last tensor's data
    (newest / STATE_FILE).write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="wanswarm.node.stage.checkpoint"):
        found = latest(tmp_path, RUN, STAGE)
    assert found is not None and found.epoch == 1
    assert "SHA-256" in caplog.text
    with pytest.raises(CheckpointError, match="SHA-256"):
        read_checkpoint(newest, RUN, STAGE)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda m: {**m, "run_id": "someotherrun"}, "holds run"),
        (lambda m: {**m, "stage": 0}, "holds run"),
        (lambda m: {**m, "epoch": 9}, "manifest says epoch"),
        (lambda m: {**m, "version": 2}, "newer than this release"),
        (lambda m: {**m, "surprise": 1}, "invalid manifest"),
        (lambda m: {**m, "state_bytes": m["state_bytes"] + 1}, "the manifest says"),
        (lambda m: {**m, "tensors": m["tensors"] + 1}, "the manifest says"),
        (lambda m: [m], "invalid manifest"),
    ],
)
def test_foreign_or_inconsistent_manifests_are_refused(
    tmp_path: Path, edit: Any, reason: str
) -> None:
    _, opt = _trained(epochs=1)
    path = _write(tmp_path, opt)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    (path / MANIFEST_FILE).write_text(json.dumps(edit(manifest)))
    with pytest.raises(CheckpointError, match=reason):
        read_checkpoint(path, RUN, STAGE)
    assert latest(tmp_path, RUN, STAGE) is None


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(manifest=st.binary(max_size=300), state=st.binary(max_size=300))
def test_random_bytes_never_crash_the_reader(tmp_path: Path, manifest: bytes, state: bytes) -> None:
    path = tmp_path / CHECKPOINTS_DIR / checkpoint_name(RUN, STAGE, 1)
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST_FILE).write_bytes(manifest)
    (path / STATE_FILE).write_bytes(state)
    assert latest(tmp_path, RUN, STAGE) is None


def test_a_deeply_nested_manifest_is_refused_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINTS_DIR / checkpoint_name(RUN, STAGE, 1)
    path.mkdir(parents=True)
    (path / MANIFEST_FILE).write_text("[" * 200_000)
    with pytest.raises(CheckpointError, match="not JSON"):
        read_checkpoint(path, RUN, STAGE)
    assert latest(tmp_path, RUN, STAGE) is None


def test_random_tensor_bytes_under_a_valid_manifest_are_refused(tmp_path: Path) -> None:
    _, opt = _trained(epochs=1)
    path = _write(tmp_path, opt)
    size = (path / STATE_FILE).stat().st_size
    gen = torch.Generator().manual_seed(5)
    junk = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    (path / STATE_FILE).write_bytes(junk)
    with pytest.raises(CheckpointError):
        read_checkpoint(path, RUN, STAGE)


def test_keep_prunes_older_checkpoints_of_this_stage_only(tmp_path: Path) -> None:
    module, opt = _trained(epochs=1)
    other_stage = _write(tmp_path, opt, stage=0)
    other_run = _write(tmp_path, opt, run="anotherrun")
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        _write(tmp_path, opt, keep=2)
        _train(module, opt, gen, 1)
    assert [e for e, _ in list_checkpoints(tmp_path, RUN, STAGE)] == [4, 3]
    assert other_stage.exists() and other_run.exists()


def test_rewriting_an_epoch_keeps_identical_bytes_and_replaces_different_ones(
    tmp_path: Path,
) -> None:
    _, opt = _trained(epochs=1)
    path = _write(tmp_path, opt)
    inode = (path / STATE_FILE).stat().st_ino
    assert _write(tmp_path, opt) == path and (path / STATE_FILE).stat().st_ino == inode
    epoch, tensors, meta = opt.export_state()
    name = next(n for n in tensors if n.startswith("model."))
    tensors[name] = tensors[name] + 1.0  # e.g. state loaded from peers at the same epoch
    write_checkpoint(tmp_path, RUN, STAGE, epoch, tensors, meta, keep=2)
    found = latest(tmp_path, RUN, STAGE)
    assert found is not None and torch.equal(found.tensors[name], tensors[name])
    assert [p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()] == [path.name]


def test_a_checkpoint_of_another_shape_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    _, opt = _trained(epochs=2)
    epoch, tensors, meta = opt.export_state()
    name = next(n for n in tensors if n.startswith("model.") and tensors[n].dim() == 2)
    cases: list[tuple[dict[str, torch.Tensor], dict[str, Any], str]] = [
        ({**tensors, name: tensors[name][:, :-1].contiguous()}, meta, "mismatched"),
        ({**tensors, name: tensors[name].double()}, meta, "mismatched"),
        ({k: v for k, v in tensors.items() if k != name}, meta, "missing"),
        ({**tensors, "model.extra.weight": torch.zeros(2)}, meta, "unexpected"),
        (tensors, {"param_groups": meta["param_groups"][:1]}, "param_groups"),
        (
            tensors,
            {"param_groups": [dict(g, lr=float("nan")) for g in meta["param_groups"]]},
            "finite",
        ),
        (tensors, {"param_groups": [dict(g, betas=[0.9]) for g in meta["param_groups"]]}, "items"),
        (tensors, {"param_groups": [dict(g, amsgrad=1) for g in meta["param_groups"]]}, "amsgrad"),
        (tensors, {}, "param_groups"),
    ]
    target_module = build_stage(SPEC, STAGE)
    target = LocalOptimizer(target_module, SPEC)
    before = target.export_state()
    for bad_tensors, bad_meta, match in cases:
        with pytest.raises(CheckpointError, match=match):
            target.import_state(epoch, bad_tensors, bad_meta)
    with pytest.raises(CheckpointError, match="epoch"):
        target.import_state(-1, tensors, meta)
    after = target.export_state()
    assert before[0] == after[0] and before[2] == after[2]
    for key in before[1]:
        assert torch.equal(before[1][key], after[1][key])
    assert issubclass(CheckpointError, NodeError)


def test_write_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="run id"):
        write_checkpoint(tmp_path, "../escape", STAGE, 1, {}, {}, keep=1)
    with pytest.raises(CheckpointError, match="keep"):
        write_checkpoint(tmp_path, RUN, STAGE, 1, {}, {}, keep=0)
    with pytest.raises(CheckpointError, match="JSON"):
        write_checkpoint(tmp_path, RUN, STAGE, 1, {"a": torch.zeros(1)}, {"x": object()}, keep=1)
    assert list_checkpoints(tmp_path, RUN, STAGE) == []
    assert not (tmp_path / CHECKPOINTS_DIR).exists() or not os.listdir(tmp_path / CHECKPOINTS_DIR)


def test_resume_source_prefers_the_newer_state() -> None:
    assert resume_source(False, 0, None) == "fresh"
    assert resume_source(True, 5, None) == "peers"
    assert resume_source(False, 0, 0) == "checkpoint"  # nobody answered: ours, even at epoch 0
    assert resume_source(True, 5, 6) == "checkpoint"
    assert resume_source(True, 5, 5) == "peers"  # a tie goes to the live collaboration
    assert resume_source(True, 5, 4) == "peers"


def test_schedule_waits_for_the_period_and_a_new_epoch() -> None:
    schedule = CheckpointSchedule(period_s=10.0)
    schedule.mark(100.0, 3)
    assert not schedule.due(105.0, 4)  # too soon
    assert not schedule.due(111.0, 3)  # nothing new
    assert schedule.due(110.0, 4)
    assert not CheckpointSchedule(period_s=0.0).due(1e9, 1)  # disabled


def test_checkpointer_writes_in_the_background_and_resumes(tmp_path: Path) -> None:
    _, opt = _trained(epochs=2)
    writer = Checkpointer(tmp_path, RUN, STAGE, period_s=1.0, keep=2)
    assert writer.due(0.0, 2)
    epoch, tensors, meta = opt.export_state()
    writer.submit(0.0, epoch, tensors, meta).result(timeout=30)
    assert writer.status() == {
        "checkpoint_epoch": 2,
        "checkpoints_written": 1,
        "checkpoint_failures": 0,
    }
    assert not writer.due(0.5, 3)
    writer.close()

    reader = Checkpointer(tmp_path, RUN, STAGE, period_s=1.0, keep=2)
    module = build_stage(SPEC, STAGE)
    fresh = LocalOptimizer(module, SPEC)
    assert reader.resume(fresh.import_state, peers_answered=True, peer_epoch=2) == "peers"
    assert fresh.local_epoch == 0
    assert reader.resume(fresh.import_state, peers_answered=True, peer_epoch=1) == "checkpoint"
    assert fresh.local_epoch == 2 and reader.epoch == 2
    _assert_same_state(opt, fresh)

    def refuse(epoch: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        raise CheckpointError("does not fit")

    assert reader.resume(refuse, peers_answered=False, peer_epoch=0) == "fresh"
    reader.close()
