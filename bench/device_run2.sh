#!/usr/bin/env bash
# Second device call of a session: benchmarks after the GPU suite has passed once.
# Usage: bash bench/device_run2.sh OUTDIR
set -u
OUTDIR=$1
L=/tmp/jaxrope_logs
mkdir -p "$L"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAXROPE_GPU_TESTS=1
timeout 100 bash bench/gpu_suite.sh "$L" install versions flashinfer >"$L/part1.txt" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$L" .
export PYTHONPATH="/tmp/site:$(pwd)" CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0
timeout 80 python3 -m bench.kernel_check --out "$L" --skip cases >"$L/kernel_check.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$L" .
timeout 50 python3 -m bench.bridge_bench --device cuda --out "$L/bridge_bench.json" >"$L/bridge_bench.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$L" .
timeout 90 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider -n 4 >"$L/gpu_tests.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$L" .
timeout 210 python3 -m bench.rope_bench --out "$L" --budget-s 160 >"$L/rope_bench.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$L" .
tail -4 "$L/gpu_tests.log"; tail -12 "$L/kernel_check.log"; tail -12 "$L/bridge_bench.log"; tail -40 "$L/rope_bench.log"
