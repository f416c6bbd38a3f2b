"""Quantize/dequantize throughput of the codec kernels, Triton and reference side by side.

    python benchmarks/kernels.py [--sizes 1,4,16,64,256] [--quick] [--dtype float32]
                                 [--threads N] [--codecs int8,int4:b32:f16:sr]

For every codec and input size (MiB of the input tensor in ``--dtype``), prints the
throughput of quantization and dequantization in GB/s, counting bytes read plus bytes
written (input + codes + scales), and the payload size relative to bf16. The codecs are
those of the registry (``wanswarm.kernels.registry``) except raw ones, each with its
default parameters and, where it has one, its stochastic-rounding variant; ``--codecs``
names others (``parse_codec`` forms). On CUDA the Triton kernels (of the codecs that
have them) and the reference run on the GPU, at 16-256 MiB by default, and the table
and the JSON add the fraction of the device's peak memory bandwidth (target: at least 0.9
for the Triton kernels from 64 MiB up), and ``copy_gbps``, what a plain device-to-device
copy of the largest size reaches (the bandwidth actually available). Without a GPU only
the reference runs (on the CPU): the Triton interpreter is a correctness tool, not
something to time.

Timing: warm-up runs, then the median of repeats; on CUDA with events around each run.
The last line of output is JSON:
``{"device", "peak_gbps", "copy_gbps", "results": [{"codec", "size_mb", "impl",
"quant_gbps", "dequant_gbps", "ratio_vs_bf16"[, "quant_fraction_of_peak",
"dequant_fraction_of_peak", "quant_fraction_of_copy", "dequant_fraction_of_copy"]},
...]}`` (the fractions and ``copy_gbps`` on CUDA only, where the peak is known). On CUDA
each timed sample is 10 back-to-back calls (``time_median``): what a node gets, the host's
path per call (argument checks, allocation, Triton's launcher) included, which exceeds a
small kernel's own time. The kernels' own bandwidth is measured apart (``*_kernel_gbps``
and their fractions, CUDA only): the same 10 calls captured once in a CUDA graph and
replayed, so that the GPU runs them back to back without waiting for the host
(``time_graph``); a call that synchronizes with the host cannot be captured and gets null.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from wanswarm.kernels import ops, registry
from wanswarm.transport.codecs import CodecSpec, parse_codec

# Peak memory bandwidth (GB/s, vendor figures) by a substring of the device name; first
# match wins, so the more specific names come first.
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM5 80GB HBM3
    ("GH200", 4000.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB", 2039.0),
    ("A100", 1555.0),  # 40GB
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
)


def default_codecs() -> list[str]:
    """Wire strings of every registered codec but the raw ones (a copy is no codec to time),
    with default parameters, plus the stochastic-rounding variant where one exists."""
    wires: list[str] = []
    for codec in registry.codecs():
        if codec.layout.raw:
            continue
        spec = parse_codec(codec.name)
        wires.append(spec.to_wire())
        if codec.layout.stochastic:
            wires.append(parse_codec(f"{codec.name}-sr").to_wire())
    return wires


@dataclass(frozen=True)
class Result:
    codec: str
    size_mb: float
    impl: str
    quant_gbps: float
    dequant_gbps: float
    ratio_vs_bf16: float
    quant_kernel_gbps: float | None = None  # CUDA graph replay: the kernels alone
    dequant_kernel_gbps: float | None = None


def peak_gbps(device: torch.device) -> float | None:
    """The device's peak memory bandwidth: the table, else clock x bus width (DDR)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    for key, gbps in PEAK_GBPS:
        if key in props.name:
            return gbps
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    return None


CUDA_BATCH = 10  # calls per timed sample on CUDA


def time_median(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds per call. On CUDA a sample is ``CUDA_BATCH`` back-to-back calls between
    two events, divided by their number: a stream of calls as a node makes them, where the
    host's work for one call (argument checks, the launch) overlaps the previous kernel. A
    single call between events would time the host's launch path instead of the kernel once
    the kernel takes less than it (tens of microseconds)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CUDA_BATCH):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / CUDA_BATCH)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_graph(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> float | None:
    """Median seconds per call of the GPU work alone: ``CUDA_BATCH`` calls captured in a
    CUDA graph, replayed between two events (no host launch path in between). None off
    CUDA, or when a call synchronizes with the host (checked first in CUDA's sync debug
    mode, since a synchronization inside a capture would break it)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    # "warn", not "error": an error raised inside a launch would count as a Triton failure
    # and switch the dispatcher to the reference (kernels/ops.py)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if any("called a synchronizing" in str(w.message) for w in caught):
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CUDA_BATCH):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    samples: list[float] = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / CUDA_BATCH)
    del graph
    return statistics.median(samples)


def bench_one(
    wire: str,
    x: torch.Tensor,
    impl: ops.Impl,
    warmup: int,
    repeats: int,
) -> Result:
    spec = CodecSpec.from_wire(wire)
    layout = spec.codec.layout
    n, dev = x.numel(), x.device
    in_bytes = n * x.element_size()
    ratio = spec.payload_nbytes(n, x.dtype) / CodecSpec("bf16").payload_nbytes(n, x.dtype)
    size_mb = in_bytes / 2**20
    sd = spec.torch_scale_dtype
    codes = torch.empty(layout.codes_numel(n, x.dtype), dtype=layout.code_dtype, device=dev)
    scales = torch.empty(layout.scales_numel(n, spec.block_size), dtype=sd, device=dev)
    seed = 1234 if spec.stochastic else None

    def quant() -> object:
        return ops.quantize(
            x,
            spec.name,
            spec.block_size,
            sd,
            seed=seed,
            codes_out=codes,
            scales_out=scales,
            impl=impl,
            check_finite=False,
        )

    def dequant() -> object:
        return ops.dequantize(codes, scales, spec.name, spec.block_size, n, x.dtype, impl=impl)

    q = time_median(quant, dev, warmup, repeats)
    d = time_median(dequant, dev, warmup, repeats)
    moved = in_bytes + codes.nbytes + scales.nbytes
    qk = time_graph(quant, dev, warmup, repeats) if impl == "triton" else None
    dk = time_graph(dequant, dev, warmup, repeats) if impl == "triton" else None
    return Result(
        wire, size_mb, impl, moved / q / 1e9, moved / d / 1e9, ratio,
        None if qk is None else moved / qk / 1e9, None if dk is None else moved / dk / 1e9,
    )


def copy_gbps(device: torch.device, size_mb: float, warmup: int, repeats: int) -> float:
    """GB/s (read + written) of a device-to-device copy of ``size_mb`` MiB."""
    src = torch.empty(int(size_mb * 2**20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_median(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.numel() / seconds / 1e9


def copy_kernel_gbps(device: torch.device, size_mb: float, warmup: int, repeats: int) -> float:
    """The same copy replayed from a CUDA graph (``time_graph``): the copy kernel alone."""
    src = torch.empty(int(size_mb * 2**20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_graph(lambda: dst.copy_(src), device, warmup, repeats)
    assert seconds is not None  # a device copy never synchronizes
    return 2 * src.numel() / seconds / 1e9


def _as_json(r: Result, peak: float | None, copy: float | None = None) -> dict[str, object]:
    out: dict[str, object] = {
        "codec": r.codec,
        "size_mb": r.size_mb,
        "impl": r.impl,
        "quant_gbps": round(r.quant_gbps, 3),
        "dequant_gbps": round(r.dequant_gbps, 3),
        "ratio_vs_bf16": round(r.ratio_vs_bf16, 4),
    }
    if peak:
        out["quant_fraction_of_peak"] = round(r.quant_gbps / peak, 4)
        out["dequant_fraction_of_peak"] = round(r.dequant_gbps / peak, 4)
    if copy:
        out["quant_fraction_of_copy"] = round(r.quant_gbps / copy, 4)
        out["dequant_fraction_of_copy"] = round(r.dequant_gbps / copy, 4)
    for what in ("quant", "dequant"):
        gbps = getattr(r, f"{what}_kernel_gbps")
        if gbps is None:
            continue
        out[f"{what}_kernel_gbps"] = round(gbps, 3)
        if peak:
            out[f"{what}_kernel_fraction_of_peak"] = round(gbps / peak, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help="input sizes in MiB, comma-separated")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="input dtype"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument(
        "--codecs",
        default=None,
        help="codecs to time, comma-separated parse_codec forms (default: the registry's)",
    )
    args = parser.parse_args(argv)
    if args.codecs is None:
        wires = default_codecs()
    else:
        wires = [parse_codec(c).to_wire() for c in args.codecs.split(",") if c.strip()]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    default_sizes = "16,64" if args.quick else "16,32,64,128,256"
    if not cuda and args.sizes is None:
        default_sizes = "1,4" if args.quick else "1,4,16"
    sizes = [float(s) for s in (args.sizes or default_sizes).split(",") if s.strip()]
    dtype = getattr(torch, args.dtype)
    warmup, repeats = (2, 5) if args.quick else (3, 20 if cuda else 7)
    peak = peak_gbps(device)
    name = (
        torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    )
    if not cuda:
        print(
            "no GPU present: timing the pure-torch reference on the CPU only "
            "(the Triton interpreter is not a performance target)"
        )
    copy = copy_gbps(device, max(sizes), warmup, repeats) if cuda else None
    copy_kernel = copy_kernel_gbps(device, max(sizes), warmup, repeats) if cuda else None
    print(
        f"device: {name}"
        + (f"   peak memory bandwidth: {peak:.0f} GB/s" if peak else "")
        + (f"   device copy: {copy:.0f} GB/s (graph-replayed: {copy_kernel:.0f})" if copy
           and copy_kernel else "")
    )
    print(f"input dtype: {args.dtype}; GB/s count bytes read + written; ratio = payload / bf16")
    header = (
        f"{'codec':<18}{'MiB':>7}  {'impl':<10}{'quant GB/s':>11}{'dequant GB/s':>13}{'ratio':>7}"
    )
    if peak:
        header += f"{'q %peak':>9}{'d %peak':>9}"
    if copy:
        header += f"{'q %copy':>9}{'d %copy':>9}"
    if cuda:
        header += f"{'q kernel':>10}{'d kernel':>10}"
        if peak:
            header += f"{'qk %peak':>10}{'dk %peak':>10}"
    print(header)
    results: list[Result] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for size in sizes:
        n = max(1, int(size * 2**20) // torch.tensor([], dtype=dtype).element_size())
        x = torch.randn(n, generator=gen, device=device, dtype=torch.float32).to(dtype)
        for wire in wires:
            has_triton = CodecSpec.from_wire(wire).codec.triton is not None
            impls: list[ops.Impl] = (
                ["triton", "reference"] if cuda and has_triton else ["reference"]
            )
            for impl in impls:
                r = bench_one(wire, x, impl, warmup, repeats)
                results.append(r)
                line = (
                    f"{r.codec:<18}{r.size_mb:>7.0f}  {r.impl:<10}{r.quant_gbps:>11.1f}"
                    f"{r.dequant_gbps:>13.1f}{r.ratio_vs_bf16:>7.3f}"
                )
                if peak:
                    line += f"{r.quant_gbps / peak:>9.2f}{r.dequant_gbps / peak:>9.2f}"
                if copy:
                    line += f"{r.quant_gbps / copy:>9.2f}{r.dequant_gbps / copy:>9.2f}"
                if cuda:
                    for gbps in (r.quant_kernel_gbps, r.dequant_kernel_gbps):
                        line += f"{gbps:>10.1f}" if gbps is not None else f"{'-':>10}"
                    if peak:
                        for gbps in (r.quant_kernel_gbps, r.dequant_kernel_gbps):
                            line += f"{gbps / peak:>10.2f}" if gbps is not None else f"{'-':>10}"
                print(line, flush=True)
        del x
    print(
        json.dumps(
            {
                "device": name,
                "peak_gbps": peak,
                "copy_gbps": None if copy is None else round(copy, 1),
                "copy_kernel_gbps": None if copy_kernel is None else round(copy_kernel, 1),
                "results": [_as_json(r, peak, copy) for r in results],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
