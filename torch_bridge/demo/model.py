"""The demo's model: a one-layer attention block, run by the manager and recomputed in float64."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from jaxrope.config import RopeConfig
from jaxrope import layer_reference

__all__ = ["HIDDEN", "KV_HEADS", "Layer", "MODELS", "Q_HEADS", "Stream", "TOLERANCE", "VL_MODELS",
           "VOCAB"]

# --model: the real RoPE configs of jaxrope.models.HF_CONFIGS the 1-D traces run ...
MODELS = {
    "llama3.1": "meta-llama/Llama-3.1-8B",
    "qwen2.5-yarn": "Qwen/Qwen2.5-7B-Instruct+yarn",
    "phi3-longrope": "microsoft/Phi-3-mini-128k-instruct",
    "deepseek-v2": "deepseek-ai/DeepSeek-V2-Lite",
}
# ... and the M-RoPE ones (jaxrope.models.HF_VL_CONFIGS) of the multimodal trace.
VL_MODELS = {
    "qwen2-vl": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2.5-vl": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen3-vl": "Qwen/Qwen3-VL-4B-Instruct",
    "glm-4.1v": "zai-org/GLM-4.1V-9B-Thinking",
}

# q/k/v and attention run in float32 with the float32 RoPE kernel; outputs are O(1).
# Rounding of the projections, the rotation (angles reduced in more than float32) and
# a softmax over <= ~80 keys with logits O(1) stays near 1e-6; 1e-4 leaves margin on any
# device. A position off by one turns the fastest pair by about a radian, which moves
# the output by ~1e-2 or more.
TOLERANCE = 1e-4

Q_HEADS, KV_HEADS, HIDDEN, VOCAB = 4, 2, 64, 512


@dataclasses.dataclass
class Stream:
    """One (request, label) stream on a node: its tokens and its rotated KV cache."""

    ids: List[int]
    k: torch.Tensor   # [len(ids), KV_HEADS, D], rotated
    v: torch.Tensor   # [len(ids), KV_HEADS, D]

    def clone(self) -> "Stream":
        return Stream(list(self.ids), self.k.clone(), self.v.clone())


class Layer:
    """A one-layer attention block with random weights, in torch float32 and numpy float64.

    The float64 weights are the float32 ones widened, so both sides compute the same
    function; only rounding differs.
    """

    def __init__(self, rope: RopeConfig, device: torch.device, rng: np.random.Generator):
        d = rope.head_dim
        self.rope, self.device, self.head_dim = rope, device, d
        self.emb32 = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        self.w32 = {
            name: (rng.standard_normal((HIDDEN, heads * d)) / math.sqrt(HIDDEN)).astype(np.float32)
            for name, heads in (("q", Q_HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        self.emb = torch.from_numpy(self.emb32).to(device)
        self.w = {name: torch.from_numpy(w).to(device) for name, w in self.w32.items()}
        self.attention = rope.serving_frequencies()[1]
        self._static: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor]] = {}

    def static_qk(self, key: Hashable, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """float32 ``q [tokens, Hq, D]``, ``k [tokens, Hk, D]`` buffers, the same tensors for
        the same ``key``: what a captured CUDA graph reads its inputs from."""
        if key not in self._static:
            d = self.head_dim
            self._static[key] = (
                torch.zeros((tokens, Q_HEADS, d), dtype=torch.float32, device=self.device),
                torch.zeros((tokens, KV_HEADS, d), dtype=torch.float32, device=self.device))
        return self._static[key]

    def project(self, ids: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 ``q [n, Hq, D]``, ``k [n, Hk, D]``, ``v [n, Hk, D]``, unrotated."""
        x = self.emb[torch.tensor(list(ids), device=self.device)]
        n, d = len(ids), self.head_dim
        return ((x @ self.w["q"]).view(n, Q_HEADS, d), (x @ self.w["k"]).view(n, KV_HEADS, d),
                (x @ self.w["v"]).view(n, KV_HEADS, d))

    def attend(self, q: torch.Tensor, stream: Stream) -> torch.Tensor:
        """float32 causal attention of the stream's last ``q.shape[0]`` tokens over its cache."""
        n, total = q.shape[0], stream.k.shape[0]
        group = Q_HEADS // KV_HEADS
        k = stream.k.repeat_interleave(group, dim=1)
        v = stream.v.repeat_interleave(group, dim=1)
        scores = q.transpose(0, 1) @ k.permute(1, 2, 0) / math.sqrt(self.head_dim)   # [H, n, total]
        q_pos = torch.arange(total - n, total, device=q.device)
        future = torch.arange(total, device=q.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        return (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1)

    def recompute(self, ids: Sequence[int], last: int,
                  positions: Optional[np.ndarray] = None) -> np.ndarray:
        """float64 attention output ``[last, Hq, D]`` of a stream's last tokens, from scratch.

        Every token of ``ids`` is projected again and rotated at its absolute position:
        its index, or ``positions`` (``[len(ids)]``; for an M-RoPE config ``[3, len(ids)]``,
        the t, h, w rows of the whole sequence), so nothing computed by the manager or the
        caches is reused.
        """
        x = self.emb32.astype(np.float64)[np.asarray(ids)]
        total, d = len(ids), self.head_dim
        pos = np.arange(total, dtype=np.float64) if positions is None else np.asarray(
            positions, np.float64)
        q = self._rotate((x @ self.w32["q"].astype(np.float64)).reshape(total, Q_HEADS, d), pos)
        k = self._rotate((x @ self.w32["k"].astype(np.float64)).reshape(total, KV_HEADS, d), pos)
        v = (x @ self.w32["v"].astype(np.float64)).reshape(total, KV_HEADS, d)
        group = Q_HEADS // KV_HEADS
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = q[total - last:].transpose(1, 0, 2) @ k.transpose(1, 2, 0) / math.sqrt(d)
        q_pos = np.arange(total - last, total)
        scores = np.where(np.arange(total)[None, None, :] > q_pos[None, :, None], -np.inf, scores)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return (weights @ v.transpose(1, 0, 2)).transpose(1, 0, 2)

    def _rotate(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return layer_reference.rotate(self.rope, x, pos)
