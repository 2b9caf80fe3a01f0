"""append_triton_export.export_append_kv: the fused kernel's Triton IR as the torch launcher uses it.

Off the GPU (lowered for an H200): the kernel's signature is the documented pointer
order, every pointer promised 32-byte aligned (an M-RoPE kernel's too, which reads the
other rows of ``pos_ids [3, count]``); the IR exported at the launcher's token count
compiles to the same PTX as the kernel lowered at another T (one compiled kernel serves
every T, 1-D and M-RoPE); a cache the Triton lowering cannot address is declined before
lowering.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxrope as jr
from jaxrope.ops.rope_append_kv import triton as triton_append
from jaxrope.ops.rope_append_kv import tuning as append_tuning
from jaxrope.ops.rope_append_kv import cache_layout
from jaxrope.ops.rope_append_kv import triton_export as append_triton_export
from jaxrope.ops import constants
from jaxrope.cases import APPEND_BY_NAME, MROPE_APPEND_CASES
from jaxrope.testing.lowering import cuda_target, triton_modules


def _export(name: str, tokens: int = 64, **changes):
    case = APPEND_BY_NAME[name]
    c = case.case
    _, attention = constants.kernel_constants(c.cfg)
    rows = (case.page_size, c.k_heads) if case.layout == "NHD" else (c.k_heads, case.page_size)
    components = 2 if case.combined else 1
    args = dict(q_heads=c.q_heads, k_heads=c.k_heads, head_dim=c.head_dim,
                rotary_dim=c.cfg.rotary_dim, interleave=c.cfg.interleave,
                attention_factor=attention, dtype=jnp.bfloat16,
                cache_shape=(components * case.pages, *rows, c.head_dim),
                cache_dtype=jnp.float8_e4m3fn if case.fp8 else jnp.bfloat16, layout=case.layout,
                components=components,
                block=append_tuning.append_triton_tuning(tokens, c.q_heads, c.k_heads, c.cfg.rotary_dim // 2),
                mrope_section=c.cfg.mrope_section, mrope_interleaved=c.cfg.mrope_interleaved)
    args.update(changes)
    with cuda_target():
        return append_triton_export.export_append_kv(**args), args


def _signature(ttir: str):
    header = re.search(r"tt\.func public @jaxrope_rope_append_kv\((.*?)\)\s*(attributes|\{)",
                       ttir, re.S).group(1)
    return re.findall(r"!tt\.ptr<(\w+)> \{tt\.divisibility = (\d+) : i32\}", header)


@pytest.mark.parametrize("name,caches", [("llama3_nhd_p16", ["bf16", "bf16"]),
                                         ("partial_half_fp8_hnd_combined", ["f8E4M3FN"])])
def test_the_kernel_takes_the_documented_pointers_all_32_byte_aligned(name, caches):
    exported, _ = _export(name)
    assert exported.num_caches == len(caches)
    inputs = ["i32", "i32", "i32", "f32", "f32", "bf16", "bf16", "bf16", *caches]
    assert _signature(exported.ttir) == [(t, "32") for t in inputs + ["bf16", *caches]]


@pytest.mark.parametrize("name", [case.name for case in MROPE_APPEND_CASES[:2]])
def test_the_mrope_export_takes_the_1d_pointers_and_reads_other_rows(name):
    exported, args = _export(name)
    caches = ["bf16"] * exported.num_caches
    inputs = ["i32", "i32", "i32", "f32", "f32", "bf16", "bf16", "bf16", *caches]
    assert _signature(exported.ttir) == [(t, "32") for t in inputs + ["bf16", *caches]]
    with cuda_target():
        one_d = append_triton_export.export_append_kv(**{**args, "mrope_section": None})
    assert exported.ttir != one_d.ttir


@pytest.mark.requires_triton
@pytest.mark.parametrize("name", ["llama3_hnd_p16", "gptj_fp8_nhd_p1",
                                  *(case.name for case in MROPE_APPEND_CASES[1:3])])
def test_the_exported_kernel_is_the_kernel_lowered_at_any_token_count(name, tmp_path):
    import triton
    from triton.backends.compiler import GPUTarget

    exported, args = _export(name)
    block = args["block"]
    case = APPEND_BY_NAME[name]
    address = cache_layout.cache_rows(case.layout, case.combined, case.pages, case.page_size,
                                   args["k_heads"])

    def kernel(q, k, v, pos, slots, tables, scales, *caches):
        views = tuple(c.reshape(-1, args["head_dim"]) for c in caches)
        return triton_append.rope_append_kv_triton(
            q, k, v, pos, slots, tables, scales, views, rows=address,
            rotary_dim=args["rotary_dim"], interleave=args["interleave"],
            attention_factor=args["attention_factor"],
            mrope_section=args["mrope_section"], mrope_interleaved=args["mrope_interleaved"],
            tuning=block)

    tokens = 4096
    sds = jax.ShapeDtypeStruct
    rows = sds((tokens, args["k_heads"], args["head_dim"]), jnp.bfloat16)
    cache = sds(args["cache_shape"], args["cache_dtype"])
    pos_shape = (tokens,) if args["mrope_section"] is None else (3, tokens)
    [at_4096] = triton_modules(kernel, sds((tokens, args["q_heads"], args["head_dim"]), jnp.bfloat16),
                               rows, rows, sds(pos_shape, jnp.int32), sds((tokens,), jnp.int32),
                               sds((3, args["rotary_dim"] // 2), jnp.float32),
                               sds((2,), jnp.float32), *(cache,) * exported.num_caches)

    def ptx(ttir: str) -> str:
        path = tmp_path / "kernel.ttir"
        path.write_text(ttir)
        code = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": block.num_warps,
                                       "num_stages": block.num_stages}).asm["ptx"]
        # The instructions, without debug info (file paths from Triton's compile cache).
        return "\n".join(line for line in code.split(".section")[0].splitlines()
                         if not re.match(r"\s*\.(file|loc)\b", line))

    assert ptx(exported.ttir) == ptx(at_4096)


def test_an_fp8_cache_of_2_to_4_gib_is_declined_before_lowering(monkeypatch):
    def no_lowering(*args):
        raise AssertionError("the export should decline before lowering")

    monkeypatch.setattr(append_triton_export, "capture_one", no_lowering)
    pages = (3 << 30) // (16 * 8 * 128)  # 3 GiB of fp8
    with pytest.raises(jr.BackendUnavailable, match="2-4 GiB"):
        _export("llama3_fp8_nhd", cache_shape=(pages, 16, 8, 128))
