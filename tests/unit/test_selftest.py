"""``wanswarm selftest`` on the CPU: device, precision, kernels (Triton under
TRITON_INTERPRET=1, as tests/conftest.py sets it), a stage's forward/backward."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from wanswarm.kernels import ops, quant_triton
from wanswarm.node.cli import main
from wanswarm.node.config.runspec import BatchSpec, ModelSpec, RunSpec, StagesSpec
from wanswarm.node.tools import selftest

SMALL = RunSpec(
    name="selftest",
    model=ModelSpec(d_model=32, n_heads=2, n_layers=2, seq_len=16),
    stages=StagesSpec(blocks_per_stage=(1, 1)),
    batch=BatchSpec(micro_batch_size=2, target_batch_size=2),
)
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.fixture(autouse=True)
def _fresh_failures() -> None:
    ops.reset_triton_failures()


@interpreted
@pytest.mark.parametrize("compute", ["fp32", "bf16", "fp16"])
def test_passes_on_the_cpu_with_triton_compared(compute: str) -> None:
    spec = selftest.with_precision(SMALL, compute)
    result = selftest.run_checks(spec, "cpu", require_triton=True, numel=300)
    by_name = {c.name: c for c in result.checks}
    assert result.passed, result.checks
    assert by_name["precision"].detail.startswith(f"{compute}")
    for codec in ("int8", "fp8", "int4"):
        assert "bit for bit" in by_name[f"codec {codec}"].detail
    assert by_name["codec none"].verdict == "ok" and by_name["codec bf16"].verdict == "ok"
    assert "loss" in by_name["stage"].detail


@interpreted
def test_triton_failure_is_a_warning_or_with_require_triton_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("failed to compile the launcher: gcc: not found")

    monkeypatch.setattr(quant_triton, "quantize", broken)
    relaxed = selftest.check_kernels(torch.device("cpu"), require_triton=False, numel=200)
    assert {c.verdict for c in relaxed if c.name == "codec int8"} == {"warn"}
    assert "gcc: not found" in next(c.detail for c in relaxed if c.name == "codec int8")
    ops.reset_triton_failures()
    strict = selftest.check_kernels(torch.device("cpu"), require_triton=True, numel=200)
    assert {c.verdict for c in strict if c.name.startswith("codec int")} == {"FAIL"}


def test_a_failing_check_fails_the_selftest(monkeypatch: pytest.MonkeyPatch) -> None:
    def stage(*args: object) -> selftest.Check:
        raise RuntimeError("CUDA error: no kernel image is available for execution")

    monkeypatch.setattr(selftest, "check_stage", stage)
    monkeypatch.setattr(selftest, "check_kernels", lambda *a, **k: [])
    result = selftest.run_checks(SMALL, "cpu")
    assert not result.passed
    assert "no kernel image" in result.checks[-1].detail


def test_the_cli_runs_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "run.toml"
    spec_file.write_text(
        'name = "selftest"\n[model]\nd_model = 32\nn_heads = 2\nn_layers = 2\nseq_len = 16\n'
        "[stages]\nblocks_per_stage = [1, 1]\n[batch]\nmicro_batch_size = 2\n"
        "target_batch_size = 2\n"
    )
    monkeypatch.setattr(selftest, "_NUMEL", 200)
    monkeypatch.setenv("WANSWARM__NODE__RUN_SPEC", str(spec_file))
    marker = tmp_path / "ok" / "selftest.ok"
    argv = ["selftest", "--state-dir", str(tmp_path), "--device", "cpu", "--json"]
    assert main([*argv, "--once", str(marker)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and marker.exists()
    assert {c["name"] for c in report["checks"]} >= {"device", "precision", "stage"}
    assert main([*argv, "--once", str(marker)]) == 0
    assert capsys.readouterr().out == ""  # the marker is there: nothing ran
