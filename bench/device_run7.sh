#!/usr/bin/env bash
# Last device call of a session: rope_bench's full sweep with the final launch-shape
# heuristic, then the FlashInfer parity tests on it. Usage: bash bench/device_run7.sh OUTDIR
set -u
OUTDIR=$1
L=/tmp/jaxrope_logs
mkdir -p "$L"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAXROPE_GPU_TESTS=1
pack() { tar czf "$OUTDIR/logs.tgz" -C "$L" . 2>/dev/null; }
timeout 60 bash bench/gpu_suite.sh "$L" install versions >"$L/part1.txt" 2>&1
export PYTHONPATH="/tmp/site:$(pwd)" CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0
timeout 190 python3 -m bench.rope_bench --out "$L" --budget-s ${BENCH_BUDGET:-125} >"$L/rope_bench.log" 2>&1
pack
timeout 70 python3 -m pytest -m gpu tests/gpu/test_flashinfer_parity.py -q -x -p no:cacheprovider -n 4 \
    >"$L/gpu_tests.log" 2>&1
pack
tail -3 "$L/gpu_tests.log"; tail -30 "$L/rope_bench.log"
