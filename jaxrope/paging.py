"""Page tables to KV slots, and each token's view: the glue between a planned step and the cache.

A step's tokens are its views' tokens laid end to end (``counts [V]``, as
:func:`jaxrope.positions.plan` takes them); :func:`jaxrope.apply_rope_and_append_kv`
writes token ``t`` at its KV *slot*, ``page * page_size + entry``. These pure functions
(static shapes, ``jax.jit``-able) give both from what engines keep:

- :func:`token_views`: ``int32 [T]``, the view of each token;
- :func:`block_table_slots`: vLLM's ``slot_mapping`` from a block table,
  ``slot = block_table[row, p // page_size] * page_size + p % page_size`` for the token
  at KV position ``p`` (its index in its sequence) of block-table row ``row``
  (``vllm/v1/worker/block_table.py``, ``_compute_slot_mapping_kernel``);
- :func:`append_positions` and :func:`page_table_slots`: FlashInfer's page table
  ``(kv_indptr, kv_indices, kv_last_page_len)``: the appended tokens are the last
  ``counts[b]`` of request ``b`` (``get_seq_lens`` then ``get_batch_indices_positions``),
  and token ``(b, p)`` goes to page ``kv_indices[kv_indptr[b] + p // page_size]``, entry
  ``p % page_size`` (``append_paged_kv_cache``; ``flashinfer/page.py``).

Padding, one convention: tokens past ``sum(counts)`` have view -1, and every token
without a valid address gets slot -1, which the fused append skips: a padding token
(view or row -1), a KV position outside its request's pages (negative, past the block
table's columns, past the request's pages in ``kv_indptr``), a negative page id, or a
slot that would not fit int32. Nothing is clamped into another request's page. Integer
inputs wider than int32 are checked at their width first (host arrays raise; traced
values outside int32 count as invalid).

Example (a prefill of 3 tokens, a decode, a padding token):
  >>> import jax.numpy as jnp
  >>> from jaxrope import paging
  >>> counts = jnp.array([3, 1], jnp.int32)
  >>> views = paging.token_views(counts, 5)
  >>> views.tolist()
  [0, 0, 0, 1, -1]
  >>> table = jnp.array([[7, 2], [4, 0]], jnp.int32)     # vLLM block table, 2 blocks a row
  >>> kv_pos = jnp.array([6, 7, 8, 3, 0], jnp.int32)    # the tokens' indices in their sequences
  >>> paging.block_table_slots(table, views, kv_pos, page_size=8).tolist()
  [62, 63, 16, 35, -1]
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope.numbers import as_int

__all__ = ["append_positions", "block_table_slots", "page_table_slots", "token_views"]

_INT32 = np.iinfo(np.int32)
# Reads that must not wrap a negative index around to the last entry.
_NO_WRAP = {"mode": "fill", "fill_value": -1, "wrap_negative_indices": False}


def _int32(name: str, x) -> jax.Array:
    """``x`` as int32, values that do not fit int32 as -1 (invalid); host arrays whose values
    do not fit raise instead."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"{name}.dtype={x.dtype} must be an integer type")
        if x.size and (x.min() < _INT32.min or x.max() > _INT32.max):
            raise ValueError(f"{name} must fit int32, got values in [{x.min()}, {x.max()}]")
        return jnp.asarray(x, jnp.int32)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}.dtype={x.dtype} must be an integer type")
    info = jnp.iinfo(x.dtype)
    if info.min < _INT32.min or info.max > _INT32.max:
        x = jnp.where((x >= _INT32.min) & (x <= _INT32.max), x, -1)
    return x.astype(jnp.int32)


def _static_size(name: str, value, minimum: int = 1) -> int:
    # A size is a shape: int32 like every index of it, and static (a Python int).
    return as_int(value, name, minimum, _INT32.max, " (static)")


def token_views(counts, num_tokens: int) -> jax.Array:
    """int32 ``[num_tokens]``: the view of each token of a step, -1 past ``sum(counts)``.

    Args:
      counts: int ``[V]``, the tokens of each view in step order (``positions.plan``'s
        ``counts``; FlashInfer's ``append_indptr`` is ``[0, *cumsum(counts)]``); a
        negative count counts as 0, an empty view owns no token.
      num_tokens: ``T``, the step's (bucketed) token count; static.

    Returns:
      ``views``: token ``t`` belongs to view ``v`` when ``sum(counts[:v]) <= t <
      sum(counts[:v + 1])``; tokens ``[sum(counts), T)`` are padding, view -1 (so
      ``x.at[views].get(mode="fill", wrap_negative_indices=False)`` reads padding as the
      fill value; plain ``x[views]`` would wrap -1 to the last view).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrope import paging
      >>> paging.token_views(jnp.array([2, 0, 3]), 6).tolist()
      [0, 0, 2, 2, 2, -1]
    """
    num_tokens = _static_size("num_tokens", num_tokens, minimum=0)   # an empty step
    counts = jnp.clip(_int32("counts", counts), 0, num_tokens)
    ends = jnp.cumsum(counts)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # Each view marks the token where it starts; a running max gives every token its
    # view (an empty view shares its start with the next one and the max keeps the later).
    marks = jnp.zeros_like(token).at[ends - counts].max(
        jnp.arange(counts.shape[0], dtype=jnp.int32), mode="drop")
    total = ends[-1] if counts.shape[0] else 0
    return jnp.where(token < total, jax.lax.cummax(marks, axis=0), -1)


def _slot(page: jax.Array, position: jax.Array, page_size: int, ok: jax.Array) -> jax.Array:
    # page * page_size + entry, -1 where not ok or where it would not fit int32.
    ok = ok & (page >= 0) & (page <= (_INT32.max - (page_size - 1)) // page_size)
    return jnp.where(ok, page * page_size + position % page_size, -1)


def block_table_slots(block_table, rows, kv_positions, *, page_size: int) -> jax.Array:
    """int32 ``[T]``: vLLM's ``slot_mapping`` of tokens from a block table.

    Args:
      block_table: int ``[R, max_blocks]``, each row a sequence's pages (blocks) in order.
      rows: int ``[T]``, each token's row of ``block_table`` (vLLM's request index; e.g.
        :func:`token_views` when the views are the rows, or a stream's row gathered by
        view); -1 for padding.
      kv_positions: int ``[T]``, each token's index in its sequence (for M-RoPE not its
        rotary position).
      page_size: tokens a page (vLLM's ``block_size``) holds; static.

    Returns:
      ``block_table[row, p // page_size] * page_size + p % page_size``, or -1 (see the
      module doc: padding rows, ``p`` negative or past ``max_blocks * page_size``, a
      negative block id, a slot past int32).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrope import paging
      >>> paging.block_table_slots(jnp.array([[3, 9]]), jnp.array([0, 0, 0]),
      ...                          jnp.array([1, 5, 8]), page_size=4).tolist()   # 8 // 4 = 2
      [13, 37, -1]
    """
    page_size = _static_size("page_size", page_size)
    table, row, position = (_int32(n, x) for n, x in (("block_table", block_table),
                                                        ("rows", rows),
                                                        ("kv_positions", kv_positions)))
    if table.ndim != 2:
        raise ValueError(f"block_table.shape={tuple(table.shape)} must be [R, max_blocks]")
    if row.shape != position.shape or row.ndim != 1:
        raise ValueError(f"rows.shape={tuple(row.shape)} and kv_positions.shape="
                         f"{tuple(position.shape)} must both be [T]")
    block = position // page_size
    ok = (row >= 0) & (row < table.shape[0]) & (position >= 0) & (block < table.shape[1])
    page = table.at[jnp.where(ok, row, -1), block].get(**_NO_WRAP)
    return _slot(page, position, page_size, ok)


def append_positions(counts, kv_indptr, kv_last_page_len, *, page_size: int,
                     num_tokens: int) -> Tuple[jax.Array, jax.Array]:
    """``(batch_indices, positions)``, int32 ``[num_tokens]``, of FlashInfer's append.

    ``get_seq_lens`` then ``get_batch_indices_positions``: request ``b`` holds
    ``seq_len[b] = max(kv_indptr[b + 1] - kv_indptr[b] - 1, 0) * page_size +
    kv_last_page_len[b]`` tokens, the step's ``counts[b]`` among them (the page table
    already has room for them), so its ``i``-th appended token sits at KV position
    ``seq_len[b] - counts[b] + i``. Padding tokens get ``(-1, -1)``.

    Args:
      counts: int ``[B]``, the tokens each request appends this step (``diff(append_indptr)``).
      kv_indptr: int ``[B + 1]``; kv_last_page_len: int ``[B]``; page_size: static.
      num_tokens: ``T``, static.

    Example (FlashInfer's ``get_batch_indices_positions`` docstring case):
      >>> import jax.numpy as jnp
      >>> from jaxrope import paging
      >>> b, p = paging.append_positions(jnp.array([1, 2, 3, 4]), jnp.array([0, 1, 2, 3, 4]),
      ...                                jnp.array([5, 5, 5, 5]), page_size=16, num_tokens=10)
      >>> b.tolist(), p.tolist()
      ([0, 1, 1, 2, 2, 2, 3, 3, 3, 3], [4, 3, 4, 2, 3, 4, 1, 2, 3, 4])
    """
    page_size = _static_size("page_size", page_size)
    num_tokens = _static_size("num_tokens", num_tokens)
    indptr, last = _int32("kv_indptr", kv_indptr), _int32("kv_last_page_len", kv_last_page_len)
    counts = jnp.clip(_int32("counts", counts), 0, num_tokens)
    seq_lens = jnp.maximum(indptr[1:] - indptr[:-1] - 1, 0) * page_size + last
    views = token_views(counts, num_tokens)
    starts = jnp.cumsum(counts) - counts
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    first = (seq_lens - counts).at[views].get(**_NO_WRAP)
    positions = first + token - starts.at[views].get(**_NO_WRAP)
    return views, jnp.where(views >= 0, positions, -1)


def page_table_slots(kv_indptr, kv_indices, batch_indices, positions, *,
                     page_size: int) -> jax.Array:
    """int32 ``[T]``: the slots FlashInfer's ``append_paged_kv_cache`` writes tokens to.

    Token ``i`` of request ``b = batch_indices[i]`` at KV position ``p = positions[i]``
    goes to page ``kv_indices[kv_indptr[b] + p // page_size]``, entry ``p % page_size``;
    -1 (skipped) for padding (``b`` or ``p`` negative), a ``p`` past the request's pages
    ``[kv_indptr[b], kv_indptr[b + 1])``, a negative page id or a slot past int32.

    Args:
      kv_indptr: int ``[B + 1]``; kv_indices: int ``[kv_indptr[-1]]`` (page ids);
      batch_indices, positions: int ``[T]`` (e.g. from :func:`append_positions`);
      page_size: static.

    Example (FlashInfer's ``append_paged_kv_cache`` docstring: pages 0-7, 3 for request 0):
      >>> import jax.numpy as jnp
      >>> from jaxrope import paging
      >>> paging.page_table_slots(jnp.array([0, 3, 4, 6, 8]), jnp.arange(8),
      ...                         jnp.array([0, 0, 1, -1]), jnp.array([0, 44, 7, 0]),
      ...                         page_size=16).tolist()
      [0, 44, 55, -1]
    """
    page_size = _static_size("page_size", page_size)
    indptr, indices, b, p = (_int32(n, x) for n, x in (
        ("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("batch_indices", batch_indices),
        ("positions", positions)))
    if b.shape != p.shape or b.ndim != 1:
        raise ValueError(f"batch_indices.shape={tuple(b.shape)} and positions.shape="
                         f"{tuple(p.shape)} must both be [T]")
    ok = (b >= 0) & (b < indptr.shape[0] - 1) & (p >= 0)
    begin = indptr.at[jnp.where(ok, b, -1)].get(**_NO_WRAP)
    end = indptr.at[jnp.where(ok, b + 1, -1)].get(**_NO_WRAP)
    # Compared as a count of pages, so that nothing here can overflow int32.
    ok = ok & (p // page_size < end - begin)
    page = indices.at[jnp.where(ok, begin + p // page_size, -1)].get(**_NO_WRAP)
    return _slot(page, p, page_size, ok)
