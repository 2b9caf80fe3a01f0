"""Every named case through the compiled Pallas kernel on the GPU, against the float64 oracle.

The CPU suite runs the same cases through the XLA path and the Pallas interpreter
(``tests/test_apply.py``); here the Triton-compiled kernel runs, through ``jax.jit``
with q and k donated and launched from torch, where a lowering bug would show.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import CASES
from jaxrope.testing import oracle

pytestmark = pytest.mark.gpu

TOLERANCE = oracle.RELATIVE_TOLERANCE


@pytest.fixture(scope="module")
def jax_gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend ({e})")



@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_kernels_rotate_every_case_in_place_like_the_oracle(jax_gpu, rng, case, dtype,
                                                                backend):
    capability = jr.ops.backends.device_capability(jax_gpu)
    if backend == "mosaic" and jr.ops.backends.backend_name(
            "auto", jax_gpu.platform, compute_capability=capability) != "mosaic":
        pytest.skip(f"Mosaic GPU does not run on {jax_gpu.device_kind}")
    cfg = case.cfg
    rope = jax.jit(lambda a, b, p: jr.apply_rope(a, b, p, cfg, backend=backend),
                   donate_argnums=(0, 1))
    for tokens in (1, case.tokens, 1000):
        q_host = np.asarray(jnp.asarray(rng.standard_normal((tokens, case.q_heads, cfg.head_dim)),
                                        dtype), np.float64)
        k_host = np.asarray(jnp.asarray(rng.standard_normal((tokens, case.k_heads, cfg.head_dim)),
                                        dtype), np.float64)
        pos = rng.integers(0, cfg.max_position, tokens).astype(np.int32)
        q, k = (jax.device_put(jnp.asarray(x, dtype), jax_gpu) for x in (q_host, k_host))
        pointers = q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer()
        q2, k2 = rope(q, k, jax.device_put(pos, jax_gpu))
        assert (q2.unsafe_buffer_pointer(), k2.unsafe_buffer_pointer()) == pointers, tokens
        for x, y in ((q_host, q2), (k_host, k2)):
            y = np.asarray(y, np.float64)
            error = oracle.relative_error(y, oracle.rope_of(cfg, x, pos))
            assert error < TOLERANCE[dtype], (tokens, error)
            np.testing.assert_array_equal(y[..., cfg.rotary_dim:], x[..., cfg.rotary_dim:])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_launch_rotates_every_case_in_place_like_the_oracle(device, rng, case):
    import torch
    from torch_bridge.launch.triton import TritonLauncher

    cfg, launcher = case.cfg, TritonLauncher()
    for tokens in (1, 64, 333):
        q = torch.from_numpy(rng.standard_normal((tokens, case.q_heads, cfg.head_dim))).to(
            device, torch.bfloat16)
        k = torch.from_numpy(rng.standard_normal((tokens, case.k_heads, cfg.head_dim))).to(
            device, torch.bfloat16)
        pos = rng.integers(0, cfg.max_position, tokens).astype(np.int32)
        q_host, k_host = q.double().cpu().numpy(), k.double().cpu().numpy()
        pointers = q.data_ptr(), k.data_ptr()
        launcher.rotate_(q, k, torch.from_numpy(pos).to(device), cfg)
        torch.cuda.synchronize(device)
        assert (q.data_ptr(), k.data_ptr()) == pointers
        for x, y in ((q_host, q), (k_host, k)):
            error = oracle.relative_error(y.double().cpu().numpy(), oracle.rope_of(cfg, x, pos))
            assert error < TOLERANCE["bfloat16"], (tokens, error)
