#!/usr/bin/env bash
# What the lead runs through the device tool in one call: the GPU suite steps in order of
# what CI and the issues need most (goldens, kernel timings, parity tests), each bounded
# by a timeout so that the archive is always written. Usage: bash bench/device_run.sh OUTDIR
set -u
OUTDIR=$1
L=/tmp/jaxrope_logs
mkdir -p "$L"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 150 bash bench/gpu_suite.sh "$L" install versions flashinfer goldens golden-check >"$L/part1.txt" 2>&1
timeout 100 python3 -m bench.kernel_check --out "$L" --skip cases --sweep-seconds 20 >"$L/kernel_check.log" 2>&1
timeout 260 bash bench/gpu_suite.sh "$L" tests >"$L/part2.txt" 2>&1
timeout 40 python3 -m jaxrope.demo --device cuda >"$L/demo.log" 2>&1
tar czf "$OUTDIR/logs.tgz" -C "$L" .
cp "$L/gpu_suite.log" "$OUTDIR/" 2>/dev/null
grep -E "^=== \[|rc=|passed|failed|error" "$L/gpu_suite.log" | tail -40
tail -15 "$L/kernel_check.log"
tail -3 "$L/demo.log"
