"""What a HF vision-language ``config.json`` says about M-RoPE, as jaxrope arguments.

Pure functions of a config dict, for :meth:`jaxrope.RopeConfig.from_hf` to merge with
the fields it already reads (``rope_theta``, head geometry, ``partial_rotary_factor``):

- :func:`hf_text_config`: the dict that holds the text model's fields (the nested
  ``text_config`` of a VL config, else the config itself);
- :func:`hf_mrope_args`: ``mrope_section``, ``mrope_interleaved`` and the pair layout
  ``interleave`` of an M-RoPE model, or None for a 1-D one;
- :func:`hf_index_args`: the family, spatial merge and ``tokens_per_second`` that
  :func:`jaxrope.mrope.rope_index` needs.

The layouts are properties of each model's code in transformers 5.24, not of its
config, so they come from one table keyed by ``model_type`` (checked against the
transformers rotary classes in tests/test_mrope_apply.py):

=============================  ============  ===============  ============================
model_type                     sections      pairs            default ``mrope_section``
=============================  ============  ===============  ============================
qwen2_vl, qwen2_5_vl           end to end    NeoX halves      (16, 24, 24)
qwen3_vl, qwen3_vl_moe         interleaved   NeoX halves      (24, 20, 20)
glm4v (GLM-4.1V)               end to end    GPT-J pairs      (8, 12, 12)
=============================  ============  ===============  ============================

Qwen3-VL's rotary class interleaves whatever ``mrope_interleaved`` says, so a config
saying False for it is refused rather than followed. The default sections are the
ones transformers falls back to when a config has none. Other models with an
``mrope_section`` (GLM-4.5V's ``glm4v_moe`` rotates NeoX halves, ERNIE-4.5-VL has its
own layout, ...) are refused: a guessed layout would rotate silently wrong.

Example:
  >>> from jaxrope.mrope import HF_VL_CONFIGS, hf_mrope_args
  >>> hf_mrope_args(HF_VL_CONFIGS["Qwen/Qwen3-VL-4B-Instruct"])
  {'mrope_section': (24, 20, 20), 'mrope_interleaved': True, 'interleave': False}
  >>> hf_mrope_args({"model_type": "llama", "rope_theta": 5e5}) is None
  True
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

__all__ = ["HF_MODEL_TYPES", "hf_index_args", "hf_mrope_args", "hf_text_config"]


class _Layout(NamedTuple):
    family: str
    mrope_interleaved: bool
    interleave: bool
    default_section: Tuple[int, int, int]


_LAYOUTS = {
    "qwen2_vl": _Layout("qwen2_vl", False, False, (16, 24, 24)),
    "qwen2_5_vl": _Layout("qwen2_5_vl", False, False, (16, 24, 24)),
    "qwen3_vl": _Layout("qwen3_vl", True, False, (24, 20, 20)),
    "qwen3_vl_moe": _Layout("qwen3_vl", True, False, (24, 20, 20)),
    "glm4v": _Layout("glm4v", False, True, (8, 12, 12)),
}
# The model types whose M-RoPE layout is known (their ``_text`` configs too).
HF_MODEL_TYPES: Tuple[str, ...] = tuple(sorted(_LAYOUTS))
# transformers' Qwen2_5_VLVisionConfig default, for a config that omits it.
_DEFAULT_TOKENS_PER_SECOND = 4
_DEFAULT_SPATIAL_MERGE = 2


def _mapping(config: Any) -> Mapping[str, Any]:
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (a HF config.json), got {type(config).__name__}")
    return config


def hf_text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's fields: ``config["text_config"]`` when it is a dict, else ``config``.

    Raises:
      TypeError: ``config`` is not a dict.

    Example:
      >>> from jaxrope.mrope import HF_VL_CONFIGS, hf_text_config
      >>> hf_text_config(HF_VL_CONFIGS["zai-org/GLM-4.1V-9B-Thinking"])["partial_rotary_factor"]
      0.5
    """
    text = _mapping(config).get("text_config")
    return text if isinstance(text, Mapping) else config


def _model_type(config: Mapping[str, Any]) -> Optional[str]:
    model_type = config.get("model_type") or hf_text_config(config).get("model_type")
    if isinstance(model_type, str) and model_type.endswith("_text"):
        model_type = model_type[:-len("_text")]
    return model_type


def _rope_params(config: Mapping[str, Any]) -> Mapping[str, Any]:
    for where in (hf_text_config(config), config):
        for key in ("rope_parameters", "rope_scaling"):
            params = where.get(key)
            if isinstance(params, Mapping):
                return params
    return {}


def hf_mrope_args(config: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """``{"mrope_section", "mrope_interleaved", "interleave"}`` for an M-RoPE model, else None.

    Reads ``model_type`` (top level, else the text config's, ``_text`` dropped) and
    ``mrope_section`` from ``rope_parameters`` or ``rope_scaling``, of the nested
    ``text_config`` first, then of the top level. ``mrope_section`` may be missing for
    a known VL model (transformers' default is used); ``mrope_interleaved`` may be
    missing, or must match the model's code.

    Raises:
      TypeError: ``config`` is not a dict.
      ValueError: an ``mrope_section`` on a model type whose layout is not in the
        table, or an ``mrope_interleaved`` the model's code contradicts.

    Example:
      >>> from jaxrope.mrope import HF_VL_CONFIGS, hf_mrope_args
      >>> hf_mrope_args(HF_VL_CONFIGS["zai-org/GLM-4.1V-9B-Thinking"])
      {'mrope_section': (8, 12, 12), 'mrope_interleaved': False, 'interleave': True}
    """
    params = _rope_params(_mapping(config))
    model_type = _model_type(config)
    layout = _LAYOUTS.get(model_type)
    section = params.get("mrope_section")
    if layout is None:
        if section is None:
            return None
        raise ValueError(f"model_type={model_type!r} has rope mrope_section={section!r}, but its "
                         f"M-RoPE layout is not known here; known: {sorted(_LAYOUTS)}")
    flag = params.get("mrope_interleaved")
    if flag is not None and flag != layout.mrope_interleaved:
        raise ValueError(f"mrope_interleaved={flag!r} contradicts model_type={model_type!r}, whose "
                         f"rotary embedding is {'interleaved' if layout.mrope_interleaved else 'sectioned'}")
    section = layout.default_section if section is None else tuple(section)
    return {"mrope_section": section, "mrope_interleaved": layout.mrope_interleaved,
            "interleave": layout.interleave}


def hf_index_args(config: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"family", "spatial_merge_size", "tokens_per_second"}`` for
    :func:`jaxrope.mrope.rope_index`, from a VL config and its ``vision_config``.

    ``tokens_per_second`` is None except for Qwen2.5-VL (transformers' default 4 when
    the config omits it); ``spatial_merge_size`` defaults to 2, as in transformers.

    Raises:
      TypeError: ``config`` is not a dict.
      ValueError: the model type is not an M-RoPE model of the table.

    Example:
      >>> from jaxrope.mrope import HF_VL_CONFIGS, hf_index_args
      >>> hf_index_args(HF_VL_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"])
      {'family': 'qwen2_5_vl', 'spatial_merge_size': 2, 'tokens_per_second': 2}
    """
    model_type = _model_type(_mapping(config))
    layout = _LAYOUTS.get(model_type)
    if layout is None:
        raise ValueError(f"model_type={model_type!r} is not an M-RoPE model known here; known: "
                         f"{sorted(_LAYOUTS)}")
    vision = config.get("vision_config") or {}
    tokens_per_second = None
    if layout.family == "qwen2_5_vl":
        tokens_per_second = vision.get("tokens_per_second", _DEFAULT_TOKENS_PER_SECOND)
    return {"family": layout.family,
            "spatial_merge_size": vision.get("spatial_merge_size", _DEFAULT_SPATIAL_MERGE),
            "tokens_per_second": tokens_per_second}
