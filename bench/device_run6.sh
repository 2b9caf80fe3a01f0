#!/usr/bin/env bash
# One device call after a change of the kernel's default launch shape: the whole GPU suite,
# kernel_check timings (variants, 64 tokens) and the full rope_bench sweep.
# Usage: bash bench/device_run6.sh OUTDIR   (carry .whl)
set -u
OUTDIR=$1
L=/tmp/jaxrope_logs
mkdir -p "$L"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAXROPE_GPU_TESTS=1
pack() { tar czf "$OUTDIR/logs.tgz" -C "$L" . 2>/dev/null; }
timeout 100 bash bench/gpu_suite.sh "$L" install versions >"$L/part1.txt" 2>&1
pack
export PYTHONPATH="/tmp/site:$(pwd)" CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0
timeout 120 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider -n 4 >"$L/gpu_tests.log" 2>&1
pack
timeout 70 python3 -m bench.kernel_check --out "$L" --skip cases,triton >"$L/kernel_check.log" 2>&1
pack
timeout 210 python3 -m bench.rope_bench --out "$L" --budget-s ${BENCH_BUDGET:-150} >"$L/rope_bench.log" 2>&1
pack
tail -4 "$L/gpu_tests.log"; grep -v Warn "$L/kernel_check.log" | tail -5; tail -42 "$L/rope_bench.log"
