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
  ``mrope_interleaved`` and the pair layout through :mod:`jaxrope.mrope.hf` (the one
  place M-RoPE fields are read; the layouts are the model table's), the M-RoPE keys
  (and ``rope_type`` "mrope") taken out of the rope parameters before the rest is
  read as above; the config rotates ``pos_ids [3, T]``.

The steps live in three private modules, each read top to bottom:
:mod:`jaxrope.hf_source` (the config as the checked fields of its text model),
:mod:`jaxrope.hf_layers` (layer types, NoPE layers, rope parameters per layer type)
and :mod:`jaxrope.hf_fields` (one layer type's fields as a :class:`RopeConfig`);
this module picks the layer types and checks the arguments.

Nothing is dropped silently: a RoPE field the model's code does not read, an unknown
``rope_type``, or an unknown key inside the rope parameters raises ``ValueError``
naming it (keys known not to affect the rotation, :data:`IGNORED_KEYS`, warn). An
M-RoPE config of a model type whose layout the model table does not know
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
  >>> from jaxrope.models import HF_VL_CONFIGS
  >>> vl = jr.RopeConfig.from_hf(HF_VL_CONFIGS["Qwen/Qwen3-VL-4B-Instruct"])
  >>> vl.mrope_section, vl.mrope_interleaved, vl.theta
  ((24, 20, 20), True, 5000000.0)
  >>> nope_layers({"model_type": "llama4_text", "num_hidden_layers": 8, "no_rope_layers": []})
  (3, 7)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from jaxrope.hf_fields import IGNORED_KEYS, build
from jaxrope.hf_layers import layer_types, nope, rope_parameters
from jaxrope.hf_source import ROPE_FIELDS, Source, load_config, read
from jaxrope.numbers import as_int
from jaxrope.scaling import LONGROPE_FACTORS

__all__ = ["IGNORED_KEYS", "ROPE_FIELDS", "config_from_hf", "load_config", "nope_layers"]


def nope_layers(config: Any) -> Tuple[int, ...]:
    """The layer indices that apply no rotary embedding (NoPE), ascending.

    Llama 4 (``no_rope_layers``: 1 = RoPE, 0 = NoPE; empty means every
    ``no_rope_layer_interval``-th layer, default 4, is NoPE), SmolLM 3 (the same
    fields) and Cohere 2 (its ``full_attention`` layers). Every other family rotates
    in every layer: ``()``. ``RopeConfig.from_hf`` returns the rotation of the other layers.
    Llama 4 scales the queries of its NoPE layers (``attn_temperature_tuning``); that
    is attention, not rotation, and not read here.

    Raises:
      ValueError: the config lacks the fields that place the NoPE layers, or carries
        NoPE fields its model does not read.
    """
    source = read(config, interleave=False)
    return nope(source.fields, source.row)


def _check_arguments(layer_type: Optional[str], max_position: Optional[int],
                     interleave: Optional[bool], longrope_factors: str) -> Optional[int]:
    """``max_position`` as an int (or None), after every argument's type is checked."""
    if interleave is not None and not isinstance(interleave, bool):
        raise TypeError(f"interleave={interleave!r} must be None or a bool")
    if layer_type is not None and not isinstance(layer_type, str):
        raise TypeError(f"layer_type={layer_type!r} must be None or a str")
    if not isinstance(longrope_factors, str):
        raise TypeError(f"longrope_factors={longrope_factors!r} must be a str")
    if longrope_factors not in LONGROPE_FACTORS:
        raise ValueError(f"longrope_factors={longrope_factors!r} must be one of "
                         f"{LONGROPE_FACTORS}")
    return None if max_position is None else as_int(max_position, "max_position")


def _interleave(source: Source, interleave: Optional[bool]) -> bool:
    """The pair layout: the caller's, else the M-RoPE layout's, else the row's field or value."""
    if interleave is not None:
        return interleave
    if source.mrope is not None:
        return source.mrope["interleave"]
    row = source.row
    if row.interleave_key is not None and source.fields.get(row.interleave_key) is not None:
        value = source.fields[row.interleave_key]
        if not isinstance(value, bool):
            raise TypeError(f"{row.interleave_key}={value!r} must be a bool")
        return value
    return row.interleave


def _rotating_types(source: Source, types: Optional[Tuple[str, ...]],
                    per_type: Dict[Optional[str], Any], layer_type: Optional[str]) -> List[str]:
    """The layer types that rotate, sorted; ``layer_type`` checked against them.

    ``types``: each layer's type (None when the config does not say); ``per_type``:
    the rope parameters per layer type.
    """
    fields, row = source.fields, source.row
    if types is not None:
        skipped = set(nope(fields, row))
        all_types = sorted(set(types))
        rotating = sorted({t for i, t in enumerate(types) if i not in skipped})
    else:  # no layer count: the types the rope parameters or the row name
        all_types = sorted({t for t in per_type if t is not None} or (
            {"sliding_attention", "full_attention"} if row.layer_pattern else {"full_attention"}))
        rotating = [t for t in all_types if not (row.nope == "full_attention"
                                                and t == "full_attention")]
    if layer_type is not None and layer_type not in all_types:
        raise ValueError(f"layer_type={layer_type!r} is not a layer type of this "
                         f"{source.model_type!r} model: {all_types}")
    if layer_type is not None and layer_type not in rotating:
        raise ValueError(f"layer_type={layer_type!r}: those layers of this {source.model_type!r} "
                         "model apply no RoPE (see jaxrope.hf.nope_layers)")
    return rotating


def _summary(cfg: Any) -> str:
    scaling = type(cfg.scaling).__name__ if cfg.scaling is not None else "default"
    return f"head_dim={cfg.head_dim} rotary_dim={cfg.rotary_dim} theta={cfg.theta:g} {scaling}"


def config_from_hf(config_type: type, config: Any, *, layer_type: Optional[str] = None,
                   max_position: Optional[int] = None, interleave: Optional[bool] = None,
                   longrope_factors: str = "auto") -> Any:
    """The ``config_type`` (:class:`jaxrope.RopeConfig`, or a subclass) of a HF model's
    attention layers: what ``RopeConfig.from_hf`` returns (see the module docstring).

    The class is an argument, not an import, so that :mod:`jaxrope.config` can call this
    module without the two importing each other.

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
      NotImplementedError: an M-RoPE layout the model table does not know
        (GLM-4.5V's ``glm4v_moe``, M-RoPE fields on a 1-D model).
    """
    max_position = _check_arguments(layer_type, max_position, interleave, longrope_factors)
    source = read(config, interleave)
    interleave = _interleave(source, interleave)
    types = layer_types(source.fields, source.row)
    per_type = rope_parameters(source.fields, source.row, types)
    rotating = _rotating_types(source, types, per_type, layer_type)
    configs = {}
    for kind in rotating if layer_type is None else [layer_type]:
        key = kind if kind in per_type else None
        if key not in per_type:
            raise ValueError(f"the rope parameters have no entry for layer type {kind!r} "
                             f"(they have {sorted(k for k in per_type if k)})")
        where, params = per_type[key]
        configs[kind] = build(config_type, source, kind, where, params,
                              max_position=max_position, interleave=interleave,
                              longrope_factors=longrope_factors)
    if len(set(configs.values())) > 1:
        listing = "; ".join(f"{kind}: {_summary(cfg)}" for kind, cfg in configs.items())
        raise ValueError(f"this {source.model_type!r} model's layer types rotate differently "
                         f"({listing}); pass layer_type= one of {sorted(configs)}")
    return next(iter(configs.values()))
