"""``from_hf``'s second step: the layer types of a model and the rope parameters of each.

- :func:`layer_types`: each layer's type (``full_attention``, ``sliding_attention``, ...)
  as the config class derives it;
- :func:`nope`: the layers that apply no rotary embedding (Llama 4, SmolLM 3, Cohere 2);
- :func:`rope_parameters`: ``{layer type or None (all layers): (where, params)}``, the
  rope parameters in transformers' standardised form (``rope_theta`` filled in, the
  top-level ``original_max_position_embeddings`` applied, Gemma 3's legacy fields
  split per layer type).

Example:
  >>> from jaxrope.models import MODEL_TYPES
  >>> row = MODEL_TYPES["gemma2"]
  >>> layer_types({"num_hidden_layers": 4}, row)
  ('sliding_attention', 'full_attention', 'sliding_attention', 'full_attention')
  >>> rope_parameters({"rope_theta": 1e4}, MODEL_TYPES["llama"], None)
  {None: ('rope_parameters', {'rope_theta': 10000.0})}
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from jaxrope.models import ModelRow
from jaxrope.numbers import as_float, as_int

__all__ = ["layer_types", "nope", "rope_parameters"]

_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _num_layers(fields: Mapping[str, Any]) -> Optional[int]:
    n = fields.get("num_hidden_layers", fields.get("num_layers", fields.get("n_layer")))
    return None if n is None else as_int(n, "num_hidden_layers")


def layer_types(fields: Mapping[str, Any], row: ModelRow) -> Optional[Tuple[str, ...]]:
    """Each layer's type, as the config class derives it; None when unknown."""
    declared = fields.get("layer_types")
    if declared is not None:
        if isinstance(declared, str) or not hasattr(declared, "__iter__"):
            raise TypeError(f"layer_types={declared!r} must be a list of strings")
        return tuple(str(t) for t in declared)
    n = _num_layers(fields)
    if n is None:
        return None
    if row.layer_pattern is None:
        return ("full_attention",) * n
    pattern = as_int(fields.get("sliding_window_pattern", row.layer_pattern),
                     "sliding_window_pattern")
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if row.last_layer_full and types:
        types[-1] = "full_attention"
    return tuple(types)


def nope(fields: Mapping[str, Any], row: ModelRow) -> Tuple[int, ...]:
    """The indices of the layers that apply no RoPE, ascending (see :func:`jaxrope.hf.nope_layers`)."""
    if row.nope == "no_rope_layers":
        flags = fields.get("no_rope_layers")
        if not flags:
            n = _num_layers(fields)
            if n is None:
                raise ValueError("num_hidden_layers is required to place the NoPE layers "
                                 "(no_rope_layers is empty)")
            interval = as_int(fields.get("no_rope_layer_interval", 4), "no_rope_layer_interval")
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)
    if row.nope == "full_attention":
        types = layer_types(fields, row)
        if types is None:
            raise ValueError("layer_types or num_hidden_layers is required to place the "
                             "NoPE (full_attention) layers")
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    return ()


def _params_dict(value: Any, name: str) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}={value!r} must be a dict or null")
    return dict(value)


def _local_theta(fields: Mapping[str, Any], row: ModelRow) -> float:
    value = fields.get(row.local_theta_key)
    return row.local_theta_default if value is None else as_float(value, row.local_theta_key)


def _theta(fields: Mapping[str, Any], row: ModelRow) -> float:
    if row.theta_key is None:
        return row.theta_default
    value = fields.get(row.theta_key)
    value = row.theta_default if value is None else as_float(value, row.theta_key)
    return value * row.theta_unit


def _per_layer_type(fields: Mapping[str, Any], row: ModelRow, where: str, params: Mapping[str, Any],
                    nested: Mapping[str, Any]) -> Dict[Optional[str], Tuple[str, dict]]:
    """Rope parameters given per layer type (Gemma 4's form), each with its base."""
    for key, value in params.items():
        if key not in nested and value is not None and (key, value) != ("rope_type", "default"):
            raise ValueError(f"{where}.{key}={value!r} sits beside per-layer-type rope "
                             f"parameters {sorted(nested)}; transformers ignores it")
    out = {}
    for layer_type, value in nested.items():
        one = _params_dict(value, f"{where}.{layer_type}")
        if one.get("rope_theta") is None:
            local = row.local_theta_key is not None and layer_type == "sliding_attention"
            one["rope_theta"] = _local_theta(fields, row) if local else _theta(fields, row)
        out[layer_type] = (f"{where}.{layer_type}", one)
    return out


def rope_parameters(fields: Mapping[str, Any], row: ModelRow,
                    types: Optional[Tuple[str, ...]]) -> Dict[Optional[str], Tuple[str, dict]]:
    """``{layer type or None (all layers): (where, params)}``, transformers' standardised form.

    ``where`` names the parameters' place in the config for error messages
    (``rope_scaling``, ``rope_parameters.full_attention``, ...).

    Raises:
      TypeError: rope parameters that are not a dict.
      ValueError: ``rope_scaling`` and ``rope_parameters`` that differ; a key beside
        per-layer-type parameters.
    """
    legacy = _params_dict(fields.get("rope_scaling"), "rope_scaling") if row.scaling else {}
    modern = _params_dict(fields.get("rope_parameters"), "rope_parameters") if row.scaling else {}
    if legacy and modern and legacy != modern:
        raise ValueError("rope_scaling and rope_parameters are both set and differ; "
                         "keep one (transformers would use rope_scaling)")
    params, where = (legacy, "rope_scaling") if legacy else (modern, "rope_parameters")
    if not params and row.rope_parameters_default is not None:
        params = _params_dict(row.rope_parameters_default, where)
    known = set(types or ()) | set(_LAYER_TYPES)
    nested = {k: v for k, v in params.items() if k in known and isinstance(v, (Mapping, type(None)))}
    if nested:
        return _per_layer_type(fields, row, where, params, nested)
    if params.get("rope_theta") is None:
        params["rope_theta"] = _theta(fields, row)
    rope_type = params.get("rope_type", params.get("type"))
    if row.rope_type_aliases.get(rope_type, rope_type) in ("yarn", "longrope", "llama3"):
        # transformers: a top-level original_max_position_embeddings (or the config
        # class's attribute) wins over the one inside the rope parameters.
        top = fields.get("original_max_position_embeddings", row.original_max_position_default)
        if top is not None:
            params["original_max_position_embeddings"] = top
    if row.local_theta_key is not None:
        # Gemma 3's legacy layout: rope_scaling and rope_theta are the full layers',
        # rope_local_base_freq the sliding layers' base.
        return {"full_attention": (where, params),
                "sliding_attention": (row.local_theta_key, {"rope_type": "default",
                                                            "rope_theta": _local_theta(fields, row)})}
    return {None: (where, params)}
