"""Small attention layers that call the bridge, for ``torch.compile`` tests and benchmarks.

- :class:`PagedAttention`: q/k/v projections -> ``RopeManager.apply_qk_and_append_kv``
  into a combined ``[pages, 2, page_size, Hk, D]`` cache (a buffer of the layer, as an
  engine binds its cache to the layer) -> attention over the cached context.
- :class:`Qwen3Attention`: the same with Qwen3's QK-norm (its ``q_norm.weight`` and
  ``k_norm.weight`` parameters) fused into the call, and optionally an fp8 q.
- :class:`FusedQKVAttention`: one qkv projection, its q and k views rotated in place by
  ``rotary(positions, q, k)`` (vLLM's call: :class:`torch_bridge.RotaryEmbedding`, or
  :class:`ManagerRotary` over a manager's plan) -> causal attention.

Both take one request's tokens; the cache slot of a position is the position itself.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from jaxrope.qk_norm import QKNorm


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    """``q [T, Hq, D]`` over ``keys, values [S, Hk, D]`` (GQA) where ``mask [T, S]``."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (keys, values))
    out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys, values,
                                                     attn_mask=mask)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


class PagedAttention(nn.Module):
    """``forward(x [T, hidden], slots [T], context_slots [S]) -> [T, hidden]``.

    Token ``t`` (at position ``slots[t]``) attends to the cached tokens at
    ``context_slots`` with positions up to its own.
    """

    def __init__(self, manager: Any, hidden: int, q_heads: int, k_heads: int, pages: int,
                 page_size: int, *, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                 label: str = "text"):
        super().__init__()
        head_dim = manager.head_dim
        self.manager, self.label, self.page_size = manager, label, page_size
        self.heads = (q_heads, k_heads, head_dim)
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden, k_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden, k_heads * head_dim, **kw)
        self.o_proj = nn.Linear(q_heads * head_dim, hidden, **kw)
        self.register_buffer("kv_cache", torch.zeros(pages, 2, page_size, k_heads, head_dim,
                                                     dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, slots: torch.Tensor,
                context_slots: torch.Tensor) -> torch.Tensor:
        q_heads, k_heads, head_dim = self.heads
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, q_heads, head_dim)
        k = self.k_proj(x).view(tokens, k_heads, head_dim)
        v = self.v_proj(x).view(tokens, k_heads, head_dim)
        q = self.rope_and_append(q, k, v, slots)
        pages, entries = context_slots // self.page_size, context_slots % self.page_size
        keys, values = self.kv_cache[pages, 0, entries], self.kv_cache[pages, 1, entries]
        mask = context_slots[None, :] <= slots[:, None]
        return self.o_proj(_attend(q, keys, values, mask))

    def rope_and_append(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        """Rotate q and cache k and v; returns the q attention reads."""
        self.manager.apply_qk_and_append_kv(q, k, v, self.label, self.kv_cache, slots)
        return q


class Qwen3Attention(PagedAttention):
    """:class:`PagedAttention` with Qwen3's QK-norm: ``q_norm`` and ``k_norm`` are
    ``nn.RMSNorm(head_dim)`` (Qwen3RMSNorm's math, its state-dict names), their weights
    passed to ``apply_qk_and_append_kv`` with ``QKNorm(eps)``, which normalises each head
    before the rotation.

    ``q_quant_scale``: None (q rotated in place), or a float: q is quantised to
    float8_e4m3fn into a ``q_out`` buffer (FlashInfer's fp8 q), and attention reads it
    dequantised (``q_out / q_quant_scale``).
    """

    def __init__(self, manager: Any, hidden: int, q_heads: int, k_heads: int, pages: int,
                 page_size: int, *, eps: float = 1e-6, q_quant_scale: Optional[float] = None,
                 dtype: torch.dtype = torch.float32, device: Any = "cpu", label: str = "text"):
        super().__init__(manager, hidden, q_heads, k_heads, pages, page_size, dtype=dtype,
                         device=device, label=label)
        self.q_norm, self.k_norm = (nn.RMSNorm(manager.head_dim, eps=eps, dtype=dtype,
                                               device=device) for _ in "qk")
        self.qk_norm = QKNorm(eps=eps)
        self.q_quant_scale = q_quant_scale

    def rope_and_append(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        norm = dict(q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
                    qk_norm=self.qk_norm)
        if self.q_quant_scale is None:
            self.manager.apply_qk_and_append_kv(q, k, v, self.label, self.kv_cache, slots, **norm)
            return q
        q_out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
        self.manager.apply_qk_and_append_kv(q, k, v, self.label, self.kv_cache, slots,
                                            q_out=q_out, q_quant_scale=self.q_quant_scale,
                                            **norm)
        return q_out.to(q.dtype) / self.q_quant_scale


class ManagerRotary(nn.Module):
    """vLLM's rotary call over a manager: ``forward(positions, q, k)`` rotates at the
    planned positions of ``label`` (``positions`` unused: the plan holds them)."""

    def __init__(self, manager: Any, label: str = "text"):
        super().__init__()
        self.manager, self.label = manager, label

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.manager.apply_qk(q, k, self.label)


class FusedQKVAttention(nn.Module):
    """``forward(positions, x [T, hidden]) -> [T, hidden]``: causal attention with q and k
    rotated in place as views of one qkv buffer."""

    def __init__(self, rotary: nn.Module, hidden: int, q_heads: int, k_heads: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32, device: Any = "cpu"):
        super().__init__()
        self.rotary = rotary
        self.heads = (q_heads, k_heads, head_dim)
        kw = dict(bias=False, dtype=dtype, device=device)
        self.qkv_proj = nn.Linear(hidden, (q_heads + 2 * k_heads) * head_dim, **kw)
        self.o_proj = nn.Linear(q_heads * head_dim, hidden, **kw)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_heads, k_heads, head_dim = self.heads
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
        q, k = self.rotary(positions, q, k)
        rows = torch.arange(tokens, device=x.device)
        mask = rows[None, :] <= rows[:, None]
        return self.o_proj(_attend(q.view(tokens, q_heads, head_dim),
                                   k.view(tokens, k_heads, head_dim),
                                   v.view(tokens, k_heads, head_dim), mask))
