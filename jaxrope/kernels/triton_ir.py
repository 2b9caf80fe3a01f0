"""Export the Pallas RoPE kernels as Triton IR, for launching outside JAX dispatch.

A PyTorch engine calling RoPE through JAX pays for a DLPack import (~90 us) and a jitted
call (~40 us) per layer. The kernel itself is a Triton kernel: Pallas lowers it to a
Triton MLIR module and hands XLA the bytecode. This module captures that module's text
while JAX lowers the kernel, so ``torch_bridge.triton_launch`` can compile it with
Triton and launch it on torch's stream (:func:`export`); likewise the kernel of RoPE
fused with the paged KV append for ``torch_bridge.kv_launch`` (:func:`export_append_kv`).

This relies on private JAX API (``jax._src.pallas.triton``), checked against JAX
0.11.2 and 0.10.2: ``pallas_call_registration`` calls
``lowering.lower_jaxpr_to_triton_module(...)``, whose result has ``.module`` (an MLIR
module) and ``.grid``. Everything private is touched here and nowhere else; any
failure raises :class:`jaxrope.BackendUnavailable` and callers fall back to the JAX path.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrope.errors import BackendUnavailable
from jaxrope.kernels import kv_layout, kv_pallas, pallas_triton

_CAPTURE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """A Pallas kernel as Triton IR, plus what a launch needs.

    ``ttir`` takes pointer arguments in ``pallas_call`` operand order: inputs
    ``(count, pos_ids, tables, q, k)`` then outputs ``(q, k)``; an M-RoPE kernel's
    ``pos_ids`` is a contiguous int32 ``[3, count]``.
    """

    ttir: str
    block: pallas_triton.BlockConfig
    q_heads: int
    k_heads: int

    # The launch grid of ``block``: the kernel module's own rule (``AppendKernel``'s differs).
    _grid = staticmethod(pallas_triton.grid)

    @property
    def num_warps(self) -> int:
        return self.block.num_warps

    @property
    def num_stages(self) -> int:
        return self.block.num_stages

    def grid(self, num_tokens: int) -> Tuple[int, int, int]:
        axes = self._grid(num_tokens, self.q_heads, self.k_heads, self.block)
        return (*axes, 1, 1)[:3]


def capture(fn, *specs) -> List[str]:
    """The Triton IR text of each Pallas kernel in ``jax.jit(fn)`` lowered for CUDA on ``specs``.

    Raises:
      BackendUnavailable: no GPU target (off a GPU, JAX 0.11 needs an abstract one:
        :func:`jaxrope.testing.lowering.cuda_target`), or JAX's private lowering API
        changed.
    """
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError as e:  # pragma: no cover - depends on the installed JAX
        raise BackendUnavailable(f"JAX {jax.__version__} has no Pallas Triton lowering: {e}") from e
    lowering = getattr(registration, "lowering", None)
    original = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if original is None:
        raise BackendUnavailable(f"JAX {jax.__version__}: Pallas Triton lowering entry point moved")
    captured = []

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    with _CAPTURE_LOCK:
        lowering.lower_jaxpr_to_triton_module = spy
        try:
            # A fresh closure per capture: jit's caches must not skip the lowering.
            jax.jit(lambda *a: fn(*a)).trace(*specs).lower(lowering_platforms=("cuda",))
        except Exception as e:
            raise BackendUnavailable(f"lowering the Pallas kernel failed: {e}") from e
        finally:
            lowering.lower_jaxpr_to_triton_module = original
    return captured


def export(*, q_heads: int, k_heads: int, head_dim: int, rotary_dim: int, interleave: bool,
           attention_factor: float, dtype, block: pallas_triton.BlockConfig,
           mrope_section: Optional[Tuple[int, int, int]] = None,
           mrope_interleaved: bool = False) -> TritonKernel:
    """Lower the kernel for one head layout and launch shape and return its Triton IR.

    The IR does not depend on the token count (read at run time from the ``count``
    operand, which is also the row stride of M-RoPE positions), so one export serves
    every T.

    Raises:
      BackendUnavailable: no GPU, or JAX's private lowering API changed.
    """
    # Any T works (the IR reads the count at run time) as long as the grid has two token
    # blocks: Pallas folds program_id of a size-1 grid axis to the constant 0.
    tokens = 2 * block.block_tokens * block.token_loop

    def kernel_call(q, k, pos_ids, tables):
        return pallas_triton.rope_pallas(q, k, pos_ids, tables, rotary_dim=rotary_dim,
                                         interleave=interleave,
                                         attention_factor=attention_factor,
                                         mrope_section=mrope_section,
                                         mrope_interleaved=mrope_interleaved, config=block)

    pos_shape = (tokens,) if mrope_section is None else (3, tokens)
    args = (jax.ShapeDtypeStruct((tokens, q_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((tokens, k_heads, head_dim), dtype),
            jax.ShapeDtypeStruct(pos_shape, jnp.int32),
            jax.ShapeDtypeStruct((3, rotary_dim // 2), jnp.float32))
    captured = capture(kernel_call, *args)
    if len(captured) != 1:
        raise BackendUnavailable(f"expected one Triton module, captured {len(captured)}")
    return TritonKernel(ttir=captured[0], block=block, q_heads=q_heads, k_heads=k_heads)


@dataclasses.dataclass(frozen=True)
class AppendKernel(TritonKernel):
    """The fused RoPE + paged KV append kernel (:mod:`jaxrope.kernels.kv_pallas`) as Triton IR.

    ``ttir`` takes pointer arguments in ``pallas_call`` operand order: inputs ``(count,
    pos_ids, slots, tables, scales, q, k, v, *caches)`` then outputs ``(q, *caches)``,
    which alias the inputs (pass the same pointers again). ``count`` is int32 ``[1]``
    (the token count, read at run time), ``pos_ids`` and ``slots`` int32 ``[>= T]`` (an
    M-RoPE kernel's ``pos_ids`` a contiguous int32 ``[3, count]``),
    ``tables`` float32 ``[3, lanes]`` (the angle tables zero-padded to
    :func:`jaxrope.kernels.pallas_triton.lanes_for` lanes), ``scales`` float32 ``[2]``
    (read by fp8 caches only), ``caches`` FlashInfer's ``(k_cache, v_cache)``
    (``num_caches == 2``) or one combined ``[pages, 2, ...]`` cache (``num_caches == 1``),
    which the kernel addresses as ``[rows, D]`` (:mod:`jaxrope.kernels.kv_layout`).
    """

    block: kv_pallas.AppendBlockConfig
    num_caches: int

    _grid = staticmethod(kv_pallas.grid)


def export_append_kv(*, q_heads: int, k_heads: int, head_dim: int, rotary_dim: int,
                     interleave: bool, attention_factor: float, dtype,
                     cache_shape: Tuple[int, int, int, int], cache_dtype, layout: str,
                     components: int, block: kv_pallas.AppendBlockConfig,
                     mrope_section: Optional[Tuple[int, int, int]] = None,
                     mrope_interleaved: bool = False) -> AppendKernel:
    """Lower the fused kernel for one head layout, cache and launch shape; return its Triton IR.

    ``cache_shape`` is the canonical 4-D view (NHD ``[pages * components, page_size, Hk,
    D]`` or HND ``[pages * components, Hk, page_size, D]``), ``components`` 2 for one
    combined cache, 1 for a ``(k_cache, v_cache)`` pair. The IR does not depend on the
    token count (read at run time from ``count``, also the row stride of M-RoPE
    positions); it does depend on the cache's shape and dtype, which an engine fixes once.

    Raises:
      BackendUnavailable: no GPU target, JAX's private lowering API changed, or a cache
        the Triton lowering cannot address (:func:`jaxrope.kernels.kv_pallas.unsupported`).
    """
    pages = cache_shape[0] // components
    page_size, heads = cache_shape[1:3] if layout == "NHD" else cache_shape[2:0:-1]
    address = kv_layout.cache_rows(layout, components == 2, pages, page_size, heads)
    # The kernel's [rows, D] view of the cache (the same memory as the canonical view).
    cache = jax.ShapeDtypeStruct((math.prod(cache_shape[:-1]), head_dim), cache_dtype)
    declined = kv_pallas.unsupported(cache)
    if declined:
        raise BackendUnavailable(declined)
    num_caches = 2 if components == 1 else 1
    # Any T works (the IR reads the count at run time) as long as the grid has two
    # token programs, as in export.
    tokens = 2 * block.token_loop

    def kernel_call(q, k, v, pos_ids, slots, tables, scales, *caches):
        return kv_pallas.rope_append_kv_pallas(
            q, k, v, pos_ids, slots, tables, scales, caches, rows=address,
            rotary_dim=rotary_dim, interleave=interleave, attention_factor=attention_factor,
            mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, config=block)

    sds = jax.ShapeDtypeStruct
    rows = sds((tokens, k_heads, head_dim), dtype)
    pos_shape = (tokens,) if mrope_section is None else (3, tokens)
    specs = (sds((tokens, q_heads, head_dim), dtype), rows, rows, sds(pos_shape, jnp.int32),
             sds((tokens,), jnp.int32), sds((3, rotary_dim // 2), jnp.float32),
             sds((2,), jnp.float32), *(cache,) * num_caches)
    captured = capture(kernel_call, *specs)
    if len(captured) != 1:
        raise BackendUnavailable(f"expected one Triton module, captured {len(captured)}")
    return AppendKernel(ttir=captured[0], block=block, q_heads=q_heads, k_heads=k_heads,
                        num_caches=num_caches)
