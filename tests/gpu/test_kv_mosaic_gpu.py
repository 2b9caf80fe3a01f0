"""The Mosaic GPU append kernel compiled on the GPU, against the float64 oracle, the
Triton-lowered kernel and the XLA reference: every named append case and dtype, every
layout form at T in (0, 1, 17, 512, 4099), fp8 with scales, slots at -1 and past the cache.

Where the math is the same the caches are the same bits (v rows, dims past ``rotary_dim``,
fp8 conversions of equal values, every entry no slot names); the rotated values differ by
the hardware sine against XLA's, within two ulps of a row's scale (float32: within the
oracle's bound). The CPU suite runs the
same body in Mosaic GPU's interpreter (tests/test_kv_mosaic_interpret.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import APPEND_BY_NAME, APPEND_CASES, MROPE_APPEND_CASES
from jaxrope.ops.rope_append_kv import cache_layout
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_inputs import check_against_oracle, make_inputs, run

pytestmark = pytest.mark.gpu

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
FORMS = [("NHD", False), ("HND", False), ("NHD", True), ("HND", True), ("paged_attention", False),
         ("ragged_paged_attention", True)]
CFG = jr.RopeConfig(head_dim=128, theta=5e5, max_position=1 << 20)
MROPE = jr.RopeConfig(head_dim=128, theta=1e6, max_position=1 << 20, mrope_section=(16, 24, 24))
fused = jax.jit(jr.apply_rope_and_append_kv,
                static_argnames=("cfg", "layout", "backend", "k_quant_scale", "v_quant_scale"))


def _within_rounding(a, b, label):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == jnp.float8_e4m3fn:
        worst = kv_oracle.ulps(a, b).max(initial=0)
        assert worst <= 1, f"{label}: {worst} e4m3 ulps apart"
        return
    if a.dtype == np.float32:
        # The hardware sine's ~1e-6 is several float32 ulps: within the oracle's bound.
        error = oracle.relative_error(a.astype(np.float64), b.astype(np.float64))
        assert error < oracle.RELATIVE_TOLERANCE["float32"], f"{label}: {error:.2g} apart"
        return
    worst = kv_oracle.row_ulps(a, b).max(initial=0)
    assert worst <= 2, f"{label}: {worst} ulps of the row's scale apart"


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", APPEND_CASES + MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_compiled_mosaic_append_matches_the_oracle_and_the_triton_kernel(case, dtype_name,
                                                                         hopper, rng):
    x = make_inputs(rng, case, DTYPES[dtype_name])
    ours = run(x, case, "mosaic")
    check_against_oracle(case, x, ours, oracle.RELATIVE_TOLERANCE[dtype_name])
    for backend in ("triton", "xla"):
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(run(x, case, backend))):
            _within_rounding(a, b, f"{case.name} mosaic vs {backend}")


def _form_inputs(rng, cfg, layout, combined, tokens, dtype, fp8, q_heads=32, k_heads=8,
                 page_size=16):
    pages = 2 * -(-max(tokens, 1) // page_size) + 1
    shape = cache_layout.shape(layout, combined, pages, page_size, k_heads, cfg.head_dim)
    cache_dtype = jnp.float8_e4m3fn if fp8 else dtype
    old = [jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(cache_dtype)
           for _ in range(1 if combined else 2)]
    q, k, v = (jnp.asarray(rng.standard_normal((tokens, h, cfg.head_dim)), dtype)
               for h in (q_heads, k_heads, k_heads))
    rows = () if cfg.mrope_section is None else (3,)
    pos = jnp.asarray(rng.integers(0, cfg.max_position, (*rows, tokens)), jnp.int32)
    slots = rng.permutation(pages * page_size)[:tokens].astype(np.int32)
    slots[::7] = -1                          # padding
    slots[3::11] = pages * page_size + 5     # past the cache: traced under jit, skipped
    cache = old[0] if combined else tuple(old)
    return q, k, v, pos, cache, jnp.asarray(slots)


@pytest.mark.parametrize("tokens", [0, 1, 17, 512, 4099])
@pytest.mark.parametrize("layout,combined", FORMS, ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiled_mosaic_append_writes_every_layout_as_the_other_backends(
        layout, combined, tokens, fp8, hopper, rng):
    cfg = MROPE if tokens == 17 else CFG
    q, k, v, pos, cache, slots = _form_inputs(rng, cfg, layout, combined, tokens,
                                              jnp.bfloat16, fp8)
    scales = dict(k_quant_scale=0.75, v_quant_scale=150.0) if fp8 else {}
    outs = {b: fused(q, k, v, pos, cache, slots, cfg=cfg, layout=layout, backend=b, **scales)
            for b in ("mosaic", "triton", "xla")}
    for backend in ("triton", "xla"):
        for a, b in zip(jax.tree.leaves(outs["mosaic"]), jax.tree.leaves(outs[backend])):
            _within_rounding(a, b, f"{layout} combined={combined} T={tokens} vs {backend}")
    if tokens:
        want = oracle.rope_of(cfg, np.asarray(q, np.float64), np.asarray(pos))
        assert oracle.relative_error(np.asarray(outs["mosaic"][0], np.float64), want) < \
            oracle.RELATIVE_TOLERANCE["bfloat16"]
    # Every entry no valid slot names keeps its bits (the rows by kv_layout's stride rule,
    # which tests/test_kv_layouts.py checks against each reader).
    for new, mask, prev in zip(jax.tree.leaves(outs["mosaic"][1]),
                               _written(layout, combined, slots, cache), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(kv_oracle.bits(new)[~mask], kv_oracle.bits(prev)[~mask])


def _written(layout, combined, slots, cache):
    """bool masks, one per cache array, of the elements the valid slots' k and v rows hold."""
    arrays = jax.tree.leaves(cache)
    pages, page_size = cache_layout.geometry(layout, combined, arrays[0].shape)
    k_heads = arrays[0].shape[-2] // 2 if layout == "ragged_paged_attention" else (
        arrays[0].shape[cache_layout.axes(layout, combined).index("head")])
    rows = cache_layout.cache_rows(layout, combined, pages, page_size, k_heads)
    slots = np.asarray(slots)
    s = slots[(slots >= 0) & (slots < rows.num_slots)][:, None]
    keys = rows.row(s // page_size, s % page_size, np.arange(k_heads)[None, :]).ravel()
    masks = [np.zeros(a.shape[:-1], bool).reshape(-1) for a in arrays]
    masks[0][keys] = True
    masks[rows.value_array][keys + rows.value_offset] = True
    return [m.reshape(a.shape[:-1])[..., None].repeat(a.shape[-1], -1)
            for m, a in zip(masks, arrays)]


def test_auto_takes_the_mosaic_append_on_hopper(hopper, rng):
    x = make_inputs(rng, APPEND_BY_NAME["llama3_nhd_p16"], jnp.bfloat16)
    auto = run(x, APPEND_BY_NAME["llama3_nhd_p16"], "auto")
    mosaic = run(x, APPEND_BY_NAME["llama3_nhd_p16"], "mosaic")
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(mosaic)):
        np.testing.assert_array_equal(kv_oracle.bits(a), kv_oracle.bits(b))
    assert jr.ops.backends.backend_name("auto", hopper.platform, "rope_append_kv",
                                   hopper.compute_capability) == "mosaic"
