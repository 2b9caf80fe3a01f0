"""FlashInfer's paged KV append, for parity with :func:`jaxrope.apply_rope_and_append_kv`.

Importing needs numpy and jaxrope only; torch and FlashInfer are imported inside the
functions that call them. FlashInfer 0.5.3 semantics, read from its ``flashinfer/page.py``,
``flashinfer/rope.py``, ``include/flashinfer/page.cuh`` and ``pos_enc.cuh``:

- ``append_paged_kv_cache(append_key, append_value, batch_indices, positions,
  paged_kv_cache, kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD")``: token
  ``i`` of request ``b = batch_indices[i]`` at KV position ``p = positions[i]`` goes to
  page ``kv_indices[kv_indptr[b] + p // page_size]``, entry ``p % page_size``
  (``kv_last_page_len`` is not used for the address). ``paged_kv_cache`` is a tuple
  ``(k_cache, v_cache)`` of NHD ``[pages, page_size, Hk, D]`` / HND ``[pages, Hk,
  page_size, D]`` tensors or one ``[pages, 2, ...]`` tensor. No skipped tokens: every
  token is written.
- ``rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v,
  cos_sin_cache, pos_ids, paged_kv_cache, kv_indices, kv_indptr, batch_indices,
  positions, is_neox, quantize_dtype, quant_scale_q, quant_scale_kv, page_size,
  kv_layout)``: rotates ``(q_rope, k_rope)`` (the first ``R`` dims) with the float32
  table ``cos_sin_cache [rows, R]`` (row ``pos_ids[i]``: ``R/2`` cosines then ``R/2``
  sines), multiplies every q element by ``quant_scale_q`` and every k and v element by
  ``quant_scale_kv`` in float32, converts with ``__nv_cvt_float2_to_fp8x2(...,
  __NV_SATFINITE, __NV_E4M3)`` (round to nearest even, saturate at +-448) and writes q
  into new fp8 buffers ``(q_rope_out, q_nope_out)``, k and v into the fp8 cache at the
  address above. ``R`` must be 16, 32, 64, 128 or 256; ``D - R`` is copied in chunks of
  ``R`` (keep it a multiple of ``R``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import numpy as np

import jaxrope as jr
from jaxrope.testing import flashinfer as fp
from jaxrope.testing import kv_oracle


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """FlashInfer's description of where appended tokens go, and the equivalent slots."""

    kv_indices: np.ndarray        # int32 [total pages]
    kv_indptr: np.ndarray         # int32 [B + 1]
    kv_last_page_len: np.ndarray  # int32 [B]
    batch_indices: np.ndarray     # int32 [T]
    positions: np.ndarray         # int32 [T], KV positions within each request
    page_size: int

    @property
    def slots(self) -> np.ndarray:
        """int32 ``[T]``: ``page * page_size + entry`` of each appended token
        (:func:`jaxrope.paging.page_table_slots`)."""
        return np.asarray(jr.paging.page_table_slots(self.kv_indptr, self.kv_indices,
                                                     self.batch_indices, self.positions,
                                                     page_size=self.page_size))


def paged_batch(rng: np.random.Generator, append_lengths: Sequence[int],
                cached_lengths: Sequence[int], pages: int, page_size: int) -> PagedBatch:
    """Requests that hold ``cached_lengths`` tokens and append ``append_lengths`` more,
    each on its own pages drawn at random from ``[0, pages)``."""
    totals = np.asarray(cached_lengths) + np.asarray(append_lengths)
    per_request = np.maximum(1, -(-totals // page_size))
    if per_request.sum() > pages:
        raise ValueError(f"{int(per_request.sum())} pages needed, {pages=}")
    kv_indices = rng.permutation(pages)[:per_request.sum()].astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(per_request)]).astype(np.int32)
    return PagedBatch(
        kv_indices=kv_indices, kv_indptr=kv_indptr,
        kv_last_page_len=(totals - (per_request - 1) * page_size).astype(np.int32),
        batch_indices=np.repeat(np.arange(len(totals)), append_lengths).astype(np.int32),
        positions=np.concatenate([c + np.arange(n) for c, n in
                                  zip(cached_lengths, append_lengths)]).astype(np.int32),
        page_size=page_size)


# The ragged batch of the GPU parity tests: 1 to 204 tokens appended to 0 to 1023 cached
# ones, at rope positions base + KV position (bases up to ~2**20), plus PADDING tokens at
# slot -1 that FlashInfer never sees.
APPEND = (1, 19, 204, 4, 17, 1, 33)
CACHED = (0, 5, 16, 300, 1, 1023, 64)
BASES = (0, 1 << 12, 1 << 17, (1 << 20) - 2048)
PADDING = 3


@dataclasses.dataclass(frozen=True)
class AppendInputs:
    """One parity case's inputs: the first ``tokens`` rows are FlashInfer's, the rest padding."""

    batch: PagedBatch
    q: np.ndarray                      # [tokens + PADDING, Hq, D]
    k: np.ndarray                      # [tokens + PADDING, Hk, D]
    v: np.ndarray                      # [tokens + PADDING, Hk, D]
    pos: np.ndarray                    # int32 [tokens + PADDING], padding at 0
    slots: np.ndarray                  # int32 [tokens + PADDING], padding at -1
    old: Tuple[np.ndarray, np.ndarray]  # (k_cache, v_cache) before the append
    tokens: int

    def written(self, layout: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(page [T], entry [T], mask)`` of the real tokens' rows; mask: the cache elements
        they cover."""
        shape = self.old[0].shape
        page_size = shape[1] if layout == "NHD" else shape[2]
        written, page, entry = kv_oracle.entries(self.batch.slots, shape[0], page_size)
        assert written.all(), "every real token has a slot in the cache"
        return page, entry, kv_oracle.written_mask(shape, layout, page, entry)


def append_inputs(rng: np.random.Generator, layout: str, page_size: int, dtype: np.dtype,
                  head_dim: int, q_heads: int, k_heads: int, fp8: bool) -> AppendInputs:
    """The batch above on pages drawn at random, q / k / v ~ 2 N(0, 1) in ``dtype`` and
    caches of random entries (e4m3 when ``fp8``; then every fifth token of k and v is
    large enough to saturate once scaled)."""
    pages = 2 * sum(-(-(c + a) // page_size) for c, a in zip(CACHED, APPEND)) + 3
    batch = paged_batch(rng, APPEND, CACHED, pages, page_size)
    bases = rng.choice(BASES, len(APPEND))
    pos = (bases[batch.batch_indices] + batch.positions).astype(np.int32)
    tokens = len(pos)
    q, k, v = ((2 * rng.standard_normal((tokens + PADDING, h, head_dim))).astype(dtype)
               for h in (q_heads, k_heads, k_heads))
    if fp8:
        k[::5] *= 400
        v[::5] *= 400
    shape = ((pages, page_size, k_heads, head_dim) if layout == "NHD"
             else (pages, k_heads, page_size, head_dim))
    old = tuple(rng.standard_normal(shape).astype(kv_oracle.E4M3 if fp8 else dtype)
                for _ in "kv")
    return AppendInputs(batch, q, k, v, np.concatenate([pos, np.zeros(PADDING, np.int32)]),
                        np.concatenate([batch.slots, np.full(PADDING, -1, np.int32)]), old,
                        tokens)


def to_torch(x: np.ndarray, device):
    """A torch copy of ``x`` on ``device`` (bf16 and fp8 through their bits)."""
    import torch
    if x.dtype == kv_oracle.E4M3:
        return torch.from_numpy(x.copy().view(np.uint8)).view(torch.float8_e4m3fn).to(device)
    return fp._to_torch(x, device)


def from_torch(t, dtype: np.dtype) -> np.ndarray:
    """numpy ``dtype`` of a torch tensor (fp8 tensors come back as ml_dtypes e4m3)."""
    import torch
    if t.dtype == torch.float8_e4m3fn:
        return t.detach().cpu().contiguous().view(torch.uint8).numpy().view(kv_oracle.E4M3)
    return fp._from_torch(t, dtype)


def batch_tensors(batch: PagedBatch, device):
    """FlashInfer's index tensors of ``batch`` on ``device``, by field name."""
    return {name: to_torch(getattr(batch, name), device)
            for name in ("kv_indices", "kv_indptr", "kv_last_page_len", "batch_indices",
                         "positions")}


def run_rope_then_append(cfg: jr.RopeConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                         pos_ids: np.ndarray, batch: PagedBatch, k_cache: np.ndarray,
                         v_cache: np.ndarray, layout: str) -> Tuple[np.ndarray, ...]:
    """FlashInfer's unfused pair on copies: ``apply_rope_pos_ids_inplace`` then
    ``append_paged_kv_cache``; returns numpy ``(q, k_cache, v_cache)``."""
    import flashinfer
    import torch

    dev = torch.device(fp.FLASHINFER_DEVICE)
    tq, tk, tv = (to_torch(x, dev) for x in (q, k, v))
    kc, vc = to_torch(k_cache, dev), to_torch(v_cache, dev)
    ids = batch_tensors(batch, dev)
    flashinfer.apply_rope_pos_ids_inplace(tq, tk, to_torch(pos_ids, dev),
                                          **fp.flashinfer_kwargs("pos_ids", cfg))
    flashinfer.append_paged_kv_cache(tk, tv, ids["batch_indices"], ids["positions"], (kc, vc),
                                     ids["kv_indices"], ids["kv_indptr"], ids["kv_last_page_len"],
                                     kv_layout=layout)
    torch.cuda.synchronize()
    return from_torch(tq, q.dtype), from_torch(kc, k_cache.dtype), from_torch(vc, v_cache.dtype)


def run_fp8_fused(cfg: jr.RopeConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  pos_ids: np.ndarray, batch: PagedBatch, k_cache: np.ndarray,
                  v_cache: np.ndarray, layout: str, quant_scale_q: float,
                  quant_scale_kv: float) -> Tuple[np.ndarray, ...]:
    """FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` on copies, with a float32
    cos/sin table made from ``cfg``'s float64 frequencies (:func:`fp.cos_sin_cache`);
    returns numpy ``(q_fp8 [T, Hq, D], k_cache, v_cache)``."""
    import flashinfer
    import torch

    dev = torch.device(fp.FLASHINFER_DEVICE)
    r = cfg.rotary_dim
    table, rows = fp.cos_sin_cache(cfg, pos_ids, dense=False)
    tq, tk, tv = (to_torch(x, dev) for x in (q, k, v))
    kc, vc = to_torch(k_cache, dev), to_torch(v_cache, dev)
    ids = batch_tensors(batch, dev)
    # No non-rotary part: None (FlashInfer makes the empty tensors itself).
    q_nope, k_nope = (x[..., r:] if r < cfg.head_dim else None for x in (tq, tk))
    # FlashInfer 0.5.3 keeps this op in flashinfer.rope (not re-exported at the top level).
    q_rope, q_nope = flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache(
        tq[..., :r], tk[..., :r], q_nope, k_nope, tv, to_torch(table, dev),
        to_torch(rows, dev), (kc, vc), ids["kv_indices"], ids["kv_indptr"],
        ids["batch_indices"], ids["positions"], is_neox=not cfg.interleave,
        quantize_dtype=torch.float8_e4m3fn, quant_scale_q=quant_scale_q,
        quant_scale_kv=quant_scale_kv, page_size=batch.page_size, kv_layout=layout)
    torch.cuda.synchronize()
    q_fp8 = np.concatenate([from_torch(q_rope, None), from_torch(q_nope, None)], axis=-1)
    return q_fp8, from_torch(kc, None), from_torch(vc, None)
