"""``from_hf``'s last step: one layer type's fields and rope parameters as a :class:`RopeConfig`.

:func:`build` reads, in order, each through one small function:

- the rope type and its keys (:func:`rope_type`): ``rope_type`` or legacy ``type``,
  the row's aliases, every other key known for that type (:data:`IGNORED_KEYS` warn);
- the rotated head (``head_dim``, the row's field, or ``hidden_size //
  num_attention_heads``; Gemma 4's full layers ``global_head_dim``);
- the rotated fraction (``partial_rotary_factor`` where the model's code honours it)
  and from it, or from the row's field (GPT-J ``rotary_dim``), ``rotary_dim``;
- the trained length and the scaling variant of :mod:`jaxrope.scaling`;
- the served length (``max_position``): the trained one, extended by YaRN's and
  dynamic NTK's factor, at most the ``2**24`` the angle keeps accurate;
- the base ``rope_theta`` and the M-RoPE sections.

Example:
  >>> from jaxrope.config import RopeConfig
  >>> from jaxrope.hf_source import read
  >>> from jaxrope.models import HF_CONFIGS
  >>> source = read(HF_CONFIGS["EleutherAI/gpt-neox-20b"], interleave=None)
  >>> cfg = build(RopeConfig, source, None, "rope_parameters", {"rope_theta": 10000.0},
  ...             max_position=None, interleave=False, longrope_factors="auto")
  >>> cfg.head_dim, cfg.rotary_dim, cfg.max_position
  (96, 24, 2048)
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional

from jaxrope import frequencies as _frequencies
from jaxrope.hf_source import Source
from jaxrope.models import ModelRow
from jaxrope.numbers import as_float, as_int
from jaxrope.scaling import DynamicNTK, Linear, Llama3, LongRope, Proportional, Yarn

__all__ = ["IGNORED_KEYS", "build", "rope_type"]

# Keys that may appear inside rope_scaling / rope_parameters without affecting the
# rotation: warned about, not refused.
IGNORED_KEYS: Mapping[str, str] = {
    "llama_4_scaling_beta": "Ministral 3 scales queries by position in attention, after RoPE",
}

# Per rope_type, the keys read from the rope parameters (beside _COMMON_KEYS).
_TYPE_KEYS: Mapping[str, tuple] = {
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


def rope_type(params: Mapping[str, Any], where: str, row: ModelRow) -> str:
    """The rope type of ``params`` (the row's aliases applied), every key checked.

    Raises:
      TypeError: a rope type that is not a string.
      ValueError: ``type`` and ``rope_type`` that disagree, an unknown type, or a key
        the type does not read.
    """
    kind = params.get("rope_type", params.get("type", "default"))
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        raise ValueError(f"{where}.type={params['type']!r} and {where}.rope_type="
                         f"{params['rope_type']!r} disagree")
    if not isinstance(kind, str):
        raise TypeError(f"{where}.rope_type={kind!r} must be a string")
    kind = row.rope_type_aliases.get(kind, kind)
    if kind not in _TYPE_KEYS:
        raise ValueError(f"{where}.rope_type={kind!r} is not one of {tuple(_TYPE_KEYS)}")
    for key, value in params.items():
        if key in _COMMON_KEYS or key in _TYPE_KEYS[kind] or value is None:
            continue
        if key in IGNORED_KEYS:
            # stacklevel: rope_type, build, config_from_hf, then RopeConfig.from_hf.
            warnings.warn(f"{where}.{key}={value!r} ignored: {IGNORED_KEYS[key]}", stacklevel=4)
            continue
        raise ValueError(f"{where}.{key}={value!r} is not read for rope_type={kind!r} "
                         f"(reads {_TYPE_KEYS[kind] or 'no other key'})")
    return kind


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


def _partial(source: Source, params: Mapping[str, Any], kind: str) -> Optional[float]:
    """The rotated fraction, None when neither the parameters nor the row give one."""
    fields, row = source.fields, source.row
    partial = params.get("partial_rotary_factor")
    if partial is None and row.partial_rotary is not None:
        partial = fields.get(row.partial_key)
        partial = row.partial_rotary if partial is None else partial
    if partial is None:
        return None
    partial = as_float(partial, "partial_rotary_factor")
    if not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor={partial!r} must be in (0, 1]")
    if row.partial_rotary is None and kind != "proportional" and partial != 1:
        raise ValueError(f"partial_rotary_factor={partial!r} is not read by model_type="
                         f"{source.model_type!r}: its {row.source[2]} rotates the whole head")
    return partial


def _rotary_dim(fields: Mapping[str, Any], row: ModelRow, kind: str, head_dim: int,
                partial: Optional[float]) -> int:
    if kind == "proportional":
        return head_dim  # the zero-frequency tail spans the rest of the head
    if row.rotary_dim_key is not None:
        value = fields.get(row.rotary_dim_key)
        return head_dim if value is None else as_int(value, row.rotary_dim_key)
    if partial is None:
        return head_dim
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={partial!r} gives rotary_dim={rotary_dim} "
                         f"for {head_dim=}; it must give a positive even rotary_dim")
    return rotary_dim


def _trained(fields: Mapping[str, Any], row: ModelRow) -> int:
    """The length the model was trained at."""
    trained = fields.get(row.max_position_key, row.max_position_default)
    if trained is None:
        raise ValueError(f"{row.max_position_key} is required (the length the model was "
                         "trained at); or pass max_position=")
    return as_int(trained, row.max_position_key)


def _served(row: ModelRow, trained: int, scaling: Any) -> int:
    """The length a config serves when the caller gives no ``max_position``."""
    served = trained
    if isinstance(scaling, (Yarn, DynamicNTK)):
        # These extend past the trained length by factor (Qwen's YaRN block keeps
        # max_position_embeddings at the original 32768); Llama 3 and LongRoPE
        # configs already state the extended length.
        served = max(served, int(scaling.original_max_position * scaling.factor))
    if served > _frequencies.MAX_ACCURATE_POSITION:
        raise ValueError(f"{row.max_position_key}={trained} serves positions up to "
                         f"{served}, past the 2**24 that jaxrope's angle keeps "
                         f"accurate; pass max_position=<= {_frequencies.MAX_ACCURATE_POSITION}")
    return served


def _number(params: Mapping[str, Any], key: str, where: str, default: Any = None) -> Any:
    value = params.get(key)
    return default if value is None else as_float(value, f"{where}.{key}")


def _require(params: Mapping[str, Any], key: str, where: str, kind: str) -> float:
    if params.get(key) is None:
        raise ValueError(f"{where}.{key} is required for rope_type={kind!r}")
    return as_float(params[key], f"{where}.{key}")


def _scaling(kind: str, params: Mapping[str, Any], where: str, trained: int,
             partial: Optional[float], longrope_factors: str):
    """The variant of rope type ``kind`` from its parameters; ``trained`` is the config's length."""
    original = params.get("original_max_position_embeddings")
    if original is not None:
        original = as_int(original, f"{where}.original_max_position_embeddings")
    elif kind in ("llama3", "longrope"):
        raise ValueError(f"{where}.original_max_position_embeddings (or a top-level one) is "
                         f"required for rope_type={kind!r}")
    if kind == "default":
        return None
    if kind == "linear":
        return Linear(factor=_require(params, "factor", where, kind))
    if kind == "dynamic":
        return DynamicNTK(factor=_require(params, "factor", where, kind),
                          original_max_position=trained)
    if kind == "llama3":
        return Llama3(factor=_require(params, "factor", where, kind),
                      low_freq_factor=_require(params, "low_freq_factor", where, kind),
                      high_freq_factor=_require(params, "high_freq_factor", where, kind),
                      original_max_position=original)
    if kind == "yarn":
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
    if kind == "longrope":
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


def build(config_type: type, source: Source, layer_type: Optional[str], where: str,
          params: Mapping[str, Any], *, max_position: Optional[int], interleave: bool,
          longrope_factors: str) -> Any:
    """The ``config_type`` (:class:`jaxrope.RopeConfig`) of ``source``'s layers of
    ``layer_type`` (None: all layers).

    ``where`` and ``params``: the layer type's entry of
    :func:`jaxrope.hf_layers.rope_parameters`; the keywords are ``from_hf``'s, checked.
    """
    kind = rope_type(params, where, source.row)
    head_dim = _head_dim(source.fields, source.row, layer_type)
    partial = _partial(source, params, kind)
    rotary_dim = _rotary_dim(source.fields, source.row, kind, head_dim, partial)
    trained = _trained(source.fields, source.row)
    scaling = _scaling(kind, params, where, trained, partial, longrope_factors)
    if max_position is None:
        max_position = _served(source.row, trained, scaling)
    theta = as_float(params["rope_theta"], f"{where}.rope_theta")
    mrope = source.mrope
    sections = {} if mrope is None else {"mrope_section": mrope["mrope_section"],
                                         "mrope_interleaved": mrope["mrope_interleaved"]}
    return config_type(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta,
                       interleave=interleave, max_position=max_position, scaling=scaling,
                       **sections)
