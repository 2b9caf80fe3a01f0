"""The RoPE kernel in Pallas's Mosaic GPU dialect (Hopper+), for measuring against Triton's.

JAX 0.11 deprecates Pallas's Triton lowering; Mosaic GPU is its successor. It cannot
reuse :mod:`jaxrope.kernels.pallas_triton`'s body: in JAX 0.11.2 ``pallas_call`` lowers
only with Triton's compiler params, so this is a ``plgpu.kernel`` of its own:

- one block (one warpgroup, 128 threads) per token; it rotates that token's q heads,
  then its k heads, each half ``[heads, R/2]`` loaded from GMEM straight into registers
  in the ``WG_STRIDED`` layout (no SMEM: nothing is shared between threads);
- in place: q and k enter as mutable refs (``jax.new_ref``), so with donated inputs XLA
  aliases them to the outputs and dims past ``rotary_dim`` are never touched;
- the angle is the accurate one of :mod:`jaxrope.kernels.angle`, computed per element
  from the turn tables tiled to ``[3, heads, R/2]`` (a ``WG_STRIDED`` array cannot be
  broadcast from a row); ``floor`` has no Mosaic GPU lowering, so it is built from a
  truncating int conversion (the values floored stay below ``2**31`` in magnitude).

Covered: NeoX halves, any ``rotary_dim``, fp32/fp16/bf16, any T, head layouts whose
half (``heads * R/2``) is a multiple of 128 elements for both q and k. Interleaved
pairs and smaller halves raise ``NotImplementedError`` (:func:`unsupported`): the
measurement this kernel exists for is the serving layout, and splitting pairs in the
strided layout needs layouts Mosaic GPU does not infer.

On CPU it runs in Mosaic GPU's interpreter (``interpret=True``), for tests.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrope.kernels.angle import cos_sin

_LANES = 128  # threads of a warpgroup


def unavailable() -> Optional[str]:
    """Why this JAX cannot build the kernel (it needs 0.11's Mosaic GPU API), or None."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # JAX 0.10 imports absl there
        return f"Mosaic GPU Pallas does not import with jax {jax.__version__}: {e}"
    # 0.10 has neither; its plgpu.load also takes a different signature.
    if not (hasattr(plgpu, "InterpretGPUParams") and hasattr(jax, "new_ref")):
        return (f"jax {jax.__version__} lacks the Mosaic GPU API this kernel uses "
                "(mutable refs, the GPU interpreter): JAX 0.11 or newer")
    return None


def unsupported(q_heads: int, k_heads: int, rotary_dim: int, interleave: bool) -> Optional[str]:
    """Why this kernel cannot run a layout, or None when it can."""
    if interleave:
        return "interleaved pairs are not implemented in the Mosaic GPU kernel"
    half = rotary_dim // 2
    for name, heads in (("q", q_heads), ("k", k_heads)):
        if heads * half % _LANES:
            return (f"{name} has {heads} heads x {half} rotary pairs = {heads * half} elements "
                    f"per half, not a multiple of {_LANES} (one warpgroup)")
    return None


def _vector(heads: int, half: int, head_dim: int, itemsize: int) -> int:
    # The widest vector (up to 16 bytes per thread) that splits the half evenly over the
    # warpgroup and never straddles a head: Mosaic GPU needs the contiguous dim and
    # every stride (head_dim per head) divisible by it.
    for vec in (16 // itemsize, 8 // itemsize, 2, 1):
        if heads * half % (_LANES * vec) == 0 and half % vec == 0 and head_dim % vec == 0:
            return vec
    return 1


def _floor(x):
    t = x.astype(jnp.int32).astype(jnp.float32)  # truncates toward zero
    return t - (t > x).astype(jnp.float32)


def rope_mosaic(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                attention_factor: float, interpret: bool = False):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]``; same contract
    as :func:`jaxrope.kernels.pallas_triton.rope_pallas` (in place when donated).

    Raises:
      NotImplementedError: a layout :func:`unsupported` names, or a JAX
        :func:`unavailable` names.
    """
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    reason = unsupported(q_heads, k_heads, rotary_dim, interleave) or unavailable()
    if reason:
        raise NotImplementedError(reason)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    # Tiled per head: a constant under jit when the tables are (XLA folds the broadcast).
    tiled = [jnp.broadcast_to(tables[:, None, :half], (3, heads, half)) for heads in (q_heads, k_heads)]
    vecs = [_vector(heads, half, head_dim, np.dtype(q.dtype).itemsize)
            for heads in (q_heads, k_heads)]

    def body(pos_ref, q_tables_ref, k_tables_ref, q_ref, k_ref):
        t = jax.lax.axis_index("token")
        pos = pos_ref[t]
        for x_ref, tables_ref, heads, vec in ((q_ref, q_tables_ref, q_heads, vecs[0]),
                                              (k_ref, k_tables_ref, k_heads, vecs[1])):
            layout = plgpu.Layout.WG_STRIDED((heads, half), vec_size=vec)
            cos, sin = cos_sin(pos, *(plgpu.load(tables_ref.at[i], layout=layout)
                                      for i in range(3)), attention_factor, floor=_floor)
            first, second = x_ref.at[t, :, pl.ds(0, half)], x_ref.at[t, :, pl.ds(half, half)]
            a = plgpu.load(first, layout=layout).astype(jnp.float32)
            b = plgpu.load(second, layout=layout).astype(jnp.float32)
            first[...] = (a * cos - b * sin).astype(x_ref.dtype)
            second[...] = (b * cos + a * sin).astype(x_ref.dtype)

    kernel = plgpu.kernel(
        body, out_type=(), grid=(num_tokens,), grid_names=("token",),
        kernel_name="jaxrope_rope_mosaic",  # what profilers show
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    q_ref, k_ref = jax.new_ref(q), jax.new_ref(k)
    kernel(pos_ids, *tiled, q_ref, k_ref)
    return jax.freeze(q_ref), jax.freeze(k_ref)

