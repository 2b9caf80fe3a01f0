"""Export the Triton-lowered RoPE kernel as Triton IR, for launching outside JAX dispatch.

A PyTorch engine calling RoPE through JAX pays for a DLPack import and a jitted call per
layer, many times the kernel's own time. The kernel itself is a Triton kernel: Pallas
lowers it to a Triton MLIR module and hands XLA the bytecode. :func:`export` captures
that module's text while JAX lowers the kernel
(:func:`jaxrope.ops.triton_common.capture`), so ``torch_bridge.launch.triton`` can
compile it with Triton and launch it on torch's stream.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrope.ops.rope import triton, tuning
from jaxrope.ops.triton_common import capture_one


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """A Pallas kernel as Triton IR, plus what a launch needs.

    ``ttir`` takes pointer arguments in ``pallas_call`` operand order: inputs
    ``(count, pos_ids, tables, q, k)`` then outputs ``(q, k)``; an M-RoPE kernel's
    ``pos_ids`` is a contiguous int32 ``[3, count]``.
    """

    ttir: str
    block: tuning.TritonTuning
    q_heads: int
    k_heads: int

    # The launch grid of ``block``: the kernel's own rule (the fused append's differs).
    _grid = staticmethod(tuning.grid)

    @property
    def num_warps(self) -> int:
        return self.block.num_warps

    @property
    def num_stages(self) -> int:
        return self.block.num_stages

    def grid(self, num_tokens: int) -> Tuple[int, int, int]:
        axes = self._grid(num_tokens, self.q_heads, self.k_heads, self.block)
        return (*axes, 1, 1)[:3]


def export(*, q_heads: int, k_heads: int, head_dim: int, rotary_dim: int, interleave: bool,
           attention_factor: float, dtype, block: tuning.TritonTuning,
           mrope_section: Optional[Tuple[int, int, int]] = None,
           mrope_interleaved: bool = False) -> TritonKernel:
    """Lower the kernel for one head layout and launch shape and return its Triton IR.

    The IR does not depend on the token count (read at run time from the ``count``
    operand, which is also the row stride of M-RoPE positions), so one export serves
    every T.

    Raises:
      BackendUnavailable: no GPU, or JAX's private lowering API changed.
    """
    # Any T works (the IR reads the count at run time) as long as the grid has two token
    # blocks: Pallas folds program_id of a size-1 grid axis to the constant 0.
    tokens = 2 * block.block_tokens * block.token_loop

    def kernel_call(q, k, pos_ids, tables):
        return triton.rope_triton(q, k, pos_ids, tables, rotary_dim=rotary_dim,
                                  interleave=interleave, attention_factor=attention_factor,
                                  mrope_section=mrope_section,
                                  mrope_interleaved=mrope_interleaved, tuning=block)

    pos_shape = (tokens,) if mrope_section is None else (3, tokens)
    args = (jax.ShapeDtypeStruct((tokens, q_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((tokens, k_heads, head_dim), dtype),
            jax.ShapeDtypeStruct(pos_shape, jnp.int32),
            jax.ShapeDtypeStruct((3, rotary_dim // 2), jnp.float32))
    return TritonKernel(ttir=capture_one(kernel_call, *args), block=block, q_heads=q_heads,
                        k_heads=k_heads)
