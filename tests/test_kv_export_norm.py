"""The fused kernel's Triton IR with QK-norm weights and an fp8 q, as the torch launcher
takes it (off the GPU, lowered for an H200, as tests/test_kv_export.py does).

- The pointer signature: the weights after v (q's, then k's, each in its own dtype), the
  q output fp8 when asked, the caches after both; all 32-byte aligned.
- The norm is in the IR (a reduction, a reciprocal square root) only when a weight is
  exported.
- :class:`NormOperands` refuses what the kernel cannot do, and spells dtypes one way (a
  launcher's kernel key).
- Where Triton is installed: the launcher compiles the normalised fp8-q kernel for sm90
  (slow: one PTX compile; --run-slow) and declines CPU tensors and a per-token norm (the
  manager then takes the JAX path).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxrope as jr
from jaxrope.ops.rope_append_kv.triton_export import NormOperands
from jaxrope.testing.lowering import cuda_target
from test_kv_export import _export, _signature

QWEN3 = jr.QKNorm(eps=1e-6)
GEMMA = jr.QKNorm(eps=1e-6, convention="gemma")
BASE = ["i32", "i32", "i32", "f32", "f32", "bf16", "bf16", "bf16"]


@pytest.mark.parametrize("name, norm, weights, q_out, caches", [
    ("partial_half_fp8_hnd_combined", NormOperands("bfloat16", "float32", QWEN3, fp8_q=True),
     ["bf16", "f32"], "f8E4M3FN", ["f8E4M3FN"]),
    # Interleaved pairs, D 96 of which 48 rotate: pieces (and weights) running past D.
    ("interleave_d96_nhd_p1", NormOperands(k_weight="float16", qk_norm=GEMMA), ["f16"], "bf16",
     ["bf16", "bf16"]),
    ("partial_half_fp8_hnd_combined", NormOperands(fp8_q=True), [], "f8E4M3FN", ["f8E4M3FN"])],
    ids=["both-fp8-q", "k-only-d96", "fp8-q-only"])
def test_the_weights_sit_after_v_and_an_fp8_q_is_its_own_output(name, norm, weights, q_out,
                                                                 caches):
    exported, _ = _export(name, norm=norm)
    assert (exported.num_weights, exported.fp8_q) == (len(weights), norm.fp8_q)
    inputs = BASE + weights + caches
    assert _signature(exported.ttir) == [(t, "32") for t in inputs + [q_out, *caches]]


def test_the_norm_is_in_the_ir_only_when_a_weight_is_exported():
    plain, _ = _export("llama3_nhd_p16")
    fp8_q, _ = _export("llama3_nhd_p16", norm=NormOperands(fp8_q=True))
    normed, _ = _export("llama3_nhd_p16", norm=NormOperands("bfloat16", "bfloat16", QWEN3))
    # The sum of squares (a reduction) and libdevice's reciprocal square root.
    for marker in ("tt.reduce", "__nv_rsqrtf"):
        assert marker in normed.ttir and marker not in plain.ttir and marker not in fp8_q.ttir
    assert len({plain.ttir, fp8_q.ttir, normed.ttir}) == 3


def test_norm_operands_refuse_what_the_kernel_cannot_do_and_spell_dtypes_once():
    assert NormOperands(jnp.bfloat16, None, QWEN3) == NormOperands("bfloat16", None, QWEN3)
    assert hash(NormOperands(jnp.float32, None, QWEN3)) == hash(NormOperands("float32", None, QWEN3))
    with pytest.raises(NotImplementedError, match="holds a subset of a token's heads"):
        NormOperands("float32", None, jr.QKNorm(eps=1e-5, per_head=False))
    with pytest.raises(ValueError, match="q_weight='int32' must be one of"):
        NormOperands("int32", None, QWEN3)
    with pytest.raises(ValueError, match="goes with a q or k weight dtype and only with one"):
        NormOperands(qk_norm=QWEN3)
    with pytest.raises(ValueError, match="goes with a q or k weight dtype"):
        NormOperands(k_weight="float32")


@pytest.mark.slow
@pytest.mark.requires_triton
def test_the_launcher_compiles_the_normalised_fp8_q_kernel_for_sm90():
    import torch
    from triton.backends.compiler import GPUTarget

    from jaxrope.ops.rope_append_kv import tuning as append_tuning
    from jaxrope.cases import APPEND_BY_NAME
    from torch_bridge.launch.triton import TritonKVLauncher
    from test_kv_bridge import _geometry

    case = APPEND_BY_NAME["llama3_nhd_p16"]
    c = case.case
    launcher = TritonKVLauncher(target=GPUTarget("cuda", 90, 32))
    block = append_tuning.append_triton_tuning(64, c.q_heads, c.k_heads, c.cfg.rotary_dim // 2)
    norm = NormOperands("bfloat16", "bfloat16", GEMMA, fp8_q=True)
    with cuda_target():
        compiled, exported = launcher.kernel(c.q_heads, torch.bfloat16, c.cfg, _geometry(case),
                                             block, norm)
    assert (c.q_heads, torch.bfloat16, c.cfg, _geometry(case), block, norm) in launcher._kernels._kernels
    assert (exported.num_weights, exported.fp8_q) == (2, True)
    ptx = compiled.asm["ptx"]
    # A bf16 cache: the only e4m3 conversion is q's.
    assert "rsqrt.approx" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.requires_triton
def test_the_launcher_declines_cpu_tensors_and_a_per_token_norm():
    import torch

    from jaxrope.cases import APPEND_BY_NAME
    from torch_bridge.launch.triton import TritonKVLauncher
    from test_kv_bridge import _geometry

    case = APPEND_BY_NAME["llama3_nhd_p16"]
    c = case.case
    q = torch.zeros(3, c.q_heads, c.head_dim, dtype=torch.bfloat16)
    k = torch.zeros(3, c.k_heads, c.head_dim, dtype=torch.bfloat16)
    caches = tuple(torch.zeros(case.pages, case.page_size, c.k_heads, c.head_dim,
                               dtype=torch.bfloat16) for _ in "kv")
    w = torch.ones(c.head_dim, dtype=torch.bfloat16)
    args = (q, k, k, torch.zeros(3, dtype=torch.int32), caches,
            torch.tensor([0, 1, -1], dtype=torch.int32), c.cfg, _geometry(case))
    launcher = TritonKVLauncher()
    assert launcher.accepts == {"norm", "q_out"}
    with pytest.raises(jr.BackendUnavailable, match="q is on cpu: the launcher needs CUDA"):
        launcher.rotate_and_append_kv_(*args, (1.0, 1.0), norm=(w, None, QWEN3))
    olmo = jr.QKNorm(eps=1e-5, per_head=False)
    with pytest.raises(jr.BackendUnavailable, match="per-token norm .* takes the JAX path"):
        launcher.rotate_and_append_kv_(*args, (1.0, 1.0), norm=(w, None, olmo))
    with pytest.raises(ValueError, match=r"must be \(k_scale, v_scale, q_scale\) with q_out"):
        launcher.rotate_and_append_kv_(*args, (1.0, 1.0),
                                       q_out=torch.zeros(q.shape, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="q_out .* must be torch.float8_e4m3fn shaped like q"):
        launcher.rotate_and_append_kv_(*args, (1.0, 1.0, 1.0), q_out=torch.zeros_like(q))
