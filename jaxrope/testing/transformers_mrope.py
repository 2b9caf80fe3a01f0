"""transformers' own M-RoPE code, called on numpy inputs: the reference for jaxrope.mrope.

Two references, for the model types of :mod:`jaxrope.mrope.hf`:

- :func:`get_rope_index`: the VL model class's ``get_rope_index`` (and
  ``get_vision_position_ids``), bound to a model built from a tiny config of that class:
  the real methods, on a real instance, with the merge size and ``tokens_per_second``
  under test; no weights matter to them;
- :func:`rotate`: the text model's rotary class, built from a real ``config.json`` dict
  through transformers' config class, and the ``apply_rotary_pos_emb`` of the same
  modeling module (each family's pair layout and section recomposition);
  :func:`frequencies`: that rotary class's ``inv_freq`` and attention factor.

torch and transformers are imported inside the functions (``jaxrope.testing`` must
import without them).
"""

from __future__ import annotations

import copy
import functools
import importlib
from typing import Any, Mapping, Optional, Tuple

import numpy as np

# model_type -> (modeling module, config class, VL model class, text rotary class).
_CLASSES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLConfig", "Qwen2VLModel", "Qwen2VLRotaryEmbedding"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLModel", "Qwen2_5_VLRotaryEmbedding"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLModel", "Qwen3VLTextRotaryEmbedding"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeConfig", "Qwen3VLMoeModel",
                     "Qwen3VLMoeTextRotaryEmbedding"),
    "glm4v": ("glm4v", "Glm4vConfig", "Glm4vModel", "Glm4vTextRotaryEmbedding"),
    # GLM-4.5V: M-RoPE jaxrope refuses (NeoX halves); :func:`rotate` shows what it computes.
    "glm4v_moe": ("glm4v_moe", "Glm4vMoeConfig", "Glm4vMoeModel", "Glm4vMoeTextRotaryEmbedding"),
}

# The smallest text and vision towers each class accepts; get_rope_index reads only the
# vision config's spatial_merge_size (and tokens_per_second).
_TINY_TEXT = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64, head_dim=8)
_TINY_VISION = {
    "qwen2_vl": dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2),
    "qwen2_5_vl": dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                       out_hidden_size=16, fullatt_block_indexes=[0]),
    "qwen3_vl": dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                     out_hidden_size=16, deepstack_visual_indexes=[], num_position_embeddings=16),
    "glm4v": dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
}
_TINY_ROPE = {
    "qwen2_vl": {"type": "mrope", "mrope_section": [2, 1, 1]},
    "qwen2_5_vl": {"type": "mrope", "mrope_section": [2, 1, 1]},
    "qwen3_vl": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "glm4v": {"rope_type": "default", "mrope_section": [2, 1, 1]},
}


def _module(model_type: str):
    return importlib.import_module(f"transformers.models.{_CLASSES[model_type][0]}."
                                   f"modeling_{_CLASSES[model_type][0]}")


def _config_class(model_type: str):
    import transformers
    return getattr(transformers, _CLASSES[model_type][1])


@functools.lru_cache(maxsize=None)
def tiny_model(model_type: str, spatial_merge_size: int, tokens_per_second: Optional[int] = None):
    """A VL model of ``model_type``'s own class (qwen2_vl, qwen2_5_vl, qwen3_vl, glm4v),
    with tiny towers and the given vision merge (and Qwen2.5-VL ``tokens_per_second``)."""
    vision = dict(_TINY_VISION[model_type], spatial_merge_size=spatial_merge_size)
    if tokens_per_second is not None:
        vision["tokens_per_second"] = tokens_per_second
    config = _config_class(model_type)(text_config=dict(_TINY_TEXT, rope_scaling=_TINY_ROPE[model_type]),
                                       vision_config=vision)
    return getattr(_module(model_type), _CLASSES[model_type][2])(config).eval()


def get_rope_index(model, mm_token_type_ids: np.ndarray, image_grid_thw: np.ndarray,
                   video_grid_thw: np.ndarray, second_per_grid_ts: Optional[np.ndarray] = None,
                   input_ids: Optional[np.ndarray] = None) -> Tuple[np.ndarray, int]:
    """``model.get_rope_index`` on one prompt: int64 positions ``[3, L]`` and the delta.

    ``mm_token_type_ids`` int ``[L]`` (0 text, 1 image, 2 video), grids int ``[n, 3]``
    (``n`` may be 0), ``second_per_grid_ts`` float32 ``[videos]`` as HF processors give
    it (passed to Qwen2.5-VL only), ``input_ids`` ``[L]`` (default: the model's image and
    video token ids at vision tokens, 0 elsewhere).
    """
    import torch
    types = torch.as_tensor(np.asarray(mm_token_type_ids, np.int64))[None]
    if input_ids is None:
        input_ids = np.where(mm_token_type_ids == 1, model.config.image_token_id,
                             np.where(mm_token_type_ids == 2, model.config.video_token_id, 0))
    kwargs = {}
    for name, grids in (("image_grid_thw", image_grid_thw), ("video_grid_thw", video_grid_thw)):
        if len(grids):
            kwargs[name] = torch.as_tensor(np.asarray(grids, np.int64).reshape(-1, 3))
    if second_per_grid_ts is not None and len(second_per_grid_ts):
        kwargs["second_per_grid_ts"] = torch.as_tensor(np.asarray(second_per_grid_ts, np.float32))
    with torch.no_grad():
        positions, delta = model.get_rope_index(torch.as_tensor(np.asarray(input_ids))[None],
                                                types, **kwargs)
    return positions[:, 0].numpy(), int(delta.reshape(()))


def vision_position_ids(model, start: int, grid: Tuple[int, int, int],
                        second_per_grid_t: Optional[float] = None) -> np.ndarray:
    """``model.get_vision_position_ids`` of one grid at ``start``: int64 ``[3, tokens]``.

    With ``second_per_grid_t`` (a Qwen2.5-VL video) the time interval is formed as
    ``get_rope_index`` forms it, ``tokens_per_second`` times the float32 value its
    processor hands over; otherwise the method's default interval.
    """
    import torch
    vision = model.config.vision_config
    extra = ()
    if second_per_grid_t is not None:
        extra = (vision.tokens_per_second * torch.tensor(second_per_grid_t, dtype=torch.float32),)
    return model.get_vision_position_ids(start, torch.tensor(grid), 1, vision.spatial_merge_size,
                                         *extra).numpy()


def vl_config(config: Mapping[str, Any]):
    """transformers' config object (its model type's class) for a ``config.json`` dict."""
    # A deep copy: transformers' config classes rewrite the nested rope dicts in place
    # (rope_theta and rope_type added), and the caller's dict may be a shared table.
    fields = copy.deepcopy({key: value for key, value in config.items() if key != "model_type"})
    return _config_class(config["model_type"])(**fields)


def _rotary(config: Mapping[str, Any]):
    model_type = config["model_type"]
    return getattr(_module(model_type), _CLASSES[model_type][3])(vl_config(config).text_config)


def frequencies(config: Mapping[str, Any]) -> Tuple[np.ndarray, float]:
    """The rotary class's float32 ``inv_freq [R/2]`` and ``attention_scaling`` for a
    ``config.json`` dict (its scaling type applied, as the model builds it)."""
    rotary = _rotary(config)
    return rotary.inv_freq.numpy(), float(rotary.attention_scaling)


def rotate(config: Mapping[str, Any], q: np.ndarray, k: np.ndarray,
           pos_ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """float32 ``q [T, Hq, D]``, ``k [T, Hk, D]`` rotated at ``pos_ids [3, T]`` by the
    family's rotary class and ``apply_rotary_pos_emb``, as its attention layer calls them."""
    import torch
    module = _module(config["model_type"])
    rotary = _rotary(config)
    qt = torch.as_tensor(np.asarray(q, np.float32)).permute(1, 0, 2)[None]  # [1, H, T, D]
    kt = torch.as_tensor(np.asarray(k, np.float32)).permute(1, 0, 2)[None]
    with torch.no_grad():
        cos, sin = rotary(qt, torch.as_tensor(np.asarray(pos_ids, np.int64))[:, None, :])
        q_out, k_out = module.apply_rotary_pos_emb(qt, kt, cos, sin)
    return q_out[0].permute(1, 0, 2).numpy(), k_out[0].permute(1, 0, 2).numpy()
