"""The Llama-style block: stage-split forward equals transformers' LlamaForCausalLM, a run
starts from a saved checkpoint (each stage reading its own tensors), and ``wanswarm export``
writes a checkpoint transformers loads back with equal logits."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from wanswarm.node.config.runspec import RunSpec, RunSpecError, parse_run_spec
from wanswarm.node.stage.checkpoint import write_checkpoint
from wanswarm.node.stage.state_tensors import module_tensors, snapshot
from wanswarm.node.tools.export import ExportError, export_run
from wanswarm.node.training.fingerprint import fingerprint_files
from wanswarm.node.training.hf_llama import (
    PretrainedError,
    checkpoint_files,
    load_stage_tensors,
    model_fields,
)
from wanswarm.node.training.model import (
    build_full_model,
    build_stage,
    count_parameters,
    expected_stage_parameters,
)

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install 'wanswarm[models]'"
)

STAGES = (1, 2, 1)


def _save_llama(path: Path, tie: bool = False, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=sum(STAGES),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=tie,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config).eval()
        model.save_pretrained(path)
    return model


def _spec_from(path: Path) -> RunSpec:
    fields = model_fields(path)
    fields.update(
        seq_len=32,
        pretrained=str(path),
        pretrained_fingerprint=str(fingerprint_files(checkpoint_files(path))),
    )
    return RunSpec.model_validate(
        {
            "name": "llama-test",
            "model": fields,
            "stages": {"blocks_per_stage": list(STAGES)},
            # the run's tokenizer file is only copied by export here: any file will do
            "data": {
                "format": "jsonl",
                "tokenizer": str(path / "config.json"),
                "tokenizer_sha256": "0" * 64,
            },
        }
    )


def _hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits  # (B, T, V)


@pytest.mark.parametrize("tie", [False, True])
def test_stage_split_forward_equals_transformers(tmp_path: Path, tie: bool) -> None:
    reference = _save_llama(tmp_path / "hf", tie=tie)
    spec = _spec_from(tmp_path / "hf")
    assert spec.model.tie_embeddings is tie and spec.model.kv_heads == 2
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))  # (B, T)
    stages = [build_stage(spec, s) for s in range(spec.n_stages)]
    for s, stage in enumerate(stages):
        assert count_parameters(stage) == expected_stage_parameters(spec, s)
    h: torch.Tensor = ids
    with torch.no_grad():
        for stage in stages:  # one stage at a time, as three servers would
            stage.check_input(h)
            h = stage(h)
    torch.testing.assert_close(h, _hf_logits(reference, ids), atol=1e-4, rtol=0)


def test_each_stage_reads_only_its_tensors(tmp_path: Path) -> None:
    _save_llama(tmp_path / "hf")
    spec = _spec_from(tmp_path / "hf")
    middle = load_stage_tensors(spec, 1)
    assert sorted({k.split(".")[1] for k in middle}) == ["0", "1"]
    assert not any(k.startswith(("tok_emb", "head", "ln_f")) for k in middle)


def test_mismatched_or_changed_checkpoint_is_refused(tmp_path: Path) -> None:
    _save_llama(tmp_path / "hf")
    spec = _spec_from(tmp_path / "hf")
    wider = spec.model_copy(update={"model": spec.model.model_copy(update={"rope_base": 1e4})})
    with pytest.raises(PretrainedError, match="rope_base"):
        build_stage(wider, 0)
    _save_llama(tmp_path / "hf", seed=1)  # same shapes, other weights
    with pytest.raises(PretrainedError, match="content"):
        build_stage(spec, 0)


def test_export_from_checkpoints_loads_in_transformers(tmp_path: Path) -> None:
    _save_llama(tmp_path / "hf")
    spec = _spec_from(tmp_path / "hf")
    # Train a little so that the export is not the checkpoint we started from.
    model = build_full_model(spec)
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.forward_loss(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
    state_dirs = []
    for s, stage in enumerate(model.stages):  # one state directory per server
        state_dir = tmp_path / f"node{s}"
        tensors = snapshot(module_tensors(stage))
        write_checkpoint(state_dir, spec.run_id, s, 7, tensors, {"param_groups": []}, keep=1)
        state_dirs.append(state_dir)
    out = tmp_path / "exported"
    summary = export_run(spec, state_dirs, out)
    assert summary["epochs"] == {"0": 7, "1": 7, "2": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ours = model(ids)  # (B, T, V)
    torch.testing.assert_close(_hf_logits(loaded, ids), ours, atol=1e-4, rtol=0)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(ExportError, match="stage 1"):
        export_run(spec, [state_dirs[0], state_dirs[2]], tmp_path / "partial")


def test_random_llama_run_and_spec_checks() -> None:
    spec = parse_run_spec(
        """
        name = "r"
        [model]
        architecture = "llama"
        d_model = 32
        n_heads = 4
        n_kv_heads = 1
        n_layers = 2
        seq_len = 16
        [stages]
        blocks_per_stage = [1, 1]
        """
    )
    stages = [build_stage(spec, s) for s in range(2)]
    assert [count_parameters(m) for m in stages] == [
        expected_stage_parameters(spec, s) for s in range(2)
    ]
    again = build_stage(spec, 1)
    for a, b in zip(stages[1].parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)  # deterministic init
    with pytest.raises(RunSpecError, match="n_kv_heads"):
        parse_run_spec('name = "r"\n[model]\nn_kv_heads = 2\n')  # gpt has no GQA
    with pytest.raises(RunSpecError, match="must divide"):
        parse_run_spec('name = "r"\n[model]\narchitecture = "llama"\nn_kv_heads = 3\n')
    with pytest.raises(RunSpecError, match="byte-level"):
        parse_run_spec('name = "r"\n[model]\nvocab_size = 1000\n')
