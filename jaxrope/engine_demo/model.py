"""The JAX engine demo's layer: one attention layer over a paged cache, jitted per token bucket.

The layer is small but real: token ids -> embeddings -> q, k, v projections; positions
from the counters pytree (:func:`jaxrope.positions.plan`, 1-D for the KV index and
``[3, T]`` M-RoPE for the rotation); KV slots from the block table
(:func:`jaxrope.paging.block_table_slots`); :func:`jaxrope.apply_rope_and_append_kv`
into a ``"paged_attention"`` cache ``(k_pages, v_pages)``, each ``[Hk, pages, page_size,
D]``; attention read from the pages by JAX's own Pallas ``paged_attention`` kernel (the
Pallas interpreter off the GPU), every token one query over its sequence's keys up to its
own (causal). :func:`recompute` is the float64 twin of the same layer, from the token ids
and the positions the model's definition gives.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import jax
import jax.numpy as jnp
import numpy as np
# Imported before the first trace: JAX 0.11 imports it inside the first trace of a
# pallas_call, and the config option it registers then changes the tracing cache key, so
# the first bucket would compile twice.
from jax.experimental.pallas import fuser  # noqa: F401

import jaxrope as jr
from jaxrope import layer_reference as reference
from jaxrope import paging, positions
from jaxrope.models import HF_VL_CONFIGS

# Qwen2-VL-7B's rotation (M-RoPE sections 16/24/24, head_dim 128, theta 1e6), with fewer
# heads and a small hidden size so that CPU steps take milliseconds.
MODEL = "Qwen/Qwen2-VL-7B-Instruct"
Q_HEADS, K_HEADS, HIDDEN, VOCAB = 4, 2, 64, 512
PAGE_SIZE, PAGES, PAGES_PER_SEQ = 16, 96, 8
# paged_attention splits a sequence's pages into K_SPLITS partitions of blocks of
# PAGES_PER_BLOCK pages; both must divide PAGES_PER_SEQ.
K_SPLITS, PAGES_PER_BLOCK = 2, 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """float32 embedding and projections (the float64 recompute reads the same values)."""

    embed: np.ndarray   # [VOCAB, HIDDEN]
    wq: np.ndarray      # [HIDDEN, Q_HEADS * D]
    wk: np.ndarray      # [HIDDEN, K_HEADS * D]
    wv: np.ndarray      # [HIDDEN, K_HEADS * D]

    @classmethod
    def random(cls, rng: np.random.Generator, head_dim: int) -> "Weights":
        """N(0, 1) embeddings, projections scaled to unit-variance outputs."""
        def proj(heads):
            return (rng.standard_normal((HIDDEN, heads * head_dim)) / np.sqrt(HIDDEN)).astype(
                np.float32)
        return cls(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), proj(Q_HEADS),
                   proj(K_HEADS), proj(K_HEADS))


def config() -> jr.RopeConfig:
    """The demo model's rotation, from its HF config."""
    return jr.RopeConfig.from_hf(HF_VL_CONFIGS[MODEL])


def make_step(cfg: jr.RopeConfig, interpret: bool, traces: Dict[int, int]) -> Callable:
    """The jitted engine step (donating the cache); ``traces[T]`` counts its traces per
    token bucket ``T`` (a trace is a compile: nothing else varies between calls).

    ``step(table, cache, weights, rows [V], counts [V], ids [T], prompt_pos [3, T],
    use_prompt_pos [T], block_table [capacity, PAGES_PER_SEQ]) -> (table, cache, out
    [T, Hq, D], pos [3, T], kv_slots [T])``: views ``v`` are the table's rows ``rows[v]`` with
    ``counts[v]`` tokens (padding views at :data:`jaxrope.positions.PAD`, count 0);
    ``prompt_pos`` are an M-RoPE prompt's host-computed positions where
    ``use_prompt_pos``, every other token's positions come from the counters.
    """
    head_dim = cfg.head_dim
    attention = reference.gpu_paged_attention()

    def step(table, cache, weights, rows, counts, ids, prompt_pos, use_prompt_pos, block_table):
        num_tokens = ids.shape[0]
        traces[num_tokens] = traces.get(num_tokens, 0) + 1
        # The KV index of each token: its stream's counter numbering (no M-RoPE delta).
        kv_pos = positions.plan(table, rows, counts, jnp.full((num_tokens,), -1, jnp.int32))
        planned = positions.plan(table, rows, counts, jnp.zeros((3, num_tokens), jnp.int32))
        pos = jnp.where(use_prompt_pos[None, :], prompt_pos, planned)
        views = paging.token_views(counts, num_tokens)
        stream = rows.at[views].get(mode="fill", fill_value=-1, wrap_negative_indices=False)
        kv_slots = paging.block_table_slots(block_table, stream, kv_pos, page_size=PAGE_SIZE)
        x = weights.embed[ids]
        heads = ((weights.wq, Q_HEADS), (weights.wk, K_HEADS), (weights.wv, K_HEADS))
        # Full float32 projections: a GPU's default TF32 would be ~1e-3 off the recompute.
        q, k, v = (jnp.matmul(x, w, precision="highest").reshape(num_tokens, h, head_dim)
                   for w, h in heads)
        q, cache = jr.apply_rope_and_append_kv(q, k, v, pos, cache, kv_slots, cfg,
                                               layout="paged_attention")
        # Every token is one query over its sequence's first kv_pos + 1 keys; padding
        # tokens read one key of page 0 and are ignored.
        pages = block_table.at[stream].get(mode="fill", fill_value=0, wrap_negative_indices=False)
        lengths = jnp.where(kv_slots >= 0, kv_pos + 1, 1)
        out = attention(q * head_dim ** -0.5, *cache, pages, lengths, k_splits=K_SPLITS,
                        pages_per_compute_block=PAGES_PER_BLOCK, interpret=interpret)
        return positions.commit(table, rows, counts), cache, out, pos, kv_slots

    return jax.jit(step, donate_argnums=(1,))


def device_weights(weights: Weights):
    """The weights as a pytree of device arrays (a step argument)."""
    return jax.tree.map(jnp.asarray, weights)


def empty_cache():
    """A zeroed ``paged_attention`` cache ``(k_pages, v_pages)``, float32."""
    shape = (K_HEADS, PAGES, PAGE_SIZE, config().head_dim)
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


def projections(weights: Weights, head_dim: int) -> Dict[str, np.ndarray]:
    """float64 ``q, k, v`` of every token id, ``[VOCAB, H, D]`` (before the rotation)."""
    embed = weights.embed.astype(np.float64)
    return {name: (embed @ w.astype(np.float64)).reshape(VOCAB, -1, head_dim)
            for name, w in (("q", weights.wq), ("k", weights.wk), ("v", weights.wv))}


def recompute(cfg: jr.RopeConfig, projected: Dict[str, np.ndarray], ids: List[int],
              pos: np.ndarray) -> Dict[str, np.ndarray]:
    """float64 ``q, k, v [L, H, D]`` of a whole sequence from its token ids and the
    positions ``pos [3, L]`` its model gives (rotated by :func:`jaxrope.layer_reference.rotate`);
    ``projected`` from :func:`projections`."""
    ids = np.asarray(ids)
    return dict(q=reference.rotate(cfg, projected["q"][ids], pos),
                k=reference.rotate(cfg, projected["k"][ids], pos), v=projected["v"][ids])


def attention_of(seq: Dict[str, np.ndarray], index: np.ndarray, head_dim: int) -> np.ndarray:
    """float64 ``[n, Hq, D]``: the sequence's tokens at ``index`` attending causally."""
    return np.stack([reference.causal_attention(seq["q"][i:i + 1], seq["k"][:i + 1], seq["v"][:i + 1],
                                         head_dim ** -0.5)[0] for i in index])
