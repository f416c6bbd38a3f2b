"""The run spec's [subspace] section: off by default and out of the run id, checked at load."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest
from wanswarm.node.config.runspec import RunSpec, RunSpecError, load_run_spec, parse_run_spec
from wanswarm.node.config.subspace_spec import SubspaceSpec
from wanswarm.node.training.subspace import Subspace

REPO = Path(__file__).resolve().parents[2]

WIDE = """
name = "wide"
[model]
d_model = 256
n_heads = 4
n_layers = 3
[stages]
blocks_per_stage = [1, 1, 1]
"""


def test_off_by_default_and_out_of_the_run_id() -> None:
    spec = RunSpec(name="pinned")
    assert not spec.subspace.enabled
    assert "subspace" not in json.loads(spec.canonical_json())["spec"]
    assert spec.run_id == "f862dc87ae4433db"  # test_runspec's pin: unchanged by the section
    assert Subspace.for_run(spec) is None


def test_a_subspace_changes_the_run_id() -> None:
    base = parse_run_spec(WIDE)
    on = parse_run_spec(WIDE + "[subspace]\nk = 32\n")
    scaled = parse_run_spec(WIDE + "[subspace]\nk = 32\nembedding_std = 0.25\n")
    assert len({base.run_id, on.run_id, scaled.run_id}) == 3
    assert on.subspace.k == 32 and on.subspace.widths(2) == (32, 32)
    nested = parse_run_spec(WIDE + "[subspace]\nk = [16, 32]\n")
    assert nested.subspace.k == (16, 32) and nested.subspace.widths(2) == (16, 32)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("k = 300", "subspace.k = 300 exceeds model.d_model = 256"),
        ("k = [16, 300]", "subspace.k = [16, 300] exceeds model.d_model = 256"),
        ("k = [16, 32, 64]", "subspace.k has 3 widths but the run has 2 boundaries"),
        ("k = [32, 16]", "subspace.k = [32, 16] decreases at boundary 1"),
        ("k = 0", "subspace.k = 0"),
        ("k = []", "subspace.k is an empty list"),
        ("k = 8\nembedding_std = 0.0", "embedding_std"),
        ("k = 8\nbasis = 'data'", "basis"),
    ],
)
def test_refusals_name_the_field(section: str, message: str) -> None:
    with pytest.raises(RunSpecError) as info:
        parse_run_spec(WIDE + "[subspace]\n" + section + "\n", "wide.toml")
    assert message in str(info.value)
    assert "wide.toml" in str(info.value)


def test_a_single_stage_has_no_boundary() -> None:
    text = WIDE.replace("n_layers = 3", "n_layers = 1").replace("[1, 1, 1]", "[1]")
    with pytest.raises(RunSpecError, match="single stage"):
        parse_run_spec(text + "[subspace]\nk = 8\n")


def test_a_pretrained_model_is_refused() -> None:
    text = """
name = "hf"
[model]
architecture = "llama"
d_model = 64
n_heads = 4
n_layers = 2
pretrained = "some/checkpoint"
pretrained_fingerprint = "2f-10b-0123456789abcdef"
[stages]
blocks_per_stage = [1, 1]
[subspace]
k = 8
"""
    with pytest.raises(RunSpecError, match="subspace.k is set with model.pretrained"):
        parse_run_spec(text)


def test_section_is_frozen_and_strict() -> None:
    spec = SubspaceSpec(k=8)
    with pytest.raises(pydantic.ValidationError):
        spec.k = 4
    with pytest.raises(pydantic.ValidationError):
        SubspaceSpec.model_validate({"k": 8, "free_layers": 2})
    with pytest.raises(ValueError, match="unset"):
        SubspaceSpec().widths(2)


def test_shipped_subspace_run_spec() -> None:
    spec = load_run_spec(REPO / "configs" / "runs" / "tiny_subspace.toml")
    tiny = load_run_spec(REPO / "configs" / "runs" / "tiny.toml")
    subspace = Subspace.for_run(spec)
    assert subspace is not None and subspace.n_boundaries == spec.n_stages - 1
    assert spec.model == tiny.model and spec.stages == tiny.stages
