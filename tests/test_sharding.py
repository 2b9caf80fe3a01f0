"""The per-shard wrapper on one device: its spec rules, and what it lowers to for CUDA.

The 8-device behaviour (results, no collectives, in place) is in tests/multidevice/.
Here: ``local_specs`` on its own, the plain path left exactly as it was, and the
Pallas kernel on an Explicit mesh lowered for CUDA from this CPU host (an abstract mesh
of H200s stands in for the devices): over a 1-device mesh the program is the plain
call's, one kernel and nothing else; over 2 devices the same kernel runs on each
device's block inside one manual computation, with no collective.
"""

from __future__ import annotations

import collections
import re
import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxrope as jr
import jaxrope.ops.rope.api
from jaxrope import sharding
from jaxrope.ops.rope.reference import rope_reference

CFG = jr.RopeConfig(head_dim=128)
TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton"


def test_local_specs_fill_in_ranks_and_give_pos_ids_the_tokens_spec():
    specs = sharding.local_specs(P("data", "model"), P("data"), P(), (8, 4, 64), (8, 2, 64),
                                 {"data": 2, "model": 2})
    assert [tuple(s) for s in specs] == [("data", "model", None), ("data", None, None),
                                         ("data",)]
    specs = sharding.local_specs(P(("a", "b")), P(("a", "b")), P(("a", "b")), (8, 1, 64),
                                 (8, 1, 64), {"a": 2, "b": 4})
    assert tuple(specs[2]) == (("a", "b"),)


@pytest.mark.parametrize("q_spec, k_spec, pos_spec, message", [
    (P(None, None, "m"), P(), P(), r"q is sharded over its head_dim \(axis 2\) by mesh axes "
                                   r"\('m',\)"),
    (P(), P(None, None, "m"), P(), "k is sharded over its head_dim"),
    (P("m"), P(), P(), r"q's tokens \(axis 0\) are sharded over \('m',\) but k's over no mesh "
                       r"axis"),
    (P("m"), P("m"), P(("m", "n")), r"pos_ids is sharded over \('m', 'n'\)"),
    (P(None, "n"), P(), P(), r"q.shape\[1\]=4 \(heads\) does not split evenly over mesh axes "
                             r"\('n',\) \(3 devices\)"),
    (P(("m", "n")), P(("m", "n")), P(), r"q.shape\[0\]=8 \(tokens\) does not split evenly over "
                                        r"mesh axes \('m', 'n'\) \(6 devices\)"),
])
def test_local_specs_refuse_layouts_that_would_need_communication(q_spec, k_spec, pos_spec,
                                                                  message):
    with pytest.raises(ValueError, match=message):
        sharding.local_specs(q_spec, k_spec, pos_spec, (8, 4, 64), (8, 2, 64), {"m": 2, "n": 3})


@pytest.mark.parametrize("q_spec, k_spec, pos_spec, runnable", [
    # head_dim replicated
    (P(None, None, "m"), P(), P(), [(None, None, None), (None, None, None), (None,)]),
    # k's tokens follow q's, replicated or sharded
    (P(), P("m"), P(), [(None, None, None), (None, None, None), (None,)]),
    (P("m"), P(), P(), [("m", None, None), ("m", None, None), ("m",)]),
    # pos_ids follows the tokens
    (P("m"), P("m"), P(("m", "n")), [("m", None, None), ("m", None, None), ("m",)]),
    (P(None, "m"), P(None, "m"), P("n"), [(None, "m", None), (None, "m", None), (None,)]),
    # k's heads give up the axis the tokens took
    (P("m"), P(None, "m"), P(), [("m", None, None), ("m", None, None), ("m",)]),
    # axes that do not split evenly are replicated: q's 4 heads over 3, 8 tokens over 6
    (P(None, "n"), P(None, "m"), P(), [(None, None, None), (None, "m", None), (None,)]),
    (P(("m", "n")), P(("m", "n")), P(), [(None, None, None), (None, None, None), (None,)]),
    # a layout local_specs takes stays as it is
    (P("n", "m"), P("n"), P("n"), [("n", "m", None), ("n", None, None), ("n",)]),
])
def test_runnable_specs_pick_the_nearest_layout_local_specs_takes(q_spec, k_spec, pos_spec,
                                                                 runnable):
    shapes, mesh_shape = ((6, 4, 64), (6, 2, 64)), {"m": 2, "n": 3}
    if q_spec == P(("m", "n")):
        shapes = ((8, 4, 64), (8, 2, 64))
    specs = sharding.runnable_specs(q_spec, k_spec, pos_spec, *shapes, mesh_shape)
    assert [tuple(s) for s in specs] == runnable
    assert sharding.local_specs(*specs, *shapes, mesh_shape) == specs


def test_off_a_mesh_the_kernel_is_called_as_before():
    q, k = jnp.zeros((4, 2, 64)), jnp.zeros((4, 1, 64))
    pos = jnp.zeros((4,), jnp.int32)
    assert sharding.per_shard(rope_reference, q, k, pos) is rope_reference
    traced = []
    jax.jit(lambda q: traced.append(sharding.per_shard(rope_reference, q, k, pos)))(q)
    assert traced == [rope_reference]


def _lowered_for_cuda(monkeypatch, devices: int, spec):
    """``apply_rope`` (backend "auto": the Triton-lowered kernel on a CUDA device of unknown
    capability) on bf16 [16, 32, 128] / [16, 8, 128], donated, lowered for CUDA; q and k
    sharded ``spec`` on an Explicit mesh of ``devices`` abstract H200s, or unsharded when
    ``spec`` is None."""
    # The arrays are abstract, so apply_rope would take the default backend's device: a
    # CUDA device of unknown compute capability instead, whose "auto" is the Triton-lowered
    # kernel (tests/gpu/test_sharding_gpu.py runs the real device's choice).
    monkeypatch.setattr(jaxrope.ops.backends, "device_of", lambda x: types.SimpleNamespace(platform="cuda"))
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                         platform="cuda")
    grid = jax.sharding.AbstractMesh((devices,), ("model",), axis_types=(AxisType.Explicit,),
                                     abstract_device=device)

    def arg(shape, arg_spec, dtype=jnp.bfloat16):
        layout = None if spec is None else NamedSharding(grid, arg_spec)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=layout)

    args = (arg((16, 32, 128), spec), arg((16, 8, 128), spec), arg((16,), P(), jnp.int32))
    # The mesh context gives JAX 0.11's Triton lowering its GPU (it reads the device kind).
    with jax.sharding.use_abstract_mesh(grid):
        rope = jax.jit(lambda q, k, pos: jr.apply_rope(q, k, pos, CFG), donate_argnums=(0, 1))
        return rope.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _ops(text: str) -> list:
    """The program's ops in order, without Shardy's sharding annotations."""
    return re.findall(r"\b(?:stablehlo|func|mhlo)\.[a-z_]+", text)


def _kernel_calls(text: str) -> list:
    # The kernel's Triton IR and launch grid, SSA names and operands left out.
    return re.findall(re.escape(TRITON_CALL) + r"\([^)]*\) (\{.*)", text)


def test_over_a_one_device_mesh_the_kernel_lowers_as_the_plain_call(monkeypatch):
    plain = _lowered_for_cuda(monkeypatch, 1, None)
    sharded = _lowered_for_cuda(monkeypatch, 1, P(None, "model"))
    assert _ops(sharded) == _ops(plain)
    assert _ops(plain).count("stablehlo.custom_call") == 1
    assert _kernel_calls(sharded) == _kernel_calls(plain) != []
    for op in ("transpose", "copy", "reshape", "manual_computation", "all_gather"):
        assert op not in sharded, op
    assert re.findall(r"tf\.aliasing_output = (\d)", sharded) == ["0", "1"]


def test_over_two_devices_each_rotates_its_heads_in_one_kernel(monkeypatch):
    text = _lowered_for_cuda(monkeypatch, 2, P(None, "model"))
    assert text.count("sdy.manual_computation(") == 1
    assert text.count(TRITON_CALL) == 1
    # The kernel takes each device's block: half of q's and half of k's heads.
    call = next(line for line in text.splitlines() if TRITON_CALL in line)
    assert "tensor<16x16x128xbf16>" in call and "tensor<16x4x128xbf16>" in call
    for op in ("all_gather", "all_reduce", "all_to_all", "collective_permute", "reduce_scatter",
               "transpose", "copy"):
        assert op not in text, op
    # Donated q and k (their aliasing is settled when compiling for several devices:
    # tests/multidevice checks it), and the kernel writes over its inputs.
    assert text.count("jax.buffer_donor = true") == 2
    assert call.count("stablehlo.output_operand_alias") == 2


def _compiled_program(text: str) -> collections.Counter:
    """Every instruction's opcode (and custom-call target), counted over the module."""
    ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", text))
    ops.update(re.findall(r'custom_call_target="([^"]+)"', text))
    return ops


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_over_a_one_device_mesh_both_paths_compile_to_the_plain_program(backend):
    # Compiled on this CPU, so the Auto path (whose kernel the partitioner inserts) is
    # covered too: the same instructions as the plain call, nothing added.
    rope = jax.jit(lambda q, k, pos: jr.apply_rope(q, k, pos, CFG, backend=backend),
                   donate_argnums=(0, 1))
    q, k = jnp.zeros((16, 8, 128), jnp.bfloat16), jnp.zeros((16, 2, 128), jnp.bfloat16)
    pos = jnp.zeros((16,), jnp.int32)
    plain = _compiled_program(rope.lower(q, k, pos).compile().as_text())
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        grid = jax.make_mesh((1,), ("model",), axis_types=(axis_type,), devices=jax.devices()[:1])
        layout = NamedSharding(grid, P(None, "model"))
        args = (jax.device_put(q, layout), jax.device_put(k, layout),
                jax.device_put(pos, NamedSharding(grid, P())))
        assert _compiled_program(rope.lower(*args).compile().as_text()) == plain, axis_type
