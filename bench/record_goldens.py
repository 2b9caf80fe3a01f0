"""Record FlashInfer's outputs on a small set of parity cases, for the CPU tests.

Run on the GPU machine with FlashInfer 0.5.x installed (``bench/gpu_suite.sh`` does)::

    python3 bench/record_goldens.py --out tests/data/flashinfer_golden.npz

The file holds, per case, the inputs (q, k, positions, indptr/offsets, the cos/sin
cache), FlashInfer's outputs and the call's arguments, plus FlashInfer's version, torch,
JAX and CUDA versions, the GPU's name and the date. ``tests/test_golden.py`` and
``tests/test_conventions.py`` replay it through jaxrope's XLA and interpret backends on
every CI run. It stays well under 3 MB.

``--fake-flashinfer`` (CPU, no FlashInfer) stores the float64 oracle rounded to the
dtype in place of FlashInfer's outputs and marks the file ``fake``: only for checking
this script and the CPU tests locally; the tests refuse such a file unless
``JAXROPE_ALLOW_FAKE_GOLDEN=1``. Never commit one.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from jaxrope.scaling import Linear, Llama3, Yarn  # noqa: E402
from jaxrope.testing import flashinfer as fp  # noqa: E402
from jaxrope.testing import golden, oracle  # noqa: E402

MAX_BYTES = 3 * 2 ** 20


def _case(name, api, interleave, fraction, head_dim, dtype, scaling, theta, batch_size,
          lengths, heads=(2, 1), seed=0, **extra):
    cfg = fp.parity_config(head_dim=head_dim, rotary_dim=fp.rotary_dim_of(head_dim, fraction),
                           interleave=interleave, theta=theta, scaling=scaling)
    return fp.Case(name=name, api=api, cfg=cfg, dtype=dtype, batch_size=batch_size,
                   q_heads=heads[0], k_heads=heads[1], seed=seed, lengths=lengths, **extra)


LLAMA = Llama3(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position=4096)
# Every api, both layouts, every rotary fraction and head_dim, both dtypes, ragged
# batches over all bases (positions up to 2**20); sequences kept short for size.
GOLDEN_CASES = (
    _case("pos_ids_neox_d64_r16_bf16", "pos_ids", False, 0.25, 64, "bfloat16",
          Linear(4.0), 5e5, 19, (1, 4, 19), seed=1),
    _case("pos_ids_interleave_d128_r64_fp16", "pos_ids", True, 0.5, 128, "float16",
          Linear(2.0), 1e6, 19, (1, 4), seed=2),
    _case("pos_ids_neox_d256_r192_bf16", "pos_ids", False, 0.75, 256, "bfloat16",
          Linear(1.5), 2.5e4, 19, (1, 4), seed=3),
    _case("pos_ids_interleave_d64_r64_bf16_b1", "pos_ids", True, 1.0, 64, "bfloat16",
          Linear(4.0), 1e6, 1, (204,), heads=(1, 1), seed=4, bases=(fp.BASES[-1],)),
    _case("pos_ids_neox_d128_r128_fp16", "pos_ids", False, 1.0, 128, "float16",
          Linear(2.0), 5e5, 19, (1, 4), seed=5),
    _case("pos_ids_interleave_d256_r192_fp16", "pos_ids", True, 0.75, 256, "float16",
          Linear(4.0), 2.5e4, 19, (1, 4), seed=6),
    _case("indptr_neox_d64_r32_bf16", "indptr", False, 0.5, 64, "bfloat16",
          Linear(4.0), 5e5, 19, (1, 4, 19), seed=7),
    _case("indptr_interleave_d128_r32_bf16", "indptr", True, 0.25, 128, "bfloat16",
          Linear(2.0), 1e6, 19, (1, 4), seed=8),
    _case("indptr_neox_d256_r256_fp16_b1", "indptr", False, 1.0, 256, "float16",
          Linear(1.5), 2.5e4, 1, (19,), seed=9, bases=(fp.BASES[2],)),
    _case("llama31_pos_ids_neox_d128_r128_bf16", "llama31_pos_ids", False, 1.0, 128, "bfloat16",
          LLAMA, 1e6, 19, (1, 4), seed=10),
    _case("llama31_pos_ids_interleave_d64_r32_fp16", "llama31_pos_ids", True, 0.5, 64, "float16",
          LLAMA, 1e6, 19, (1, 4, 19), seed=11),
    _case("llama31_indptr_neox_d128_r96_bf16", "llama31_indptr", False, 0.75, 128, "bfloat16",
          Llama3(factor=32.0, original_max_position=8192), 2e5, 19, (1, 4), seed=12),
    _case("cache_neox_d128_r64_bf16_yarn", "cos_sin_cache", False, 0.5, 128, "bfloat16",
          Yarn(factor=4.0, original_max_position=32768), 1e6, 19, (1, 4), seed=13),
    _case("cache_interleave_d64_r64_fp16_llama3", "cos_sin_cache", True, 1.0, 64, "float16",
          Llama3(), 5e5, 19, (1, 4, 19), seed=14),
    _case("cache_interleave_d256_r64_bf16_dense", "cos_sin_cache", True, 0.25, 256, "bfloat16",
          None, 1e4, 19, (1, 4), seed=15, bases=(0,), dense_cache=True),
    _case("cache_neox_d64_r48_fp16_b1", "cos_sin_cache", False, 0.75, 64, "float16",
          Linear(4.0), 5e5, 1, (204,), heads=(1, 1), seed=16, bases=(fp.BASES[-1],)),
)


def _fake_flashinfer(case: fp.Case, q: np.ndarray, k: np.ndarray, batch: fp.Batch):
    # The float64 oracle rounded to the dtype: what an exact FlashInfer would return.
    return (oracle.rope_of(case.cfg, q, batch.pos_ids).astype(q.dtype),
            oracle.rope_of(case.cfg, k, batch.pos_ids).astype(k.dtype))


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"


def _environment(fake: bool) -> dict:
    import jax
    env = {
        "fake": fake,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "jax": jax.__version__,
    }
    if fake:
        return {**env, "flashinfer_version": "none: --fake-flashinfer (float64 oracle, NOT FlashInfer)",
                "gpu": "none", "torch": "none", "cuda": "none"}
    import flashinfer
    import torch
    try:
        import tvm_ffi
        tvm_ffi_version = getattr(tvm_ffi, "__version__", "unknown")
    except ImportError:
        tvm_ffi_version = "not importable"
    return {**env, "flashinfer_version": flashinfer.__version__, "apache_tvm_ffi": tvm_ffi_version,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0),
            "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability(0)))}


def record(out: pathlib.Path, fake: bool) -> int:
    records = []
    for case in GOLDEN_CASES:
        batch, q, k, cache = fp.case_inputs(case)
        if fake:
            q_out, k_out = _fake_flashinfer(case, q, k, batch)
        else:
            q_out, k_out = fp.run_flashinfer(case.api, case.cfg, q, k, batch, cache)
        records.append(golden.Recorded(name=case.name, api=case.api, cfg=case.cfg, dtype=case.dtype,
                                   q=q, k=k, q_out=q_out, k_out=k_out, batch=batch,
                                   kwargs=fp.flashinfer_kwargs(case.api, case.cfg), cache=cache,
                                   dense_cache=case.dense_cache))
        print(f"{case.name}: {len(batch.pos_ids)} tokens, positions {batch.pos_ids.min()}.."
              f"{batch.pos_ids.max()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = _environment(fake)
    golden.save_golden(out, records, meta)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 2 ** 20:.2f} MiB, {len(records)} cases); "
          + ", ".join(f"{key}={meta[key]}" for key in ("flashinfer_version", "gpu", "torch", "jax")))
    if size > MAX_BYTES:
        print(f"error: {out} is over {MAX_BYTES} bytes", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path,
                        default=ROOT / "tests" / "data" / "flashinfer_golden.npz")
    parser.add_argument("--fake-flashinfer", action="store_true",
                        help="CPU self-check: the float64 oracle stands in for FlashInfer "
                             "(the file is marked fake; never commit it)")
    args = parser.parse_args(argv)
    return record(args.out, args.fake_flashinfer)


if __name__ == "__main__":
    sys.exit(main())
