"""Export the Triton-lowered kernel of the fused RoPE + KV append as Triton IR, for
``torch_bridge.launch.triton``: the append's twin of :mod:`jaxrope.ops.rope.triton_export`
(the same capture, :func:`jaxrope.ops.triton_common.capture_one`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrope.errors import BackendUnavailable
from jaxrope.ops.rope.triton_export import TritonKernel
from jaxrope.ops.rope_append_kv.cache_layout import cache_rows
from jaxrope.ops.rope_append_kv import triton, tuning
from jaxrope.ops.rope_append_kv.reference import FP8
from jaxrope.ops.triton_common import capture_one
from jaxrope.qk_norm import WEIGHT_DTYPES, QKNorm, per_token_norm


@dataclasses.dataclass(frozen=True)
class AppendKernel(TritonKernel):
    """The fused RoPE + paged KV append kernel (:mod:`jaxrope.ops.rope_append_kv.triton`)
    as Triton IR.

    ``ttir`` takes pointer arguments in ``pallas_call`` operand order: inputs ``(count,
    pos_ids, slots, tables, scales, q, k, v, *weights, *caches)`` then outputs ``(q_out,
    *caches)``, which alias the inputs (pass the same pointers again), except an fp8
    ``q_out`` (``fp8_q``): a new float8_e4m3fn ``[T, Hq, D]`` buffer, q left unchanged.
    ``weights``: ``num_weights`` QK-norm weights ``[D]`` (:class:`NormOperands`: q's,
    then k's, of those the kernel was exported with). ``count`` is int32 ``[1]``
    (the token count, read at run time), ``pos_ids`` and ``slots`` int32 ``[>= T]`` (an
    M-RoPE kernel's ``pos_ids`` a contiguous int32 ``[3, count]``),
    ``tables`` float32 ``[3, lanes]`` (the angle tables zero-padded to
    :func:`jaxrope.ops.triton_common.lanes_for` lanes), ``scales`` float32 ``[2]`` =
    ``[k_scale, v_scale]`` (read by fp8 caches only), ``[3]`` with ``q_scale`` for an fp8
    q, ``caches`` FlashInfer's ``(k_cache, v_cache)``
    (``num_caches == 2``) or one combined ``[pages, 2, ...]`` cache (``num_caches == 1``),
    which the kernel addresses as ``[rows, D]`` (:mod:`jaxrope.ops.rope_append_kv.cache_layout`).
    """

    block: tuning.AppendTritonTuning
    num_caches: int
    num_weights: int = 0
    fp8_q: bool = False

    _grid = staticmethod(tuning.grid)


@dataclasses.dataclass(frozen=True)
class NormOperands:
    """What a fused kernel does to q beyond the rotation, fixed at export: QK-norm
    weights (each a dtype name, or None for no weight), their :class:`jaxrope.QKNorm`
    (per head), and whether q is written to a new float8_e4m3fn buffer. Hashable: a
    launcher keys its kernels on it. The default is today's kernel.

    Raises:
      ValueError: a weight without ``qk_norm`` or ``qk_norm`` without a weight, or a
        weight dtype other than float32, bfloat16 and float16.
      NotImplementedError: a per-token ``qk_norm`` (the kernel normalises per head:
        :func:`jaxrope.qk_norm.per_token_norm`).
    """

    q_weight: Optional[str] = None
    k_weight: Optional[str] = None
    qk_norm: Optional[QKNorm] = None
    fp8_q: bool = False

    def __post_init__(self) -> None:
        named = [w for w in (self.q_weight, self.k_weight) if w is not None]
        if bool(named) != (self.qk_norm is not None):
            raise ValueError(f"qk_norm={self.qk_norm!r} goes with a q or k weight dtype and only "
                             f"with one, got q_weight={self.q_weight!r}, k_weight={self.k_weight!r}")
        if self.qk_norm is not None and not self.qk_norm.per_head:
            raise NotImplementedError(per_token_norm("triton"))
        for field in ("q_weight", "k_weight"):
            name = getattr(self, field)
            if name is not None and jnp.dtype(name) not in WEIGHT_DTYPES:
                raise ValueError(f"{field}={name!r} must be one of "
                                 f"{[d.name for d in WEIGHT_DTYPES]}")
            if name is not None:
                # One spelling per dtype, so equal operands hash equal (a launcher's key).
                object.__setattr__(self, field, jnp.dtype(name).name)

    def specs(self, head_dim: int) -> Tuple[jax.ShapeDtypeStruct, ...]:
        """The weights' operands, q's then k's."""
        return tuple(jax.ShapeDtypeStruct((head_dim,), w) for w in (self.q_weight, self.k_weight)
                     if w is not None)

    def kwargs(self, weights: Tuple) -> dict:
        """The kernel's keywords for ``weights`` (as :meth:`specs` orders them)."""
        given = iter(weights)
        return dict(q_norm_weight=next(given) if self.q_weight else None,
                    k_norm_weight=next(given) if self.k_weight else None,
                    qk_norm=self.qk_norm, q_dtype=FP8 if self.fp8_q else None)


def export_append_kv(*, q_heads: int, k_heads: int, head_dim: int, rotary_dim: int,
                     interleave: bool, attention_factor: float, dtype,
                     cache_shape: Tuple[int, int, int, int], cache_dtype, layout: str,
                     components: int, block: tuning.AppendTritonTuning,
                     mrope_section: Optional[Tuple[int, int, int]] = None,
                     mrope_interleaved: bool = False,
                     norm: NormOperands = NormOperands()) -> AppendKernel:
    """Lower the fused kernel for one head layout, cache and launch shape; return its Triton IR.

    ``cache_shape`` is the canonical 4-D view (NHD ``[pages * components, page_size, Hk,
    D]`` or HND ``[pages * components, Hk, page_size, D]``), ``components`` 2 for one
    combined cache, 1 for a ``(k_cache, v_cache)`` pair. The IR does not depend on the
    token count (read at run time from ``count``, also the row stride of M-RoPE
    positions), as in :func:`jaxrope.ops.rope.triton_export.export`; it does depend on
    the cache's shape and dtype, which an engine fixes once. ``norm``: QK-norm weights
    and an fp8 q (:class:`NormOperands`; the default, none of them, is today's kernel).

    Raises:
      BackendUnavailable: no GPU target, JAX's private lowering API changed, or a cache
        the Triton lowering cannot address
        (:func:`jaxrope.ops.rope_append_kv.triton.unsupported`).
    """
    pages = cache_shape[0] // components
    page_size, heads = cache_shape[1:3] if layout == "NHD" else cache_shape[2:0:-1]
    address = cache_rows(layout, components == 2, pages, page_size, heads)
    # The kernel's [rows, D] view of the cache (the same memory as the canonical view).
    cache = jax.ShapeDtypeStruct((math.prod(cache_shape[:-1]), head_dim), cache_dtype)
    declined = triton.unsupported(cache)
    if declined:
        raise BackendUnavailable(declined)
    num_caches = 2 if components == 1 else 1
    # Any T works (the IR reads the count at run time) as long as the grid has two
    # token programs, as in the rope kernel's export.
    tokens = 2 * block.token_loop

    weights = norm.specs(head_dim)

    def kernel_call(q, k, v, pos_ids, slots, tables, scales, *rest):
        return triton.rope_append_kv_triton(
            q, k, v, pos_ids, slots, tables, scales, rest[len(weights):], rows=address,
            rotary_dim=rotary_dim, interleave=interleave, attention_factor=attention_factor,
            mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, tuning=block,
            **norm.kwargs(rest[:len(weights)]))

    sds = jax.ShapeDtypeStruct
    rows = sds((tokens, k_heads, head_dim), dtype)
    pos_shape = (tokens,) if mrope_section is None else (3, tokens)
    specs = (sds((tokens, q_heads, head_dim), dtype), rows, rows, sds(pos_shape, jnp.int32),
             sds((tokens,), jnp.int32), sds((3, rotary_dim // 2), jnp.float32),
             sds((3 if norm.fp8_q else 2,), jnp.float32), *weights, *(cache,) * num_caches)
    return AppendKernel(ttir=capture_one(kernel_call, *specs), block=block, q_heads=q_heads,
                        k_heads=k_heads, num_caches=num_caches, num_weights=len(weights),
                        fp8_q=norm.fp8_q)
