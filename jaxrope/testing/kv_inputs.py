"""Random inputs for a named append case, the jitted fused op, and its check against the oracle.

One copy for the 1-D and the M-RoPE append tests (``tests/test_kv_cache.py``,
``tests/test_kv_mrope.py``): an M-RoPE case (its config has ``mrope_section``) gets
positions ``[3, T]`` whose rows differ per token (an image's t, h, w), a 1-D case ``[T]``.
The check compares with :mod:`jaxrope.testing.oracle` and :mod:`jaxrope.testing.kv_oracle`
only; nothing here imports ``jaxrope.ops``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from jaxrope.cases import AppendCase
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_oracle import bits, split

FP8_SCALES = {"k_quant_scale": 0.75, "v_quant_scale": 150.0}  # v saturates past |v| ~ 3

fused = jax.jit(jr.apply_rope_and_append_kv, static_argnames=("cfg", "layout", "backend"))


@dataclasses.dataclass
class Inputs:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    pos: np.ndarray      # int32 [T], or [3, T] for an M-RoPE case
    slots: np.ndarray    # int32 [T]; the case's padding tokens at -1
    kv_cache: object     # (k_cache, v_cache), or one [pages, 2, ...] array (combined)
    scales: dict         # FP8_SCALES for an fp8 cache, else none


def cache_shape(case: AppendCase, pages: Optional[int] = None) -> Tuple[int, ...]:
    c = case.case
    rows = ((case.page_size, c.k_heads) if case.layout == "NHD" else (c.k_heads, case.page_size))
    return (pages or case.pages, *rows, c.head_dim)


def make_inputs(rng: np.random.Generator, case: AppendCase, dtype,
                max_position: Optional[int] = None) -> Inputs:
    """q, k, v ~ N(0, 1) in ``dtype``, positions below ``max_position`` (default the
    config's), distinct random slots with the padding at -1, and a cache of random old
    entries (so an entry written by mistake shows)."""
    c = case.case
    tokens = c.tokens

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    rows = () if c.cfg.mrope_section is None else (3,)
    pos = rng.integers(0, max_position or c.cfg.max_position, (*rows, tokens)).astype(np.int32)
    slots = rng.permutation(case.pages * case.page_size)[:tokens].astype(np.int32)
    slots[tokens - case.padding:] = -1
    cache_dtype = jnp.float8_e4m3fn if case.fp8 else dtype
    old = [jnp.asarray(rng.standard_normal(cache_shape(case)), jnp.float32).astype(cache_dtype)
           for _ in "kv"]
    kv_cache = jnp.stack(old, axis=1) if case.combined else tuple(old)
    return Inputs(normal(tokens, c.q_heads, c.head_dim), normal(tokens, c.k_heads, c.head_dim),
                  normal(tokens, c.k_heads, c.head_dim), pos, slots, kv_cache,
                  FP8_SCALES if case.fp8 else {})


def run(x: Inputs, case: AppendCase, backend: str, cfg: Optional[jr.RopeConfig] = None,
        pos: Optional[np.ndarray] = None):
    """The jitted fused op on ``x`` (``pos``: other positions than ``x.pos``)."""
    return fused(x.q, x.k, x.v, jnp.asarray(x.pos if pos is None else pos), x.kv_cache,
                 jnp.asarray(x.slots), cfg=cfg or case.case.cfg, layout=case.layout,
                 backend=backend, **x.scales)


def check_against_oracle(case: AppendCase, x: Inputs, out, tolerance: float,
                         cfg: Optional[jr.RopeConfig] = None) -> None:
    """``out = (q, kv_cache)`` of the fused op on ``x``: the cache in the structure given;
    dims past ``rotary_dim`` and v rows bit for bit (fp8: k and v rows within an e4m3
    ulp of the quantized oracle); q and the k rows within ``tolerance`` relative error of
    the float64 rotation; every entry no slot names unchanged."""
    cfg = cfg or case.case.cfg
    q_out, kv_out = out
    assert isinstance(kv_out, tuple) != case.combined, "the cache comes back in the structure given"
    new, old = split(kv_out), split(x.kv_cache)
    # Pages and tokens from the inputs, not the case: a test may size both up.
    written, page, entry = kv_oracle.entries(x.slots, len(old[0]), case.page_size)
    assert written.sum() == len(x.slots) - case.padding
    page, entry = page[written], entry[written]
    np.testing.assert_array_equal(bits(q_out)[..., cfg.rotary_dim:], bits(x.q)[..., cfg.rotary_dim:],
                                  err_msg="q: dims past rotary_dim changed")
    k_rows, v_rows = (kv_oracle.rows(c, case.layout, page, entry) for c in new)
    k_want = oracle.rope_of(cfg, x.k, x.pos)[written]
    actual = [np.asarray(q_out, np.float64).ravel()]
    expected = [oracle.rope_of(cfg, x.q, x.pos).ravel()]
    if case.fp8:
        ulps_k = kv_oracle.ulps(k_rows, kv_oracle.e4m3(k_want * x.scales["k_quant_scale"]))
        v_want = kv_oracle.e4m3(np.asarray(x.v, np.float64)[written] * x.scales["v_quant_scale"])
        ulps_v = kv_oracle.ulps(v_rows, v_want)
        assert ulps_k.max(initial=0) <= 1 and ulps_v.max(initial=0) <= 1, (ulps_k.max(initial=0),
                                                                          ulps_v.max(initial=0))
    else:
        np.testing.assert_array_equal(bits(k_rows)[..., cfg.rotary_dim:],
                                      bits(x.k)[written][..., cfg.rotary_dim:],
                                      err_msg="k: dims past rotary_dim must be copied")
        np.testing.assert_array_equal(bits(v_rows), bits(x.v)[written], err_msg="v rows")
        # One error over q and the k rows: a 1-token, 1-head k alone is too few values.
        actual.append(k_rows.astype(np.float64).ravel())
        expected.append(k_want.ravel())
    error = oracle.relative_error(np.concatenate(actual), np.concatenate(expected))
    assert error < tolerance, f"relative error {error:.3g}"
    for name, n, o in zip(("k_cache", "v_cache"), new, old):
        kv_oracle.assert_untouched(name, n, o, kv_oracle.written_mask(n.shape, case.layout, page,
                                                                      entry))
