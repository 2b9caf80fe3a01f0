"""What a HF vision-language ``config.json`` says about M-RoPE: the one place it is read.

Pure functions of a config dict:

- :func:`hf_text_config`: the dict that holds the text model's fields (the nested
  ``text_config`` of a VL config, else the config itself);
- :func:`hf_mrope_args`: ``mrope_section``, ``mrope_interleaved`` and the pair layout
  ``interleave`` of an M-RoPE model, or None for a 1-D one;
- :func:`hf_index_args`: the family, spatial merge and ``tokens_per_second`` that
  :func:`jaxrope.mrope.rope_index` needs;
- :func:`split_mrope`: :meth:`jaxrope.RopeConfig.from_hf`'s M-RoPE step: the M-RoPE
  fields found (:func:`mrope_field`), checked and taken out of the rope parameters,
  so that what is left is read exactly as for a 1-D model.

The layouts are properties of each model's code in transformers 5.24, not of its
config, so they come from the model table (:class:`jaxrope.models.MropeLayout` on
the :data:`jaxrope.models.MODEL_TYPES` rows; checked against the transformers
rotary classes in tests/test_mrope_apply.py):

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
  >>> from jaxrope.models import HF_VL_CONFIGS
  >>> from jaxrope.mrope import hf_mrope_args
  >>> hf_mrope_args(HF_VL_CONFIGS["Qwen/Qwen3-VL-4B-Instruct"])
  {'mrope_section': (24, 20, 20), 'mrope_interleaved': True, 'interleave': False}
  >>> hf_mrope_args({"model_type": "llama", "rope_theta": 5e5}) is None
  True
  >>> raw = HF_VL_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"]
  >>> fields, args = split_mrope(raw, raw, "qwen2_vl", mrope_model=True)
  >>> fields["rope_scaling"], args["mrope_section"]
  ({}, (16, 24, 24))
  >>> mrope_field({"rope_parameters": {"rope_type": "mrope"}})
  ('rope_parameters.rope_type', 'mrope')
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from jaxrope.models import MODEL_TYPES, ModelRow

__all__ = ["HF_MODEL_TYPES", "MROPE_KEYS", "hf_index_args", "hf_mrope_args", "hf_text_config",
           "mrope_field", "split_mrope"]

# The model types whose M-RoPE layout is known (their ``_text`` configs too).
HF_MODEL_TYPES: Tuple[str, ...] = tuple(sorted(
    name for name, row in MODEL_TYPES.items()
    if row.mrope_layout is not None and not name.endswith("_text")))
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_PARAMS = ("rope_scaling", "rope_parameters")
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
      >>> from jaxrope.models import HF_VL_CONFIGS
      >>> from jaxrope.mrope import hf_text_config
      >>> hf_text_config(HF_VL_CONFIGS["zai-org/GLM-4.1V-9B-Thinking"])["partial_rotary_factor"]
      0.5
    """
    text = _mapping(config).get("text_config")
    return text if isinstance(text, Mapping) else config


def _model_type(config: Mapping[str, Any]) -> Optional[str]:
    model_type = config.get("model_type") or hf_text_config(config).get("model_type")
    return model_type.removesuffix("_text") if isinstance(model_type, str) else model_type


def _known_row(model_type: Optional[str]) -> Optional[ModelRow]:
    """The row of an M-RoPE model type whose layout is known, else None."""
    return MODEL_TYPES[model_type] if model_type in HF_MODEL_TYPES else None


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
      >>> from jaxrope.models import HF_VL_CONFIGS
      >>> from jaxrope.mrope import hf_mrope_args
      >>> hf_mrope_args(HF_VL_CONFIGS["zai-org/GLM-4.1V-9B-Thinking"])
      {'mrope_section': (8, 12, 12), 'mrope_interleaved': False, 'interleave': True}
    """
    params = _rope_params(_mapping(config))
    model_type = _model_type(config)
    row = _known_row(model_type)
    section = params.get("mrope_section")
    if row is None:
        if section is None:
            return None
        raise ValueError(f"model_type={model_type!r} has rope mrope_section={section!r}, but its "
                         f"M-RoPE layout is not known here; known: {list(HF_MODEL_TYPES)}")
    layout = row.mrope_layout
    flag = params.get("mrope_interleaved")
    if flag is not None and flag != layout.mrope_interleaved:
        raise ValueError(f"mrope_interleaved={flag!r} contradicts model_type={model_type!r}, whose "
                         f"rotary embedding is {'interleaved' if layout.mrope_interleaved else 'sectioned'}")
    section = layout.default_section if section is None else tuple(section)
    return {"mrope_section": section, "mrope_interleaved": layout.mrope_interleaved,
            "interleave": row.interleave}


def hf_index_args(config: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"family", "spatial_merge_size", "tokens_per_second"}`` for
    :func:`jaxrope.mrope.rope_index`, from a VL config and its ``vision_config``.

    ``tokens_per_second`` is None except for Qwen2.5-VL (transformers' default 4 when
    the config omits it); ``spatial_merge_size`` defaults to 2, as in transformers.

    Raises:
      TypeError: ``config`` is not a dict.
      ValueError: the model type is not an M-RoPE model of the table.

    Example:
      >>> from jaxrope.models import HF_VL_CONFIGS
      >>> from jaxrope.mrope import hf_index_args
      >>> hf_index_args(HF_VL_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"])
      {'family': 'qwen2_5_vl', 'spatial_merge_size': 2, 'tokens_per_second': 2}
    """
    model_type = _model_type(_mapping(config))
    row = _known_row(model_type)
    if row is None:
        raise ValueError(f"model_type={model_type!r} is not an M-RoPE model known here; known: "
                         f"{list(HF_MODEL_TYPES)}")
    layout = row.mrope_layout
    vision = config.get("vision_config") or {}
    tokens_per_second = None
    if layout.family == "qwen2_5_vl":
        tokens_per_second = vision.get("tokens_per_second", _DEFAULT_TOKENS_PER_SECOND)
    return {"family": layout.family,
            "spatial_merge_size": vision.get("spatial_merge_size", _DEFAULT_SPATIAL_MERGE),
            "tokens_per_second": tokens_per_second}


def mrope_field(fields: Mapping[str, Any], where: str = "") -> Optional[Tuple[str, Any]]:
    """``(dotted name, value)`` of the first field asking for M-RoPE: at the top level or
    anywhere inside the rope parameters (per-layer-type blocks included); else None."""
    for key in ("rope_type", "type"):
        if fields.get(key) == "mrope":
            return f"{where}{key}", fields[key]
    for key in MROPE_KEYS:
        if fields.get(key) is not None:
            return f"{where}{key}", fields[key]
    for key, value in fields.items():
        if isinstance(value, Mapping) and (where or key in _PARAMS):
            found = mrope_field(value, f"{where}{key}.")
            if found:
                return found
    return None


def split_mrope(raw: Mapping[str, Any], fields: Mapping[str, Any], model_type: str, *,
                mrope_model: bool) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """``(fields without the M-RoPE keys, hf_mrope_args(raw))``, or ``(fields, None)`` for
    a 1-D config.

    Args:
      raw: the whole config (``hf_mrope_args`` reads its ``text_config`` first).
      fields: the text model's fields, as ``from_hf`` reads them.
      model_type: the text model's type (``qwen3_vl_text`` or ``qwen3_vl`` alike).
      mrope_model: the model's code rotates with M-RoPE whatever the config says.

    Raises:
      NotImplementedError: M-RoPE fields, or an M-RoPE model, whose layout
        the model table does not know (GLM-4.5V's ``glm4v_moe``; an
        ``mrope_section`` on a 1-D model).
      ValueError: an M-RoPE key where the model's code does not read it (the top
        level, a per-layer-type block), or one it contradicts (``hf_mrope_args``).
    """
    found = mrope_field(fields)
    if not (found or mrope_model):
        return dict(fields), None
    if model_type.removesuffix("_text") not in HF_MODEL_TYPES:
        what = (f"{found[0]}={found[1]!r}" if found
                else f"model_type={model_type!r} (its code rotates with M-RoPE)")
        raise NotImplementedError(
            f"{what}: jaxrope implements the M-RoPE layouts (sections over t, h and w "
            f"positions, pair layout) of model types {list(HF_MODEL_TYPES)} "
            f"(jaxrope.mrope.hf), not of model_type={model_type!r}; a 1-D rotation would be "
            "right for text tokens only")
    for key in MROPE_KEYS:
        if fields.get(key) is not None:
            raise ValueError(f"{key}={fields[key]!r} at the top level is not read by "
                             f"model_type={model_type!r}; its code reads rope_parameters.{key}")
    args = hf_mrope_args(raw)
    out = dict(fields)
    for key in _PARAMS:
        params = out.get(key)
        if isinstance(params, Mapping):
            params = {k: v for k, v in params.items() if k not in MROPE_KEYS}
            for type_key in ("rope_type", "type"):
                if params.get(type_key) == "mrope":
                    del params[type_key]
            out[key] = params
    left = mrope_field(out)
    if left:
        raise ValueError(f"{left[0]}={left[1]!r} is not read by model_type={model_type!r}; its "
                         "code reads the M-RoPE keys of rope_parameters itself")
    return out, args
