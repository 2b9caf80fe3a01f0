"""Issue 46's fused family on both sides, for one :class:`jaxrope.cases.FusedCase`.

Shared by ``bench/fused_family_bench.py`` and ``tests/gpu/test_fused_family_flashinfer.py``
so that both run the same calls:

- :func:`ours`: :func:`jaxrope.apply_rope_and_append_kv` (GQA, with the QK-norm and fp8 q
  when the case asks) or :func:`jaxrope.apply_mla_rope_and_append` (MLA), as the round's
  contract (``notes/round5_contract.md``, parts A and B) defines them;
  :func:`unavailable` says which of those this jaxrope lacks.
- :func:`flashinfer_step`: what a FlashInfer 0.5.3 engine runs for the same step, on
  torch tensors: ``rmsnorm(q)`` + ``rmsnorm(k)`` (``gemma_rmsnorm`` for the Gemma
  convention) before the rest when the case normalises; then ``apply_rope_pos_ids_inplace``
  + ``append_paged_kv_cache`` (GQA bf16), ``apply_rope_pos_ids_inplace(q_pe, k_pe)`` +
  ``append_paged_mla_kv_cache`` (MLA bf16), or ``rope.rope_quantize_fp8_append_paged_kv_cache``
  (fp8, GQA or MLA by k's rank).

Array names are the GQA ones for both families: ``q`` (MLA: ``q_pe [T, H, r]``), ``k``
(``k_pe [T, r]``), ``v`` (``ckv [T, kv_lora_rank]``); ``q_nope`` only for MLA.
FlashInfer 0.5.3's signatures were read from its ``flashinfer/norm.py``, ``rope.py`` and
``page.py``; ``rmsnorm`` takes a weight of the input's dtype and a 3-D ``[T, H, D]`` input
(one warp per head), ``append_paged_mla_kv_cache`` serves ``ckv`` 512 / ``kpe`` 64 only.
Importing needs numpy, JAX and jaxrope; torch and FlashInfer are imported inside the
functions that use them.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from jaxrope.cases import FusedCase
from jaxrope.testing import flashinfer as fp
from jaxrope.testing import flashinfer_kv

# Per-tensor fp8 scales (FlashInfer's quant_scale_q / quant_scale_kv); neither is 1 so a
# side that drops a scale shows.
Q_SCALE = 0.8
KV_SCALE = 0.37


def input_shapes(case: FusedCase, tokens: int) -> Dict[str, Tuple[int, ...]]:
    """The shapes of a call's inputs by name; absent names are None in the call."""
    t, d = tokens, case.head_dim
    if case.mla:
        shapes = {"q": (t, case.q_heads, d), "k": (t, d), "v": (t, case.kv_lora_rank)}
        if case.q_nope_dim:
            shapes["q_nope"] = (t, case.q_heads, case.q_nope_dim)
        return shapes
    shapes = {"q": (t, case.q_heads, d), "k": (t, case.k_heads, d), "v": (t, case.k_heads, d)}
    if case.qk_norm is not None:
        shapes.update(wq=(d,), wk=(d,))
    return shapes


def cache_shapes(case: FusedCase, pages: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(k_cache, v_cache)`` NHD shapes, or MLA's ``(ckv_cache, kpe_cache)``."""
    s = case.page_size
    if case.mla:
        return (pages, s, case.kv_lora_rank), (pages, s, case.head_dim)
    return ((pages, s, case.k_heads, case.head_dim),) * 2


def random_inputs(rng: np.random.Generator, case: FusedCase, tokens: int,
                  dtype: np.dtype) -> Dict[str, np.ndarray]:
    """numpy inputs: activations ~ 2 N(0, 1), norm weights ~ 1 + N(0, 0.1**2), in ``dtype``."""
    out = {}
    for name, shape in input_shapes(case, tokens).items():
        x = (1 + 0.1 * rng.standard_normal(shape) if name in ("wq", "wk")
             else 2 * rng.standard_normal(shape))
        out[name] = x.astype(dtype)
    return out


def unavailable(case: FusedCase) -> Optional[str]:
    """Why this jaxrope cannot run ``case`` at all (a contract part not built), or None."""
    if case.mla:
        if not hasattr(jr, "apply_mla_rope_and_append"):
            return ("jaxrope has no apply_mla_rope_and_append (issue 46 contract part B, "
                    "the MLA op)")
        return None
    params = inspect.signature(jr.apply_rope_and_append_kv).parameters
    if case.qk_norm is not None and "q_norm_weight" not in params:
        return "apply_rope_and_append_kv takes no q_norm_weight (QK-norm)"
    if case.fp8 and "q_dtype" not in params:
        return "apply_rope_and_append_kv takes no q_dtype (issue 46 contract part A, fp8 q)"
    return None


def _fp8_kwargs(case: FusedCase) -> Dict[str, Any]:
    if not case.fp8:
        return {}
    q = {"q_dtype": jnp.float8_e4m3fn, "q_quant_scale": Q_SCALE}
    if case.mla:
        return {**q, "kv_quant_scale": KV_SCALE}
    return {**q, "k_quant_scale": KV_SCALE, "v_quant_scale": KV_SCALE}


def ours(case: FusedCase, backend: str) -> Callable:
    """Our op for ``case`` on ``backend``:
    ``f(q, k, v, q_nope, wq, wk, pos_ids, slots, caches) -> (q_out, q_nope_out, caches)``,
    ``q_nope``, ``wq``, ``wk`` None where the case has none (``q_nope_out`` then None)."""
    extra = _fp8_kwargs(case)
    cfg = case.cfg
    if case.mla:
        def call(q, k, v, q_nope, wq, wk, pos_ids, slots, caches):
            return jr.apply_mla_rope_and_append(q, k, v, pos_ids, tuple(caches), slots, cfg,
                                                q_nope=q_nope, backend=backend, **extra)
        return call
    if case.qk_norm is not None:
        extra["qk_norm"] = case.qk_norm

    def call(q, k, v, q_nope, wq, wk, pos_ids, slots, caches):
        norm = {} if wq is None else {"q_norm_weight": wq, "k_norm_weight": wk}
        q_out, caches = jr.apply_rope_and_append_kv(q, k, v, pos_ids, tuple(caches), slots,
                                                    cfg, backend=backend, **norm, **extra)
        return q_out, None, caches
    return call


def rope_kwargs(case: FusedCase) -> Tuple[Dict[str, Any], Optional[str]]:
    """``apply_rope_pos_ids_inplace``'s keywords for ``case.cfg`` and None when they mean
    the same rotation; else (a variant it cannot express, e.g. YaRN) the nearest it has,
    theta and pair layout, and a note saying the angles differ (for timing only)."""
    try:
        return fp.flashinfer_kwargs("pos_ids", case.cfg), None
    except ValueError as e:
        cfg = case.cfg
        return ({"rotary_dim": cfg.rotary_dim, "interleave": cfg.interleave,
                 "rope_theta": cfg.theta, "rope_scale": 1.0},
                f"{case.name}: apply_rope_pos_ids_inplace rotates with rope_theta "
                f"{cfg.theta} and no scaling ({e}); same kernel, other angles")


def _norm_stage(case: FusedCase, flashinfer, x: Dict[str, Any]):
    """FlashInfer's two norms into new buffers: ``(calls, q_normed, k_normed)``."""
    import torch
    norm = case.qk_norm
    if not norm.per_head:
        raise ValueError(f"{case.name}: FlashInfer's rmsnorm normalises per row; the "
                         "per-token (OLMo 2) span has no chain here")
    fn = flashinfer.gemma_rmsnorm if norm.convention == "gemma" else flashinfer.rmsnorm
    qn, kn = torch.empty_like(x["q"]), torch.empty_like(x["k"])
    calls = (lambda: fn(x["q"], x["wq"], norm.eps, out=qn),
             lambda: fn(x["k"], x["wk"], norm.eps, out=kn))
    return calls, qn, kn


def flashinfer_step(case: FusedCase, x: Dict[str, Any], pos_ids: np.ndarray,
                    batch: flashinfer_kv.PagedBatch) -> Tuple[Callable[[], None], Dict[str, Any]]:
    """FlashInfer's step for ``case`` on torch tensors ``x`` (:func:`input_shapes`' names,
    plus ``"caches"``, the pair it appends to, and ``"pos"``, int32 positions), for the
    requests ``batch`` describes (``pos_ids`` its rope positions, numpy).

    Returns ``(step, out)``: calling ``step`` runs the chain once (in place where
    FlashInfer works in place: the bf16 q / k, the caches); ``out`` holds the tensors it
    writes: ``"q"`` (rotated q, or the fp8 q), ``"q_nope"`` (fp8 MLA), ``"caches"``,
    ``"q_normed"`` / ``"k_normed"`` (the norms' outputs, when the case normalises), and
    ``"note"``: None, or why FlashInfer's rotation differs from ours (:func:`rope_kwargs`).
    """
    import flashinfer
    import torch

    dev = x["q"].device
    ids = flashinfer_kv.batch_tensors(batch, dev)
    q, k = x["q"], x["k"]
    calls, out = [], {"caches": x["caches"], "note": None}
    if case.qk_norm is not None:
        norms, q, k = _norm_stage(case, flashinfer, x)
        calls += norms
        out.update(q_normed=q, k_normed=k)
    if case.fp8:
        calls.append(_fp8_call(case, flashinfer, torch, q, k, x, pos_ids, batch, ids, out))
    else:
        kwargs, out["note"] = rope_kwargs(case)
        # MLA's k_pe [T, r] as the [T, 1, r] view the rope kernel takes (same storage).
        k_rope = k.view(k.shape[0], 1, k.shape[1]) if case.mla else k
        calls.append(lambda: flashinfer.apply_rope_pos_ids_inplace(q, k_rope, x["pos"], **kwargs))
        if case.mla:
            calls.append(lambda: flashinfer.append_paged_mla_kv_cache(
                x["v"], k, ids["batch_indices"], ids["positions"], *x["caches"],
                ids["kv_indices"], ids["kv_indptr"], ids["kv_last_page_len"]))
        else:
            calls.append(lambda: flashinfer.append_paged_kv_cache(
                k, x["v"], ids["batch_indices"], ids["positions"], x["caches"],
                ids["kv_indices"], ids["kv_indptr"], ids["kv_last_page_len"], kv_layout="NHD"))
        out["q"] = q

    def step() -> None:
        for call in calls:
            call()
    return step, out


def _fp8_call(case, flashinfer, torch, q, k, x, pos_ids, batch, ids, out) -> Callable[[], Any]:
    """``rope_quantize_fp8_append_paged_kv_cache`` on ``q``, ``k`` (GQA: with ``v``; MLA:
    ``k_nope`` = ckv, ``v`` None), its float32 cos/sin table made from ``case.cfg``'s
    float64 frequencies (YaRN and its attention factor included); fills ``out``."""
    e4m3 = torch.float8_e4m3fn
    dev = q.device
    table, rows = (flashinfer_kv.to_torch(a, dev)
                   for a in fp.cos_sin_cache(case.cfg, pos_ids, dense=False))
    tokens, heads = q.shape[:2]
    q_nope = x.get("q_nope")
    nope_width = q_nope.shape[-1] if q_nope is not None else 0
    out["q"] = torch.empty(q.shape, dtype=e4m3, device=dev)
    out["q_nope"] = torch.empty((tokens, heads, nope_width), dtype=e4m3, device=dev)
    if case.mla:
        k_nope, v = x["v"], None
    else:
        k_nope, v = None, x["v"]
    return lambda: flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache(
        q, k, q_nope, k_nope, v, table, rows, x["caches"], ids["kv_indices"], ids["kv_indptr"],
        ids["batch_indices"], ids["positions"], is_neox=not case.cfg.interleave,
        quantize_dtype=e4m3, quant_scale_q=Q_SCALE, quant_scale_kv=KV_SCALE,
        page_size=batch.page_size, kv_layout="NHD", q_rope_out=out["q"],
        q_nope_out=out["q_nope"])
