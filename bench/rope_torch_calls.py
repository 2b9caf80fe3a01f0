"""The torch-side RoPE calls :mod:`bench.rope_bench` times against jaxrope: HF transformers'
``rotate_half`` formula and FlashInfer's three in-place APIs (with the cos/sin cache one
of them reads, and the warm-up that JIT-builds FlashInfer's module).

torch and FlashInfer are passed in (``torch``, ``fi``), so importing this module needs
neither.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import numpy as np

from jaxrope import RopeConfig
from jaxrope.scaling import Llama3

__all__ = ["cos_sin_cache", "cos_sin_table", "flashinfer_call", "hf_rope", "warm_flashinfer"]


def warm_flashinfer(torch, fi) -> None:
    """First calls of the three APIs: FlashInfer JIT-builds its rope module here (~1 min)."""
    q = torch.randn(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(4, 1, 64, dtype=torch.bfloat16, device="cuda")
    pos = torch.arange(4, dtype=torch.int32, device="cuda")
    fi.apply_rope_pos_ids_inplace(q, k, pos)
    fi.apply_llama31_rope_pos_ids_inplace(q, k, pos)
    cache = torch.rand(16, 64, dtype=torch.float32, device="cuda")
    fi.apply_rope_with_cos_sin_cache_inplace(pos, q.view(4, -1), k.view(4, -1), 64, cache, True)
    torch.cuda.synchronize()


def hf_rope(torch, q, k, pos, cfg: RopeConfig) -> Callable[[], Any]:
    """HF's formula: cos/sin of ``cat(freqs, freqs)`` in float32, ``x*cos + rotate_half(x)*sin``."""
    inv_freq = torch.tensor(cfg.serving_frequencies()[0], dtype=torch.float32, device=q.device)
    half = cfg.head_dim // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def run():
        freqs = pos[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None], emb.sin().to(q.dtype)[:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return run


def cos_sin_table(cfg: RopeConfig, positions: int) -> np.ndarray:
    """FlashInfer's cos/sin cache ``[positions, rotary_dim]`` as float32, cos then sin,
    computed in float64.

    Example:
      >>> from jaxrope import RopeConfig
      >>> table = cos_sin_table(RopeConfig(head_dim=8), 16)
      >>> table.shape, table[0].tolist()   # position 0: cos 1, sin 0
      ((16, 8), [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    """
    inv_freq, attention = cfg.serving_frequencies()
    angle = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    table = np.concatenate([np.cos(angle), np.sin(angle)], axis=1) * attention
    return table.astype(np.float32)


def cos_sin_cache(torch, cfg: RopeConfig, device, positions: int):
    """:func:`cos_sin_table` as a torch tensor on ``device``."""
    return torch.from_numpy(cos_sin_table(cfg, positions)).to(device)


def flashinfer_call(torch, fi, cfg: RopeConfig, q, k, pos, use_cache: bool,
                    cache_positions: int) -> Tuple[Callable[[], Any], str]:
    """FlashInfer's in-place call for ``cfg`` on torch tensors, and its API's name; the
    cos/sin cache call (``use_cache``, or a scaling FlashInfer has no call for) reads a
    cache of ``cache_positions`` positions."""
    tokens, _, head_dim = q.shape
    if use_cache or (cfg.scaling is not None and not isinstance(cfg.scaling, Llama3)):
        cache, q2, k2 = cos_sin_cache(torch, cfg, q.device, cache_positions), q.view(tokens, -1), k.view(tokens, -1)
        return (lambda: fi.apply_rope_with_cos_sin_cache_inplace(
            pos, q2, k2, head_dim, cache, not cfg.interleave)), "apply_rope_with_cos_sin_cache_inplace"
    common = dict(rotary_dim=cfg.rotary_dim, interleave=cfg.interleave, rope_theta=cfg.theta)
    if isinstance(cfg.scaling, Llama3):
        s = cfg.scaling
        return (lambda: fi.apply_llama31_rope_pos_ids_inplace(
            q, k, pos, rope_scale=s.factor, low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor, old_context_len=s.original_max_position,
            **common)), "apply_llama31_rope_pos_ids_inplace"
    return (lambda: fi.apply_rope_pos_ids_inplace(q, k, pos, **common)), "apply_rope_pos_ids_inplace"
