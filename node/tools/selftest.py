"""``wanswarm selftest``: can this machine serve a stage? Device, precision, kernels, a stage.

Four checks, each a line (``ok``, ``warn`` or ``FAIL``), then a verdict:

1. device: the one a stage server would use (``--device``, default ``auto``), its name and
   compute capability, torch's and Triton's versions;
2. precision: what the run spec's ``[precision] compute`` becomes there
   (node/stage/precision.py) and that autocast computes in it;
3. kernels: every registered codec, encoded and decoded on the device, for float32,
   float16 and bfloat16 inputs; for codecs with Triton kernels, Triton against the pure-torch
   reference bit for bit (fp8 quantizes through the same integer encoder in both; see
   docs/codecs.md). On a CPU without ``TRITON_INTERPRET=1`` the Triton kernels do not run
   and this says so. A Triton launch that fails falls back to the reference (logged, as a
   node would) and is a ``warn``; ``--require-triton`` makes it a failure (an image built
   to run them);
4. stage: the run's last stage (it has a loss) built on the device, a forward and backward
   of one micro-batch in the run's precision, and its dL/dx and parameter gradients finite;
   then a few optimizer steps on that micro-batch, whose loss must fall.

Exit status 0 when nothing failed, 1 otherwise. ``--once PATH`` skips everything when
PATH exists and creates it after a pass: the Docker image's HEALTHCHECK runs the selftest
on its first run that way (docs/gpu.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from ...kernels import ops, registry
from ...transport import codecs
from ..config.node_config import NodeConfig
from ..config.runspec import (
    PrecisionSpec,
    RunSpec,
    RunSpecError,
    default_run_spec,
    load_run_spec,
)
from ..stage.optimizer import make_adamw
from ..stage.precision import ComputePrecision, resolve_precision
from ..stage.server import resolve_device
from ..training.model import build_stage, param_groups

logger = logging.getLogger(__name__)

Verdict = Literal["ok", "warn", "FAIL"]
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NUMEL = 4096 + 77  # several blocks and programs, a short last block


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str


@dataclass(frozen=True)
class SelftestResult:
    checks: tuple[Check, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.verdict != "FAIL" for c in self.checks)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_device(device: torch.device) -> Check:
    triton = _version("triton")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return Check("device", "FAIL", f"{device} asked for, but torch sees no CUDA device")
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB"
    else:
        name = "the CPU"
    return Check(
        "device", "ok", f"{device} ({name}); torch {torch.__version__}, triton {triton}"
    )


def check_precision(precision: ComputePrecision, device: torch.device) -> Check:
    a = torch.randn(16, 16, device=device)
    with precision.autocast():
        got = (a @ a).dtype
    if got != precision.dtype:
        return Check(
            "precision", "FAIL", f"{precision.describe()}: autocast computed {got}"
        )
    return Check("precision", "ok", f"{precision.describe()} (master weights float32)")


def _triton_runs_on(device: torch.device) -> bool:
    if not ops.triton_available():
        return False
    return device.type == "cuda" or ops.triton_interpreted()


_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, to compare floats exactly (NaN payloads and -0.0 included)."""
    return t.view(_INT_VIEWS[t.dtype.itemsize])


def check_kernels(
    device: torch.device, *, require_triton: bool, numel: int = _NUMEL
) -> list[Check]:
    """Every codec round-trips on ``device``; Triton matches the reference bit for bit."""
    checks: list[Check] = []
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(numel, generator=gen) * 3
    base[::97] = 0.0
    triton_here = _triton_runs_on(device)
    before = ops.triton_failures()
    for codec in registry.codecs():
        spec = codecs.CodecSpec(codec.name)
        problems: list[str] = []
        compared = 0
        for dtype in _INPUT_DTYPES:
            x = base.to(dtype).to(device)
            try:
                encoded = codecs.encode(x, spec)
                back = codecs.decode(encoded, device=device)
            except Exception as exc:  # the check reports any failure, it does not stop
                problems.append(f"{dtype}: {type(exc).__name__}: {exc}")
                continue
            if back.device.type != device.type or back.dtype != dtype:
                problems.append(f"{dtype}: decoded to {back.dtype} on {back.device}")
            if codec.triton is None or not triton_here or not codec.layout.blockwise:
                continue
            problems.extend(_compare(codec.name, x, dtype))
            compared += 1
        failed = {k: v for k, v in ops.triton_failures().items() if k not in before}
        if problems:
            checks.append(Check(f"codec {codec.name}", "FAIL", "; ".join(problems)[:400]))
        elif failed:
            verdict: Verdict = "FAIL" if require_triton else "warn"
            why = next(iter(failed.values()))
            checks.append(
                Check(f"codec {codec.name}", verdict, f"Triton failed, reference used: {why}")
            )
        elif compared:
            checks.append(
                Check(f"codec {codec.name}", "ok", "Triton = reference bit for bit, "
                      f"{compared} input dtypes, decoded on {device}")
            )
        elif codec.triton is not None and not triton_here:
            verdict = "FAIL" if require_triton else "ok"
            checks.append(Check(f"codec {codec.name}", verdict,
                                f"round trip on {device} (reference; Triton does not run here)"))
        else:
            checks.append(Check(f"codec {codec.name}", "ok", f"round trip on {device}"))
    return checks


def _compare(name: str, x: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """Triton and the reference on the same input: codes, scales and output bit for bit."""
    problems = []
    c_t, s_t = ops.quantize(x, name, 64, impl="triton")
    c_r, s_r = ops.quantize(x, name, 64, impl="reference")
    if not torch.equal(c_t, c_r) or not torch.equal(_bits(s_t), _bits(s_r)):
        return [f"{dtype}: Triton codes or scales differ from the reference"]
    for out_dtype in _INPUT_DTYPES:
        d_t = ops.dequantize(c_t, s_t, name, 64, x.numel(), out_dtype, impl="triton")
        d_r = ops.dequantize(c_r, s_r, name, 64, x.numel(), out_dtype, impl="reference")
        if not torch.equal(_bits(d_t), _bits(d_r)):
            problems.append(f"{dtype} -> {out_dtype}: Triton output differs from the reference")
    return problems


def check_stage(spec: RunSpec, device: torch.device, precision: ComputePrecision) -> Check:
    """The run's last stage: forward and backward of one micro-batch, then a few steps."""
    stage = spec.n_stages - 1
    module = build_stage(spec, stage).to(device)
    gen = torch.Generator().manual_seed(2)
    B, T, C = spec.batch.micro_batch_size, spec.model.seq_len, spec.model.d_model
    x = torch.randn(B, T, C, generator=gen).to(device)
    targets = torch.randint(0, spec.model.vocab_size, (B, T), generator=gen).to(device)
    leaf = x.to(precision.activation_dtype()).requires_grad_(True)
    opt = make_adamw(spec.optimizer, param_groups(module, spec.optimizer.weight_decay))
    losses = []
    for step in range(4):
        with precision.autocast():
            loss = module.forward_loss(leaf, targets)  # ()
        losses.append(float(loss.detach()))
        scale = 1.0 if precision.scaler is None else precision.scaler.scale
        (loss * scale).backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if leaf.grad is None or not bool(torch.isfinite(leaf.grad).all()):
            return Check("stage", "FAIL", f"step {step}: dL/dx is missing or not finite")
        if not grads or not all(bool(torch.isfinite(g).all()) for g in grads):
            return Check("stage", "FAIL", f"step {step}: parameter gradients not finite")
        for g in grads:
            g.div_(scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        leaf.grad = None
    if not losses[-1] < losses[0]:
        return Check("stage", "FAIL", f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    return Check(
        "stage", "ok",
        f"stage {stage} of the run on {device}: forward+backward in {precision.mode}, "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses) - 1} steps",
    )


def run_checks(
    spec: RunSpec | None = None,
    device_name: str = "auto",
    *,
    require_triton: bool = False,
    numel: int | None = None,
) -> SelftestResult:
    """Every check on ``device_name`` for ``spec`` (default the tiny run); ``numel``: the
    size of the kernels' test tensor."""
    started = time.perf_counter()
    spec = spec or default_run_spec()
    device = resolve_device(device_name)
    checks = [check_device(device)]
    if checks[0].verdict == "FAIL":
        return SelftestResult(tuple(checks), time.perf_counter() - started)
    precision = resolve_precision(spec.precision.compute, device)
    steps: list[Callable[[], list[Check]]] = [
        lambda: [check_precision(precision, device)],
        lambda: check_kernels(
            device, require_triton=require_triton, numel=_NUMEL if numel is None else numel
        ),
        lambda: [check_stage(spec, device, precision)],
    ]
    for step in steps:
        try:
            checks.extend(step())
        except Exception as exc:  # a crash is a failed check, reported with the others
            logger.debug("selftest step failed", exc_info=True)
            checks.append(Check("selftest", "FAIL", f"{type(exc).__name__}: {exc}"[:400]))
    return SelftestResult(tuple(checks), time.perf_counter() - started)


def with_precision(spec: RunSpec, compute: str | None) -> RunSpec:
    """``spec`` with ``[precision] compute`` replaced (the CLI's ``--precision``)."""
    if compute is None:
        return spec
    return spec.model_copy(update={"precision": PrecisionSpec.model_validate({"compute": compute})})


def run_selftest(
    config: NodeConfig,
    *,
    device: str | None = None,
    precision: str | None = None,
    require_triton: bool = False,
    as_json: bool = False,
    once: Path | None = None,
) -> int:
    """The CLI's ``wanswarm selftest``: print the checks; exit status 0 (passed) or 1.

    The run spec is the config's (``node.run_spec``, else the embedded tiny run), the
    device the stage server's (``stage_server.device``); ``device`` and ``precision``
    override them."""
    if once is not None and once.exists():
        return 0
    try:
        spec = default_run_spec() if config.node.run_spec is None else load_run_spec(
            config.node.run_spec
        )
    except RunSpecError as exc:
        print(f"wanswarm selftest: node.run_spec: {exc}")
        return 1
    spec = with_precision(spec, precision)
    name = device or config.stage_server.device
    result = run_checks(spec, name, require_triton=require_triton)
    if as_json:
        print(json.dumps({
            "passed": result.passed,
            "seconds": round(result.seconds, 2),
            "checks": [asdict(c) for c in result.checks],
        }))
    else:
        for c in result.checks:
            print(f"{c.verdict:<4}  {c.name}: {c.detail}")
        print(f"selftest {'passed' if result.passed else 'FAILED'} in {result.seconds:.1f}s")
    if result.passed and once is not None:
        once.parent.mkdir(parents=True, exist_ok=True)
        once.touch()
    return 0 if result.passed else 1
