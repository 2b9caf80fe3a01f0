#!/usr/bin/env bash
# Device calls after the first (bench/device_run.sh): named steps, each bounded by a
# timeout, logs archived into OUTDIR/logs.tgz after every step so a call cut short keeps
# what it measured. Carry .whl when a step needs FlashInfer.
#
#   bash bench/device_steps.sh OUTDIR STEP [STEP ...]
#
# Steps:
#   install   FlashInfer wheels into /tmp/site, versions      (bench/gpu_suite.sh)
#   tests     every gpu-marked test, 4 workers
#   counters  the counter-store and bridge GPU tests
#   parity    the FlashInfer parity tests
#   bridge    plan + commit host time and apply_qk vs FlashInfer (bench/bridge_bench.py)
#   apply     apply_qk's layers timed alone (bench/apply_profile.py)
#   plan      plan + commit's host time split: launch, Python, cProfile (bench/plan_profile.py)
#   kernel    kernel timings, variants, 64 tokens, both JAX paths: XLA's Triton and Mosaic GPU
#             (bench/kernel_check.py)
#   mosaic    the Mosaic GPU kernel's GPU test (tests/gpu/test_mosaic_gpu.py)
#   sweep     kernel_check with the launch-shape sweep (SWEEP_S seconds per size, 100)
#   shapes    launch shapes per head layout (bench/shape_sweep.py)
#   loops     launch shapes of Hq=32 Hk=8 D=128 at 16384 and 65536 tokens, token loops and
#             program order included (bench/shape_sweep.py --layouts 32x8x128)
#   jaxshapes the same through jax.jit (XLA's Triton), bench/shape_sweep.py --path jax
#   shapetest the launch-shape GPU tests (tests/gpu/test_launch_shapes_gpu.py)
#   ncu       Nsight Compute on the kernel (from torch, and both JAX paths), ceiling and
#             FlashInfer (bench/ncu_rope.sh; NCU_BUDGET seconds, 200)
#   kprof     kernel durations (JAX profiler) at 64, 16384 and 65536 tokens of both JAX
#             kernels, the torch launch, FlashInfer and the ceiling: rope_bench's kernel
#             section alone (plus the ceilings that size its loops)
#   bench     the full rope_bench sweep (BENCH_BUDGET seconds, 150)
set -u
OUTDIR=$1
shift
L=/tmp/jaxrope_logs
mkdir -p "$L"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 JAXROPE_GPU_TESTS=1
PYTHONPATH="/tmp/site:$(pwd)"
export PYTHONPATH CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0
pack() { tar czf "$OUTDIR/logs.tgz" -C "$L" . 2>/dev/null; }
PYTEST=(python3 -m pytest -m gpu -q -x -p no:cacheprovider)

for step in "$@"; do
    log="$L/$step.log"
    case $step in
        install) timeout 100 bash bench/gpu_suite.sh "$L" install versions >"$log" 2>&1 ;;
        tests) timeout 150 "${PYTEST[@]}" tests/gpu -n 4 >"$log" 2>&1 ;;
        counters) timeout 150 "${PYTEST[@]}" tests/gpu/test_counters_gpu.py tests/gpu/test_bridge_gpu.py >"$log" 2>&1 ;;
        parity) timeout 90 "${PYTEST[@]}" tests/gpu/test_flashinfer_parity.py -n 4 >"$log" 2>&1 ;;
        bridge) timeout 150 python3 -m bench.bridge_bench --device cuda --iters "${BRIDGE_ITERS:-1000}" --warmup 500 \
                    --out "$L/bridge_bench.json" >"$log" 2>&1 ;;
        apply) timeout 60 python3 -m bench.apply_profile >"$log" 2>&1 ;;
        plan) { timeout 100 python3 -m bench.plan_profile --steps 1500;
                timeout 100 python3 -m bench.plan_profile --steps 1500 --init-jax; } >"$log" 2>&1 ;;
        kernel) timeout 90 python3 -m bench.kernel_check --out "$L" --skip cases,triton >"$log" 2>&1 ;;
        sweep) timeout 280 python3 -m bench.kernel_check --out "$L" --skip cases,triton \
                   --sweep-seconds "${SWEEP_S:-100}" >"$log" 2>&1 ;;
        loops) for t in 16384 65536; do timeout 150 python3 -m bench.shape_sweep --layouts 32x8x128 \
                   --tokens $t --seconds-per-shape 120 --out "$L/loops_$t.json"; done >"$log" 2>&1 ;;
        jaxshapes) for t in 16384 65536; do timeout 120 python3 -m bench.shape_sweep --layouts 32x8x128 \
                   --path jax --tokens $t --seconds-per-shape 90 --out "$L/jaxshapes_$t.json"; done >"$log" 2>&1 ;;
        mosaic) timeout 150 "${PYTEST[@]}" tests/gpu/test_mosaic_gpu.py >"$log" 2>&1 ;;
        shapetest) timeout 150 "${PYTEST[@]}" tests/gpu/test_launch_shapes_gpu.py >"$log" 2>&1 ;;
        shapes) timeout 200 python3 -m bench.shape_sweep --seconds-per-shape "${SHAPES_S:-25}" --out "$L/shape_sweep.json" >"$log" 2>&1 ;;
        ncu) NCU_ROPE_FULL=${NCU_ROPE_FULL:-1} NCU_ROPE_BUDGET_S=${NCU_BUDGET:-200} \
                 timeout $((${NCU_BUDGET:-200} + 30)) bash bench/ncu_rope.sh "$L/ncu" >"$log" 2>&1 ;;
        kprof) timeout 200 python3 -m bench.rope_bench --out "$L/kprof" --filter kernel/ \
                   --no-write-results --budget-s 150 >"$log" 2>&1 ;;
        bench) timeout $((${BENCH_BUDGET:-150} + 60)) python3 -m bench.rope_bench --out "$L" --budget-s "${BENCH_BUDGET:-150}" \
                   >"$log" 2>&1 ;;
        *) echo "unknown step $step" >"$log" ;;
    esac
    echo "=== $step rc=$?" | tee -a "$L/steps.txt"
    pack
    grep -v -e Warning -e "return rule" "$log" | tail -${TAIL:-30}
done
