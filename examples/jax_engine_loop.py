"""A continuous-batching engine loop in JAX, one jitted step per token bucket:

  RowMap rows -> each token's row (``rows.at[views].get(mode="fill", ...)``) -> its
  KV slot from the block table -> RoPE fused with the paged KV append -> attention
  over each token's pages (JAX's own ``paged_attention_reference`` as the consumer).

Three requests prefill in chunks and decode side by side; one leaves and its row and
pages go to a later one. Every token's attention output is checked against a float64
recompute of its sequence from scratch. Run: ``python examples/jax_engine_loop.py``.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from jaxrope import paging, positions

from float64_oracle import attention, verdict

with warnings.catch_warnings():  # JAX 0.11+ deprecates the module; its reference stays
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention_reference

CFG = jr.RopeConfig(head_dim=64, theta=10000.0)
HQ, HK, PAGE_SIZE, PAGES_PER_SEQ, PAGES, TOKENS = 4, 2, 4, 4, 16, 8   # TOKENS: the bucket
SEED = 0


@functools.partial(jax.jit, donate_argnums=(1,))
def step(table, cache, rows, counts, block_table, q, k, v):
    """One step over views ``rows [V]`` with ``counts [V]`` tokens, packed in ``q, k, v [T, H, D]``."""
    num_tokens = q.shape[0]
    kv_pos = positions.plan(table, rows, counts, jnp.full((num_tokens,), -1, jnp.int32))
    views = paging.token_views(counts, num_tokens)                      # -1: a padding token
    row = rows.at[views].get(mode="fill", fill_value=-1, wrap_negative_indices=False)
    slots = paging.block_table_slots(block_table, row, kv_pos, page_size=PAGE_SIZE)
    q, cache = jr.apply_rope_and_append_kv(q, k, v, jnp.maximum(kv_pos, 0), cache, slots, CFG,
                                           layout="paged_attention")
    # Each token reads its own sequence's pages: [Hk, T, pages, page_size, D] -> [T, L, Hk, D].
    pages = block_table.at[row].get(mode="fill", fill_value=0, wrap_negative_indices=False)
    k_seq, v_seq = (c[:, pages].transpose(1, 2, 3, 0, 4).reshape(num_tokens, -1, HK, CFG.head_dim)
                    for c in cache)
    lengths = jnp.where(slots >= 0, kv_pos + 1, 1)                      # causal: keys up to its own
    out = paged_attention_reference(q * CFG.head_dim ** -0.5, k_seq, v_seq, lengths)
    return positions.commit(table, rows, counts), cache, out


def main() -> float:
    rng = np.random.default_rng(SEED)
    print(f"seed {SEED}")
    lengths = {"a": 11, "b": 6, "c": 9}            # c arrives at step 3, on the row b left
    qkv = {rid: [rng.standard_normal((n, h, CFG.head_dim)).astype(np.float32) for h in (HQ, HK, HK)]
           for rid, n in lengths.items()}
    row_map = positions.RowMap(capacity=2)
    table = positions.init(row_map.capacity)
    cache = tuple(jnp.zeros((HK, PAGES, PAGE_SIZE, CFG.head_dim), jnp.float32) for _ in "kv")
    block_table = np.zeros((8, PAGES_PER_SEQ), np.int32)   # by table row: the row's pages
    free_pages, done, worst = list(range(PAGES)), {}, 0.0
    for step_index in range(12):
        if step_index == 0:
            arrivals = ["a", "b"]
        elif step_index == 3:
            arrivals = ["c"]
        else:
            arrivals = []
        for rid in arrivals:
            row = row_map.acquire(rid, "text")
            table = positions.grow(table, row_map.capacity)
            block_table[row] = [free_pages.pop(0) for _ in range(PAGES_PER_SEQ)]
            done[rid] = 0
        live = [rid for rid in done if done[rid] < lengths[rid]]
        if not live:
            break
        # Up to 4 tokens a request (a prefill chunk; 1 once the "prompt" is half done: decode).
        counts = [min(lengths[r] - done[r], 4 if done[r] < lengths[r] // 2 else 1) for r in live]
        rows = positions.pad_rows(row_map.lookup(live, ["text"] * len(live)), 4)
        batch = [np.zeros((TOKENS, h, CFG.head_dim), np.float32) for h in (HQ, HK, HK)]
        at = 0
        for rid, n in zip(live, counts):
            for part, source in zip(batch, qkv[rid]):
                part[at:at + n] = source[done[rid]:done[rid] + n]
            at += n
        table, cache, out = step(table, cache, jnp.asarray(rows),
                                 jnp.asarray(counts + [0] * (4 - len(live)), jnp.int32),
                                 jnp.asarray(block_table), *map(jnp.asarray, batch))
        out, at = np.asarray(out), 0
        for rid, n in zip(live, counts):
            for i in range(n):
                expected = attention(CFG, *qkv[rid], done[rid] + i)
                worst = max(worst, float(np.abs(out[at + i] - expected).max()))
            at += n
            done[rid] += n
            if done[rid] == lengths[rid]:                # the request leaves: row and pages freed
                (row,) = row_map.release(rid)
                table = positions.reset(table, [row])
                free_pages += block_table[row].tolist()
        print(f"step {step_index}: {dict(zip(live, counts))}, worst |out - float64| {worst:.2e}")
    return verdict(done, lengths, worst)


if __name__ == "__main__":
    main()
