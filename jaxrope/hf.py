"""``RopeConfig.from_hf``: a HF transformers config to the rotation its model computes.

What is read, for every model family of :data:`jaxrope.models.MODEL_TYPES`:

- the sub-config: a nested ``text_config`` when present (transformers v5 writes one
  for every multimodal model and for Llama 4), else the top level; a RoPE field that
  both carry with different values is refused;
- the layout (NeoX halves or GPT-J pairs) from the model's row, never from the config
  (``interleave=`` overrides it; DeepSeek-V3's ``rope_interleave`` is read);
- the rotated head: ``head_dim`` (else ``hidden_size // num_attention_heads``), or the
  row's field (``qk_rope_head_dim``, ``kv_channels``, Gemma 4's ``global_head_dim``);
  the rotated fraction ``partial_rotary_factor`` (``rotary_pct``, GPT-J ``rotary_dim``)
  where the model's apply function honours it;
- the base ``rope_theta`` (``rotary_emb_base``; ChatGLM ``10000 * rope_ratio``;
  Gemma 3's sliding layers ``rope_local_base_freq``), inside ``rope_parameters`` first;
- ``rope_scaling`` / ``rope_parameters`` (``rope_type`` or legacy ``type``), the keys
  of each type, ``original_max_position_embeddings`` as transformers resolves it;
- the trained length ``max_position_embeddings`` (``n_positions``, ``seq_length``).

- M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), GLM-4.1V): ``mrope_section``,
  ``mrope_interleaved`` and the pair layout through :func:`jaxrope.mrope.hf_mrope_args`
  (its one table of layouts), the M-RoPE keys (and ``rope_type`` "mrope") taken out
  of the rope parameters before the rest is read as above; the config rotates
  ``pos_ids [3, T]``.

Nothing is dropped silently: a RoPE field the model's code does not read, an unknown
``rope_type``, or an unknown key inside the rope parameters raises ``ValueError``
naming it (keys known not to affect the rotation, :data:`IGNORED_KEYS`, warn). An
M-RoPE config of a model type whose layout :mod:`jaxrope.mrope.hf` does not know
(GLM-4.5V's ``glm4v_moe``, or M-RoPE fields on a 1-D model) raises
``NotImplementedError`` naming the field. An unknown ``model_type`` is read as NeoX
halves with a warning.

Example:
  >>> import jaxrope as jr
  >>> glm = {"model_type": "glm", "hidden_size": 4096, "num_attention_heads": 32,
  ...        "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
  ...        "max_position_embeddings": 131072}
  >>> cfg = jr.RopeConfig.from_hf(glm)
  >>> cfg.head_dim, cfg.rotary_dim, cfg.interleave
  (128, 64, True)
  >>> from jaxrope.mrope import HF_VL_CONFIGS
  >>> vl = jr.RopeConfig.from_hf(HF_VL_CONFIGS["Qwen/Qwen3-VL-4B-Instruct"])
  >>> vl.mrope_section, vl.mrope_interleaved, vl.theta
  ((24, 20, 20), True, 5000000.0)
  >>> nope_layers({"model_type": "llama4_text", "num_hidden_layers": 8, "no_rope_layers": []})
  (3, 7)
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple

from jaxrope import frequencies as _frequencies
from jaxrope.config import RopeConfig
from jaxrope.models import GENERIC, MODEL_TYPES, ModelRow
from jaxrope.hf_mrope import split_mrope
from jaxrope.numbers import as_float, as_int
from jaxrope.scaling import (LONGROPE_FACTORS, DynamicNTK, Linear, Llama3, LongRope, Proportional,
                             Yarn)

__all__ = ["IGNORED_KEYS", "ROPE_FIELDS", "from_hf", "load_config", "nope_layers"]

# Top-level fields that decide a rotation. One a row does not read must be absent or
# carry the neutral value listed (what the model's code would do anyway).
ROPE_FIELDS: Mapping[str, Tuple[Any, ...]] = {
    "rope_theta": (), "rope_scaling": (None,), "rope_parameters": (None,),
    "partial_rotary_factor": (1, 1.0, None), "rotary_pct": (1, 1.0, None),
    "rotary_emb_base": (), "rotary_dim": (None,), "rope_ratio": (), "rope_local_base_freq": (),
    "rope_interleave": (), "head_dim": (), "qk_rope_head_dim": (), "kv_channels": (),
    "global_head_dim": (), "no_rope_layers": (), "no_rope_layer_interval": (),
    "alibi": (False, None), "position_embedding_type": ("rope", "rotary"),
    "original_max_position_embeddings": (),
}

# Keys that may appear inside rope_scaling / rope_parameters without affecting the
# rotation: warned about, not refused.
IGNORED_KEYS: Mapping[str, str] = {
    "llama_4_scaling_beta": "Ministral 3 scales queries by position in attention, after RoPE",
}

# Per rope_type, the keys read from the rope parameters (beside rope_type / type /
# rope_theta / partial_rotary_factor).
_TYPE_KEYS: Mapping[str, Tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings",
                 "attention_factor", "factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
    "proportional": ("factor",),
}
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def load_config(config: Any) -> Dict[str, Any]:
    """``config`` as a plain dict: a mapping, a path to a ``config.json`` (or to the
    directory holding one), or an object with ``to_dict()``.

    Raises:
      TypeError: none of the above.
      ValueError: the file is not a JSON object.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"config={path!r} must hold a JSON object, got {type(loaded).__name__}")
        return loaded
    if callable(getattr(config, "to_dict", None)):
        return dict(config.to_dict())
    raise TypeError(f"config must be a dict (a HF config.json), a path to one, or an object "
                    f"with to_dict() (a transformers config), got {type(config).__name__}")


def _sub_config(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """``text_config`` when there is one (its model_type defaulting to the wrapper's),
    else the top level."""
    text = raw.get("text_config")
    if text is None:
        return dict(raw)
    if not isinstance(text, Mapping):
        raise TypeError(f"text_config={text!r} must be a dict")
    text = dict(text)
    for key in ROPE_FIELDS:
        if key in raw and key in text and raw[key] != text[key]:
            raise ValueError(f"{key} differs between the top level ({raw[key]!r}) and "
                             f"text_config ({text[key]!r}); from_hf reads text_config")
    text.setdefault("model_type", raw.get("model_type"))
    return text


def _row(fields: Mapping[str, Any], interleave: Optional[bool]) -> Tuple[str, ModelRow]:
    model_type = fields.get("model_type")
    row = MODEL_TYPES.get(model_type)
    if row is None:
        if interleave is None:
            warnings.warn(f"model_type={model_type!r} is not in jaxrope.models.MODEL_TYPES: "
                          "reading it as NeoX halves (x[..., :R/2], x[..., R/2:]); check the "
                          "model's apply_rotary_pos_emb and pass interleave= to say which",
                          stacklevel=4)
        row = GENERIC
    return str(model_type), row


def _canonical(fields: Dict[str, Any], row: ModelRow) -> Dict[str, Any]:
    for old, new in row.aliases.items():
        if old in fields:
            value = fields.pop(old)
            if fields.get(new, value) != value:
                raise ValueError(f"{old}={value!r} and {new}={fields[new]!r} disagree")
            fields[new] = value
    return fields


def _reads(row: ModelRow) -> set:
    """The top-level fields of ROPE_FIELDS that ``row``'s model reads."""
    read = {"head_dim", row.head_dim_key, "original_max_position_embeddings"}
    if row.theta_key:
        read.add(row.theta_key)
    if row.scaling:
        read |= {"rope_scaling", "rope_parameters"}
    if row.partial_rotary is not None:
        read.add(row.partial_key)
    for key in (row.rotary_dim_key, row.interleave_key, row.local_theta_key,
                row.full_head_dim_key):
        if key:
            read.add(key)
    if row.nope == "no_rope_layers":
        read |= {"no_rope_layers", "no_rope_layer_interval"}
    read |= {field for field, _, _ in row.refuse}
    return read


def _check_fields(fields: Mapping[str, Any], model_type: str, row: ModelRow) -> None:
    for field, value, reason in row.refuse:
        if fields.get(field) == value:
            raise ValueError(f"{field}={fields[field]!r}: {reason}")
    read = _reads(row)
    for key, neutral in ROPE_FIELDS.items():
        if key in fields and key not in read and fields[key] not in neutral:
            raise ValueError(f"{key}={fields[key]!r} is not read by model_type={model_type!r} "
                             f"(its code: {'.'.join(row.source[:2])}); jaxrope will not "
                             "guess what it would change")


def _read(config: Any, interleave: Optional[bool]):
    """``(fields, model_type, row, mrope args or None)`` of a config, checked."""
    raw = load_config(config)
    fields = _sub_config(raw)
    model_type, row = _row(fields, interleave)
    fields = _canonical(fields, row)
    fields, mrope = split_mrope(raw, fields, model_type, mrope_model=row.mrope)
    _check_fields(fields, model_type, row)
    return fields, model_type, row, mrope


# -- layer types ------------------------------------------------------------------------


def _num_layers(fields: Mapping[str, Any]) -> Optional[int]:
    n = fields.get("num_hidden_layers", fields.get("num_layers", fields.get("n_layer")))
    return None if n is None else as_int(n, "num_hidden_layers")


def _layer_types(fields: Mapping[str, Any], row: ModelRow) -> Optional[Tuple[str, ...]]:
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


def _nope(fields: Mapping[str, Any], row: ModelRow) -> Tuple[int, ...]:
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
        types = _layer_types(fields, row)
        if types is None:
            raise ValueError("layer_types or num_hidden_layers is required to place the "
                             "NoPE (full_attention) layers")
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    return ()


def nope_layers(config: Any) -> Tuple[int, ...]:
    """The layer indices that apply no rotary embedding (NoPE), ascending.

    Llama 4 (``no_rope_layers``: 1 = RoPE, 0 = NoPE; empty means every
    ``no_rope_layer_interval``-th layer, default 4, is NoPE), SmolLM 3 (the same
    fields) and Cohere 2 (its ``full_attention`` layers). Every other family rotates
    in every layer: ``()``. :func:`from_hf` returns the rotation of the other layers.
    Llama 4 scales the queries of its NoPE layers (``attn_temperature_tuning``); that
    is attention, not rotation, and not read here.

    Raises:
      ValueError: the config lacks the fields that place the NoPE layers, or carries
        NoPE fields its model does not read.
    """
    fields, _, row, _ = _read(config, interleave=False)
    return _nope(fields, row)


# -- rope parameters per layer type -----------------------------------------------------


def _params_dict(value: Any, name: str) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}={value!r} must be a dict or null")
    return dict(value)


def _rope_parameters(fields: Mapping[str, Any], row: ModelRow,
                     types: Optional[Tuple[str, ...]]) -> Dict[Optional[str], Tuple[str, dict]]:
    """``{layer type or None (all layers): (where, params)}``, transformers' standardised form."""
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


def _local_theta(fields: Mapping[str, Any], row: ModelRow) -> float:
    value = fields.get(row.local_theta_key)
    return row.local_theta_default if value is None else as_float(value, row.local_theta_key)


def _theta(fields: Mapping[str, Any], row: ModelRow) -> float:
    if row.theta_key is None:
        return row.theta_default
    value = fields.get(row.theta_key)
    value = row.theta_default if value is None else as_float(value, row.theta_key)
    return value * row.theta_unit


# -- one layer type's RopeConfig --------------------------------------------------------


def _head_dim(fields: Mapping[str, Any], row: ModelRow, layer_type: Optional[str]) -> int:
    if layer_type == "full_attention" and row.full_head_dim_key is not None:
        value = fields.get(row.full_head_dim_key)
        per_layer = fields.get("per_layer_config")
        if value is None and isinstance(per_layer, Mapping):  # a to_dict() of Gemma 4
            dims = {layer.get("head_dim") for layer in per_layer.values()
                    if isinstance(layer, Mapping)} - {None}
            value = dims.pop() if len(dims) == 1 else None
        return as_int(row.full_head_dim_default if value is None else value,
                      row.full_head_dim_key)
    for key in (row.head_dim_key, "head_dim"):
        if fields.get(key) is not None:
            return as_int(fields[key], key)
    if row.head_dim_default is not None:
        return row.head_dim_default
    hidden, heads = fields.get("hidden_size"), fields.get("num_attention_heads")
    if hidden is None or heads is None:
        raise ValueError(f"config needs {row.head_dim_key}, or hidden_size and "
                         "num_attention_heads")
    hidden, heads = as_int(hidden, "hidden_size"), as_int(heads, "num_attention_heads")
    if heads <= 0 or hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    return hidden // heads


def _number(params: Mapping[str, Any], key: str, where: str, default: Any = None) -> Any:
    value = params.get(key)
    return default if value is None else as_float(value, f"{where}.{key}")


def _require(params: Mapping[str, Any], key: str, where: str, rope_type: str) -> float:
    if params.get(key) is None:
        raise ValueError(f"{where}.{key} is required for rope_type={rope_type!r}")
    return as_float(params[key], f"{where}.{key}")


def _scaling(rope_type: str, params: Mapping[str, Any], where: str, trained: int,
             partial: Optional[float], longrope_factors: str):
    """The variant of ``rope_type`` from its parameters; ``trained`` is the config's length."""
    original = params.get("original_max_position_embeddings")
    if original is not None:
        original = as_int(original, f"{where}.original_max_position_embeddings")
    elif rope_type in ("llama3", "longrope"):
        raise ValueError(f"{where}.original_max_position_embeddings (or a top-level one) is "
                         f"required for rope_type={rope_type!r}")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return Linear(factor=_require(params, "factor", where, rope_type))
    if rope_type == "dynamic":
        return DynamicNTK(factor=_require(params, "factor", where, rope_type),
                          original_max_position=trained)
    if rope_type == "llama3":
        return Llama3(factor=_require(params, "factor", where, rope_type),
                      low_freq_factor=_require(params, "low_freq_factor", where, rope_type),
                      high_freq_factor=_require(params, "high_freq_factor", where, rope_type),
                      original_max_position=original)
    if rope_type == "yarn":
        original = trained if original is None else original
        truncate = params.get("truncate", True)
        return Yarn(factor=_number(params, "factor", where, trained / original),
                    original_max_position=original,
                    beta_fast=_number(params, "beta_fast", where) or 32.0,
                    beta_slow=_number(params, "beta_slow", where) or 1.0,
                    mscale=_number(params, "mscale", where),
                    mscale_all_dim=_number(params, "mscale_all_dim", where),
                    attention_factor=_number(params, "attention_factor", where),
                    truncate=True if truncate is None else truncate)
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if params.get(key) is None:
                raise ValueError(f"{where}.{key} is required for rope_type='longrope'")
        # The attention factor follows the model's own lengths, never the caller's
        # max_position (transformers and vLLM: max_position_embeddings / original).
        return LongRope(short_factor=params["short_factor"], long_factor=params["long_factor"],
                        original_max_position=original,
                        attention_factor=_number(params, "attention_factor", where),
                        factor=_number(params, "factor", where, trained / original),
                        factors=longrope_factors)
    return Proportional(factor=_number(params, "factor", where, 1.0),
                        partial_rotary_factor=1.0 if partial is None else partial)


def _one(fields: Mapping[str, Any], row: ModelRow, layer_type: Optional[str], where: str,
         params: Mapping[str, Any], *, model_type: str, max_position: Optional[int],
         interleave: bool, longrope_factors: str,
         mrope: Optional[Mapping[str, Any]]) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        raise ValueError(f"{where}.type={params['type']!r} and {where}.rope_type="
                         f"{params['rope_type']!r} disagree")
    if not isinstance(rope_type, str):
        raise TypeError(f"{where}.rope_type={rope_type!r} must be a string")
    rope_type = row.rope_type_aliases.get(rope_type, rope_type)
    if rope_type not in _TYPE_KEYS:
        raise ValueError(f"{where}.rope_type={rope_type!r} is not one of {tuple(_TYPE_KEYS)}")
    for key, value in params.items():
        if key in _COMMON_KEYS or key in _TYPE_KEYS[rope_type] or value is None:
            continue
        if key in IGNORED_KEYS:
            warnings.warn(f"{where}.{key}={value!r} ignored: {IGNORED_KEYS[key]}", stacklevel=5)
            continue
        raise ValueError(f"{where}.{key}={value!r} is not read for rope_type={rope_type!r} "
                         f"(reads {_TYPE_KEYS[rope_type] or 'no other key'})")

    head_dim = _head_dim(fields, row, layer_type)
    partial = params.get("partial_rotary_factor")
    if partial is None and row.partial_rotary is not None:
        partial = fields.get(row.partial_key)
        partial = row.partial_rotary if partial is None else partial
    if partial is not None:
        partial = as_float(partial, "partial_rotary_factor")
        if not 0 < partial <= 1:
            raise ValueError(f"partial_rotary_factor={partial!r} must be in (0, 1]")
        if row.partial_rotary is None and rope_type != "proportional" and partial != 1:
            raise ValueError(f"partial_rotary_factor={partial!r} is not read by model_type="
                             f"{model_type!r}: its {row.source[2]} rotates the whole head")
    if rope_type == "proportional":
        rotary_dim = head_dim  # the zero-frequency tail spans the rest of the head
    elif row.rotary_dim_key is not None:
        value = fields.get(row.rotary_dim_key)
        rotary_dim = head_dim if value is None else as_int(value, row.rotary_dim_key)
    elif partial is not None:
        rotary_dim = int(head_dim * partial)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={partial!r} gives rotary_dim={rotary_dim} "
                             f"for {head_dim=}; it must give a positive even rotary_dim")
    else:
        rotary_dim = head_dim

    trained = fields.get(row.max_position_key, row.max_position_default)
    if trained is None:
        raise ValueError(f"{row.max_position_key} is required (the length the model was "
                         "trained at); or pass max_position=")
    trained = as_int(trained, row.max_position_key)
    scaling = _scaling(rope_type, params, where, trained, partial, longrope_factors)
    if max_position is None:
        max_position = trained
        if isinstance(scaling, (Yarn, DynamicNTK)):
            # These extend past the trained length by factor (Qwen's YaRN block keeps
            # max_position_embeddings at the original 32768); Llama 3 and LongRoPE
            # configs already state the extended length.
            max_position = max(max_position, int(scaling.original_max_position * scaling.factor))
        if max_position > _frequencies.MAX_ACCURATE_POSITION:
            raise ValueError(f"{row.max_position_key}={trained} serves positions up to "
                             f"{max_position}, past the 2**24 that jaxrope's angle keeps "
                             f"accurate; pass max_position=<= {_frequencies.MAX_ACCURATE_POSITION}")
    theta = as_float(params["rope_theta"], f"{where}.rope_theta")
    sections = {} if mrope is None else {"mrope_section": mrope["mrope_section"],
                                         "mrope_interleaved": mrope["mrope_interleaved"]}
    return RopeConfig(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta,
                      interleave=interleave, max_position=max_position, scaling=scaling,
                      **sections)


def _summary(cfg: RopeConfig) -> str:
    scaling = type(cfg.scaling).__name__ if cfg.scaling is not None else "default"
    return f"head_dim={cfg.head_dim} rotary_dim={cfg.rotary_dim} theta={cfg.theta:g} {scaling}"


def from_hf(config: Any, *, layer_type: Optional[str] = None, max_position: Optional[int] = None,
            interleave: Optional[bool] = None, longrope_factors: str = "auto") -> RopeConfig:
    """The :class:`RopeConfig` of a HF model's attention layers (see the module docstring).

    Reads ``text_config`` when the config has one, else the top level. An M-RoPE
    model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), GLM-4.1V) gives a config with
    ``mrope_section`` set, for ``pos_ids [3, T]``. Models whose
    layer types rotate differently (Gemma 3: base of the sliding layers; Gemma 4:
    head size and rope parameters per type) need ``layer_type``; with None they raise
    and list the types. Layers without RoPE (Llama 4, SmolLM 3, Cohere 2's full
    attention) are listed by :func:`nope_layers`; this returns the rotation of the
    others. ``max_position`` defaults to the length the model serves:
    ``max_position_embeddings``, or ``factor * original_max_position_embeddings`` when
    YaRN or dynamic NTK extend past it.

    Raises:
      TypeError: ``config`` is none of a dict, a path and a config object; a field or
        argument has the wrong type.
      ValueError: naming the field: a RoPE field the model's code does not read, an
        unknown rope type or key, inconsistent values (an ``mrope_section`` that does
        not sum to ``rotary_dim / 2``, an ``mrope_interleaved`` the model's code
        contradicts), a served length past ``2**24`` (pass ``max_position``), or a
        ``layer_type`` that is unknown, does not rotate, or is missing where the layer
        types differ.
      NotImplementedError: an M-RoPE layout :mod:`jaxrope.mrope.hf` does not know
        (GLM-4.5V's ``glm4v_moe``, M-RoPE fields on a 1-D model).
    """
    if interleave is not None and not isinstance(interleave, bool):
        raise TypeError(f"interleave={interleave!r} must be None or a bool")
    if layer_type is not None and not isinstance(layer_type, str):
        raise TypeError(f"layer_type={layer_type!r} must be None or a str")
    if not isinstance(longrope_factors, str):
        raise TypeError(f"longrope_factors={longrope_factors!r} must be a str")
    if longrope_factors not in LONGROPE_FACTORS:
        raise ValueError(f"longrope_factors={longrope_factors!r} must be one of "
                         f"{LONGROPE_FACTORS}")
    if max_position is not None:
        max_position = as_int(max_position, "max_position")
    fields, model_type, row, mrope = _read(config, interleave)
    if interleave is None and mrope is not None:
        interleave = mrope["interleave"]
    if interleave is None:
        interleave = row.interleave
        if row.interleave_key is not None and fields.get(row.interleave_key) is not None:
            value = fields[row.interleave_key]
            if not isinstance(value, bool):
                raise TypeError(f"{row.interleave_key}={value!r} must be a bool")
            interleave = value

    types = _layer_types(fields, row)
    per_type = _rope_parameters(fields, row, types)
    if types is not None:
        nope = set(_nope(fields, row))
        all_types = sorted(set(types))
        rotating = sorted({t for i, t in enumerate(types) if i not in nope})
    else:  # no layer count: the types the rope parameters or the row name
        all_types = sorted({t for t in per_type if t is not None} or (
            {"sliding_attention", "full_attention"} if row.layer_pattern else {"full_attention"}))
        rotating = [t for t in all_types if not (row.nope == "full_attention"
                                                and t == "full_attention")]
    if layer_type is not None and layer_type not in all_types:
        raise ValueError(f"layer_type={layer_type!r} is not a layer type of this "
                         f"{model_type!r} model: {all_types}")
    if layer_type is not None and layer_type not in rotating:
        raise ValueError(f"layer_type={layer_type!r}: those layers of this {model_type!r} "
                         "model apply no RoPE (see jaxrope.hf.nope_layers)")

    def build(kind: str) -> RopeConfig:
        key = kind if kind in per_type else None
        if key not in per_type:
            raise ValueError(f"the rope parameters have no entry for layer type {kind!r} "
                             f"(they have {sorted(k for k in per_type if k)})")
        where, params = per_type[key]
        return _one(fields, row, kind, where, params, model_type=model_type,
                    max_position=max_position, interleave=interleave,
                    longrope_factors=longrope_factors, mrope=mrope)

    if layer_type is not None:
        return build(layer_type)
    configs = {kind: build(kind) for kind in rotating}
    if len(set(configs.values())) > 1:
        listing = "; ".join(f"{kind}: {_summary(cfg)}" for kind, cfg in configs.items())
        raise ValueError(f"this {model_type!r} model's layer types rotate differently "
                         f"({listing}); pass layer_type= one of {sorted(configs)}")
    return next(iter(configs.values()))
