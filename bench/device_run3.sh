#!/usr/bin/env bash
# One device call: the Triton counter store and apply_qk's bound launch on the GPU (tests,
# bridge timings), then Nsight Compute on the RoPE kernel against the ceiling and FlashInfer.
# Usage: bash bench/device_run3.sh OUTDIR   (carry .whl)
set -u
OUTDIR=$1
L=/tmp/jaxrope_logs
mkdir -p "$L"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAXROPE_GPU_TESTS=1
pack() { tar czf "$OUTDIR/logs.tgz" -C "$L" . 2>/dev/null; }
timeout 100 bash bench/gpu_suite.sh "$L" install versions >"$L/part1.txt" 2>&1
pack
export PYTHONPATH="/tmp/site:$(pwd)" CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0
timeout 150 python3 -m pytest -m gpu tests/gpu/test_counters_gpu.py tests/gpu/test_bridge_gpu.py \
    -q -x -p no:cacheprovider >"$L/gpu_tests.log" 2>&1
pack
timeout 100 python3 -m bench.bridge_bench --device cuda --iters 100 --out "$L/bridge_bench.json" \
    >"$L/bridge_bench.log" 2>&1
pack
NCU_ROPE_BUDGET_S=${NCU_BUDGET:-200} timeout 230 bash bench/ncu_rope.sh "$L/ncu" >"$L/ncu.log" 2>&1
pack
tail -5 "$L/gpu_tests.log"; tail -25 "$L/bridge_bench.log"; tail -80 "$L/ncu.log"
