"""``apply_rope_and_append_kv``: RoPE fused with the paged KV-cache append, in one pass.

After RoPE an engine writes the rotated k and the v into its paged KV cache; done as two
kernels, k is read twice. This op rotates q (in place when donated) and writes the
rotated k and the v into the cache at each token's slot in one launch on the GPU: the
Mosaic GPU kernel (:mod:`jaxrope.ops.rope_append_kv.mosaic`) on Hopper or newer, the
Triton-lowered one (:mod:`jaxrope.ops.rope_append_kv.triton`) on other GPUs
(:data:`jaxrope.ops.backends.IMPLEMENTATIONS`).

Vocabulary and conventions:

- **slots** (vLLM's ``slot_mapping``): int ``[T]``, token ``t`` goes to page
  ``slots[t] // page_size``, entry ``slots[t] % page_size``; a negative slot (padding,
  conventionally -1) writes nothing. FlashInfer's ``(kv_indices, kv_indptr,
  batch_indices, positions)`` describe the same thing: ``slot = kv_indices[kv_indptr[b]
  + p // page_size] * page_size + p % page_size`` for token ``(b, p)``;
  :mod:`jaxrope.paging` computes slots from either page table.
- **kv_cache** and **layout**: FlashInfer's ``paged_kv_cache``: a tuple ``(k_cache,
  v_cache)`` of ``[pages, page_size, Hk, D]`` arrays (``layout="NHD"``, FlashInfer's
  default) or ``[pages, Hk, page_size, D]`` (``"HND"``), or one ``[pages, 2, page_size,
  Hk, D]`` (``[pages, 2, Hk, page_size, D]``) array holding keys at ``[:, 0]`` and values
  at ``[:, 1]`` (vLLM's FlashInfer backend allocates this one). What JAX's own kernels
  read (:data:`JAX_LAYOUTS`): ``"paged_attention"``, a ``(k_pages, v_pages)`` pair of
  ``[Hk, pages, page_size, D]`` arrays (``jax.experimental.pallas.ops.gpu.
  paged_attention``); ``"ragged_paged_attention"``, one ``[pages, page_size, 2 * Hk, D]``
  array with keys at even heads ``[:, :, 0::2]`` and values at odd ones ``[:, :, 1::2]``
  (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``). Every layout is one
  stride rule (:mod:`jaxrope.ops.rope_append_kv.cache_layout`).
- **M-RoPE** (``cfg.mrope_section``): ``pos_ids [3, T]``, each frequency slot rotated
  by its row's position exactly as :func:`jaxrope.apply_rope` does it.
- **fp8**: a ``float8_e4m3fn`` cache stores ``e4m3(clip(x * k_quant_scale, -448, 448))``
  (rounded to nearest even) for the float32 rotated k, likewise v with
  ``v_quant_scale``: FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache``, whose
  ``quant_scale_kv`` multiplies (vLLM's ``k_scale`` divides: pass its reciprocal).
- **fp8 q** (``q_dtype=jnp.float8_e4m3fn``): q comes back as a new ``float8_e4m3fn``
  array ``e4m3(clip(x * q_quant_scale, -448, 448))`` of the float32 rotated q, every dim
  (those past ``rotary_dim`` too), and q itself is left as it is: FlashInfer's
  ``quant_scale_q``, whose kernel multiplies the float32 rotated q by it and stores with
  the saturating e4m3 conversion (FlashInfer 0.5.3's
  ``rope_quantize_fp8_append_paged_kv_cache``, ``q_nope`` scaled alike).
- **QK-norm** (Qwen3, Gemma 3, OLMo 2): ``q_norm_weight`` / ``k_norm_weight`` with a
  :class:`jaxrope.QKNorm` normalise q / k before the rotation, in the same pass, in
  float32 (:mod:`jaxrope.qk_norm`). The Mosaic GPU and Triton kernels normalise per
  head (Qwen3, Gemma 3) in their pass; OLMo 2/3's norm over all of a token's heads runs on
  XLA ("auto" takes XLA for such a call, the kernels raise ``NotImplementedError``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import checks as _checks
from jaxrope.config import RopeConfig
from jaxrope.numbers import check_float32_positive
from jaxrope.ops import backends
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.ops.rope.api import validate
from jaxrope.ops.rope_append_kv import cache_layout
from jaxrope.ops.rope_append_kv.reference import FP8
from jaxrope.qk_norm import QKNorm, norm_asked

# FlashInfer's layouts, which the torch bridge's append takes too.
LAYOUTS = ("NHD", "HND")
# The layouts JAX's own paged-attention kernels read (jax.experimental.pallas.ops).
JAX_LAYOUTS = ("paged_attention", "ragged_paged_attention")

Cache = Union[jax.Array, Tuple[jax.Array, jax.Array]]


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _visible(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _caches(kv_cache, layout: str, k) -> Tuple[Tuple, bool, cache_layout.CacheRows]:
    """The cache arrays, whether they are one array holding k and v, and their addressing."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2 or not all(_is_array(c) for c in kv_cache):
            raise TypeError(f"kv_cache must be a (k_cache, v_cache) pair of arrays or one array, "
                            f"got a {type(kv_cache).__name__} of {len(kv_cache)}")
        if cache_layout.axes(layout, False) is None:
            raise ValueError(f"{layout=} takes one {cache_layout.describe(layout, True)} array, "
                             "not a (k_cache, v_cache) pair")
        k_cache, v_cache = kv_cache
        if k_cache is v_cache:
            # Visible outside jit and for one traced value inside it; two jit arguments
            # holding one buffer are distinct tracers (donating both, JAX refuses the call).
            raise ValueError("kv_cache=(c, c) passes one array as both k_cache and v_cache: "
                             "keys and values need separate caches; pass two arrays or one "
                             "[pages, 2, ...] array")
        cache_layout.check_pair(k_cache, v_cache, layout)
        caches, combined, name = (k_cache, v_cache), False, "k_cache"
    elif _is_array(kv_cache):
        if cache_layout.axes(layout, True) is None:
            raise ValueError(f"kv_cache.shape={tuple(kv_cache.shape)}: {layout=} takes a "
                             f"(k_cache, v_cache) pair of {cache_layout.describe(layout, False)} "
                             "arrays")
        if kv_cache.ndim != len(cache_layout.axes(layout, True)) + 1:
            raise ValueError(f"kv_cache.shape={tuple(kv_cache.shape)} must be "
                             f"{cache_layout.layout_text(layout, True)} (or pass a (k_cache, v_cache) pair)")
        caches, combined, name = (kv_cache,), True, "kv_cache"
    else:
        raise TypeError(f"kv_cache must be a (k_cache, v_cache) pair of arrays or one array, "
                        f"got {type(kv_cache).__name__}")
    shape = tuple(caches[0].shape)
    pages, page_size = cache_layout.geometry(layout, combined, shape)
    if shape != cache_layout.shape(layout, combined, pages, page_size, *k.shape[1:]):
        raise ValueError(f"{name}.shape={shape} must be {cache_layout.layout_text(layout, combined)} with "
                         f"Hk={k.shape[1]} and D={k.shape[2]} (k's heads and head_dim)")
    # The kernels address a cache as [rows, D] with int32 row numbers.
    if math.prod(shape[:-1]) >= 2 ** 31:
        raise ValueError(f"{name}.shape={shape} has {math.prod(shape[:-1])} rows of D values; "
                         "the kernels address at most 2**31 - 1")
    dtype = jnp.dtype(caches[0].dtype)
    if dtype not in (jnp.dtype(k.dtype), FP8):
        raise ValueError(f"{name}.dtype={dtype} must be k's dtype ({k.dtype}) or float8_e4m3fn")
    if _visible(k) and isinstance(k, jax.Array):
        for c in caches:
            if _visible(c) and isinstance(c, jax.Array) and c.devices() != k.devices():
                raise ValueError(f"{name} is on {c.devices()} but k is on {k.devices()}; "
                                 "put them on one device")
    return caches, combined, cache_layout.cache_rows(layout, combined, pages, page_size, k.shape[1])


def _in_cache(slots, num_slots: int):
    """Which ``slots`` lie in ``[0, num_slots)``, compared at their own width (numpy or jnp).

    A bound the dtype cannot hold is left out instead of converted (converting wraps it):
    every int8 is below 1000. The torch bridge's twin is
    :func:`torch_bridge.kv_append.int32_slots`; tests/test_kv_slot_fuzz.py checks both
    against one numpy reference.
    """
    ok = slots >= 0
    if num_slots <= np.iinfo(slots.dtype).max:
        ok = ok & (slots < num_slots)
    return ok


def check_slots(values: np.ndarray, num_slots: int) -> None:
    """The rule for slots whose values are on the host (every eager call: numpy, a JAX
    array outside ``jit``, a torch CPU tensor through the bridge): a slot in
    ``[num_slots, inf)`` is refused, a negative one is padding (skipped), and no slot of
    the cache appears twice. Compared at the values' own width.

    Raises:
      ValueError: naming the largest slot, or the repeated ones.

    Example:
      >>> check_slots(np.array([3, -1, 2**32 + 3], np.int64), 16)
      Traceback (most recent call last):
      ...
      ValueError: slots must be < 16 (pages * page_size) or negative (skipped), got a maximum of 4294967299
    """
    inside = _in_cache(values, num_slots)
    if (~inside & (values >= 0)).any():
        raise ValueError(f"slots must be < {num_slots} (pages * page_size) or negative "
                         f"(skipped), got a maximum of {int(values.max())}")
    unique, counts = np.unique(values[inside], return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slots must not repeat a slot (which write would win is "
                         f"undefined), got {unique[counts > 1][:8].tolist()} more than once")


def _slots(slots, num_tokens: int, num_slots: int):
    """``slots`` as the int32 ``[T]`` the kernels read, each outside the cache still outside it.

    Visible slots of any integer width are checked (a slot past the cache or a repeated
    one raises); traced ones are not, and a slot outside ``[0, num_slots)`` is skipped.
    Either way the range is decided at the slots' own width before the cast (a slot
    outside becomes -1), so none wraps into the cache (int64 ``-2**32 + 5`` cast to int32
    would be 5). int32 slots pass as they are: the kernels skip those outside the cache.
    """
    if not _is_array(slots):
        raise TypeError(f"slots must be an integer array, got {type(slots).__name__}")
    if slots.ndim != 1 or slots.shape[0] != num_tokens:
        raise ValueError(f"slots.shape={tuple(slots.shape)} must be [T] with T={num_tokens}")
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots.dtype={slots.dtype} must be an integer type (int32)")
    # A numpy array keeps its values on the host: without jax_enable_x64, jnp.asarray
    # would cut int64 and uint64 to 32 bits before any check could see them.
    xp = jnp if isinstance(slots, jax.Array) else np
    if xp is np:
        slots = np.asarray(slots)
    if not _visible(slots):
        _checks.slots(slots, num_slots)
    elif num_tokens:
        check_slots(np.asarray(slots), num_slots)
    if slots.dtype == np.int32:
        return jnp.asarray(slots)
    ok = _in_cache(slots, num_slots)
    # The where runs at the slots' own width, then the cast sees only slots in the cache.
    narrowed = xp.where(ok, slots, 0).astype(np.int32)
    return jnp.asarray(xp.where(ok, narrowed, np.int32(-1)))


# What each scale applies to, for the refusal of one given without it.
_CACHE_ONLY = "a float8_e4m3fn cache; leave it None for a cache in k's dtype"
_FP8_Q_ONLY = "q_dtype=float8_e4m3fn; leave it None when q keeps its dtype"


def _scale(name: str, value, quantized: bool, applies_to: str = _CACHE_ONLY):
    """``value`` as a float32 scalar (1 when None); refused where nothing is quantized."""
    if not quantized:
        if value is not None:
            raise ValueError(f"{name}={value!r} applies only to {applies_to}")
        return jnp.float32(1.0)
    if value is None:
        return jnp.float32(1.0)
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or _is_array(value)):
        raise TypeError(f"{name} must be a float or a scalar array, got {type(value).__name__}")
    if _is_array(value) and value.shape != ():
        raise ValueError(f"{name}.shape={tuple(value.shape)} must be () (one scale per tensor)")
    if _visible(value):
        check_float32_positive(name, float(np.asarray(value)))
        return jnp.asarray(value, jnp.float32)
    scale = jnp.asarray(value, jnp.float32)
    _checks.float32_positive(name, scale)  # traced: inside jaxrope.checked only
    return scale


def _q_dtype(q_dtype, q, name: str = "q") -> Optional[np.dtype]:
    """``q_dtype`` as the kernels take it: None (q rotated in its own dtype) or FP8; ``name``
    is what errors call ``q`` (MLA's "q_pe"). The rule of both fused ops."""
    if q_dtype is None:
        return None
    expected = f"None, {name}'s dtype ({q.dtype}) or float8_e4m3fn"
    try:
        dtype = jnp.dtype(q_dtype)
    except TypeError as e:
        raise TypeError(f"q_dtype={q_dtype!r} must be {expected}") from e
    if dtype == FP8:
        return FP8
    if dtype == jnp.dtype(q.dtype):
        return None
    raise ValueError(f"q_dtype={dtype} must be {expected}")


def apply_rope_and_append_kv(q, k, v, pos_ids, kv_cache: Cache, slots, cfg: RopeConfig, *,
                             layout: str = "NHD", k_quant_scale=None, v_quant_scale=None,
                             q_norm_weight=None, k_norm_weight=None,
                             qk_norm: Optional[QKNorm] = None, q_dtype=None, q_quant_scale=None,
                             backend: str = "auto"):
    """Rotate q and k by their positions and write the rotated k and the v into a paged cache.

    Args:
      q: ``[T, Hq, D]`` float32, float16 or bfloat16, ``D == cfg.head_dim``.
      k: ``[T, Hk, D]``, same dtype and ``T`` as ``q``.
      v: ``[T, Hk, D]``, same shape and dtype as ``k``.
      pos_ids: int ``[T]``, the position of each token, in ``[0, cfg.max_position)``;
        for an M-RoPE config (``cfg.mrope_section``) int ``[3, T]``, the t, h and w rows
        (checked when visible, as in :func:`jaxrope.apply_rope`, by the same checks).
      kv_cache: ``(k_cache, v_cache)``, each ``[pages, page_size, Hk, D]`` (NHD),
        ``[pages, Hk, page_size, D]`` (HND) or ``[Hk, pages, page_size, D]``
        ("paged_attention"); or one array ``[pages, 2, page_size, Hk, D]`` (NHD),
        ``[pages, 2, Hk, page_size, D]`` (HND) with keys at ``[:, 0]`` and values at
        ``[:, 1]``, or ``[pages, page_size, 2 * Hk, D]`` ("ragged_paged_attention") with
        keys at even heads and values at odd ones. Dtype: k's, or ``float8_e4m3fn``.
      slots: int ``[T]``: token ``t`` is written to page ``slots[t] // page_size``, entry
        ``slots[t] % page_size``; a negative slot writes nothing (padding). Visible slots
        must be below ``pages * page_size`` and not repeat; traced slots out of range are
        skipped like negative ones.
      cfg: the :class:`jaxrope.RopeConfig`; static under ``jit``.
      layout: "NHD" (default, FlashInfer's), "HND", "paged_attention" (a pair only) or
        "ragged_paged_attention" (one array only).
      k_quant_scale, v_quant_scale: fp8 caches only (None otherwise): the cache stores
        ``e4m3(clip(x * scale, -448, 448))``, FlashInfer's ``quant_scale_kv``; a float or
        a scalar array (may be traced); default 1.
      q_norm_weight, k_norm_weight: QK-norm weights (None: that one is not normalised),
        each ``[D]`` (``[Hq * D]`` / ``[Hk * D]`` when ``qk_norm.per_head`` is False),
        float32, bfloat16 or float16, may be traced: q (k) is RMS-normalised by
        ``qk_norm`` with it, in float32, before the rotation, exactly as
        :func:`jaxrope.qk_norm.normalize`; the model's ``q_norm.weight`` and
        ``k_norm.weight`` as they are (Gemma's too: the convention adds the 1).
      qk_norm: the :class:`jaxrope.QKNorm` (``eps``, convention, span; static under
        ``jit``), required with a weight; :meth:`jaxrope.QKNorm.from_hf` reads a model's.
      q_dtype: None (default) or q's own dtype: q is rotated in its dtype;
        ``jnp.float8_e4m3fn`` (or ``"float8_e4m3fn"``): q comes back as a new
        ``float8_e4m3fn`` ``[T, Hq, D]`` array, ``e4m3(clip(x * q_quant_scale, -448,
        448))`` of the float32 rotated (and normalised) q, every dim, rounded once;
        FlashInfer's fp8 q. Static under ``jit``.
      q_quant_scale: with ``q_dtype=float8_e4m3fn`` only (None otherwise): FlashInfer's
        ``quant_scale_q``; a float or a scalar array (may be traced); default 1.
      backend: "auto" (the Mosaic GPU kernel on Hopper or newer with JAX 0.11, the
        Triton-lowered Pallas kernel on other GPUs, XLA elsewhere:
        :func:`jaxrope.ops.backends.backend_name`; XLA when that kernel declines), "mosaic",
        "triton", "xla" or "interpret".

    Returns:
      ``(q, kv_cache)``: q rotated exactly as :func:`jaxrope.apply_rope` rotates it
      (dims past ``cfg.rotary_dim`` unchanged), and the cache in the structure given
      (a tuple, or the one array) with k rotated as ``apply_rope`` rotates it (then
      quantized for fp8) and v written at every valid slot; every other entry unchanged.
      k and v themselves are not returned. Under ``jax.jit`` with q and the cache donated
      (``donate_argnums=(0, 4)``) the outputs reuse their buffers: q is rotated and the
      cache written in place; without donation XLA copies them first, so the caller's
      arrays never change. With ``q_dtype=float8_e4m3fn`` the first output is the new
      fp8 q and q itself is only read: donate the cache alone (``donate_argnums=4``).

    Raises:
      TypeError: ``cfg`` is not a RopeConfig, ``qk_norm`` not a QKNorm, ``q_dtype`` not
        a dtype, a scale neither a float nor an array, or an input is not an array (or
        a pair).
      ValueError: a shape, dtype, device, layout, visible position, slot or scale is
        invalid, ``pos_ids [T]`` for an M-RoPE config or ``[3, T]`` for a 1-D one, or
        ``kv_cache=(c, c)`` names one array twice (seen outside ``jit``, and inside it
        for one traced value; two ``jit`` arguments holding one buffer are distinct
        tracers there, and donating both is refused by JAX itself); a norm weight of the
        wrong shape or dtype, a weight without ``qk_norm`` or ``qk_norm`` without one;
        ``q_dtype`` other than None, q's dtype or float8_e4m3fn, or ``q_quant_scale``
        without an fp8 ``q_dtype``.
      NotImplementedError: a norm with ``qk_norm.per_head`` False and ``backend``
        "mosaic", "triton" or "interpret" (:func:`jaxrope.qk_norm.per_token_norm`).
      BackendUnavailable: ``backend="triton"`` off GPU or on an fp8 cache of 2-4 GiB
        (:func:`jaxrope.ops.rope_append_kv.triton.unsupported`; "auto" takes the XLA path
        there), ``"mosaic"`` off a CUDA GPU or with a JAX without Mosaic GPU's API.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=64)
      >>> q = jnp.ones((3, 4, 64), jnp.bfloat16)
      >>> k = v = jnp.ones((3, 2, 64), jnp.bfloat16)
      >>> cache = tuple(jnp.zeros((4, 16, 2, 64), jnp.bfloat16) for _ in "kv")  # 4 pages of 16
      >>> step = jax.jit(jr.apply_rope_and_append_kv, static_argnames="cfg",
      ...                donate_argnums=(0, 4))
      >>> slots = jnp.array([17, -1, 40], jnp.int32)   # page 1 entry 1, skipped, page 2 entry 8
      >>> q, (k_cache, v_cache) = step(q, k, v, jnp.arange(3), cache, slots, cfg=cfg)
      >>> float(v_cache[1, 1, 0, 0]), float(v_cache[0, 0, 0, 0])   # written, untouched
      (1.0, 0.0)
      >>> float(k_cache[1, 1, 0, 0]), float(k_cache[2, 8, 0, 0])   # cos(p) - sin(p), p = 0, 2
      (1.0, -1.328125)
      >>> vl = jr.RopeConfig(head_dim=64, mrope_section=(8, 12, 12))    # M-RoPE: [3, T]
      >>> q = jnp.ones((3, 4, 64), jnp.bfloat16)
      >>> q, (k_cache, v_cache) = step(q, k, v, jnp.zeros((3, 3), jnp.int32),
      ...                              (k_cache, v_cache), slots, cfg=vl)
      >>> float(k_cache[2, 8, 0, 0])   # position 0 on every row: k as is
      1.0
      >>> gemma = jr.QKNorm(eps=1e-6, convention="gemma")   # Gemma 3: x_hat * (1 + w)
      >>> q = jnp.full((3, 4, 64), 5.0, jnp.bfloat16)
      >>> zero = jnp.zeros(64, jnp.bfloat16)
      >>> q, (k_cache, v_cache) = step(q, 3 * k, v, jnp.zeros(3, jnp.int32), (k_cache, v_cache),
      ...                              slots, cfg=cfg, q_norm_weight=zero, k_norm_weight=zero,
      ...                              qk_norm=gemma)
      >>> float(q[0, 0, 0]), float(k_cache[1, 1, 0, 0])   # each head scaled to RMS 1
      (1.0, 1.0)
      >>> q = jnp.full((3, 4, 64), 3.0, jnp.bfloat16)     # fp8 q: a new array, q only read
      >>> q8, _ = jr.apply_rope_and_append_kv(q, k, v, jnp.zeros(3, jnp.int32), (k_cache, v_cache),
      ...                                     slots, cfg, q_dtype=jnp.float8_e4m3fn,
      ...                                     q_quant_scale=200.0)
      >>> q8.dtype, float(q8[0, 0, 0]), float(q[0, 0, 0])   # 3 * 200 saturates at 448
      (dtype(float8_e4m3fn), 448.0, 3.0)
    """
    validate(q, k, pos_ids, cfg)
    if not _is_array(v):
        raise TypeError(f"v must be an array, got {type(v).__name__}")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v ({tuple(v.shape)}, {v.dtype}) must match k ({tuple(k.shape)}, "
                         f"{k.dtype})")
    if all(_visible(x) and isinstance(x, jax.Array) for x in (k, v)) and v.devices() != k.devices():
        raise ValueError(f"v is on {v.devices()} but k is on {k.devices()}; put them on one device")
    if layout not in LAYOUTS + JAX_LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS + JAX_LAYOUTS}")
    norm = (dict(q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, qk_norm=qk_norm)
            if norm_asked(q, k, q_norm_weight, k_norm_weight, qk_norm) else {})
    caches, combined, rows = _caches(kv_cache, layout, k)
    num_slots = rows.num_slots
    if num_slots >= 2 ** 31:
        raise ValueError(f"the cache has {num_slots} slots; slots are int32, at most 2**31 - 1")
    slots = _slots(slots, q.shape[0], num_slots)
    quantized = jnp.dtype(caches[0].dtype) == FP8
    q_dtype = _q_dtype(q_dtype, q)
    scales = jnp.stack([_scale("k_quant_scale", k_quant_scale, quantized),
                        _scale("v_quant_scale", v_quant_scale, quantized),
                        _scale("q_quant_scale", q_quant_scale, q_dtype is not None, _FP8_Q_ONLY)])
    # Only an fp8 q names q_dtype: a kernel without fp8 q never sees the keyword.
    fp8_q = {} if q_dtype is None else {"q_dtype": q_dtype}
    tables, _ = kernel_constants(cfg)
    # The kernels see every layout as [rows, D] matrices, addressed by `rows`.
    views = tuple(c.reshape(-1, c.shape[-1]) for c in caches)
    args = (q, k, v, jnp.asarray(pos_ids, jnp.int32), jnp.asarray(slots, jnp.int32),
            jnp.asarray(tables), scales, views)
    # The device's compute capability decides "auto" between Mosaic GPU and Triton; "auto"
    # takes XLA when the kernel declines (an fp8 cache of 2-4 GiB for Triton, a QK-norm).
    q, views = backends.run(backend, "rope_append_kv", q,
                            lambda impl: impl(*args, rows=rows, **kernel_options(cfg), **norm,
                                              **fp8_q))
    written = tuple(view.reshape(c.shape) for view, c in zip(views, caches))
    return q, written[0] if combined else written
