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
from jaxrope.ops.triton_common import capture_one


@dataclasses.dataclass(frozen=True)
class AppendKernel(TritonKernel):
    """The fused RoPE + paged KV append kernel (:mod:`jaxrope.ops.rope_append_kv.triton`)
    as Triton IR.

    ``ttir`` takes pointer arguments in ``pallas_call`` operand order: inputs ``(count,
    pos_ids, slots, tables, scales, q, k, v, *caches)`` then outputs ``(q, *caches)``,
    which alias the inputs (pass the same pointers again). ``count`` is int32 ``[1]``
    (the token count, read at run time), ``pos_ids`` and ``slots`` int32 ``[>= T]`` (an
    M-RoPE kernel's ``pos_ids`` a contiguous int32 ``[3, count]``),
    ``tables`` float32 ``[3, lanes]`` (the angle tables zero-padded to
    :func:`jaxrope.ops.triton_common.lanes_for` lanes), ``scales`` float32 ``[2]``
    (read by fp8 caches only), ``caches`` FlashInfer's ``(k_cache, v_cache)``
    (``num_caches == 2``) or one combined ``[pages, 2, ...]`` cache (``num_caches == 1``),
    which the kernel addresses as ``[rows, D]`` (:mod:`jaxrope.ops.rope_append_kv.cache_layout`).
    """

    block: tuning.AppendTritonTuning
    num_caches: int

    _grid = staticmethod(tuning.grid)


def export_append_kv(*, q_heads: int, k_heads: int, head_dim: int, rotary_dim: int,
                     interleave: bool, attention_factor: float, dtype,
                     cache_shape: Tuple[int, int, int, int], cache_dtype, layout: str,
                     components: int, block: tuning.AppendTritonTuning,
                     mrope_section: Optional[Tuple[int, int, int]] = None,
                     mrope_interleaved: bool = False) -> AppendKernel:
    """Lower the fused kernel for one head layout, cache and launch shape; return its Triton IR.

    ``cache_shape`` is the canonical 4-D view (NHD ``[pages * components, page_size, Hk,
    D]`` or HND ``[pages * components, Hk, page_size, D]``), ``components`` 2 for one
    combined cache, 1 for a ``(k_cache, v_cache)`` pair. The IR does not depend on the
    token count (read at run time from ``count``, also the row stride of M-RoPE
    positions), as in :func:`jaxrope.ops.rope.triton_export.export`; it does depend on
    the cache's shape and dtype, which an engine fixes once.

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

    def kernel_call(q, k, v, pos_ids, slots, tables, scales, *caches):
        return triton.rope_append_kv_triton(
            q, k, v, pos_ids, slots, tables, scales, caches, rows=address,
            rotary_dim=rotary_dim, interleave=interleave, attention_factor=attention_factor,
            mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, tuning=block)

    sds = jax.ShapeDtypeStruct
    rows = sds((tokens, k_heads, head_dim), dtype)
    pos_shape = (tokens,) if mrope_section is None else (3, tokens)
    specs = (sds((tokens, q_heads, head_dim), dtype), rows, rows, sds(pos_shape, jnp.int32),
             sds((tokens,), jnp.int32), sds((3, rotary_dim // 2), jnp.float32),
             sds((2,), jnp.float32), *(cache,) * num_caches)
    return AppendKernel(ttir=capture_one(kernel_call, *specs), block=block, q_heads=q_heads,
                        k_heads=k_heads, num_caches=num_caches)
