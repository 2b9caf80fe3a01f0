"""apply_rope on q / k sharded over 8 CPU devices: per shard, no collective, in place.

Run by tests/test_multidevice.py in a process started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Every layout is checked on both
mesh axis types (Auto goes through ``custom_partitioning``, Explicit through
``shard_map``) and both CPU backends (XLA and the Pallas kernel in its interpreter):
the result equals the unsharded call bit for bit (the same kernel on a block of the
same values, on this machine), the compiled HLO has no cross-device op, and the
output shards are the donated input shards' buffers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import aliased_parameters, collectives, mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxrope as jr
from jaxrope import sharding
from jaxrope.ops.constants import kernel_constants
from jaxrope.cases import BY_NAME
from jaxrope.ops import mosaic_common
from jaxrope.ops.rope import mosaic as mosaic_rope
from jaxrope.ops.rope import triton as triton_rope

TOKENS = 16
CFG = jr.RopeConfig(head_dim=64, theta=500000.0, scaling=jr.Llama3(), max_position=1 << 20)

# name: (q spec, k spec, pos_ids spec, Hq, Hk) on the ("data": 2, "model": 4) mesh.
LAYOUTS = {
    "heads": (P(None, "model"), P(None, "model"), P(), 8, 4),
    "tokens": (P("data"), P("data"), P("data"), 8, 4),
    "tokens_pos_ids_replicated": (P("data"), P("data"), P(), 8, 4),
    "tokens_and_heads": (P("data", "model"), P("data", "model"), P("data"), 8, 4),
    "tokens_over_both_axes": (P(("data", "model")), P(("data", "model")), P(), 8, 4),
    # One KV head, replicated on every device while q's heads are split (MQA).
    "k_replicated": (P(None, "model"), P(), P(), 8, 1),
    # Device (d, m) holds q heads 2m, 2m+1 (GQA group m // 2) but k head d: groups
    # straddle devices, and every head still rotates on its own.
    "gqa_groups_straddle": (P(None, "model"), P(None, "data"), P(), 8, 2),
}


def _inputs(rng, q_heads, k_heads, head_dim=64, dtype=jnp.bfloat16):
    q = rng.standard_normal((TOKENS, q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((TOKENS, k_heads, head_dim)).astype(np.float32)
    pos = rng.integers(1 << 19, 1 << 20, TOKENS).astype(np.int32)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), pos


@functools.lru_cache(maxsize=None)
def _rope(cfg, backend):
    return jax.jit(functools.partial(jr.apply_rope, cfg=cfg, backend=backend),
                   donate_argnums=(0, 1))


def _pointers(x):
    return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


def _check_sharded_call(rng, axis_type, backend, layout, cfg=CFG):
    q_spec, k_spec, pos_spec, q_heads, k_heads = layout
    grid = mesh(axis_type)
    q, k, pos = _inputs(rng, q_heads, k_heads, cfg.head_dim)
    expected = _rope(cfg, backend)(q.copy(), k.copy(), jnp.asarray(pos))
    q_sharded = jax.device_put(q, NamedSharding(grid, q_spec))
    k_sharded = jax.device_put(k, NamedSharding(grid, k_spec))
    pos_sharded = jax.device_put(pos, NamedSharding(grid, pos_spec))
    rope = _rope(cfg, backend)
    text = rope.lower(q_sharded, k_sharded, pos_sharded).compile().as_text()
    assert collectives(text) == []
    assert aliased_parameters(text) == [0, 1]
    before = _pointers(q_sharded), _pointers(k_sharded)
    out = rope(q_sharded, k_sharded, pos_sharded)
    assert (_pointers(out[0]), _pointers(out[1])) == before, "outputs are not the donated buffers"
    for got, want, spec in ((out[0], expected[0], q_spec), (out[1], expected[1], k_spec)):
        assert got.sharding.is_equivalent_to(NamedSharding(grid, spec), 3)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# The wrapper's logic does not depend on the backend: every layout runs on XLA, and the
# Pallas kernel (slower to compile in its interpreter) on the layouts that differ in
# what a device's block looks like (heads, tokens with a sliced pos_ids, both, GQA).
KERNEL_LAYOUTS = ("heads", "tokens_pos_ids_replicated", "tokens_and_heads",
                  "gqa_groups_straddle")


@pytest.mark.parametrize("backend, layout",
                         [("xla", name) for name in LAYOUTS]
                         + [("interpret", name) for name in KERNEL_LAYOUTS])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_sharded_call_equals_the_unsharded_one_in_place_without_collectives(
        rng, axis_type, backend, layout):
    _check_sharded_call(rng, axis_type, backend, LAYOUTS[layout])


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_partial_interleaved_rotation_leaves_the_tail_dims_in_place(rng, axis_type, backend):
    # Dims past rotary_dim are never written: with aliased buffers they must still hold
    # the input, shard by shard.
    _check_sharded_call(rng, axis_type, backend, (P("data", "model"), P("data", "model"),
                                                  P("data"), 4, 4),
                        cfg=BY_NAME["interleave_d96_partial"].cfg)


def test_the_bare_kernel_under_the_same_sharding_needs_collectives():
    # The control: without the wrapper XLA gathers around the Pallas call, so the
    # assertions above can fail.
    tables, attention = kernel_constants(CFG)
    grid = mesh("auto")
    spec = NamedSharding(grid, P("data", "model"))
    q = jax.device_put(jnp.zeros((TOKENS, 8, 64), jnp.bfloat16), spec)
    k = jax.device_put(jnp.zeros((TOKENS, 4, 64), jnp.bfloat16), spec)
    bare = jax.jit(lambda q, k, pos: triton_rope.rope_triton(
        q, k, pos, jnp.asarray(tables), rotary_dim=64, interleave=False,
        attention_factor=attention, interpret=True))
    text = bare.lower(q, k, jnp.zeros((TOKENS,), jnp.int32)).compile().as_text()
    assert "all-gather" in collectives(text)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_outside_jit_a_sharded_call_keeps_the_sharding(rng, axis_type):
    grid = mesh(axis_type)
    q, k, pos = _inputs(rng, 8, 4)
    spec = NamedSharding(grid, P("data", "model"))
    out = jr.apply_rope(jax.device_put(q, spec), jax.device_put(k, spec), pos, CFG)
    expected = jr.apply_rope(q, k, pos, CFG)
    assert out[0].sharding.is_equivalent_to(spec, 3)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(expected[0]))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(expected[1]))


# Layouts no per-shard call takes as given: (q spec, k spec, pos_ids spec, Hq, Hk, the
# Explicit-axes message).
NEEDS_COMMUNICATION = {
    "head_dim": (P(None, None, "model"), P(), P(), 8, 4, "sharded over its head_dim"),
    "tokens_differ": (P("data"), P("model"), P(), 8, 4,
                      r"q's tokens \(axis 0\) are sharded over \('data',\) but k's over"),
    "only_k_tokens_sharded": (P(), P("data"), P(), 8, 4,
                              r"q's tokens \(axis 0\) are sharded over no mesh axis but k's "
                              r"over \('data',\)"),
    "pos_ids_elsewhere": (P("data"), P("data"), P("model"), 8, 4,
                          r"pos_ids is sharded over \('model',\) but q's and k's tokens"),
    "pos_ids_without_tokens": (P(None, "model"), P(None, "model"), P("data"), 8, 4,
                               r"pos_ids is sharded over \('data',\) but q's and k's tokens "
                               r"over no mesh axis"),
}


def _placed(grid, rng, case):
    q_spec, k_spec, pos_spec, q_heads, k_heads, _ = NEEDS_COMMUNICATION[case]
    q, k, pos = _inputs(rng, q_heads, k_heads)
    placed = tuple(jax.device_put(x, NamedSharding(grid, spec))
                   for x, spec in ((q, q_spec), (k, k_spec), (pos, pos_spec)))
    return (q, k, jnp.asarray(pos)), placed


@pytest.mark.parametrize("case", NEEDS_COMMUNICATION)
def test_on_explicit_axes_a_layout_that_needs_communication_raises_before_compiling(rng, case):
    _, placed = _placed(mesh("explicit"), rng, case)
    message = NEEDS_COMMUNICATION[case][-1]
    # The specs are part of the types: the refusal comes while tracing, nothing compiled.
    with pytest.raises(ValueError, match=message):
        jax.jit(functools.partial(jr.apply_rope, cfg=CFG, backend="interpret")).lower(*placed)
    with pytest.raises(ValueError, match=message):
        jr.apply_rope(*placed, CFG, backend="xla")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("case", NEEDS_COMMUNICATION)
def test_on_auto_axes_a_layout_that_needs_communication_runs_resharded(rng, case, backend):
    # The compiler chose the shardings: the kernel asks for the nearest layout it takes
    # (sharding.runnable_specs) and XLA inserts the reshard.
    unsharded, placed = _placed(mesh("auto"), rng, case)
    rope = jax.jit(functools.partial(jr.apply_rope, cfg=CFG, backend=backend))
    expected = rope(*unsharded)
    assert collectives(rope.lower(*placed).compile().as_text()), "no reshard was inserted"
    for got, want in zip(rope(*placed), expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Outside jit the same op runs (compiled on its own, so compared to a bf16 ulp).
    for got, want in zip(jr.apply_rope(*placed, CFG, backend=backend), expected):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2.0 ** -7, atol=2.0 ** -7)


def test_heads_that_split_unevenly_run_replicated_on_auto_axes(rng):
    # device_put refuses uneven NamedShardings; inside jit an Auto constraint can ask
    # for 6 heads over 4 devices, which the kernel takes with q's heads replicated.
    grid = mesh("auto")
    pos = jnp.arange(TOKENS, dtype=jnp.int32)

    def step(q, k):
        q = jax.lax.with_sharding_constraint(q, NamedSharding(grid, P(None, "model")))
        return jr.apply_rope(q, k, pos, CFG, backend="interpret")

    q, k, _ = _inputs(rng, 6, 2)
    for got, want in zip(jax.jit(step)(q, k), _rope(CFG, "interpret")(q.copy(), k.copy(), pos)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=r"k.shape\[1\]=2 \(heads\) does not split evenly"):
        sharding.local_specs(P(), P(None, "model"), P(), (4, 8, 64), (4, 2, 64), {"model": 4})


def test_a_mesh_mixing_axis_types_is_refused():
    grid = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto))
    q = jax.device_put(jnp.zeros((TOKENS, 8, 64)), NamedSharding(grid, P("data")))
    with pytest.raises(NotImplementedError, match="mixing Auto and Explicit axes"):
        jr.apply_rope(q, q, jnp.zeros((TOKENS,), jnp.int32), jr.RopeConfig(head_dim=64))


def test_inside_a_users_shard_map_the_kernel_runs_on_the_local_block(rng):
    # Manual axes: the arrays already are per-device blocks, so the kernel is called as is.
    grid = mesh("explicit")
    q, k, pos = _inputs(rng, 8, 4)
    spec = P("data", "model")
    # check_vma=False as for any Pallas call in a shard_map: JAX 0.11's pallas_call
    # outputs carry no varying-axes type.
    local = jax.shard_map(lambda q, k, p: jr.apply_rope(q, k, p, CFG, backend="interpret"),
                          mesh=grid, in_specs=(spec, spec, P("data")), out_specs=(spec, spec),
                          check_vma=False)
    out = jax.jit(local)(jax.device_put(q, NamedSharding(grid, spec)),
                         jax.device_put(k, NamedSharding(grid, spec)),
                         jax.device_put(pos, NamedSharding(grid, P("data"))))
    expected = jr.apply_rope(q, k, pos, CFG, backend="interpret")
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(expected[0]))


MOSAIC_MISSING = mosaic_common.unavailable()


@pytest.mark.skipif(MOSAIC_MISSING is not None, reason=str(MOSAIC_MISSING))
def test_mosaic_kernel_runs_per_shard_on_explicit_axes_and_is_refused_on_auto(rng):
    # The Mosaic GPU kernel (its interpreter on CPU) through the same wrapper: Explicit
    # axes shard_map it; on Auto axes custom_partitioning cannot lower its mutable refs.
    cfg = jr.RopeConfig(head_dim=128)
    tables, attention = kernel_constants(cfg)
    impl = functools.partial(mosaic_rope.rope_mosaic, interpret=True)
    q, k, pos = _inputs(rng, 4, 4, head_dim=128, dtype=jnp.float32)

    def call(q, k, pos):
        return sharding.per_shard(impl, q, k, pos)(q, k, pos, jnp.asarray(tables),
                                                   rotary_dim=128, interleave=False,
                                                   attention_factor=attention)

    expected = call(q, k, jnp.asarray(pos))
    grid = mesh("explicit", (2, 2))
    spec = NamedSharding(grid, P("data", "model"))
    args = (jax.device_put(q, spec), jax.device_put(k, spec), jax.device_put(pos, NamedSharding(grid, P())))
    text = jax.jit(call).lower(*args).compile().as_text()
    assert collectives(text) == []
    out = jax.jit(call)(*args)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(expected[0]))
    grid = mesh("auto", (2, 2))
    spec = NamedSharding(grid, P("data", "model"))
    with pytest.raises(jr.BackendUnavailable, match="custom_partitioning cannot lower"):
        jax.jit(call).lower(jax.device_put(q, spec), jax.device_put(k, spec), pos)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_mrope_positions_on_a_mesh_are_refused_with_the_reason(rng, axis_type):
    grid = mesh(axis_type, (8,), ("data",))
    cfg = jr.RopeConfig(head_dim=64, mrope_section=(8, 12, 12))
    by_token = NamedSharding(grid, P("data"))
    q = jax.device_put(jnp.asarray(rng.standard_normal((16, 4, 64)), jnp.float32), by_token)
    k = jax.device_put(jnp.asarray(rng.standard_normal((16, 2, 64)), jnp.float32), by_token)
    with pytest.raises(NotImplementedError, match="M-RoPE pos_ids.shape=\\(3, 16\\)"):
        jr.apply_rope(q, k, jnp.zeros((3, 16), jnp.int32), cfg, backend="xla")
