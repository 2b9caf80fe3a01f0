#!/usr/bin/env bash
# Nsight Compute profile of the Pallas RoPE kernel (from torch, as production launches it)
# next to the in-place elementwise ceiling and FlashInfer, at the target shape
# (Hq=32, Hk=8, D=128, bf16, in place). One command, on the GPU machine:
#
#   bash bench/ncu_rope.sh OUTDIR
#
# Steps (each bounded by a timeout and the overall budget; a failed step leaves the others):
#   1. timing: bench/ncu_rope.py --what all --time: CUDA-event times of every kernel, no
#      profiler; also builds the Triton kernels and FlashInfer's JIT module, so that the ncu
#      runs below find them cached instead of compiling under the profiler.
#   2. ncu, one process per kernel family (ours, ceiling, flashinfer) over all token counts:
#      sections SpeedOfLight, LaunchStats, Occupancy, WarpStateStats, MemoryWorkloadAnalysis
#      (+ _Tables), SchedulerStats and the metrics in METRICS; only the launches inside the
#      driver's NVTX range "ncu_rope" (after its warm-up) are profiled.
#   3. full: --set full on one launch of each of our two launch shapes and the ceiling at
#      the first token count, a report for the Nsight Compute GUI (NCU_ROPE_FULL=0 skips it).
#   4. the JAX paths (jax: XLA's compile of the same Triton IR; mosaic: Mosaic GPU),
#      picked by kernel name and launch count, one process per token count; last, so
#      that a budget they run out does not cost the full report (NCU_ROPE_JAX=0 skips).
#   5. summary: bench/ncu_rope.py --summarize, printed at the end.
#
# Writes into OUTDIR: env.txt; timing.json, timing.log; per family F: ncu_F.ncu-rep,
# ncu_F.csv (raw page, base units), ncu_F.manifest.json (labels of the profiled launches),
# ncu_F.log; full_ours_ceiling.ncu-rep/.csv/.log; summary.md, metrics_by_kernel.csv,
# launches.csv. Knobs: NCU_ROPE_TOKENS (default "16384 65536"), NCU_ROPE_FULL (default 1),
# NCU_ROPE_JAX (default 1), NCU_ROPE_BUDGET_S (default 330: each step's timeout is cut to
# what is left of it, and no step starts with under 45 s left), PYTHON (default python3).
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash bench/ncu_rope.sh OUTDIR" >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "cannot create $1" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 2

export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX (the kernel export) and torch share the GPU
ROOT=$(pwd)
export PYTHONPATH="/tmp/site:$ROOT"           # FlashInfer's wheels are installed under /tmp/site
export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
PY=${PYTHON:-python3}
read -r -a TOKENS <<<"${NCU_ROPE_TOKENS:-16384 65536}"
BUDGET_S=${NCU_ROPE_BUDGET_S:-330}

# The profiled launches are the ones in the driver's NVTX range; clock control must be off
# on this VM; caches are flushed before every replay pass, so each pass streams from HBM.
COMMON=(--clock-control none --cache-control all --target-processes all --replay-mode kernel)
NVTX=(--nvtx --nvtx-include "ncu_rope/")
WANT_SECTIONS=(SpeedOfLight LaunchStats Occupancy WarpStateStats MemoryWorkloadAnalysis
               MemoryWorkloadAnalysis_Tables SchedulerStats)
M=(gpu__time_duration.sum
   dram__bytes_read.sum dram__bytes_write.sum
   dram__bytes_read.sum.per_second dram__bytes_write.sum.per_second
   dram__bytes.sum.peak_sustained dram__cycles_elapsed.avg.per_second
   dram__throughput.avg.pct_of_peak_sustained_elapsed
   gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed
   sm__throughput.avg.pct_of_peak_sustained_elapsed
   sm__warps_active.avg.pct_of_peak_sustained_active
   smsp__issue_active.avg.pct_of_peak_sustained_active
   launch__registers_per_thread launch__occupancy_limit_registers
   launch__occupancy_limit_shared_mem launch__occupancy_limit_warps
   launch__occupancy_limit_blocks launch__grid_size launch__block_size
   launch__waves_per_multiprocessor
   sm__cycles_elapsed.avg sm__cycles_active.avg
   lts__t_sectors_srcunit_tex_op_read.sum lts__t_sectors_srcunit_tex_op_write.sum
   l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
   l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum l1tex__t_requests_pipe_lsu_mem_global_op_st.sum
   smsp__inst_executed.sum
   smsp__sass_inst_executed_op_global_ld.sum smsp__sass_inst_executed_op_global_st.sum)
METRICS=$(IFS=,; echo "${M[*]}")

remaining() { echo $((BUDGET_S - SECONDS)); }

# A step's timeout: its own limit, cut to what is left of the budget; 0 (do not start)
# when under 45 s are left, too little for a profile that a timeout would leave unwritten.
limit() {
    local left
    left=$(remaining)
    if [ "$left" -lt 45 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

NCU=""
for candidate in "$(command -v ncu 2>/dev/null)" /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu \
                 $(printf '%s\n' /opt/nvidia/nsight-compute/*/ncu | sort -rV); do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then NCU=$candidate; break; fi
done

{
    echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null)"
    echo "ncu: ${NCU:-NOT FOUND} $([ -n "$NCU" ] && "$NCU" --version 2>&1 | tail -1)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw,power.limit \
        --format=csv,noheader 2>&1
    echo "tokens: ${TOKENS[*]}"
} | tee "$OUT/env.txt"

# FlashInfer comes from the wheels in .whl (gpu_suite's install step); put it there if absent.
if [ ! -d /tmp/site/flashinfer ] && ls .whl/*.whl >/dev/null 2>&1; then
    echo "=== installing FlashInfer into /tmp/site (bench/gpu_suite.sh install)"
    bash bench/gpu_suite.sh "$OUT/install" install >/dev/null 2>&1 \
        || echo "FlashInfer install failed (see $OUT/install/gpu_suite.log): its column will be empty"
fi

echo "=== timing (no profiler: CUDA events; jax and mosaic by wall clock)"
t=$(limit 200)
if [ "$t" -gt 0 ]; then
    start=$SECONDS
    rm -f "$OUT/timing.json"
    timeout -k 10 "$t" "$PY" -m bench.ncu_rope --what all --tokens "${TOKENS[@]}" --time "$OUT/timing.json" \
        >"$OUT/timing.log" 2>&1
    echo "rc=$? in $((SECONDS - start))s"
    grep -E "us |skipped|ncu_rope:" "$OUT/timing.log" | tail -20
fi

# run_ncu NAME LIMIT_S [ncu options ...] -- [driver options ...]
run_ncu() {
    local name=$1 step_limit=$2
    shift 2
    local ncu_args=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do ncu_args+=("$1"); shift; done
    shift
    local t start=$SECONDS
    t=$(limit "$step_limit")
    if [ "$t" -le 0 ]; then
        echo "=== ncu $name: skipped, the ${BUDGET_S}s budget is spent"
        return 1
    fi
    echo "=== ncu $name: $*"
    # A stale CSV of an earlier run into the same OUTDIR must not reach the summary.
    rm -f "$OUT/$name.ncu-rep" "$OUT/$name.csv" "$OUT/$name.manifest.json"
    timeout -k 10 "$t" "$NCU" "${COMMON[@]}" "${ncu_args[@]}" --export "$OUT/$name" --force-overwrite \
        "$PY" -m bench.ncu_rope "$@" --manifest "$OUT/$name.manifest.json" >"$OUT/$name.log" 2>&1
    local rc=$?
    if [ ! -s "$OUT/$name.ncu-rep" ]; then
        grep -E "==(ERROR|WARNING)==|skipped|Error" "$OUT/$name.log" | head -8
        if grep -q "ERR_NVGPUCTRPERM" "$OUT/$name.log"; then
            echo "ncu may not read the GPU's performance counters here (ERR_NVGPUCTRPERM)"
        fi
        echo "=== ncu $name: no report (rc=$rc)"
        return 1
    fi
    "$NCU" --import "$OUT/$name.ncu-rep" --csv --page raw --print-units base \
        >"$OUT/$name.csv" 2>"$OUT/$name.import.log"
    echo "=== ncu $name: rc=$rc in $((SECONDS - start))s, $(grep -c '^"[0-9]' "$OUT/$name.csv") launches profiled"
    return 0
}

if [ -z "$NCU" ]; then
    echo "ncu not found (command -v ncu, /usr/local/cuda*/bin/ncu, /opt/nvidia/nsight-compute/*/ncu):"
    echo "no profile; the summary has the CUDA-event times only"
else
    # Only sections this ncu knows: an unknown name would fail the whole run.
    KNOWN=$("$NCU" --list-sections 2>/dev/null)
    SECTIONS=()
    for s in "${WANT_SECTIONS[@]}"; do
        if [ -z "$KNOWN" ] || grep -qw -- "$s" <<<"$KNOWN"; then SECTIONS+=(--section "$s"); fi
    done
    for what in ours ceiling flashinfer; do
        filter=()
        case $what in
            ours) filter=(--kernel-name "regex:jaxrope_rope") ;;   # the Pallas kernel's name
            ceiling) filter=(--kernel-name "regex:elementwise") ;; # torch's mul_ kernel
        esac
        # With an unknown metric name ncu profiles nothing: then the sections alone.
        run_ncu "ncu_$what" 120 "${NVTX[@]}" "${SECTIONS[@]}" --metrics "$METRICS" \
            ${filter[@]+"${filter[@]}"} -- --what "$what" --tokens "${TOKENS[@]}" \
            || { grep -qiE "==ERROR==.*metric" "$OUT/ncu_$what.log" 2>/dev/null \
                 && echo "retrying without --metrics" \
                 && run_ncu "ncu_$what" 120 "${NVTX[@]}" "${SECTIONS[@]}" ${filter[@]+"${filter[@]}"} \
                        -- --what "$what" --tokens "${TOKENS[@]}"; }
    done
    if [ "${NCU_ROPE_FULL:-1}" != 0 ]; then
        run_ncu full_ours_ceiling 120 "${NVTX[@]}" --set full -- --what ours ceiling --tokens "${TOKENS[0]}" \
            --launches 1
    fi
    # The JAX paths: XLA launches from its own threads, outside the NVTX range, so the
    # profiled launches are picked by name and count (after the driver's 3 warm-up ones),
    # one process per token count. NCU_ROPE_JAX=0 skips them.
    if [ "${NCU_ROPE_JAX:-1}" != 0 ]; then
        for what in jax mosaic; do
            for t in "${TOKENS[@]}"; do
                pick=(--kernel-name "regex:jaxrope_rope" --launch-skip 3 --launch-count 3)
                run_ncu "ncu_${what}_$t" 90 "${SECTIONS[@]}" --metrics "$METRICS" "${pick[@]}" \
                    -- --what "$what" --tokens "$t" --warmup 3 --launches 3 \
                    || { grep -qiE "==ERROR==.*metric" "$OUT/ncu_${what}_$t.log" 2>/dev/null \
                         && echo "retrying without --metrics" \
                         && run_ncu "ncu_${what}_$t" 90 "${SECTIONS[@]}" "${pick[@]}" \
                                -- --what "$what" --tokens "$t" --warmup 3 --launches 3; }
            done
        done
    fi
fi

echo "=== summary ($OUT/summary.md)"
"$PY" -m bench.ncu_rope --summarize "$OUT"
rc=$?
echo "files in $OUT:"
ls -l "$OUT"
echo "total ${SECONDS}s"
exit $rc
