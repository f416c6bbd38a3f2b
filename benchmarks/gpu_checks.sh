#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md, each step bounded in time, its full output kept in a
# log of its own under OUTDIR and its last lines printed here. A step that fails or runs out
# of time is reported and the next one runs.
#
#   benchmarks/gpu_checks.sh OUTDIR [STEP ...]
#
# Steps (default: all but swarm, in this order):
#   env       nvidia-smi, torch/triton versions, the device's name and memory
#   selftest  wanswarm selftest on CUDA, Triton required (bit-exactness against the reference)
#   tests     TRITON_INTERPRET=0 pytest tests/gpu (compiled kernels, the stage on CUDA)
#   kernels   benchmarks/kernels.py: GB/s of every codec at 16-256 MiB against peak and a copy
#   stage     benchmarks/stage.py on CUDA, bf16 and fp32, at the default size (d384, 8x128)
#             and at the small run's stage size (d768, 3 blocks, 16x1024); then bf16 at the
#             default size with 2 micro-batches in flight (the overlap of a reply's copy)
#   profile   benchmarks/stage.py --profile in bf16 at both sizes: cProfile per thread, CUDA
#             synchronizations by line, torch.profiler (OUTDIR/profile_{default,small}/)
#   swarm     benchmarks/swarm.py: the small model (configs/runs/small.toml with
#             target_batch_size = 128 and warmup_steps = 10, so a few minutes hold many steps)
#             on 4 daemons sharing the GPU, int8 on loopback, against the reference on the
#             same GPU; SWARM_S bounds its training phase (default 150 s)
# Environment: STEP_LIMIT_S scales every step's limit (default 1.0).
set -u
out=${1:?usage: benchmarks/gpu_checks.sh OUTDIR [STEP ...]}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env selftest kernels stage tests)
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
py=${PYTHON:-python3}
scale=${STEP_LIMIT_S:-1.0}

run_step() {  # name limit_s command...
    local name=$1 limit
    limit=$(awk -v a="$2" -v s="$scale" 'BEGIN { printf "%d", a * s }')
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$out/$name.log"
    local began=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$out/$name.log" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $((SECONDS - began))s" | tee -a "$out/$name.log"
    tail -n "${TAIL_LINES:-12}" "$out/$name.log" | cut -c1-220
}

for step in "${steps[@]}"; do
    case $step in
    env)
        run_step env 30 bash -c "nvidia-smi; $py -c 'import torch, triton; \
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0), \
torch.cuda.mem_get_info(0))'"
        ;;
    selftest)
        run_step selftest 90 "$py" -m wanswarm.node.cli selftest --device cuda --require-triton
        ;;
    tests)
        run_step tests 200 "$py" -m pytest tests/gpu -q -p no:cacheprovider -rf --timeout 90
        ;;
    kernels)
        run_step kernels 150 "$py" benchmarks/kernels.py ${KERNEL_SIZES:+--sizes $KERNEL_SIZES}
        ;;
    stage)
        for precision in bf16 fp32; do
            run_step stage 60 "$py" benchmarks/stage.py --device cuda --precision "$precision" --json
            run_step stage 90 "$py" benchmarks/stage.py --device cuda --precision "$precision" \
                --d-model 768 --blocks 3 --seq-len 1024 --batch 16 --json
        done
        run_step stage 60 "$py" benchmarks/stage.py --device cuda --precision bf16 \
            --in-flight 2 --json
        ;;
    profile)
        run_step profile 90 "$py" benchmarks/stage.py --device cuda --precision bf16 \
            --rounds 3 --json --profile "$out/profile_default"
        run_step profile 120 "$py" benchmarks/stage.py --device cuda --precision bf16 \
            --d-model 768 --blocks 3 --seq-len 1024 --batch 16 --rounds 3 --json \
            --profile "$out/profile_small"
        ;;
    swarm)
        spec=$out/small_b128.toml
        sed -e 's/^target_batch_size = 512.*/target_batch_size = 128/' \
            -e 's/^warmup_steps = 200/warmup_steps = 10/' \
            -e 's/^name = "small"/name = "small-b128"/' configs/runs/small.toml >"$spec"
        run_step swarm $((${SWARM_S:-150} + 240)) "$py" benchmarks/swarm.py --spec "$spec" \
            --profiles lan --codecs int8 --replicas 1 --tokens 1310720 --eval-windows 32 \
            --max-train-s "${SWARM_S:-150}" --set stage_server.device=cuda \
            --reference-device cuda --reference-threads 4 --progress-s 15
        ;;
    *)
        echo "unknown step $step" >&2
        exit 2
        ;;
    esac
done
