"""JAX's own paged-attention ops as readers of a written cache, and a float64 attention.

The layouts ``"paged_attention"`` and ``"ragged_paged_attention"`` of
:func:`jaxrope.apply_rope_and_append_kv` are checked by running the op that reads them
(tests and the JAX engine demo):

- :func:`gpu_paged_attention` (from :mod:`jaxrope.layer_reference`): ``jax.experimental.pallas.ops.gpu.paged_attention.
  paged_attention(q [B, Hq, D], k_pages, v_pages [Hk, pages, page_size, D], block_tables
  [B, pages_per_sequence], lengths [B])``, one query per sequence over its first
  ``lengths[b]`` keys; a Pallas kernel (Triton lowering) that runs on CPU in the Pallas
  interpreter (``interpret=True``). JAX 0.11 deprecates the module (a warning on import,
  silenced here: it is still JAX's op for this layout);
- :func:`ragged_reference`: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention.
  ref_ragged_paged_attention(queries [T, Hq, D], kv_pages [pages, page_size, 2 * Hk, D],
  kv_lens, page_indices, cu_q_lens, num_seqs)``, pure jnp: sequence ``i``'s queries are
  its last ``cu_q_lens[i + 1] - cu_q_lens[i]`` tokens, causal over its ``kv_lens[i]`` keys.
  It loops over sequences in Python and slices by their lengths, so it traces only with
  those as host values (:func:`ragged_attention` closes over them);
- :func:`causal_attention` (from :mod:`jaxrope.layer_reference`): the float64 attention
  both must match, and
  :func:`append_sequences` / :func:`expected_attention`: sequences written into a cache
  of either layout by the fused op (the CPU and GPU tests' inputs).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from jaxrope.layer_reference import causal_attention, gpu_paged_attention
from jaxrope.testing import oracle


def ragged_reference():
    """JAX's ``ref_ragged_paged_attention`` (pure jnp, any platform).

    Raises:
      ImportError: this JAX has no ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``.
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
    return ref_ragged_paged_attention


def ragged_attention(q_lens: Sequence[int], kv_lens: Sequence[int], sm_scale: float):
    """A jitted ``(queries, kv_pages, page_indices) -> [T, Hq, D]`` of
    :func:`ragged_reference` for sequences of these query and key counts (host values:
    the reference slices by them)."""
    reference = ragged_reference()
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.asarray(kv_lens, np.int32)
    num_seqs = np.array([len(lens)], np.int32)
    return jax.jit(lambda queries, kv_pages, page_indices: reference(
        queries, kv_pages, lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale))


@functools.lru_cache(maxsize=None)
def available(name: str) -> str:
    """Why JAX's op ``name`` ("paged_attention" or "ragged") is missing here, or ""."""
    try:
        (gpu_paged_attention if name == "paged_attention" else ragged_reference)()
    except ImportError as e:
        return f"JAX {jax.__version__} has no {name} op: {e}"
    return ""


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A small paged cache: ``pages`` of ``page_size`` tokens, ``k_heads`` key heads."""

    cfg: jr.RopeConfig
    q_heads: int
    k_heads: int
    page_size: int
    pages: int

    def shape(self, layout: str) -> Tuple[int, ...]:
        """One cache array of JAX's ``layout`` ("paged_attention" or "ragged_paged_attention")."""
        D = self.cfg.head_dim
        if layout == "paged_attention":
            return (self.k_heads, self.pages, self.page_size, D)
        return (self.pages, self.page_size, 2 * self.k_heads, D)


def block_tables(rng: np.random.Generator, g: Geometry, lengths: Sequence[int],
                 pages_per_seq: int) -> Tuple[np.ndarray, List[np.ndarray]]:
    """Distinct shuffled pages per sequence (unused table entries at page 0) and each
    sequence's slots (vLLM's ``slot_mapping`` rule, written here)."""
    order = iter(rng.permutation(g.pages))
    tables = np.zeros((len(lengths), pages_per_seq), np.int32)
    slots = []
    for b, n in enumerate(lengths):
        used = -(-n // g.page_size)
        tables[b, :used] = [next(order) for _ in range(used)]
        t = np.arange(n)
        slots.append(tables[b, t // g.page_size] * g.page_size + t % g.page_size)
    return tables, slots


def append_sequences(rng: np.random.Generator, g: Geometry, layout: str, backend: str,
                     lengths: Sequence[int], pages_per_seq: int, dtype=np.float32):
    """Every sequence's tokens appended by the fused op in two calls (a 3-token prefix,
    then the rest, as chunked prefill does) into a cache of random old entries.

    Returns ``(seqs, q_rotated, cache, tables)``: per sequence its inputs (``q, k, v,
    pos, slots``) and the fused op's rotated q, then the cache and the block tables.
    """
    tables, slots = block_tables(rng, g, lengths, pages_per_seq)
    D = g.cfg.head_dim
    seqs: List[Dict[str, np.ndarray]] = [
        dict(q=rng.standard_normal((n, g.q_heads, D)).astype(dtype),
             k=rng.standard_normal((n, g.k_heads, D)).astype(dtype),
             v=rng.standard_normal((n, g.k_heads, D)).astype(dtype),
             pos=(rng.integers(0, 1000) + np.arange(n)).astype(np.int32), slots=s)
        for n, s in zip(lengths, slots)]
    arrays = [jnp.asarray(rng.standard_normal(g.shape(layout)), dtype)
              for _ in range(2 if layout == "paged_attention" else 1)]
    cache = tuple(arrays) if layout == "paged_attention" else arrays[0]
    q_rotated: List[List[np.ndarray]] = [[] for _ in seqs]
    for part in (slice(0, 3), slice(3, None)):
        cat = {name: np.concatenate([s[name][part] for s in seqs]) for name in seqs[0]}
        q, cache = _fused(*(jnp.asarray(cat[name]) for name in ("q", "k", "v", "pos")), cache,
                          jnp.asarray(cat["slots"]), cfg=g.cfg, layout=layout, backend=backend)
        bounds = np.cumsum([len(s["pos"][part]) for s in seqs])[:-1]
        for rows, got in zip(q_rotated, np.split(np.asarray(q), bounds)):
            rows.append(got)
    return seqs, [np.concatenate(r) for r in q_rotated], cache, tables


_fused = jax.jit(jr.apply_rope_and_append_kv, static_argnames=("cfg", "layout", "backend"))


def expected_attention(cfg: jr.RopeConfig, seq: Dict[str, np.ndarray], n: int) -> np.ndarray:
    """float64 attention of a sequence's last ``n`` queries (from :func:`append_sequences`),
    rotated by the float64 oracle, scale ``D ** -0.5``."""
    k = oracle.rope_of(cfg, seq["k"], seq["pos"])
    q = oracle.rope_of(cfg, seq["q"][-n:], seq["pos"][-n:])
    return causal_attention(q, k, seq["v"], cfg.head_dim ** -0.5)
