"""Run spec: parsing, validation messages, run id, mismatch description, schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pydantic
import pytest
from wanswarm.node.config.runspec import (
    RunSpec,
    RunSpecError,
    default_run_spec,
    describe_mismatch,
    differing_fields,
    load_run_spec,
    parse_run_spec,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_RUNS = sorted((REPO / "configs" / "runs").glob("*.toml"))


def test_embedded_default_is_configs_tiny() -> None:
    embedded = (REPO / "node" / "runs" / "tiny.toml").read_bytes()
    assert embedded == (REPO / "configs" / "runs" / "tiny.toml").read_bytes()
    assert default_run_spec() == load_run_spec(REPO / "configs" / "runs" / "tiny.toml")
    assert default_run_spec().name == "tiny"
    assert default_run_spec().n_stages == 3


@pytest.mark.parametrize("path", CONFIG_RUNS, ids=[p.name for p in CONFIG_RUNS])
def test_every_config_run_parses(path: Path) -> None:
    spec = load_run_spec(path)
    assert sum(spec.stages.blocks_per_stage) == spec.model.n_layers
    assert spec.name == path.stem


def test_configs_have_two_runs() -> None:
    assert {p.stem for p in CONFIG_RUNS} >= {"tiny", "small"}


def test_run_id_is_stable_and_pinned() -> None:
    spec = RunSpec(name="pinned")
    assert spec.run_id == RunSpec(name="pinned").run_id
    assert len(spec.run_id) == 16 and int(spec.run_id, 16) >= 0
    # Pinned: a change here means peers built from older code would refuse this spec.
    assert spec.run_id == "f862dc87ae4433db"


def test_run_id_changes_with_any_field() -> None:
    base = RunSpec(name="a")
    variants = [
        RunSpec(name="b"),
        RunSpec(name="a", seed=1),
        RunSpec.model_validate({"name": "a", "optimizer": {"lr": 2e-3}}),
        RunSpec.model_validate({"name": "a", "codecs": {"forward_activations": "bf16"}}),
        RunSpec.model_validate({"name": "a", "data": {"validation_windows": 65}}),
    ]
    ids = {base.run_id} | {v.run_id for v in variants}
    assert len(ids) == len(variants) + 1


def test_describe_mismatch_names_fields() -> None:
    a = RunSpec(name="a")
    b = RunSpec.model_validate({"name": "a", "optimizer": {"lr": 0.002}, "model": {"d_model": 256}})
    assert differing_fields(a, b) == ["model.d_model", "optimizer.lr"]
    text = describe_mismatch(a, b)
    assert "model.d_model: ours=128 theirs=256" in text
    assert "optimizer.lr: ours=0.001 theirs=0.002" in text
    assert a.run_id in text and b.run_id in text
    assert describe_mismatch(a, RunSpec(name="a")) == ""


def test_frozen() -> None:
    spec = RunSpec(name="a")
    with pytest.raises(pydantic.ValidationError):
        spec.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('name = "x"\n[stages]\nblocks_per_stage = [2, 2]\n', "sums to 4 but model.n_layers = 6"),
        ('name = "x"\n[model]\nd_model = 130\n', "multiple of n_heads"),
        ('name = "x"\n[model]\ndropout = 0.1\n', "dropout = 0.0"),
        ('name = "x.y"\n', "name:"),
        ('name = "x"\nbogus = 1\n', "bogus"),
        ('name = "x"\n[model]\nwidth = 1\n', "model.width"),
        ('name = "x"\n[batch]\nmicro_batch_size = 8\ntarget_batch_size = 60\n', "multiple of"),
        ('name = "x"\n[optimizer]\nwarmup_steps = 50\ndecay_steps = 50\n', "raise decay_steps"),
        ('name = "x"\n[optimizer]\nbetas = [0.9, 1.0]\n', "betas[1]"),
        ('name = "x"\n[codecs]\nforward_activations = ""\n', "codecs.forward_activations"),
        ('name = "x"\n[codecs]\nbackward_gradients = "int 8"\n', "whitespace"),
        ('name = "x"\n[codecs]\nbackward_gradients = "int7"\n', "unknown codec 'int7'"),
        ('name = "x"\n[data]\ncorpus = ["stdlib", "a.txt"]\n', "only corpus entry"),
        ('name = "x"\n[data]\ncorpus = []\n', "data.corpus"),
        ('name = "x"\n[stages]\nblocks_per_stage = [3, 0, 3]\n', "stage 1 has 0 blocks"),
        ("[model]\nd_model = 64\n", "name: Field required"),
    ],
)
def test_errors_name_the_field(toml: str, needle: str) -> None:
    with pytest.raises(RunSpecError) as info:
        parse_run_spec(toml, "test.toml")
    assert needle in str(info.value)
    assert "test.toml" in str(info.value)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(RunSpecError, match="cannot read run spec"):
        load_run_spec(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(RunSpecError, match="not valid TOML"):
        load_run_spec(bad)


def test_lr_schedule() -> None:
    opt = RunSpec.model_validate(
        {"name": "a", "optimizer": {"warmup_steps": 4, "decay_steps": 14, "min_lr_ratio": 0.1}}
    ).optimizer
    assert [opt.lr_multiplier(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert opt.lr_multiplier(4) == 1.0
    assert math.isclose(opt.lr_multiplier(9), 0.55)  # half way down the cosine
    assert math.isclose(opt.lr_multiplier(14), 0.1)
    assert math.isclose(opt.lr_multiplier(1000), 0.1)
    const = RunSpec.model_validate(
        {"name": "a", "optimizer": {"warmup_steps": 0, "schedule": "constant"}}
    ).optimizer
    assert const.lr_multiplier(0) == const.lr_multiplier(10**6) == 1.0
    assert opt.adamw_kwargs() == {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps}


def test_every_field_is_described() -> None:
    def walk(model: type[pydantic.BaseModel]) -> None:
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
                walk(annotation)

    walk(RunSpec)
