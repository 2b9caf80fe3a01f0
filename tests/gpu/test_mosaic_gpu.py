"""The Mosaic GPU kernel compiled on the GPU: the oracle's answer, in place.

The CPU suite runs the same body in Mosaic GPU's interpreter
(``tests/test_apply.py::test_mosaic_kernel_matches_the_oracle_in_its_interpreter``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import BY_NAME
from jaxrope.kernels import mosaic_gpu
from jaxrope.testing import oracle

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def jax_gpu():
    """JAX's first GPU (no torch needed) with the Mosaic GPU API, or a skip saying why not."""
    missing = mosaic_gpu.unavailable()
    if missing:
        pytest.skip(missing)
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend ({e})")


@pytest.mark.parametrize("name", ["llama3_8b", "qwen25_yarn", "partial_half_d128", "head_dim_512"])
def test_compiled_mosaic_kernel_rotates_in_place_like_the_oracle(jax_gpu, name, rng):
    cfg = dataclasses.replace(BY_NAME[name].cfg, max_position=1 << 20)
    q_heads, k_heads = (32, 8) if name != "qwen25_yarn" else (28, 4)
    q = jax.device_put(jnp.asarray(rng.standard_normal((257, q_heads, cfg.head_dim)),
                                   jnp.bfloat16), jax_gpu)
    k = jax.device_put(jnp.asarray(rng.standard_normal((257, k_heads, cfg.head_dim)),
                                   jnp.bfloat16), jax_gpu)
    pos = rng.integers(0, 1 << 20, 257).astype(np.int32)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    pointers = q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer()
    rope = jax.jit(lambda a, b: jr.apply_rope(a, b, jnp.asarray(pos), cfg, backend="mosaic"),
                   donate_argnums=(0, 1))
    q2, k2 = rope(q, k)
    assert (q2.unsafe_buffer_pointer(), k2.unsafe_buffer_pointer()) == pointers
    inv_freq, attention = oracle.serving_frequencies(cfg)
    for x, y in ((q_host, q2), (k_host, k2)):
        expected = oracle.rope_oracle(x, pos.astype(np.int64), inv_freq, attention,
                                      cfg.rotary_dim, cfg.interleave)
        assert oracle.relative_error(np.asarray(y, np.float64), expected) < 2.5e-3
        np.testing.assert_array_equal(np.asarray(y, np.float64)[..., cfg.rotary_dim:],
                                      x[..., cfg.rotary_dim:])
