"""The Mosaic torch launch's shapes hold the bounds its compiled kernel relies on.

The kernel a shape compiles leaves out the path for counts under one block when the
shape's ``min_count`` is a block or more, and its walk over items when the grid has a
block for every item of ``max_count`` tokens: a count outside the bounds would leave
tokens unrotated, silently. The kernel's side runs in tests/test_mosaic_interpret.py
(``test_mosaic_kernel_reads_the_token_count_at_run_time``) and on the GPU in
tests/gpu/test_mosaic_launch_gpu.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from torch_bridge.launch.mosaic import launch_shape  # noqa: E402


@pytest.mark.parametrize("tokens_per_block, groups, block_groups", [
    (16, 10, 2),   # Llama's 32/8 heads, bf16 D 128
    (4, 10, 8),    # GPT-J pairs
    (16, 3, 2), (8, 1, 1), (32, 17, 4)])
def test_every_count_lies_in_the_bounds_of_its_one_shape(tokens_per_block, groups,
                                                         block_groups):
    shapes = {}
    for tokens in range(1, 64 * tokens_per_block + 1):  # whole shapes only
        shape = launch_shape(tokens, tokens_per_block, groups, block_groups)
        assert shape.min_count <= tokens <= shape.max_count <= shape.capacity, (tokens, shape)
        # A block for every item of the largest count: the compiled kernel has no walk.
        assert shape.grid == -(-shape.max_count // tokens_per_block) * shape.splits
        assert 1 <= shape.splits <= groups
        # Counts under a block reach only the shape compiled with that path.
        assert (shape.min_count < tokens_per_block) == (shape.max_count <= tokens_per_block)
        shapes.setdefault(shape, []).append(tokens)
    for shape, counts in shapes.items():
        # One compile per shape: the bounds are exactly the counts that map to it.
        assert counts == list(range(shape.min_count, shape.max_count + 1)), shape


def test_a_compiled_module_hands_the_host_function_each_pointer_in_order():
    # CompiledModule packs the launch's buffers as 64-bit pointers for the host function
    # MosaicGpuCompile returns (kernel, stream, void** buffers); here that function is a
    # ctypes callback that reads them back.
    import ctypes
    import types

    from torch_bridge.launch.mosaic import CompiledModule

    seen = []
    host = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.POINTER(ctypes.c_uint64))(
        lambda kernel, stream, buffers: seen.append((kernel, stream, buffers[:len(pointers)])))
    pair = (ctypes.c_void_p * 2)(0x1234, ctypes.cast(host, ctypes.c_void_p).value)

    def compile_fn(module, size):
        assert (module, size) == (b"ML\xefR", 4)
        return ctypes.cast(pair, ctypes.POINTER(ctypes.c_void_p))

    compiled = CompiledModule(types.SimpleNamespace(module=b"ML\xefR"), compile_fn)
    for pointers in ((1 << 47) + 256, 0, 2 ** 64 - 32, 7), (5,), (0x7F00_0000_0040,) * 13:
        compiled(0xABC, *pointers)
        assert seen.pop() == (0x1234, 0xABC, list(pointers))
