"""How each HF ``model_type`` rotates: one row per model family, checked against its code.

The rotation layout (NeoX halves or GPT-J interleaved pairs) and which config fields
carry the rotated head size, the base and the special rules are properties of a
model's modeling code, not of its ``config.json``. Each row names the transformers
5.24 modeling file, rotary class and apply function it was checked against
(``tests/test_hf_parity.py`` runs exactly those against :meth:`RopeConfig.from_hf`),
and its defaults are the config class's (checked there too). Remote-code models
(``trust_remote_code``: ChatGLM, MiniCPM) name their own file and the transformers
port that rotates the same way, which the parity suite uses.

Adding a family is one row; an M-RoPE family is a row with ``mrope=True`` and, when
jaxrope implements its layout, an :class:`MropeLayout` (sections and their
interleaving; :mod:`jaxrope.mrope.hf` reads it, ``from_hf`` refuses a family without).

The sample configs live here too: :data:`HF_CONFIGS` (text models) and
:data:`HF_VL_CONFIGS` (vision-language models), real ``config.json`` files' RoPE
fields keyed by model id.

Example:
  >>> from jaxrope.models import MODEL_TYPES
  >>> MODEL_TYPES["cohere"].interleave, MODEL_TYPES["minicpm3"].interleave
  (True, False)
  >>> MODEL_TYPES["deepseek_v3"].head_dim_key
  'qk_rope_head_dim'
  >>> MODEL_TYPES["qwen3_vl"].mrope_layout.mrope_interleaved, MODEL_TYPES["glm4v_moe"].mrope_layout
  (True, None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

from jaxrope.hf_examples import HF_CONFIGS, HF_VL_CONFIGS

__all__ = ["HF_CONFIGS", "HF_VL_CONFIGS", "MODEL_TYPES", "ModelRow", "MropeLayout"]


class MropeLayout(NamedTuple):
    """How an M-RoPE family's code spreads the ``t``, ``h`` and ``w`` rows of ``pos_ids [3, T]``
    over the frequency pairs (the pair layout is the row's ``interleave``).

    Args:
      family: the :func:`jaxrope.mrope.rope_index` family that numbers its prompts.
      mrope_interleaved: Qwen3-VL's interleaved sections (True) or sections laid end
        to end (False); the code's choice, whatever the config says.
      default_section: the sections transformers uses when a config has none.
    """

    family: str
    mrope_interleaved: bool
    default_section: Tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class ModelRow:
    """One model family's rotation as its transformers code computes it.

    Args:
      source: ``(module, rotary class, apply function)`` under ``transformers.models``
        whose code this row was checked against, e.g. ``("llama",
        "LlamaRotaryEmbedding", "apply_rotary_pos_emb")``.
      interleave: GPT-J pairs ``(x[2i], x[2i+1])`` (True) or NeoX halves (False).
      note: what the code does that the fields alone do not say.
      head_dim_key: the field holding the rotated head's size (``qk_rope_head_dim``
        for MLA, ``kv_channels`` for ChatGLM), else ``head_dim`` or
        ``hidden_size // num_attention_heads``.
      head_dim_default: the config class's ``head_dim`` when the field is absent
        (None: computed from ``hidden_size``).
      partial_rotary: None when the rotated fraction is not read (the apply function
        rotates the whole head; a ``partial_rotary_factor`` other than 1 is refused),
        else its default when absent.
      partial_key: the top-level field holding the fraction (GPT-NeoX: ``rotary_pct``;
        inside the rope parameters it is always ``partial_rotary_factor``).
      rotary_dim_key: GPT-J / CodeGen: the field giving the rotated dims directly.
      theta_key: the field holding the base, None for a fixed base.
      theta_default: the base when the field is absent.
      theta_unit: multiplies the field (ChatGLM: ``10000 * rope_ratio``).
      max_position_key / max_position_default: the trained length's field and default.
      original_max_position_default: a config class attribute that transformers
        puts over ``rope_scaling.original_max_position_embeddings`` (Phi-3: 4096).
      interleave_key: a bool field choosing the layout (DeepSeek-V3 ``rope_interleave``,
        default ``interleave``).
      scaling: whether ``rope_scaling`` / ``rope_parameters`` are read at all.
      rope_parameters_default: the config class's rope parameters when the config
        has none (gpt-oss: YaRN; Gemma 4: per layer type).
      rope_type_aliases: legacy ``rope_type`` names the config class rewrites.
      aliases: the config class's ``attribute_map`` / legacy names: ``{old: canonical}``.
      layer_pattern: when ``layer_types`` is absent, every ``n``-th layer is
        ``full_attention`` and the others ``sliding_attention`` (``sliding_window_pattern``
        overrides ``n``).
      last_layer_full: the config class forces the last layer to ``full_attention``.
      local_theta_key / local_theta_default: Gemma 3's base of the sliding layers.
      full_head_dim_key / full_head_dim_default: Gemma 4's head size of the
        ``full_attention`` layers.
      nope: which layers do not rotate: ``"no_rope_layers"`` (a 0/1 list, 1 = RoPE,
        else every ``no_rope_layer_interval``-th layer) or ``"full_attention"``.
      refuse: ``((field, value, reason), ...)``: configs that do not use RoPE.
      mrope: the family rotates with M-RoPE (multimodal positions ``[3, T]``).
      mrope_layout: that family's :class:`MropeLayout` when jaxrope implements it;
        None for an M-RoPE family whose layout it does not (``from_hf`` refuses it).
    """

    source: Tuple[str, str, str]
    interleave: bool = False
    note: str = ""
    head_dim_key: str = "head_dim"
    head_dim_default: Optional[int] = None
    partial_rotary: Optional[float] = None
    partial_key: str = "partial_rotary_factor"
    rotary_dim_key: Optional[str] = None
    theta_key: Optional[str] = "rope_theta"
    theta_default: float = 10000.0
    theta_unit: float = 1.0
    max_position_key: str = "max_position_embeddings"
    max_position_default: Optional[int] = None
    original_max_position_default: Optional[int] = None
    interleave_key: Optional[str] = None
    scaling: bool = True
    rope_parameters_default: Optional[Mapping[str, Any]] = None
    rope_type_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    layer_pattern: Optional[int] = None
    last_layer_full: bool = False
    local_theta_key: Optional[str] = None
    local_theta_default: Optional[float] = None
    full_head_dim_key: Optional[str] = None
    full_head_dim_default: Optional[int] = None
    nope: Optional[str] = None
    refuse: Tuple[Tuple[str, Any, str], ...] = ()
    mrope: bool = False
    mrope_layout: Optional[MropeLayout] = None


# The row for a model_type not in the table: NeoX halves, partial_rotary_factor read.
# from_hf warns when it uses it (an explicit interleave= silences the warning).
GENERIC = ModelRow(source=("llama", "LlamaRotaryEmbedding", "apply_rotary_pos_emb"),
                   partial_rotary=1.0, note="not in the table: NeoX halves assumed")


def _neox(module: str, cls: str, **kw) -> ModelRow:
    return ModelRow(source=(module, cls, "apply_rotary_pos_emb"), **kw)


_GPTJ_ALIASES = {"n_embd": "hidden_size", "n_head": "num_attention_heads",
                 "n_positions": "max_position_embeddings"}
_GEMMA4_DEFAULT = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1000000.0}}

MODEL_TYPES: Dict[str, ModelRow] = {
    # -- NeoX halves: rotate_half = cat(-x[R/2:], x[:R/2]), cos/sin = cat(freqs, freqs).
    "llama": _neox("llama", "LlamaRotaryEmbedding", max_position_default=2048),
    "mistral": _neox("mistral", "MistralRotaryEmbedding", max_position_default=131072),
    "mixtral": _neox("mixtral", "MixtralRotaryEmbedding", theta_default=1e6,
                     max_position_default=131072),
    "qwen2": _neox("qwen2", "Qwen2RotaryEmbedding", max_position_default=32768),
    "qwen2_moe": _neox("qwen2_moe", "Qwen2MoeRotaryEmbedding", max_position_default=32768),
    "qwen3": _neox("qwen3", "Qwen3RotaryEmbedding", head_dim_default=128,
                   max_position_default=32768),
    "qwen3_moe": _neox("qwen3_moe", "Qwen3MoeRotaryEmbedding", max_position_default=32768),
    "gemma": _neox("gemma", "GemmaRotaryEmbedding", head_dim_default=256,
                   max_position_default=8192),
    "gemma2": _neox("gemma2", "Gemma2RotaryEmbedding", head_dim_default=256,
                    max_position_default=8192, layer_pattern=2,
                    note="sliding and full layers rotate alike"),
    "gemma3_text": _neox(
        "gemma3", "Gemma3RotaryEmbedding", head_dim_default=256, max_position_default=131072,
        theta_default=1e6, local_theta_key="rope_local_base_freq", local_theta_default=10000.0,
        layer_pattern=6,
        note="per layer type: legacy rope_scaling and rope_theta are the full_attention "
             "layers', rope_local_base_freq the sliding_attention layers' base"),
    "gemma4_text": ModelRow(
        source=("gemma4", "Gemma4TextRotaryEmbedding", "apply_rotary_pos_emb"),
        head_dim_default=256, max_position_default=131072, layer_pattern=6,
        last_layer_full=True, full_head_dim_key="global_head_dim", full_head_dim_default=512,
        rope_parameters_default=_GEMMA4_DEFAULT,
        note="per layer type; full_attention layers run at global_head_dim (per_layer_config)"),
    "gpt_oss": _neox("gpt_oss", "GptOssRotaryEmbedding", head_dim_default=64,
                     theta_default=150000.0, max_position_default=131072,
                     rope_parameters_default={"rope_type": "yarn", "factor": 32.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": False,
                                              "original_max_position_embeddings": 4096},
                     note="_apply_rotary_emb: torch.chunk halves"),
    "falcon": _neox("falcon", "FalconRotaryEmbedding", max_position_default=2048,
                    aliases={"n_head": "num_attention_heads"},
                    refuse=(("alibi", True, "alibi=true: this Falcon uses ALiBi attention "
                                            "biases, not RoPE"),)),
    "starcoder2": _neox("starcoder2", "Starcoder2RotaryEmbedding", max_position_default=4096),
    "olmo2": _neox("olmo2", "Olmo2RotaryEmbedding", max_position_default=2048),
    "granite": _neox("granite", "GraniteRotaryEmbedding", max_position_default=2048),
    "smollm3": _neox("smollm3", "SmolLM3RotaryEmbedding", theta_default=2e6,
                     max_position_default=32768, nope="no_rope_layers"),
    "minicpm": _neox("llama", "LlamaRotaryEmbedding", max_position_default=2048,
                     note="remote code openbmb/MiniCPM-2B modeling_minicpm.py: "
                          "MiniCPMRotaryEmbedding + apply_rotary_pos_emb are Llama's"),
    "minicpm3": _neox("minicpm3", "MiniCPM3RotaryEmbedding", head_dim_key="qk_rope_head_dim",
                      head_dim_default=32, max_position_default=32768,
                      note="MLA like DeepSeek-V2, but NeoX halves over qk_rope_head_dim"),
    # -- NeoX halves over a leading fraction: q[..., :R] rotates, q[..., R:] passes.
    "gpt_neox": _neox("gpt_neox", "GPTNeoXRotaryEmbedding", partial_rotary=0.25,
                      partial_key="rotary_pct", theta_key="rotary_emb_base",
                      max_position_default=2048,
                      note="GPTNeoXConfig reads rotary_pct / rotary_emb_base, not the top-level "
                           "partial_rotary_factor / rope_theta"),
    "phi": _neox("phi", "PhiRotaryEmbedding", partial_rotary=0.5, max_position_default=2048),
    "phi3": _neox("phi3", "Phi3RotaryEmbedding", partial_rotary=1.0, max_position_default=4096,
                  original_max_position_default=4096,
                  rope_type_aliases={"su": "longrope", "yarn": "longrope"},
                  note="top-level original_max_position_embeddings (default 4096) wins"),
    "stablelm": _neox("stablelm", "StableLmRotaryEmbedding", partial_rotary=0.25,
                      max_position_default=4096),
    "persimmon": _neox("persimmon", "PersimmonRotaryEmbedding", partial_rotary=0.5,
                       max_position_default=16384),
    "nemotron": _neox("nemotron", "NemotronRotaryEmbedding", partial_rotary=0.5,
                      max_position_default=4096),
    "glm4_moe": _neox("glm4_moe", "Glm4MoeRotaryEmbedding", partial_rotary=0.5,
                      max_position_default=131072,
                      note="GLM-4.5: halves, unlike glm / glm4"),
    # -- GPT-J pairs: rotate_half on x[..., 0::2] / x[..., 1::2], cos/sin repeat_interleave.
    "cohere": ModelRow(source=("cohere", "CohereRotaryEmbedding", "apply_rotary_pos_emb"),
                       interleave=True, theta_default=500000.0, max_position_default=8192,
                       note="emb = repeat_interleave(freqs, 2), rotate_half on ::2 / 1::2"),
    "cohere2": ModelRow(source=("cohere2", "Cohere2RotaryEmbedding", "apply_rotary_pos_emb"),
                        interleave=True, head_dim_default=128, max_position_default=8192,
                        layer_pattern=4, nope="full_attention",
                        note="only sliding_attention layers rotate; full_attention is NoPE"),
    "glm": ModelRow(source=("glm", "GlmRotaryEmbedding", "apply_rotary_pos_emb"),
                    interleave=True, partial_rotary=0.5, head_dim_default=128,
                    max_position_default=131072,
                    note="cos[..., :R/2].repeat_interleave(2): pairs over the first half"),
    "glm4": ModelRow(source=("glm4", "Glm4RotaryEmbedding", "apply_rotary_pos_emb"),
                     interleave=True, partial_rotary=0.5, head_dim_default=128,
                     max_position_default=131072),
    "chatglm": ModelRow(
        source=("glm", "GlmRotaryEmbedding", "apply_rotary_pos_emb"), interleave=True,
        head_dim_key="kv_channels", partial_rotary=0.5, theta_key="rope_ratio",
        theta_default=1.0, theta_unit=10000.0, max_position_key="seq_length",
        max_position_default=2048, scaling=False,
        note="remote code THUDM/chatglm3-6b modeling_chatglm.py: RotaryEmbedding(dim="
             "kv_channels // 2, base 10000 * rope_ratio) + apply_rotary_pos_emb (pairs); "
             "transformers' GLM port rotates the same way"),
    "ernie4_5": ModelRow(source=("ernie4_5", "Ernie4_5RotaryEmbedding", "apply_rotary_pos_emb"),
                         interleave=True, head_dim_default=128, theta_default=500000.0,
                         max_position_default=131072),
    "helium": ModelRow(source=("helium", "HeliumRotaryEmbedding", "apply_rotary_pos_emb"),
                       interleave=True, head_dim_default=128, theta_default=100000.0,
                       max_position_default=4096),
    "gptj": ModelRow(source=("gptj", "GPTJRotaryEmbedding", "apply_rotary_pos_emb"),
                     interleave=True, rotary_dim_key="rotary_dim", theta_key=None,
                     max_position_default=2048, scaling=False, aliases=_GPTJ_ALIASES,
                     note="create_sinusoidal_positions: base 10000, no rope_scaling"),
    "codegen": ModelRow(source=("codegen", "CodeGenRotaryEmbedding", "apply_rotary_pos_emb"),
                        interleave=True, rotary_dim_key="rotary_dim", theta_key=None,
                        max_position_default=2048, scaling=False, aliases=_GPTJ_ALIASES),
    # -- Complex multiply of (x[2i], x[2i+1]) by freqs_cis: GPT-J pairs.
    "llama4_text": ModelRow(source=("llama4", "Llama4TextRotaryEmbedding", "apply_rotary_emb"),
                            interleave=True, head_dim_default=128, theta_default=500000.0,
                            max_position_default=131072, nope="no_rope_layers",
                            note="view_as_complex pairs; NoPE layers from no_rope_layers"),
    "deepseek_v2": ModelRow(source=("deepseek_v2", "DeepseekV2RotaryEmbedding",
                                    "apply_rotary_emb"),
                            interleave=True, head_dim_key="qk_rope_head_dim", head_dim_default=64,
                            max_position_default=2048, note="view_as_complex pairs"),
    "deepseek_v3": ModelRow(
        source=("deepseek_v3", "DeepseekV3RotaryEmbedding", "apply_rotary_pos_emb_interleave"),
        interleave=True, head_dim_key="qk_rope_head_dim", head_dim_default=64,
        max_position_default=4096, interleave_key="rope_interleave",
        note="pairs (x[2i], x[2i+1]); the output is written de-interleaved (halves), a "
             "permutation shared by q and k that leaves q.k unchanged"),
    "glm4_moe_lite": ModelRow(
        source=("glm4_moe_lite", "Glm4MoeLiteRotaryEmbedding", "apply_rotary_pos_emb_interleave"),
        interleave=True, head_dim_key="qk_rope_head_dim", head_dim_default=64,
        max_position_default=202752, interleave_key="rope_interleave",
        note="DeepSeek-V3's MLA rotation"),
}

# -- M-RoPE: positions [3, T]. Each family's layout (MropeLayout) is a property of its code
# like the pair layout; jaxrope.mrope.hf reads both from these rows. The rotary classes
# rotate the whole head (partial_rotary_factor refused) except GLM-4V's, which read
# rope_parameters.partial_rotary_factor (default 1.0, GLM-4.1V says 0.5).
_MROPE_ROWS = {
    "qwen2_vl": dict(source=("qwen2_vl", "Qwen2VLRotaryEmbedding", "apply_rotary_pos_emb"),
                     theta_default=1e6, max_position_default=32768,
                     mrope_layout=MropeLayout("qwen2_vl", False, (16, 24, 24))),
    "qwen2_5_vl": dict(source=("qwen2_5_vl", "Qwen2_5_VLRotaryEmbedding", "apply_rotary_pos_emb"),
                       theta_default=1e6, max_position_default=32768,
                       mrope_layout=MropeLayout("qwen2_5_vl", False, (16, 24, 24))),
    "qwen3_vl": dict(source=("qwen3_vl", "Qwen3VLTextRotaryEmbedding", "apply_rotary_pos_emb"),
                     head_dim_default=128, theta_default=500000.0, max_position_default=128000,
                     mrope_layout=MropeLayout("qwen3_vl", True, (24, 20, 20))),
    "qwen3_vl_moe": dict(source=("qwen3_vl_moe", "Qwen3VLMoeTextRotaryEmbedding",
                                 "apply_rotary_pos_emb"),
                         head_dim_default=128, theta_default=500000.0,
                         max_position_default=128000,
                         mrope_layout=MropeLayout("qwen3_vl", True, (24, 20, 20))),
    "glm4v": dict(source=("glm4v", "Glm4vTextRotaryEmbedding", "apply_rotary_pos_emb"),
                  interleave=True, partial_rotary=1.0, max_position_default=32768,
                  mrope_layout=MropeLayout("glm4v", False, (8, 12, 12))),
    # GLM-4.5V rotates NeoX halves with its own sections: no layout, so from_hf refuses it.
    "glm4v_moe": dict(source=("glm4v_moe", "Glm4vMoeTextRotaryEmbedding", "apply_rotary_pos_emb"),
                      partial_rotary=0.5, max_position_default=65536),
}
for _name, _fields in _MROPE_ROWS.items():
    MODEL_TYPES[_name] = MODEL_TYPES[_name + "_text"] = ModelRow(
        mrope=True, note="M-RoPE: sections over the t, h and w rows of pos_ids", **_fields)

# Multimodal wrappers whose text_config has the text model_type; a text_config without
# one is read with the wrapper's row.
for _wrapper, _text in (("gemma3", "gemma3_text"), ("gemma4", "gemma4_text"),
                        ("llama4", "llama4_text")):
    MODEL_TYPES[_wrapper] = MODEL_TYPES[_text]
