"""jaxrope: rotary position embedding for LLM serving, in JAX and Pallas.

The public API is exactly what ``__all__`` lists, by one rule:

- the top level holds what one call of the rotation needs, from its config to the state
  its positions come from: the ops :func:`apply_rope`, :func:`apply_rope_and_append_kv`
  and :func:`apply_mla_rope_and_append` (MLA), :func:`checked` (``jax.jit`` of a step
  with every range check on), :class:`RopeConfig` and its scaling variants
  (:class:`Linear`, :class:`DynamicNTK`, :class:`Yarn`, :class:`LongRope`,
  :class:`Llama3`, :class:`Proportional`), :class:`QKNorm` (the norm before RoPE
  that :func:`apply_rope_and_append_kv` can apply), the backends (:data:`BACKENDS`,
  :class:`BackendUnavailable`), and the position state's types (:class:`PositionTable`,
  :class:`Scheme`, :class:`RowMap`, also reachable through :mod:`jaxrope.positions`);
- every other public name belongs to a subject and is reached through its module, each
  with its own ``__all__``: :mod:`jaxrope.hf` (``from_hf``, ``nope_layers``),
  :mod:`jaxrope.models` (the ``model_type`` table and the sample HF configs),
  :mod:`jaxrope.mrope` (M-RoPE prompt positions and config fields), :mod:`jaxrope.paging`
  (KV slots from vLLM block tables and FlashInfer page tables, a step's token -> view map),
  :mod:`jaxrope.positions` (the position table's transitions), :mod:`jaxrope.speculative_positions`
  (draft and verify positions) and :mod:`jaxrope.wire` (published records as bytes).

Every other module is private: importable, but its names may change without notice.
They are the implementation of the above (``ops``, one folder per op with its public
function, reference, kernels, tunings and exports; ``config``, ``cos_sin_cache``,
``checks``, ``errors``, ``frequencies``, ``int_arrays``, ``numbers``, ``qk_norm``,
``row_map``, ``scaling``, ``sharding``, ``sums``; ``hf_source``, ``hf_layers``, ``hf_fields`` and ``hf_examples`` behind :mod:`jaxrope.hf` and
:mod:`jaxrope.models`), ``layer_reference`` (the float64 layer the demos and the cache
readers' tests check against), the JAX engine demo (``demo``, run as
``python -m jaxrope.demo``, and ``engine_demo``, its trace),
and support for the tests and benchmarks: ``cases`` (the table of named cases they
share, imported as ``jaxrope.cases``) and ``testing`` (oracles and reference
implementations). No module of jaxrope or torch_bridge outside these two imports them; tests/test_packaging.py
checks that, and that every module is named here or in ``__all__``.

Example:
  >>> import jax.numpy as jnp, jaxrope as jr
  >>> cfg = jr.RopeConfig(head_dim=64, theta=10000.0)
  >>> q = k = jnp.ones((3, 2, 64), jnp.float32)
  >>> jr.apply_rope(q, k, jnp.arange(3, dtype=jnp.int32), cfg)[0].shape
  (3, 2, 64)
  >>> jr.Scheme is jr.positions.Scheme
  True
"""

from jaxrope import hf, models, mrope, paging, positions, speculative_positions, wire
from jaxrope.ops.backends import BACKENDS
from jaxrope.ops.rope.api import apply_rope
from jaxrope.checks import checked
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.ops.mla_rope_append.api import apply_mla_rope_and_append
from jaxrope.ops.rope_append_kv.api import apply_rope_and_append_kv
from jaxrope.positions import PositionTable, RowMap, Scheme
from jaxrope.qk_norm import QKNorm
from jaxrope.scaling import DynamicNTK, Linear, Llama3, LongRope, Proportional, Yarn

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "DynamicNTK",
    "Linear",
    "Llama3",
    "LongRope",
    "PositionTable",
    "Proportional",
    "QKNorm",
    "RopeConfig",
    "RowMap",
    "Scheme",
    "Yarn",
    "apply_mla_rope_and_append",
    "apply_rope",
    "apply_rope_and_append_kv",
    "checked",
    "hf",
    "models",
    "mrope",
    "paging",
    "positions",
    "speculative_positions",
    "wire",
]
