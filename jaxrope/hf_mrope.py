"""``from_hf``'s M-RoPE step: find the M-RoPE fields of a config, check them, take them out.

A vision-language config keeps its M-RoPE fields (``mrope_section``,
``mrope_interleaved``, a legacy ``rope_type`` / ``type`` "mrope") inside the text model's
rope parameters, beside the 1-D ones (``rope_theta``, a scaling type and its keys). The
layout they select is :func:`jaxrope.mrope.hf_mrope_args`' (one table of model types);
what is left is read by :func:`jaxrope.hf.from_hf` exactly as for a 1-D model.

Example:
  >>> from jaxrope.mrope import HF_VL_CONFIGS
  >>> raw = HF_VL_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"]
  >>> fields, args = split_mrope(raw, raw, "qwen2_vl", mrope_model=True)
  >>> fields["rope_scaling"], args["mrope_section"]
  ({}, (16, 24, 24))
  >>> mrope_field({"rope_parameters": {"rope_type": "mrope"}})
  ('rope_parameters.rope_type', 'mrope')
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from jaxrope.mrope import hf as _mrope_hf

__all__ = ["MROPE_KEYS", "mrope_field", "split_mrope"]

MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_PARAMS = ("rope_scaling", "rope_parameters")


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
        :mod:`jaxrope.mrope.hf` does not know (GLM-4.5V's ``glm4v_moe``; an
        ``mrope_section`` on a 1-D model).
      ValueError: an M-RoPE key where the model's code does not read it (the top
        level, a per-layer-type block), or one it contradicts (``hf_mrope_args``).
    """
    found = mrope_field(fields)
    if not (found or mrope_model):
        return dict(fields), None
    if model_type.removesuffix("_text") not in _mrope_hf.HF_MODEL_TYPES:
        what = (f"{found[0]}={found[1]!r}" if found
                else f"model_type={model_type!r} (its code rotates with M-RoPE)")
        raise NotImplementedError(
            f"{what}: jaxrope implements the M-RoPE layouts (sections over t, h and w "
            f"positions, pair layout) of model types {list(_mrope_hf.HF_MODEL_TYPES)} "
            f"(jaxrope.mrope.hf), not of model_type={model_type!r}; a 1-D rotation would be "
            "right for text tokens only")
    for key in MROPE_KEYS:
        if fields.get(key) is not None:
            raise ValueError(f"{key}={fields[key]!r} at the top level is not read by "
                             f"model_type={model_type!r}; its code reads rope_parameters.{key}")
    args = _mrope_hf.hf_mrope_args(raw)
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
