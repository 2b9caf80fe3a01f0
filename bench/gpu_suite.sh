#!/usr/bin/env bash
# The GPU run, one command: install FlashInfer from the wheels brought along, run the GPU
# test suite, record the FlashInfer goldens, check them the way CI will, run the benchmark.
#
#   bash bench/gpu_suite.sh <logdir> [step ...]
#
# Steps (default: all, in this order): install versions flashinfer tests goldens
# golden-check bench. Every step runs even when an earlier one failed; each one's exit
# code and time are summarised at the end, and the script exits non-zero if any failed.
#
# Needs, in the repository root: .whl/ holding flashinfer_python-0.5.3-py3-none-any.whl
# and apache_tvm_ffi-0.1.x-cp312-...manylinux...whl (the GPU machine has no package index;
# download them with the `pip download` line in the README). Writes into <logdir>:
#   gpu_suite.log           everything printed (versions, nvidia-smi, pytest, summary)
#   gpu_junit.xml           the GPU test suite's results
#   flashinfer_golden.npz   the recorded goldens (also written to tests/data/)
#   what bench/rope_bench.py --out <logdir> writes
# Environment knobs: GPU_SUITE_TESTS (pytest paths, default "tests": every gpu-marked
# test), GPU_SUITE_WORKERS (pytest-xdist workers, default 4; 0 runs serially),
# GPU_SUITE_BENCH_ARGS (extra arguments for bench/rope_bench.py, e.g. "--budget-s 200").
# The whole run can pass the device's 10-minute cap per command (the benchmark alone
# budgets 480 s): then run it as two commands into one <logdir>, e.g.
#   bash bench/gpu_suite.sh <logdir> install versions flashinfer tests goldens golden-check
#   bash bench/gpu_suite.sh <logdir> install bench
set -u -o pipefail

if [ $# -lt 1 ]; then
    echo "usage: bash bench/gpu_suite.sh <logdir> [install|versions|flashinfer|tests|goldens|golden-check|bench ...]" >&2
    exit 2
fi
LOGDIR=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "cannot create $1" >&2; exit 2; }
shift
STEPS=${*:-install versions flashinfer tests goldens golden-check bench}
cd "$(dirname "$0")/.."
ROOT=$(pwd)
LOG="$LOGDIR/gpu_suite.log"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX and torch share the GPU
export JAXROPE_GPU_TESTS=1                   # tests/conftest.py: leave JAX on the GPU
export JAXROPE_REQUIRE_FLASHINFER=1          # a missing FlashInfer fails instead of skipping
export PYTHONUNBUFFERED=1
GOLDEN="$ROOT/tests/data/flashinfer_golden.npz"
TESTS=${GPU_SUITE_TESTS:-tests}
WORKERS=${GPU_SUITE_WORKERS:-4}

SUMMARY=()
FAILED=0
run_step() {
    local name=$1
    shift
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    echo
    echo "=== [$name] $(date -u +%FT%TZ)"
    local start=$SECONDS
    "$@"
    local rc=$?
    local took=$((SECONDS - start))
    SUMMARY+=("$(printf '%-13s rc=%-3s %5ss' "$name" "$rc" "$took")")
    [ "$rc" -eq 0 ] || FAILED=1
    echo "=== [$name] rc=$rc in ${took}s"
}

install_wheels() {
    ls -l .whl/*.whl || { echo "no wheels in $ROOT/.whl (carry .whl)"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
}

versions() {
    python3 - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("numpy", "jax", "jaxlib", "torch", "triton", "flashinfer", "tvm_ffi", "ml_dtypes"):
    try:
        module = importlib.import_module(name)
        print(f"{name:11s}", getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as e:
        print(f"{name:11s} NOT IMPORTABLE: {type(e).__name__}: {e}")
import jax, torch
print("jax devices", jax.devices())
print("torch cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))
EOF
    local rc=$?
    nvidia-smi || true
    "$CUDA_HOME/bin/nvcc" --version || true
    return $rc
}

flashinfer_build() {
    # Builds FlashInfer's rope module (JIT, ~1 min on a fresh machine) once, before the
    # tests, so a build failure shows here and pytest workers find it built.
    python3 - <<'EOF'
import time
import torch
import flashinfer
start = time.time()
q = torch.randn(4, 2, 128, dtype=torch.bfloat16, device="cuda")
k = torch.randn(4, 1, 128, dtype=torch.bfloat16, device="cuda")
pos_ids = torch.arange(4, dtype=torch.int32, device="cuda")
flashinfer.apply_rope_pos_ids_inplace(q, k, pos_ids)
torch.cuda.synchronize()
print(f"FlashInfer {flashinfer.__version__}: rope module built and called in {time.time() - start:.1f}s")
EOF
}

gpu_tests() {
    local parallel=()
    if [ "$WORKERS" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then
        parallel=(-n "$WORKERS")
    fi
    # shellcheck disable=SC2086
    python3 -m pytest -m gpu $TESTS -q -ra -p no:cacheprovider "${parallel[@]}" \
        --junitxml="$LOGDIR/gpu_junit.xml" -o junit_family=xunit2
}

record_goldens() {
    python3 bench/record_goldens.py --out "$GOLDEN" && cp "$GOLDEN" "$LOGDIR/"
}

golden_check() {
    # What CI runs on the new file: CPU only, jaxrope's XLA and interpret backends.
    env -u JAXROPE_GPU_TESTS -u JAXROPE_REQUIRE_FLASHINFER JAX_PLATFORMS=cpu \
        python3 -m pytest -q -p no:cacheprovider tests/test_golden.py tests/test_conventions.py
}

bench() {
    if [ ! -f bench/rope_bench.py ]; then
        echo "bench/rope_bench.py not present: skipped"
        return 0
    fi
    # shellcheck disable=SC2086
    python3 -m bench.rope_bench --out "$LOGDIR" ${GPU_SUITE_BENCH_ARGS:-}
}

echo "gpu_suite: steps [$STEPS] from $ROOT into $LOGDIR"
run_step install install_wheels
run_step versions versions
run_step flashinfer flashinfer_build
run_step tests gpu_tests
run_step goldens record_goldens
run_step golden-check golden_check
run_step bench bench

echo
echo "=== summary"
for line in "${SUMMARY[@]}"; do echo "$line"; done
ls -l "$LOGDIR"
if [ "$FAILED" -eq 0 ]; then echo "gpu_suite: all steps passed"; else echo "gpu_suite: some steps FAILED"; fi
# Let tee finish writing the log before the caller collects <logdir>.
exec 1>&- 2>&-
wait "$TEE_PID"
exit "$FAILED"
