"""``from_hf``'s first step: a HF config as the checked fields of its text model.

:func:`read` loads the config (:func:`load_config`), takes the text model's fields
(a nested ``text_config`` when present, else the top level; a RoPE field both carry
with different values is refused), finds the model's row in
:data:`jaxrope.models.MODEL_TYPES`, renames the config class's aliases, takes the
M-RoPE fields out (:func:`jaxrope.mrope.hf.split_mrope`) and refuses a RoPE field of
:data:`ROPE_FIELDS` that the model's code does not read.

Example:
  >>> from jaxrope.models import HF_CONFIGS
  >>> source = read(HF_CONFIGS["EleutherAI/gpt-j-6b"], interleave=None)
  >>> source.model_type, source.fields["hidden_size"], source.row.interleave, source.mrope
  ('gptj', 4096, True, None)
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Mapping, NamedTuple, Optional, Set, Tuple

from jaxrope.models import GENERIC, MODEL_TYPES, ModelRow
from jaxrope.mrope.hf import split_mrope

__all__ = ["ROPE_FIELDS", "Source", "load_config", "read"]

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


class Source(NamedTuple):
    """A config as ``from_hf`` reads it.

    Attributes:
      fields: the text model's fields, aliases renamed, M-RoPE keys taken out.
      model_type: the text model's ``model_type``.
      row: its :class:`jaxrope.models.ModelRow` (:data:`jaxrope.models.GENERIC` when
        the type is not in the table).
      mrope: :func:`jaxrope.mrope.hf_mrope_args` of an M-RoPE model, else None.
    """

    fields: Dict[str, Any]
    model_type: str
    row: ModelRow
    mrope: Optional[Dict[str, Any]]


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
            # stacklevel: _row, read, from_hf, then from_hf's caller.
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


def _reads(row: ModelRow) -> Set[str]:
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


def read(config: Any, interleave: Optional[bool]) -> Source:
    """The :class:`Source` of ``config``, checked; ``interleave``: the caller's, only to
    silence the unknown-``model_type`` warning when given.

    Raises:
      TypeError, ValueError: as :meth:`jaxrope.RopeConfig.from_hf` lists for the fields.
      NotImplementedError: an M-RoPE layout the model table does not know.
    """
    raw = load_config(config)
    fields = _sub_config(raw)
    model_type, row = _row(fields, interleave)
    fields = _canonical(fields, row)
    fields, mrope = split_mrope(raw, fields, model_type, mrope_model=row.mrope)
    _check_fields(fields, model_type, row)
    return Source(fields, model_type, row, mrope)
