"""The Triton append kernel's per-head QK-norm and fp8 q, compiled on the GPU: under JAX and
launched from torch (``TritonKVLauncher.rotate_and_append_kv_(norm=, q_out=)``).

The named calls of :data:`jaxrope.testing.kv_norm.SPECS` at a serving size (300 tokens,
Qwen3-8B's 32 q heads and 8 k heads, 40 pages of 16), against the float64 oracle
(:func:`jaxrope.testing.kv_norm.check_against_oracle`) and, under JAX, the XLA reference
(fp8 within one e4m3 ulp, the rest within a rounding of the row's scale). The compiled
kernel uses the approximate sin/cos and libdevice's ``rsqrtf``: the oracle's tolerances
hold for them as for the rotation alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxrope.ops.rope_append_kv import triton as triton_append
from jaxrope.testing import flashinfer_kv
from jaxrope.testing.kv_norm import (SCALES, SPECS, check_against_oracle, check_against_xla,
                                     make_inputs, run_kernel, xla)

pytestmark = pytest.mark.gpu

GPU_SPECS = {name: dataclasses.replace(spec, tokens=300, q_heads=32, k_heads=8, pages=40,
                                       page_size=16) for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", GPU_SPECS)
def test_the_compiled_kernel_matches_the_oracle_and_xla(name, jax_gpu, rng):
    spec = GPU_SPECS[name]
    x = make_inputs(rng, spec)
    got = run_kernel(spec, x, triton_append.rope_append_kv_triton)
    check_against_oracle(spec, x, got)
    check_against_xla(name, spec, got, xla(spec, x))


@pytest.mark.parametrize("name", GPU_SPECS)
def test_the_torch_launcher_runs_the_norm_and_fp8_q_kernel(name, device, rng):
    import torch

    from torch_bridge.kv_append import CacheGeometry
    from torch_bridge.launch.triton import TritonKVLauncher

    spec = GPU_SPECS[name]
    x = make_inputs(rng, spec)
    tq, tk, tv = (flashinfer_kv.to_torch(np.asarray(a), device) for a in (x.q, x.k, x.v))
    host_caches = x.kv_cache if isinstance(x.kv_cache, tuple) else (x.kv_cache,)
    caches = tuple(flashinfer_kv.to_torch(np.asarray(c), device) for c in host_caches)
    shape = caches[0].shape
    view = (2 * shape[0], *shape[2:]) if spec.combined else tuple(shape)
    geometry = CacheGeometry(spec.layout, spec.combined, view, caches[0].dtype)
    weights = [None if w is None else flashinfer_kv.to_torch(np.asarray(w), device)
               for w in (x.q_w, x.k_w)]
    q_before = tq.clone()
    q_out = (torch.empty(tq.shape, dtype=torch.float8_e4m3fn, device=device)
             if spec.fp8_q else None)
    TritonKVLauncher().rotate_and_append_kv_(
        tq, tk, tv, torch.from_numpy(np.ascontiguousarray(x.pos)).to(device),
        caches, torch.from_numpy(x.slots).to(device), spec.cfg, geometry,
        SCALES if spec.fp8_q else SCALES[:2],
        norm=(*weights, spec.qk_norm) if spec.qk_norm else None, q_out=q_out)
    torch.cuda.synchronize()
    if spec.fp8_q:
        assert torch.equal(tq, q_before), "q is only read when the output is a new fp8 q"
    q_host = flashinfer_kv.from_torch(q_out if spec.fp8_q else tq, np.asarray(x.q).dtype)
    cache_host = [flashinfer_kv.from_torch(c, np.asarray(h).dtype)
                  for c, h in zip(caches, host_caches)]
    check_against_oracle(spec, x, (q_host, cache_host[0] if spec.combined else tuple(cache_host)))
