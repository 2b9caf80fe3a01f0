"""apply_rope over a 1-device mesh on the GPU: the plain call's kernel and result, in place.

The CPU suite checks the sharded paths on 8 host devices (tests/multidevice) and the
Explicit path's CUDA lowering (tests/test_sharding.py); the Auto path's kernel is
inserted by the partitioner when compiling, which needs the GPU: here.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxrope as jr
from jaxrope.ops import mosaic_common

pytestmark = pytest.mark.gpu

CFG = jr.RopeConfig(head_dim=128, theta=500000.0, scaling=jr.Llama3(), max_position=1 << 20)


def _inputs(jax_gpu, tokens=4096):
    rng = np.random.default_rng(0)
    q = jax.device_put(jnp.asarray(rng.standard_normal((tokens, 32, 128)), jnp.bfloat16), jax_gpu)
    k = jax.device_put(jnp.asarray(rng.standard_normal((tokens, 8, 128)), jnp.bfloat16), jax_gpu)
    pos = jax.device_put(jnp.asarray(rng.integers(0, 1 << 20, tokens), jnp.int32), jax_gpu)
    return q, k, pos


def _program(text: str) -> collections.Counter:
    """Every instruction's opcode (and custom-call target), counted over the module."""
    ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", text))
    ops.update(re.findall(r'custom_call_target="([^"]+)"', text))
    return ops


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_one_device_mesh_runs_the_plain_kernel_in_place(jax_gpu, axis_type, backend):
    if backend == "mosaic" and mosaic_common.unavailable():
        pytest.skip(mosaic_common.unavailable())
    rope = jax.jit(lambda q, k, pos: jr.apply_rope(q, k, pos, CFG, backend=backend),
                   donate_argnums=(0, 1))
    q, k, pos = _inputs(jax_gpu)
    plain_text = rope.lower(q, k, pos).compile().as_text()
    expected = rope(q.copy(), k.copy(), pos)
    mesh = jax.make_mesh((1,), ("model",), axis_types=(axis_type,), devices=[jax_gpu])
    layout = NamedSharding(mesh, P(None, "model"))
    q, k = jax.device_put(q, layout), jax.device_put(k, layout)
    pos = jax.device_put(pos, NamedSharding(mesh, P()))
    if backend == "mosaic" and axis_type == AxisType.Auto:
        with pytest.raises(jr.BackendUnavailable, match="custom_partitioning cannot lower"):
            rope.lower(q, k, pos)
        return
    text = rope.lower(q, k, pos).compile().as_text()
    # The same instructions as the plain call's module: one kernel, no copy or transpose.
    assert _program(text) == _program(plain_text), (_program(text) - _program(plain_text),
                                                    _program(plain_text) - _program(text))
    pointers = q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer()
    out = rope(q, k, pos)
    assert (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(expected[0]))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(expected[1]))
