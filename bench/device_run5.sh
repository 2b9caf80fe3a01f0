#!/usr/bin/env bash
# One device call: the launch-shape sweep (groups_per_program included) at 16k and 64k tokens.
# Usage: bash bench/device_run5.sh OUTDIR
set -u
OUTDIR=$1
L=/tmp/jaxrope_logs
mkdir -p "$L"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAXROPE_GPU_TESTS=1
export PYTHONPATH="$(pwd)"
timeout 280 python3 -m bench.kernel_check --out "$L" --skip cases,triton --sweep-seconds ${SWEEP_S:-100} \
    >"$L/kernel_check.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$L" .
grep -v Warning "$L/kernel_check.log" | tail -30
