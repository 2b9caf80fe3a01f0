#!/usr/bin/env bash
# The GPU run: install FlashInfer from the wheels brought along, run every gpu-marked test,
# record the FlashInfer goldens and check them the way CI will, run the demo on the GPU,
# then the benchmarks.
#
#   bash bench/gpu_suite.sh <logdir> [step ...]
#
# Steps, in this order (default: all): install versions flashinfer tests goldens
# golden-check demo bench. Every named step runs even when an earlier one
# failed, each under its own timeout; the summary gives each one's exit code and time,
# and the script exits non-zero if any failed. Everything lands in <logdir> (on the
# device machine, use $OUT): gpu_suite.log, gpu_junit.xml, flashinfer_golden.npz (also
# written to tests/data/), and one <name>.json (plus what else it writes) per benchmark.
#
# Needs .whl/ in the repository root holding flashinfer_python-0.5.3-py3-none-any.whl and
# apache_tvm_ffi-0.1.x-cp312-...manylinux...whl (the GPU machine has no package index;
# the README's `pip download` line fetches them).
# Knobs: GPU_SUITE_TESTS (pytest paths, default "tests"), GPU_SUITE_WORKERS (pytest-xdist
# workers, default 10 of the machine's 16 cores, so the whole suite fits the tests step's
# 400 s; 0 runs serially), GPU_SUITE_BENCHES (';'-separated entries replacing BENCHES below,
# e.g. "rope_bench --sections kernel").
# One command may hit the device's 10-minute cap; split the steps over two calls into the
# same <logdir>, e.g.
#   bash bench/gpu_suite.sh "$OUT" install versions flashinfer tests goldens golden-check demo
#   bash bench/gpu_suite.sh "$OUT" install bench
set -u -o pipefail

# The benchmarks, one a line: `python3 -m bench.<entry> --out <logdir>` writes <logdir>/<name>.json.
BENCHES=(
    "rope_bench --budget-s 360"
    "accuracy"
    "bridge_bench"
    "mrope_bench"
    "kv_append_bench"
    # Issue 46's fused family, split in two so each fits the step's timeout.
    "fused_family_bench --label gqa --cases qwen3_8b_norm_bf16,qwen3_8b_fp8,qwen3_8b_norm_fp8"
    "fused_family_bench --label mla --cases deepseek_v3_mla_bf16,deepseek_v3_mla_fp8"
    "shard_bench"
    "compile_bench"
    "checked_bench"
)

if [ $# -lt 1 ]; then
    echo "usage: bash bench/gpu_suite.sh <logdir> [install|versions|flashinfer|tests|goldens|golden-check|demo|bench ...]" >&2
    exit 2
fi
# Every step needs the CUDA driver and a GPU: without them say so once, before any step.
if ! python3 - <<'PY'
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
count = ctypes.c_int(0)
sys.exit(0 if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
         and count.value > 0 else 1)
PY
then
    echo "bench/gpu_suite.sh needs a CUDA GPU (no CUDA driver or no device found here);" \
         "run the CPU suite with 'make test'" >&2
    exit 3
fi
LOGDIR=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "cannot create $1" >&2; exit 2; }
shift
STEPS=${*:-install versions flashinfer tests goldens golden-check demo bench}
cd "$(dirname "$0")/.."
ROOT=$(pwd)
exec > >(tee -a "$LOGDIR/gpu_suite.log") 2>&1
TEE_PID=$!

export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX and torch share the GPU
export JAXROPE_GPU_TESTS=1                   # tests/conftest.py: leave JAX on the GPU
export JAXROPE_REQUIRE_FLASHINFER=1          # a missing FlashInfer fails instead of skipping
export PYTHONUNBUFFERED=1
GOLDEN="$ROOT/tests/data/flashinfer_golden.npz"
if [ -n "${GPU_SUITE_BENCHES:-}" ]; then IFS=';' read -r -a BENCHES <<<"$GPU_SUITE_BENCHES"; fi

SUMMARY=()
FAILED=0
run_step() {  # run_step NAME TIMEOUT_S COMMAND...: only when NAME is one of the steps asked for
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" ${name%%:*} "*) ;; *) return 0 ;; esac
    echo
    echo "=== [$name] $(date -u +%FT%TZ)"
    local start=$SECONDS
    # Through bash -c so that a step may be one of the (exported) functions below.
    timeout "$limit" bash -c '"$@"' "$name" "$@"
    local rc=$?
    SUMMARY+=("$(printf '%-28s rc=%-3s %5ss' "$name" "$rc" "$((SECONDS - start))")")
    [ "$rc" -eq 0 ] || FAILED=1
    echo "=== [$name] rc=$rc in $((SECONDS - start))s"
}

install_wheels() {
    ls -l .whl/*.whl || { echo "no wheels in $ROOT/.whl (carry .whl)"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
}

versions() {
    python3 -c "import json, sys; from bench.timing import run_info; json.dump(run_info('gpu_suite', sys.argv[1:]), sys.stdout, indent=1)" "$STEPS"
    local rc=$?
    echo
    python3 -c "import jax, torch; print('jax', jax.devices(), '| torch cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))" || rc=1
    nvidia-smi || true
    return $rc
}

flashinfer_build() {
    # Builds FlashInfer's rope module (JIT, ~1 min on a fresh machine) once, before the
    # tests, so a build failure shows here and the pytest workers find it built.
    python3 -c "
import time, torch, flashinfer
start = time.time()
q, k = (torch.randn(4, h, 128, dtype=torch.bfloat16, device='cuda') for h in (2, 1))
flashinfer.apply_rope_pos_ids_inplace(q, k, torch.arange(4, dtype=torch.int32, device='cuda'))
torch.cuda.synchronize()
print(f'FlashInfer {flashinfer.__version__}: rope module built and called in {time.time() - start:.1f}s')"
}

gpu_tests() {
    local parallel=()
    if [ "${GPU_SUITE_WORKERS:-10}" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then
        parallel=(-n "${GPU_SUITE_WORKERS:-10}")
    fi
    # shellcheck disable=SC2086
    python3 -m pytest -m gpu ${GPU_SUITE_TESTS:-tests} -q -ra -p no:cacheprovider "${parallel[@]}" \
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

export ROOT LOGDIR GOLDEN STEPS
export -f install_wheels versions flashinfer_build gpu_tests record_goldens golden_check
echo "gpu_suite: steps [$STEPS] from $ROOT into $LOGDIR"
run_step install 120 install_wheels
run_step versions 60 versions
run_step flashinfer 180 flashinfer_build
run_step tests 400 gpu_tests
run_step goldens 120 record_goldens
run_step golden-check 120 golden_check
run_step demo 60 python3 -m torch_bridge.demo --device cuda
run_step demo:vl 60 python3 -m torch_bridge.demo --device cuda --model qwen2.5-vl
run_step demo:spec 90 python3 -m torch_bridge.demo --device cuda --speculative
for entry in "${BENCHES[@]}"; do
    # A --label names the step too (bench:<module>:<label>), when an entry is split.
    label=$(sed -n 's/.*--label \([A-Za-z0-9_]*\).*/:\1/p' <<<"$entry")
    # shellcheck disable=SC2086
    run_step "bench:${entry%% *}$label" 540 python3 -m bench.$entry --out "$LOGDIR"
done

echo
echo "=== summary"
for line in "${SUMMARY[@]}"; do echo "$line"; done
ls -l "$LOGDIR"
if [ "$FAILED" -eq 0 ]; then echo "gpu_suite: all steps passed"; else echo "gpu_suite: some steps FAILED"; fi
# Let tee finish writing the log before the caller collects <logdir>.
exec 1>&- 2>&-
wait "$TEE_PID"
exit "$FAILED"
