"""Named calls of the fused append with a per-head QK-norm and an fp8 q, their inputs, the
kernels' call of them, and the check against a float64 oracle.

One copy for the interpreter tests (``tests/test_kv_norm_fp8q_triton.py``) and the GPU
ones (``tests/gpu/test_kv_norm_fp8q_gpu.py``). The oracle (:func:`norm_oracle`, then
:func:`jaxrope.testing.oracle.rope_of`; fp8 through :func:`jaxrope.testing.kv_oracle.e4m3`)
is written from the formulas; :func:`operands` and :func:`xla` build the kernels' call
and the XLA reference's output as :func:`jaxrope.apply_rope_and_append_kv` does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_oracle import bits, split

FP8 = jnp.dtype(jnp.float8_e4m3fn)
QWEN3 = jr.QKNorm(eps=1e-6)
GEMMA = jr.QKNorm(eps=1e-6, convention="gemma")
# k, v, q: v saturates past |v| ~ 3, q past |x| ~ 11 (an unnormalised q of N(0, 9) does).
SCALES = (0.75, 150.0, 40.0)


def norm_oracle(x, weight, qk_norm: jr.QKNorm) -> np.ndarray:
    """float64 ``[T, H, D]``: the RMSNorm written from its formula."""
    x = np.asarray(x, np.float64)
    w = np.asarray(weight, np.float64)
    axes = (-1,) if qk_norm.per_head else (-2, -1)
    w = w if qk_norm.per_head else w.reshape(x.shape[-2:])
    w = 1.0 + w if qk_norm.convention == "gemma" else w
    return x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + qk_norm.eps) * w


@dataclasses.dataclass(frozen=True)
class Spec:
    """One call: the config, dtypes, which of q and k are normalised, the cache's form."""

    cfg: jr.RopeConfig
    dtype: object
    qk_norm: Optional[jr.QKNorm] = None
    norm_q: bool = False
    norm_k: bool = False
    weight_dtype: object = jnp.float32
    layout: str = "NHD"
    combined: bool = False
    fp8_cache: bool = False
    fp8_q: bool = False
    num_scales: int = 3  # 2: the scales of today's callers, for a q kept in its dtype
    tokens: int = 5
    q_heads: int = 4
    k_heads: int = 2
    pages: int = 3
    page_size: int = 4


SPECS: Dict[str, Spec] = {
    # Qwen3 (Hq 4, Hk 2 of its GQA ratio), bf16 weights as the checkpoint holds them.
    "qwen3_bf16": Spec(jr.RopeConfig(head_dim=128, theta=1e6), jnp.bfloat16, QWEN3, True, True,
                       jnp.bfloat16, num_scales=2),
    # Passthrough dims [40, 80) loaded as a 64-lane piece running past D, weights too.
    "gemma_d80_partial_hnd_combined": Spec(jr.RopeConfig(head_dim=80, rotary_dim=40),
                                           jnp.float32, GEMMA, True, True, layout="HND",
                                           combined=True),
    # q not normalised but quantised: its passthrough dims scaled and stored too.
    "interleave_k_only_f16_fp8_q": Spec(jr.RopeConfig(head_dim=64, rotary_dim=32, interleave=True),
                                        jnp.float16, QWEN3, False, True, jnp.bfloat16,
                                        layout="HND", fp8_q=True),
    "mrope_q_only_combined": Spec(jr.RopeConfig(head_dim=128, mrope_section=(16, 24, 24)),
                                  jnp.bfloat16, QWEN3, True, False, combined=True),
    "gemma_partial_fp8_cache_fp8_q": Spec(jr.RopeConfig(head_dim=64, rotary_dim=32),
                                          jnp.bfloat16, GEMMA, True, True, jnp.bfloat16,
                                          fp8_cache=True, fp8_q=True),
}


@dataclasses.dataclass
class Inputs:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    pos: np.ndarray      # int32 [T], or [3, T] for an M-RoPE config
    slots: np.ndarray    # int32 [T]: one at -1 and one past the cache
    kv_cache: object     # (k_cache, v_cache), or one [pages, 2, ...] array (combined)
    q_w: Optional[jax.Array]
    k_w: Optional[jax.Array]


def make_inputs(rng: np.random.Generator, spec: Spec) -> Inputs:
    """Values of RMS 3 (so the norm shows), random positions, distinct slots with token 1
    at -1 and token 3 past the cache, and a cache of random old entries (so an entry
    written by mistake shows)."""
    cfg, tokens = spec.cfg, spec.tokens

    def normal(*shape, dtype=spec.dtype, centre=0.0, spread=3.0):
        return jnp.asarray(centre + spread * rng.standard_normal(shape), dtype)

    def weight(asked: bool):
        if not asked:
            return None
        # Around 1 for x * w, around 0 for x * (1 + w): the values models train to.
        centre = 0.0 if spec.qk_norm.convention == "gemma" else 1.0
        return normal(cfg.head_dim, dtype=spec.weight_dtype, centre=centre, spread=0.5)

    rows = () if cfg.mrope_section is None else (3,)
    pos = rng.integers(0, cfg.max_position, (*rows, tokens)).astype(np.int32)
    num_slots = spec.pages * spec.page_size
    slots = rng.permutation(num_slots)[:tokens].astype(np.int32)
    slots[1], slots[3] = -1, num_slots + 5
    shape = ((spec.page_size, spec.k_heads) if spec.layout == "NHD"
             else (spec.k_heads, spec.page_size))
    cache_dtype = FP8 if spec.fp8_cache else spec.dtype
    old = [normal(spec.pages, *shape, cfg.head_dim, dtype=jnp.float32).astype(cache_dtype)
           for _ in "kv"]
    return Inputs(normal(tokens, spec.q_heads, cfg.head_dim),
                  normal(tokens, spec.k_heads, cfg.head_dim),
                  normal(tokens, spec.k_heads, cfg.head_dim), pos, slots,
                  jnp.stack(old, axis=1) if spec.combined else tuple(old),
                  weight(spec.norm_q), weight(spec.norm_k))


def operands(spec: Spec, x: Inputs):
    """``(args, kwargs)``: ``apply_rope_and_append_kv``'s call of a kernel (the
    implementation signature of :data:`jaxrope.ops.backends.IMPLEMENTATIONS`)."""
    from jaxrope.ops.constants import kernel_constants, kernel_options
    from jaxrope.ops.rope_append_kv import api as kv_api

    caches, _, rows = kv_api._caches(x.kv_cache, spec.layout, x.k)
    tables, _ = kernel_constants(spec.cfg)
    scales = jnp.asarray(SCALES[:spec.num_scales], jnp.float32)
    norm = (dict(q_norm_weight=x.q_w, k_norm_weight=x.k_w, qk_norm=spec.qk_norm)
            if spec.qk_norm else {})
    args = (x.q, x.k, x.v, jnp.asarray(x.pos), jnp.asarray(x.slots), jnp.asarray(tables),
            scales, tuple(c.reshape(-1, c.shape[-1]) for c in caches))
    return args, dict(rows=rows, **kernel_options(spec.cfg), **norm)


def cache_back(spec: Spec, x: Inputs, views):
    """The kernel's ``[rows, D]`` views back in the structure of ``x.kv_cache``."""
    caches = x.kv_cache if isinstance(x.kv_cache, tuple) else (x.kv_cache,)
    written = tuple(view.reshape(c.shape) for view, c in zip(views, caches))
    return written[0] if spec.combined else written


def run_kernel(spec: Spec, x: Inputs, kernel: Callable, **options):
    """``(q_out, kv_cache)`` of ``kernel`` (an implementation, e.g.
    :func:`jaxrope.ops.rope_append_kv.triton.rope_append_kv_triton`) jitted on ``x``."""
    args, kwargs = operands(spec, x)
    q_dtype = FP8 if spec.fp8_q else None
    q, views = jax.jit(lambda *a: kernel(*a, q_dtype=q_dtype, **options, **kwargs))(*args)
    return q, cache_back(spec, x, views)


def xla(spec: Spec, x: Inputs):
    """The XLA reference's ``(q_out, kv_cache)``; an fp8 q quantised from the float32
    rotation it rounds, by the same ``to_cache_dtype``."""
    from jaxrope.ops.rope.reference import rope_reference
    from jaxrope.ops.rope_append_kv.reference import rope_append_kv_reference, to_cache_dtype
    from jaxrope.qk_norm import normalize

    args, kwargs = operands(spec, x)
    q, views = jax.jit(lambda *a: rope_append_kv_reference(*a, **kwargs))(*args)
    if spec.fp8_q:
        q_in = (normalize(x.q, x.q_w, spec.qk_norm) if spec.norm_q
                else x.q.astype(jnp.float32))
        rope = {name: kwargs[name] for name in ("rotary_dim", "interleave", "attention_factor",
                                                "mrope_section", "mrope_interleaved")
                if name in kwargs}
        rotated, _ = rope_reference(q_in, x.k.astype(jnp.float32), args[3], args[5], **rope)
        q = to_cache_dtype(rotated, jnp.float32(SCALES[2]), FP8)
    return q, cache_back(spec, x, views)


def within_one_e4m3_ulp(got, want, label: str) -> None:
    worst = kv_oracle.ulps(np.asarray(got), np.asarray(want)).max(initial=0)
    assert worst <= 1, f"{label}: {worst} e4m3 ulps"


def check_against_oracle(spec: Spec, x: Inputs, out) -> None:
    """q and the written k rows against the float64 norm + rotation (fp8: within one e4m3
    ulp of the oracle quantised, else the dtype's relative tolerance), v rows as given
    (quantised for fp8), and every entry no slot names unchanged."""
    cfg, tolerance = spec.cfg, oracle.RELATIVE_TOLERANCE[jnp.dtype(spec.dtype).name]
    q_out, kv_out = out
    assert isinstance(kv_out, tuple) != spec.combined, "the cache comes back in the structure given"
    q_in = norm_oracle(x.q, x.q_w, spec.qk_norm) if spec.norm_q else x.q
    k_in = norm_oracle(x.k, x.k_w, spec.qk_norm) if spec.norm_k else x.k
    q_want, k_want = oracle.rope_of(cfg, q_in, x.pos), oracle.rope_of(cfg, k_in, x.pos)
    if spec.fp8_q:
        assert q_out.dtype == FP8 and q_out.shape == x.q.shape
        within_one_e4m3_ulp(q_out, kv_oracle.e4m3(q_want * SCALES[2]), "q")
    else:
        assert q_out.dtype == x.q.dtype
        error = oracle.relative_error(q_out, q_want)
        assert error < tolerance, f"q: relative error {error:.3g}"
    new, old = split(kv_out), split(x.kv_cache)
    written, page, entry = kv_oracle.entries(x.slots, spec.pages, spec.page_size)
    assert written.sum() == spec.tokens - 2
    page, entry = page[written], entry[written]
    k_rows, v_rows = (kv_oracle.rows(c, spec.layout, page, entry) for c in new)
    if spec.fp8_cache:
        within_one_e4m3_ulp(k_rows, kv_oracle.e4m3(k_want[written] * SCALES[0]), "k rows")
        v_want = kv_oracle.e4m3(np.asarray(x.v, np.float64)[written] * SCALES[1])
        within_one_e4m3_ulp(v_rows, v_want, "v rows")
    else:
        error = oracle.relative_error(k_rows, k_want[written])
        assert error < tolerance, f"k rows: relative error {error:.3g}"
        np.testing.assert_array_equal(bits(v_rows), bits(x.v)[written], err_msg="v rows")
    for name, n, o in zip(("k_cache", "v_cache"), new, old):
        kv_oracle.assert_untouched(name, n, o, kv_oracle.written_mask(n.shape, spec.layout,
                                                                      page, entry))


def xla_ulps(spec: Spec) -> float:
    """How far (ulps of the row's scale, :func:`jaxrope.testing.kv_oracle.row_ulps`) two
    evaluations of ``spec``'s call may differ: a rounding or two of the rotation's products;
    in float32 with a norm also the norm's sum of ``head_dim`` squares, which XLA on a GPU
    adds in another order than the kernel. That sum's rounding errors grow like
    ``sqrt(head_dim)`` in practice and ``head_dim`` at worst (each evaluation off by up to
    ``(head_dim - 1) / 4`` relative ulps after the square root, in opposite directions, on a
    row whose largest element is up to twice its power of two); the allowance
    ``(head_dim - 1) / 4`` is set from measurement on the GPU (bench/RESULTS.md, "GPU
    tests"), not that worst case. A wrong kernel (bf16 sums, a wrong divisor, a
    missing ``1 + w``) is off by thousands. In bf16 or f16 outputs the float32 roundings
    stay below one output ulp."""
    if (spec.norm_q or spec.norm_k) and np.dtype(spec.dtype) == np.float32:
        return 2 + (spec.cfg.head_dim - 1) / 4
    return 2


def check_against_xla(label: str, spec: Spec, got, want) -> None:
    """Two evaluations of the call: fp8 leaves within one e4m3 ulp, the others within
    :func:`xla_ulps` of the row's scale."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if a.dtype == FP8:
            within_one_e4m3_ulp(a, b, f"{label} vs XLA")
        else:
            worst = kv_oracle.row_ulps(np.asarray(a), np.asarray(b)).max(initial=0)
            assert worst <= xla_ulps(spec), f"{label}: {worst} ulps of the row's scale from XLA"
