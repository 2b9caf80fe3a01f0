"""mla_rope_append.mosaic_export.export_mla: the MLA kernel as torch_bridge.launch.mla compiles it.

Off the GPU (JAX 0.11+, skipped with the reason on 0.10): the lowered module takes the
documented operands (``MLA_OPERANDS``: shapes and dtypes, GPT-J pairs as ``[..., r/2, 2]``
views, M-RoPE's three rows of positions) and its one Mosaic GPU call aliases each result
to the operand the launch passes again as that result (q_pe or the fp8 outputs, and the
caches); ``launch_pointers`` (the launcher's order) is checked against the same
operand list in tests/test_mla_launch_bridge.py. The kernel with a run-time count and a
grid of a block for every item (no walk) runs in the interpreter in
tests/test_mla_kernels_interpret.py.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from jaxrope.ops import mosaic_common
from jaxrope.ops.mla_rope_append import mosaic_export as mla_export
from jaxrope.ops.mla_rope_append import tuning as mla_tuning

MISSING = mosaic_common.lowering_unavailable()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

CAPACITY, SLOTS, HEADS = 1 << 16, 64, 4


def _export(monkeypatch, *, interleave=True, combined=False, cache_dtype=jnp.bfloat16,
            q_fp8=False, nope_dim=0, mrope_section=None, lora=512, max_count=None):
    """The module's bytes, and the lowered @main's argument types and its Mosaic GPU
    call's aliases ``{result: operand}`` (from the lowering the export itself makes)."""
    import jax
    from jax._src.lib.mlir.dialects import func, hlo
    seen = {}
    real = mla_export.export_module

    def spy(call, specs, donate, capacity, grid):
        seen["lowered"] = jax.jit(call, donate_argnums=donate).trace(*specs).lower(
            lowering_platforms=("cuda",))
        return real(call, specs, donate, capacity, grid)

    monkeypatch.setattr(mla_export, "export_module", spy)
    tuning = mla_tuning.mla_mosaic_tuning(HEADS, 64, 2, nope_dim)
    exported = mla_export.export_mla(
        heads=HEADS, rotary_dim=64, kv_lora_rank=lora, dtype=jnp.bfloat16,
        cache_dtype=cache_dtype, num_slots=SLOTS, combined=combined, interleave=interleave,
        attention_factor=1.25, tuning=tuning, capacity=CAPACITY,
        grid=8 * len(tuning.pieces), nope_dim=nope_dim, q_fp8=q_fp8, max_count=max_count,
        mrope_section=mrope_section)
    module = seen["lowered"].compiler_ir("stablehlo")
    with module.context:
        [main] = [op for op in module.body.operations
                  if isinstance(op, func.FuncOp) and op.name.value == "main"]
        [block] = main.body.blocks
        [call] = [op for op in block.operations if isinstance(op, hlo.CustomCallOp)]
        types = [str(a.type) for a in block.arguments]
        aliases = dict((int(out), int(operand)) for out, operand in re.findall(
            r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)",
            str(call.attributes["output_operand_aliases"])))
    return exported, types, aliases


def _head(pos_rows: int = 1):
    return ["tensor<1xi32>", f"tensor<{pos_rows * CAPACITY}xi32>", f"tensor<{CAPACITY}xi32>",
            "tensor<3x32xf32>", "tensor<32xi32>", "tensor<2xf32>"]


def test_a_pair_cache_rotates_q_pe_in_place(monkeypatch):
    exported, types, aliases = _export(monkeypatch)
    assert types == _head() + [
        f"tensor<{CAPACITY}x4x32x2xbf16>",          # q_pe, rotated in place, pairs
        f"tensor<{CAPACITY}x1x32x2xbf16>",          # k_pe
        f"tensor<{CAPACITY}x1x512xbf16>",           # ckv: its own array, no pairs
        f"tensor<{SLOTS}x1x512xbf16>",              # ckv_cache
        f"tensor<{SLOTS}x1x32x2xbf16>"]             # kpe_cache, pairs
    assert aliases == {0: 6, 1: 9, 2: 10}           # q_pe, then the caches
    assert exported.results == 3 and exported.module.startswith(b"ML\xefR")
    assert exported.capacity == CAPACITY


def test_an_fp8_q_takes_q_nope_and_writes_the_fp8_outputs_last(monkeypatch):
    exported, types, aliases = _export(monkeypatch, combined=True, q_fp8=True, nope_dim=128,
                                       cache_dtype=jnp.float8_e4m3fn)
    assert types == _head() + [
        f"tensor<{CAPACITY}x4x32x2xbf16>",          # q_pe, only read
        f"tensor<{CAPACITY}x1x32x2xbf16>",          # k_pe
        f"tensor<{CAPACITY}x1x256x2xbf16>",         # ckv, through the one array's pairs
        f"tensor<{CAPACITY}x4x128xbf16>",           # q_nope
        f"tensor<{SLOTS}x1x288x2xf8E4M3FN>",        # the [L + r] cache
        f"tensor<{CAPACITY}x4x32x2xf8E4M3FN>",      # q_pe_out
        f"tensor<{CAPACITY}x4x128xf8E4M3FN>"]       # q_nope_out
    assert aliases == {0: 10, 1: 11, 2: 12}         # the cache, then the fp8 outputs
    assert exported.results == 3


def test_neox_halves_and_mrope_positions_without_a_walk(monkeypatch):
    exported, types, aliases = _export(monkeypatch, interleave=False, combined=True,
                                       mrope_section=(16, 8, 8), max_count=8, lora=128)
    assert types == _head(pos_rows=3) + [
        f"tensor<{CAPACITY}x4x64xbf16>", f"tensor<{CAPACITY}x1x64xbf16>",
        f"tensor<{CAPACITY}x1x128xbf16>", f"tensor<{SLOTS}x1x192xbf16>"]
    assert aliases == {0: 6, 1: 9}
    assert exported.results == 2


def test_q_nope_without_an_fp8_q_is_refused():
    with pytest.raises(ValueError, match="nope_dim=128 needs q_fp8=True"):
        mla_export.export_mla(
            heads=HEADS, rotary_dim=64, kv_lora_rank=512, dtype=jnp.bfloat16,
            cache_dtype=jnp.bfloat16, num_slots=SLOTS, combined=True, interleave=True,
            attention_factor=1.0, tuning=mla_tuning.mla_mosaic_tuning(HEADS, 64, 2, 128),
            capacity=CAPACITY, grid=8, nope_dim=128)


@pytest.mark.slow
def test_deepseek_v3s_decode_shape_exports():
    # DeepSeek-V3 on one GPU: 128 heads, q_nope of 512 quantised with q_pe, one fp8
    # [L + r] cache of 2**20 rows; 37 pieces a token, a block for each of 64 tokens'.
    tuning = mla_tuning.mla_mosaic_tuning(128, 64, 2, 512)
    exported = mla_export.export_mla(
        heads=128, rotary_dim=64, kv_lora_rank=512, dtype=jnp.bfloat16,
        cache_dtype=jnp.float8_e4m3fn, num_slots=1 << 20, combined=True, interleave=True,
        attention_factor=1.0, tuning=tuning, capacity=CAPACITY,
        grid=64 * len(tuning.pieces), nope_dim=512, q_fp8=True, max_count=64)
    assert len(tuning.pieces) == 37 and exported.results == 3
    assert exported.grid == 64 * 37
