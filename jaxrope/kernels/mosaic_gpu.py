"""The RoPE kernel in Pallas's Mosaic GPU dialect (Hopper+), for measuring against Triton's.

JAX 0.11 deprecates Pallas's Triton lowering; Mosaic GPU is its successor. It cannot
reuse :mod:`jaxrope.kernels.pallas_triton`'s body: in JAX 0.11.2 ``pallas_call`` lowers
only with Triton's compiler params, so this is a ``plgpu.kernel`` of its own:

- one block (one warpgroup, 128 threads) per token; it rotates the token's heads in
  chunks of ``C`` heads, each half ``[C, R/2]`` loaded from GMEM straight into registers
  in the ``WG_STRIDED`` layout (no SMEM: nothing is shared between threads);
- one ``C`` serves q and k (it divides both head counts), so every chunk has the same
  shape and layout and a thread holds the same frequencies in each: the angle, computed
  once per block for one chunk, serves every chunk of q and of k. Computed per element,
  it was evaluated ``Hq + Hk`` times per (token, frequency) instead of ``C`` times (at
  32 + 8 heads that kernel reached 75% of an H200's bandwidth ceiling). ``C`` is the
  fewest heads whose chunk fills whole vectors of the warpgroup (at the widest vector
  that fits), so that one chunk's angles are as few as that layout allows;
- every chunk is loaded before the angle is computed and before any chunk is stored, so
  all of a token's loads are in flight together and the angle's arithmetic overlaps
  them (a store waits for its chunk's loads, and loads issued after a store to the same
  buffer may wait behind it);
- in place: q and k enter as mutable refs (``jax.new_ref``), so with donated inputs XLA
  aliases them to the outputs and dims past ``rotary_dim`` are never touched;
- the angle is the accurate one of :mod:`jaxrope.kernels.angle`, from the turn tables
  tiled to one chunk, ``[3, C, R/2]``: a ``WG_STRIDED`` array cannot be broadcast from a
  row, and tiled to every head the tables were ~30 KB of reads per token against 20 KB
  of q and k. ``floor`` has no Mosaic GPU lowering, so it is built from a truncating int
  conversion (the values floored stay below ``2**31`` in magnitude).

Covered: NeoX halves, any ``rotary_dim``, fp32/fp16/bf16, any T, head counts of q and k
that are both multiples of ``128 / gcd(R/2, 128)``, the fewest heads whose half fills a
warpgroup (so some ``C`` divides both). Interleaved pairs and other head counts raise
``BackendUnavailable`` (:func:`unsupported`): the measurement this kernel exists for is
the serving layout, and splitting pairs in the strided layout needs layouts Mosaic GPU
does not infer.

On CPU it runs in Mosaic GPU's interpreter (``interpret=True``), for tests.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrope.errors import BackendUnavailable
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


def _chunk_heads(half: int, vec: int) -> int:
    # The fewest heads whose half fills whole vectors of the warpgroup.
    lanes = _LANES * vec
    return lanes // math.gcd(lanes, half)


def unsupported(q_heads: int, k_heads: int, rotary_dim: int, interleave: bool) -> Optional[str]:
    """Why this kernel cannot run a layout, or None when it can."""
    if interleave:
        return "interleaved pairs are not implemented in the Mosaic GPU kernel"
    half = rotary_dim // 2
    fewest = _chunk_heads(half, 1)
    for name, heads in (("q", q_heads), ("k", k_heads)):
        if heads % fewest:
            return (f"{name} has {heads} heads, not a multiple of {fewest}: the kernel rotates "
                    f"chunks of heads that divide both q's and k's heads, and with {half} "
                    f"rotary pairs per head a chunk fills whole warpgroups ({_LANES} elements) "
                    f"only in multiples of {fewest} heads")
    return None


def _chunking(q_heads: int, k_heads: int, half: int, head_dim: int,
              itemsize: int) -> tuple[int, int]:
    """``(C, vec)``: heads per chunk and elements per thread vector, for a supported layout.

    The widest vector first (up to 16 bytes per thread: fewer, wider memory accesses),
    then the fewest heads per chunk (the fewest angles). Sharing ``C`` can narrow a
    tensor's vector: 32 bf16 heads of 64 pairs alone fill 8-wide vectors, but a chunk
    that also divides 8 k heads fills only 4-wide ones. A vector never straddles a head:
    Mosaic GPU needs the contiguous dim and every stride (head_dim per head) divisible
    by it. One-element vectors fit every layout :func:`unsupported` lets through.
    """
    common = math.gcd(q_heads, k_heads)
    for vec in (8, 4, 2):
        heads = _chunk_heads(half, vec)
        if (vec * itemsize <= 16 and common % heads == 0
                and half % vec == 0 and head_dim % vec == 0):
            return heads, vec
    return _chunk_heads(half, 1), 1


def _floor(x):
    t = x.astype(jnp.int32).astype(jnp.float32)  # truncates toward zero
    return t - (t > x).astype(jnp.float32)


def rope_mosaic(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                attention_factor: float, mrope_section: Optional[Tuple[int, int, int]] = None,
                mrope_interleaved: bool = False, interpret: bool = False):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]``; same contract
    as :func:`jaxrope.kernels.pallas_triton.rope_pallas` (in place when donated).

    Raises:
      BackendUnavailable: M-RoPE (``mrope_section``, not implemented here: the Pallas
        kernel covers it), a layout :func:`unsupported` names, or a JAX
        :func:`unavailable` names.
    """
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    reason = ((mrope_section is not None and f"M-RoPE ({mrope_section=}, {mrope_interleaved=}) "
               "is not implemented in the Mosaic GPU kernel; backend='pallas' runs it")
              or unsupported(q_heads, k_heads, rotary_dim, interleave) or unavailable())
    if reason:
        raise BackendUnavailable(reason)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    chunk, vec = _chunking(q_heads, k_heads, half, head_dim, np.dtype(q.dtype).itemsize)
    # Tiled to one chunk: a constant under jit when the tables are (XLA folds the broadcast).
    tiled = jnp.broadcast_to(tables[:, None, :half], (3, chunk, half))
    layout = plgpu.Layout.WG_STRIDED((chunk, half), vec_size=vec)

    def chunks(x_ref, t):
        for c in range(x_ref.shape[1] // chunk):
            heads = pl.ds(c * chunk, chunk)
            yield x_ref.at[t, heads, pl.ds(0, half)], x_ref.at[t, heads, pl.ds(half, half)]

    def body(pos_ref, tables_ref, q_ref, k_ref):
        t = jax.lax.axis_index("token")
        halves = [*chunks(q_ref, t), *chunks(k_ref, t)]
        loaded = [(plgpu.load(first, layout=layout), plgpu.load(second, layout=layout))
                  for first, second in halves]
        cos, sin = cos_sin(pos_ref[t], *(plgpu.load(tables_ref.at[i], layout=layout)
                                         for i in range(3)), attention_factor, floor=_floor)
        for (first, second), (a, b) in zip(halves, loaded):
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            first[...] = (a * cos - b * sin).astype(first.dtype)
            second[...] = (b * cos + a * sin).astype(second.dtype)

    kernel = plgpu.kernel(
        body, out_type=(), grid=(num_tokens,), grid_names=("token",),
        kernel_name="jaxrope_rope_mosaic",  # what profilers show
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    q_ref, k_ref = jax.new_ref(q), jax.new_ref(k)
    kernel(pos_ids, tiled, q_ref, k_ref)
    return jax.freeze(q_ref), jax.freeze(k_ref)

