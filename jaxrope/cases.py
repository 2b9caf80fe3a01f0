"""One table of named cases shared by the tests and the benchmarks.

Each case is a layer shape plus a :class:`RopeConfig`: real model shapes, odd sizes
(1, 17, 19 tokens; 3, 5 heads), head_dim 64/80/96/128/192/256/512, partial rotary and
interleaved pairs, every scaling variant. Tests take the CPU-sized ``tokens``;
benchmarks scale ``tokens`` up (``dataclasses.replace(case, tokens=16384)``) and keep
the rest; ``default_d128`` (Llama-3-8B's heads, no scaling) is the benchmarks' target.
``MROPE_CASES`` are the M-RoPE layouts (``pos_ids [3, T]``): sectioned, interleaved,
GLM-4.1V's partial GPT-J pairs, partial NeoX halves, odd sizes.

``FUSED_CASES`` are issue 46's fused family (QK-norm -> RoPE -> fp8 -> paged append):
Qwen3-8B's GQA shape with its QK-norm, bf16 and fp8, and DeepSeek-V3's MLA (q_pe,
k_pe, ckv), bf16 and fp8; benchmarks run them at :data:`FUSED_BENCH_TOKENS`.

``APPEND_CASES`` extend some of them with the paged KV cache that
:func:`jaxrope.apply_rope_and_append_kv` writes: layout, page size, a combined
``[pages, 2, ...]`` array or a pair, fp8, and how many tokens are padding (slot -1);
``MROPE_APPEND_CASES`` do the same for M-RoPE cases.

Example:
  >>> from jaxrope.cases import APPEND_BY_NAME, BY_NAME
  >>> case = BY_NAME["llama3_8b"]
  >>> case.tokens, case.q_heads, case.k_heads, case.head_dim
  (17, 32, 8, 128)
  >>> BY_NAME["qwen2_vl_7b"].cfg.mrope_section
  (16, 24, 24)
  >>> APPEND_BY_NAME["llama3_hnd_p16"].case.name, APPEND_BY_NAME["llama3_hnd_p16"].layout
  ('llama3_8b', 'HND')
  >>> FUSED_BY_NAME["deepseek_v3_mla_fp8"].kv_lora_rank, FUSED_BY_NAME["qwen3_8b_norm_bf16"].mla
  (512, False)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from jaxrope.config import RopeConfig
from jaxrope.qk_norm import QKNorm
from jaxrope.scaling import DynamicNTK, Linear, Llama3, LongRope, Proportional, Yarn


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer's RoPE call: ``q [tokens, q_heads, D]``, ``k [tokens, k_heads, D]``."""

    name: str
    tokens: int
    q_heads: int
    k_heads: int
    cfg: RopeConfig

    @property
    def head_dim(self) -> int:
        return self.cfg.head_dim


def _longrope(rotary_dim: int) -> LongRope:
    half = rotary_dim // 2
    return LongRope(short_factor=tuple(1.0 + 0.05 * i for i in range(half)),
                    long_factor=tuple(1.0 + 1.3 * i for i in range(half)),
                    original_max_position=4096)


CASES: Tuple[Case, ...] = (
    Case("llama3_8b", 17, 32, 8,
         RopeConfig(head_dim=128, theta=500000.0, scaling=Llama3(), max_position=1 << 20)),
    Case("qwen25_yarn", 19, 28, 4,
         RopeConfig(head_dim=128, theta=1e6, max_position=131072,
                    scaling=Yarn(factor=4.0, original_max_position=32768))),
    Case("phi3_longrope", 5, 32, 32,
         RopeConfig(head_dim=96, max_position=131072, scaling=_longrope(96))),
    Case("deepseek_v2_rope", 3, 16, 1,
         RopeConfig(head_dim=64, interleave=True, max_position=163840,
                    scaling=Yarn(factor=40.0, original_max_position=4096, mscale=0.707,
                                 mscale_all_dim=0.707))),
    Case("neox_partial_quarter", 17, 8, 8, RopeConfig(head_dim=128, rotary_dim=32)),
    Case("gptj_interleave", 19, 4, 4, RopeConfig(head_dim=256, rotary_dim=64, interleave=True)),
    Case("gemma_proportional", 7, 8, 1,
         RopeConfig(head_dim=256, theta=1e6,
                    scaling=Proportional(factor=1.0, partial_rotary_factor=0.25))),
    Case("linear_x4", 1, 5, 1, RopeConfig(head_dim=80, scaling=Linear(factor=4.0))),
    Case("dynamic_ntk", 17, 3, 3,
         RopeConfig(head_dim=192, max_position=16384,
                    scaling=DynamicNTK(factor=2.0, original_max_position=4096))),
    Case("default_d64", 1, 8, 1, RopeConfig(head_dim=64)),
    Case("default_d128", 9, 32, 8, RopeConfig(head_dim=128)),
    Case("partial_half_d128", 19, 32, 8, RopeConfig(head_dim=128, rotary_dim=64)),
    Case("interleave_d96_partial", 17, 5, 5,
         RopeConfig(head_dim=96, rotary_dim=48, interleave=True)),
    Case("head_dim_512", 3, 2, 1, RopeConfig(head_dim=512)),
)

_MROPE_POSITIONS = 1 << 20

MROPE_CASES: Tuple[Case, ...] = (
    Case("qwen2_vl_7b", 17, 28, 4,
         RopeConfig(head_dim=128, theta=1e6, max_position=_MROPE_POSITIONS,
                    mrope_section=(16, 24, 24))),
    Case("qwen3_vl_interleaved", 19, 32, 8,
         RopeConfig(head_dim=128, theta=5e6, max_position=_MROPE_POSITIONS,
                    mrope_section=(24, 20, 20), mrope_interleaved=True)),
    # GLM-4.1V: half the head rotates, in GPT-J pairs.
    Case("glm41v_partial_pairs", 5, 32, 2,
         RopeConfig(head_dim=128, rotary_dim=64, interleave=True, max_position=_MROPE_POSITIONS,
                    mrope_section=(8, 12, 12))),
    Case("mrope_partial_halves", 3, 8, 8,
         RopeConfig(head_dim=128, rotary_dim=64, max_position=_MROPE_POSITIONS,
                    mrope_section=(8, 12, 12))),
    Case("mrope_interleaved_d80_odd", 17, 5, 3,
         RopeConfig(head_dim=80, theta=1e6, max_position=_MROPE_POSITIONS,
                    mrope_section=(14, 13, 13), mrope_interleaved=True)),
    Case("mrope_yarn_empty_w", 1, 4, 1,
         RopeConfig(head_dim=64, theta=1e6, max_position=_MROPE_POSITIONS,
                    scaling=Yarn(factor=4.0, original_max_position=32768),
                    mrope_section=(16, 16, 0))),
)

BY_NAME = {case.name: case for case in CASES + MROPE_CASES}


@dataclasses.dataclass(frozen=True)
class AppendCase:
    """A :class:`Case` whose k and v also go into a paged cache (``pages`` of ``page_size``)."""

    name: str
    rope: str  # the name of the Case giving tokens, heads and config
    layout: str = "NHD"
    page_size: int = 16
    combined: bool = False  # one [pages, 2, ...] array rather than a (k_cache, v_cache) pair
    fp8: bool = False
    padding: int = 1  # tokens (the last ones) given slot -1

    @property
    def case(self) -> Case:
        return BY_NAME[self.rope]

    @property
    def pages(self) -> int:
        """Room for every token twice over plus one page, so slots scatter and some stay free."""
        return 2 * -(-self.case.tokens // self.page_size) + 1


APPEND_CASES: Tuple[AppendCase, ...] = (
    AppendCase("llama3_nhd_p16", "llama3_8b"),
    AppendCase("llama3_hnd_p16", "llama3_8b", layout="HND"),
    AppendCase("llama3_nhd_p1_combined", "llama3_8b", page_size=1, combined=True),
    AppendCase("partial_half_hnd_p1", "partial_half_d128", layout="HND", page_size=1),
    AppendCase("neox_quarter_nhd_combined", "neox_partial_quarter", combined=True, padding=3),
    AppendCase("gptj_interleave_hnd_combined", "gptj_interleave", layout="HND", combined=True),
    AppendCase("interleave_d96_nhd_p1", "interleave_d96_partial", page_size=1),
    AppendCase("deepseek_interleave_nhd", "deepseek_v2_rope"),
    AppendCase("linear_d80_hnd_one_token", "linear_x4", layout="HND", padding=0),
    AppendCase("decode_d64_nhd_one_token", "default_d64", padding=0),
    AppendCase("head_dim_512_hnd", "head_dim_512", layout="HND"),
    AppendCase("yarn_all_padding", "qwen25_yarn", padding=19),
    AppendCase("llama3_fp8_nhd", "llama3_8b", fp8=True),
    AppendCase("partial_half_fp8_hnd_combined", "partial_half_d128", layout="HND", combined=True,
               fp8=True),
    AppendCase("gptj_fp8_nhd_p1", "gptj_interleave", page_size=1, fp8=True),
    AppendCase("dynamic_d192_fp8_hnd", "dynamic_ntk", layout="HND", fp8=True, padding=2),
)

# The M-RoPE layouts through the fused append (``pos_ids [3, T]``): sectioned Qwen2-VL,
# interleaved Qwen3-VL, partial rotary in halves and in GLM-4.1V's pairs, odd sizes.
MROPE_APPEND_CASES: Tuple[AppendCase, ...] = (
    AppendCase("qwen2_vl_nhd_p16", "qwen2_vl_7b"),
    AppendCase("qwen3_vl_interleaved_hnd_combined", "qwen3_vl_interleaved", layout="HND",
               combined=True, padding=2),
    AppendCase("mrope_partial_halves_nhd_p1", "mrope_partial_halves", page_size=1),
    AppendCase("glm41v_pairs_fp8_hnd", "glm41v_partial_pairs", layout="HND", fp8=True),
    AppendCase("mrope_interleaved_d80_nhd_combined", "mrope_interleaved_d80_odd", combined=True),
)

APPEND_BY_NAME = {case.name: case for case in APPEND_CASES + MROPE_APPEND_CASES}


@dataclasses.dataclass(frozen=True)
class FusedCase:
    """One call of issue 46's fused family at a model's shape.

    GQA (``kv_lora_rank == 0``): :func:`jaxrope.apply_rope_and_append_kv` on ``q [T,
    q_heads, D]``, ``k`` and ``v [T, k_heads, D]``, NHD pages. MLA (``kv_lora_rank > 0``):
    :func:`jaxrope.apply_mla_rope_and_append` on ``q_pe [T, q_heads, r]``, ``k_pe [T, r]``
    and ``ckv [T, kv_lora_rank]`` (``r = cfg.head_dim``), plus ``q_nope [T, q_heads,
    q_nope_dim]`` when ``q_nope_dim``, into the ``(ckv_cache, kpe_cache)`` pair.
    ``fp8``: q comes out and the cache is stored as float8_e4m3fn. ``qk_norm``: q and k
    normalised per head before the rotation (weights ``[D]`` from the caller).
    ``tokens`` is the CPU size; benchmarks replace it.
    """

    name: str
    cfg: RopeConfig
    q_heads: int
    k_heads: int = 0
    kv_lora_rank: int = 0
    q_nope_dim: int = 0
    fp8: bool = False
    qk_norm: Optional[QKNorm] = None
    tokens: int = 17
    page_size: int = 16

    def __post_init__(self) -> None:
        if (self.k_heads > 0) == (self.kv_lora_rank > 0):
            raise ValueError(f"{self.name}: give k_heads (GQA) or kv_lora_rank (MLA), "
                             f"not {self.k_heads=} with {self.kv_lora_rank=}")
        if self.kv_lora_rank > 0 and self.qk_norm is not None:
            raise ValueError(f"{self.name}: MLA has no QK-norm in this op")

    @property
    def mla(self) -> bool:
        """True for an MLA case (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        """GQA's ``D``, MLA's rotary width ``r``: ``cfg.head_dim``."""
        return self.cfg.head_dim


# Qwen3-8B: 32 q heads, 8 kv heads, head_dim 128, theta 1e6, rms_norm_eps 1e-6 on per-head
# q_norm / k_norm. max_position is widened from its 40960 so tests reach 2**20.
_QWEN3_8B = RopeConfig(head_dim=128, theta=1e6, max_position=1 << 20)
_QWEN3_NORM = QKNorm(eps=1e-6)
# DeepSeek-V3: qk_rope_head_dim 64 in GPT-J pairs, YaRN factor 40 over 4096 positions,
# mscale = mscale_all_dim = 1 (attention factor 1); 128 heads, kv_lora_rank 512.
# max_position widened from 163840 likewise.
_DEEPSEEK_V3 = RopeConfig(head_dim=64, interleave=True, max_position=1 << 20,
                          scaling=Yarn(factor=40.0, original_max_position=4096, mscale=1.0,
                                       mscale_all_dim=1.0))

FUSED_CASES: Tuple[FusedCase, ...] = (
    FusedCase("qwen3_8b_norm_bf16", _QWEN3_8B, 32, k_heads=8, qk_norm=_QWEN3_NORM),
    # FlashInfer's fused fp8 op has no norm: this one is like for like with it.
    FusedCase("qwen3_8b_fp8", _QWEN3_8B, 32, k_heads=8, fp8=True),
    FusedCase("qwen3_8b_norm_fp8", _QWEN3_8B, 32, k_heads=8, fp8=True, qk_norm=_QWEN3_NORM),
    FusedCase("deepseek_v3_mla_bf16", _DEEPSEEK_V3, 128, kv_lora_rank=512),
    # q_nope as the absorbed decode query, [T, H, kv_lora_rank]: FlashInfer's MLA mode
    # quantises it with q_pe.
    FusedCase("deepseek_v3_mla_fp8", _DEEPSEEK_V3, 128, kv_lora_rank=512, q_nope_dim=512,
              fp8=True),
)

FUSED_BY_NAME = {case.name: case for case in FUSED_CASES}

# Issue 46's token counts: 512 decode tokens (one per request), 16k and 64k in prefill chunks.
FUSED_BENCH_TOKENS: Tuple[int, ...] = (512, 16384, 65536)
