"""``apply_mla_rope_and_append``: DeepSeek's multi-head latent attention (MLA) RoPE fused
with its paged cache append, in one pass.

An MLA layer (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) caches per token one compressed
latent ``ckv [L]`` (``kv_lora_rank``, 512) and one rotary key ``k_pe [r]``
(``qk_rope_head_dim``, 64) shared by every head; only ``q_pe [H, r]`` and ``k_pe`` are
rotated, ``q_nope [H, N]`` and ``ckv`` are not. This op rotates ``q_pe`` and ``k_pe``,
writes ``ckv`` and the rotated ``k_pe`` into the paged cache at each token's slot, and
optionally quantizes q to fp8 for an fp8 attention kernel.

Vocabulary and conventions:

- **slots**: as :func:`jaxrope.apply_rope_and_append_kv` (vLLM's ``slot_mapping``): token
  ``t`` goes to page ``slots[t] // page_size``, entry ``slots[t] % page_size``; a
  negative slot writes nothing; visible slots are checked by the same rule
  (:func:`jaxrope.ops.rope_append_kv.api.check_slots`).
- **mla_cache**: FlashInfer's ``append_paged_mla_kv_cache`` pair ``(ckv_cache [pages,
  page_size, L], kpe_cache [pages, page_size, r])``, or vLLM's one ``[pages, page_size,
  L + r]`` buffer, ckv at ``[..., :L]`` and the rotated k_pe at ``[..., L:]``.
- **layout of the rotation**: ``cfg.interleave`` (True for DeepSeek) pairs ``(x[2i],
  x[2i + 1])`` and writes each rotated pair back where it was, as FlashInfer's
  ``mla_rope_quantize_fp8(is_neox=False)`` and vLLM's ``DeepseekScalingRotaryEmbedding``
  do. transformers' ``apply_rotary_pos_emb_interleave`` writes the same pairs
  de-interleaved (pair ``i`` at ``(i, i + r/2)``): a permutation shared by q_pe and k_pe
  that leaves every ``q_pe . k_pe`` unchanged.
- **fp8**: ``q_dtype=float8_e4m3fn`` gives new ``e4m3(clip(rot(q_pe) * q_quant_scale,
  -448, 448))`` and ``e4m3(clip(q_nope * q_quant_scale, ...))`` (FlashInfer's
  ``quant_scale_q``); a ``float8_e4m3fn`` cache stores ``ckv`` and the rotated ``k_pe``
  times ``kv_quant_scale`` likewise (``quant_scale_kv``).
"""

from __future__ import annotations

import math
from typing import Tuple, Union

import jax
import jax.numpy as jnp

from jaxrope.config import RopeConfig
from jaxrope.ops import backends
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.ops.rope.api import SUPPORTED_DTYPES, check_pos_ids
from jaxrope.ops.rope_append_kv.api import _is_array, _q_dtype, _scale, _slots, _visible
from jaxrope.ops.rope_append_kv.reference import FP8

MlaCache = Union[jax.Array, Tuple[jax.Array, jax.Array]]


def _check_inputs(q_pe, k_pe, ckv, q_nope, cfg: RopeConfig) -> None:
    """Types, ranks, shapes, one dtype and one device for the token arrays."""
    if not isinstance(cfg, RopeConfig):
        raise TypeError(f"cfg must be a RopeConfig, got {type(cfg).__name__}")
    if cfg.rotary_dim != cfg.head_dim:
        raise ValueError(f"cfg.rotary_dim={cfg.rotary_dim} must equal cfg.head_dim="
                         f"{cfg.head_dim}: MLA rotates all of q_pe and k_pe (r dims)")
    named = [("q_pe", q_pe, 3), ("k_pe", k_pe, 2), ("ckv", ckv, 2)]
    if q_nope is not None:
        named.append(("q_nope", q_nope, 3))
    for name, x, rank in named:
        if not _is_array(x):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != rank:
            want = {"q_pe": "[T, H, r]", "k_pe": "[T, r]", "ckv": "[T, L]",
                    "q_nope": "[T, H, N]"}[name]
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be {want} (rank {rank})")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} must be one of float32, float16, bfloat16")
        if x.dtype != q_pe.dtype:
            raise ValueError(f"{name}.dtype={x.dtype} must equal q_pe.dtype={q_pe.dtype}")
        if x.shape[0] != q_pe.shape[0]:
            raise ValueError(f"{name}.shape[0]={x.shape[0]} must equal q_pe.shape[0]="
                             f"{q_pe.shape[0]} (tokens)")
        if (_visible(x) and _visible(q_pe) and isinstance(x, jax.Array)
                and isinstance(q_pe, jax.Array) and x.devices() != q_pe.devices()):
            raise ValueError(f"{name} is on {x.devices()} but q_pe is on {q_pe.devices()}; "
                             "put them on one device")
    for name, size in (("q_pe.shape[2]", q_pe.shape[2]), ("k_pe.shape[1]", k_pe.shape[1])):
        if size != cfg.head_dim:
            raise ValueError(f"{name}={size} must equal cfg.head_dim={cfg.head_dim} (r, "
                             "qk_rope_head_dim)")
    if q_nope is not None and q_nope.shape[1] != q_pe.shape[1]:
        raise ValueError(f"q_nope.shape[1]={q_nope.shape[1]} must equal q_pe.shape[1]="
                         f"{q_pe.shape[1]} (heads)")


def _caches(mla_cache, k_pe, ckv) -> Tuple[Tuple, bool]:
    """The cache arrays (the pair, or the one array alone) and whether it is one array."""
    lora, rope = ckv.shape[1], k_pe.shape[1]
    if isinstance(mla_cache, (tuple, list)):
        if len(mla_cache) != 2 or not all(_is_array(c) for c in mla_cache):
            raise TypeError(f"mla_cache must be a (ckv_cache, kpe_cache) pair of arrays or one "
                            f"array, got a {type(mla_cache).__name__} of {len(mla_cache)}")
        ckv_cache, kpe_cache = mla_cache
        if ckv_cache is kpe_cache:
            raise ValueError("mla_cache=(c, c) passes one array as both ckv_cache and "
                             "kpe_cache; pass two arrays or one [pages, page_size, L + r] array")
        if ckv_cache.ndim != 3 or ckv_cache.shape[2] != lora:
            raise ValueError(f"ckv_cache.shape={tuple(ckv_cache.shape)} must be [pages, "
                             f"page_size, L] with L={lora} (ckv.shape[1])")
        if tuple(kpe_cache.shape) != (*ckv_cache.shape[:2], rope):
            raise ValueError(f"kpe_cache.shape={tuple(kpe_cache.shape)} must be "
                             f"{(*ckv_cache.shape[:2], rope)} (ckv_cache's pages and page_size, "
                             f"r={rope})")
        if kpe_cache.dtype != ckv_cache.dtype:
            raise ValueError(f"kpe_cache.dtype={kpe_cache.dtype} must equal ckv_cache.dtype="
                             f"{ckv_cache.dtype}")
        caches, combined, name = (ckv_cache, kpe_cache), False, "ckv_cache"
    elif _is_array(mla_cache):
        if mla_cache.ndim != 3 or mla_cache.shape[2] != lora + rope:
            raise ValueError(f"mla_cache.shape={tuple(mla_cache.shape)} must be [pages, "
                             f"page_size, L + r] with L + r={lora + rope} (ckv's L={lora}, "
                             f"k_pe's r={rope}), or pass a (ckv_cache, kpe_cache) pair")
        caches, combined, name = (mla_cache,), True, "mla_cache"
    else:
        raise TypeError(f"mla_cache must be a (ckv_cache, kpe_cache) pair of arrays or one "
                        f"array, got {type(mla_cache).__name__}")
    dtype = jnp.dtype(caches[0].dtype)
    if dtype not in (jnp.dtype(k_pe.dtype), FP8):
        raise ValueError(f"{name}.dtype={dtype} must be k_pe's dtype ({k_pe.dtype}) or "
                         "float8_e4m3fn")
    # The kernels address the cache as [rows, width] matrices with int32 row numbers.
    if math.prod(caches[0].shape[:2]) >= 2 ** 31:
        raise ValueError(f"{name}.shape={tuple(caches[0].shape)} has "
                         f"{math.prod(caches[0].shape[:2])} slots; slots are int32, at most "
                         "2**31 - 1")
    if _visible(k_pe) and isinstance(k_pe, jax.Array):
        for c in caches:
            if _visible(c) and isinstance(c, jax.Array) and c.devices() != k_pe.devices():
                raise ValueError(f"{name} is on {c.devices()} but k_pe is on "
                                 f"{k_pe.devices()}; put them on one device")
    return caches, combined


def _q_scale(value, quantize_q: bool):
    if not quantize_q and value is not None:
        raise ValueError(f"q_quant_scale={value!r} applies only with q_dtype=float8_e4m3fn; "
                         "leave it None")
    return _scale("q_quant_scale", value, quantize_q)


def apply_mla_rope_and_append(q_pe, k_pe, ckv, pos_ids, mla_cache: MlaCache, slots,
                              cfg: RopeConfig, *, q_nope=None, q_dtype=None, q_quant_scale=None,
                              kv_quant_scale=None, backend: str = "auto"):
    """Rotate MLA's ``q_pe`` and ``k_pe``; write ``ckv`` and the rotated ``k_pe`` into a paged cache.

    Args:
      q_pe: ``[T, H, r]`` float32, float16 or bfloat16, ``r == cfg.head_dim`` (DeepSeek's
        ``qk_rope_head_dim``, 64).
      k_pe: ``[T, r]``, q_pe's dtype: the one rotary key all heads share.
      ckv: ``[T, L]``, q_pe's dtype: the compressed latent (``kv_lora_rank``, 512), cached
        as it is.
      pos_ids: int ``[T]`` in ``[0, cfg.max_position)``; ``[3, T]`` for an M-RoPE config;
        checked when visible, as :func:`jaxrope.apply_rope` checks them.
      mla_cache: ``(ckv_cache [pages, page_size, L], kpe_cache [pages, page_size, r])``
        or one ``[pages, page_size, L + r]`` array (ckv at ``[..., :L]``, k_pe at
        ``[..., L:]``); dtype k_pe's or ``float8_e4m3fn``.
      slots: int ``[T]``: token ``t`` goes to page ``slots[t] // page_size``, entry
        ``slots[t] % page_size``; negative: nothing written. Visible slots must be below
        ``pages * page_size`` and not repeat; traced ones out of range are skipped.
      cfg: the :class:`jaxrope.RopeConfig` with ``rotary_dim == head_dim == r``
        (:meth:`jaxrope.RopeConfig.from_hf` of a DeepSeek-V2/V3 config: YaRN with its
        mscale in the attention factor, ``interleave=True``); static under ``jit``.
      q_nope: ``[T, H, N]`` (q_pe's dtype) or None: only read, quantized with q.
      q_dtype: None (or q_pe's dtype): q_pe rotated in its dtype; ``jnp.float8_e4m3fn``
        (or "float8_e4m3fn"): new fp8 ``q_pe`` and ``q_nope`` outputs.
      q_quant_scale: fp8 q only: q is stored as ``e4m3(clip(x * q_quant_scale, -448,
        448))``; a float or a scalar array (may be traced); default 1.
      kv_quant_scale: fp8 caches only, the same for ckv and the rotated k_pe; default 1.
      backend: "auto", "mosaic", "triton", "xla" or "interpret"
        (:mod:`jaxrope.ops.backends`); "auto" takes XLA where no kernel runs.

    Returns:
      ``(q_pe_out, q_nope_out, mla_cache)``: with ``q_dtype`` None, q_pe rotated (its
      dtype; in place under ``jax.jit`` with q_pe donated) and q_nope as given (None if
      None); with fp8, new float8_e4m3fn arrays. The cache in the structure given, with
      ckv and the rotated k_pe (quantized for fp8) at every valid slot; every other entry
      unchanged (in place with the cache donated: ``donate_argnums=(0, 4)``).

    Raises:
      TypeError: ``cfg`` not a RopeConfig, an input not an array (or a pair), a scale
        neither a float nor an array, ``q_dtype`` not a dtype.
      ValueError: a shape, dtype, device, visible position or slot is invalid; a
        ``q_dtype`` other than None, q_pe's dtype and float8_e4m3fn; a scale given where
        it does not apply, not scalar, or not finite and > 0 as a normal float32.
      BackendUnavailable: a backend without an MLA kernel, or one that cannot run on the
        arrays' device.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=64, interleave=True)
      >>> q_pe = jnp.ones((2, 4, 64), jnp.bfloat16)
      >>> k_pe, ckv = jnp.ones((2, 64), jnp.bfloat16), jnp.full((2, 512), 3, jnp.bfloat16)
      >>> cache = jnp.zeros((4, 16, 512 + 64), jnp.bfloat16)     # vLLM's one buffer
      >>> step = jax.jit(jr.apply_mla_rope_and_append, static_argnames="cfg",
      ...                donate_argnums=(0, 4))
      >>> q_pe, _, cache = step(q_pe, k_pe, ckv, jnp.arange(2), cache,
      ...                       jnp.array([17, -1]), cfg=cfg)
      >>> float(cache[1, 1, 0]), float(cache[1, 1, 512]), float(cache[0, 0, 0])
      (3.0, 1.0, 0.0)
      >>> q8, n8, _ = jr.apply_mla_rope_and_append(
      ...     q_pe, k_pe, ckv, jnp.arange(2), cache, jnp.array([-1, -1]), cfg,
      ...     q_nope=jnp.ones((2, 4, 128), jnp.bfloat16), q_dtype=jnp.float8_e4m3fn,
      ...     q_quant_scale=2.0)
      >>> q8.dtype, float(n8[0, 0, 0])
      (dtype(float8_e4m3fn), 2.0)
    """
    _check_inputs(q_pe, k_pe, ckv, q_nope, cfg)
    tokens = q_pe.shape[0]
    check_pos_ids(pos_ids, tokens, cfg)
    caches, combined = _caches(mla_cache, k_pe, ckv)
    num_slots = math.prod(caches[0].shape[:2])
    slots = _slots(slots, tokens, num_slots)
    quantize_q = _q_dtype(q_dtype, q_pe, "q_pe") is not None
    scales = jnp.stack([_q_scale(q_quant_scale, quantize_q),
                        _scale("kv_quant_scale", kv_quant_scale,
                               jnp.dtype(caches[0].dtype) == FP8)])
    tables, _ = kernel_constants(cfg)
    views = tuple(c.reshape(num_slots, c.shape[-1]) for c in caches)
    args = (q_pe, k_pe, ckv, q_nope, jnp.asarray(pos_ids, jnp.int32), slots,
            jnp.asarray(tables), scales, views)
    q_pe_out, q_nope_out, views = backends.run(
        backend, "mla_rope_append", q_pe,
        lambda impl: impl(*args, **kernel_options(cfg), q_dtype=FP8 if quantize_q else None))
    written = tuple(view.reshape(c.shape) for view, c in zip(views, caches))
    return q_pe_out, q_nope_out, written[0] if combined else written
