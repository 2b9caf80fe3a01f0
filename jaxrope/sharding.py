"""Sharded q and k: the resolved kernel runs once per shard, with no collective.

A Pallas call has no partitioning rule. Under ``jit`` with q and k sharded over a
mesh, XLA either gathers them around it or refuses, and the in-place aliasing of the
kernel is lost. RoPE needs nothing from other devices: a token's rotation reads only
its own position, and heads are independent. So :func:`per_shard` wraps whichever
implementation :func:`jaxrope.ops.backends.resolve` picked (the backend table stays as it
is) so that each device rotates its own block of q and k, in place when donated.

What may be sharded (:func:`local_specs` checks it once, for both mechanisms below):

- tokens (axis 0): q and k over the same mesh axes. ``pos_ids`` is then either
  sharded the same way or replicated; a replicated ``pos_ids`` is sliced on each device
  (a local slice, no communication).
- heads (axis 1): over any mesh axes, q and k independently (k replicated while q is
  sharded, as tpu-inference does when KV heads are fewer than devices, is fine). Every
  head is rotated on its own, so GQA groups that straddle devices are fine too. The
  head count must divide evenly by the devices it is sharded over.
- head_dim (axis 2): never. A rotation pairs dims of one head (halves or adjacent
  pairs), so a split head would need its other half from another device.

Any other layout needs communication. On Explicit axes it raises ``ValueError`` naming
the array, its sharding and what would work, at the call (under ``jit`` while tracing,
before anything compiles), as JAX's own ops refuse implicit communication there. On Auto
axes, where the compiler chooses shardings, it runs: the kernel asks for the nearest
layout it takes (:func:`runnable_specs`) and XLA reshards the operands to it, so the
compiled module then holds that collective.

How the per-shard call is made depends on where JAX shows the sharding:

- **Explicit mesh axes** (``AxisType.Explicit``): the sharding is part of the array's
  type, ``jax.typeof(q).sharding.spec``, at trace time, under ``jit`` or not. The
  kernel runs inside ``jax.shard_map`` with those specs; its lowering holds the kernel
  itself (one ``sdy.manual_computation`` around it), so it can be inspected before
  compiling, and shape errors are raised at the ``apply_rope`` call.
- **Auto mesh axes** (``AxisType.Auto``, what ``jax.sharding.Mesh`` makes by default;
  ``jax.make_mesh`` defaults to Explicit in JAX 0.10 and 0.11): the type names the mesh
  but not the spec; the compiler's propagation chooses shardings after tracing. The
  kernel is wrapped in ``jax.experimental.custom_partitioning``, whose ``partition``
  callback receives the shardings the partitioner settled on and returns the per-shard
  call on the layout :func:`runnable_specs` makes of them (the partitioner reshards an
  operand whose sharding differs). The Shardy rule gives
  q, k and ``pos_ids`` separate factors, so each operand's own sharding reaches that
  callback and the choice is made in one place, by one rule. Costs of this path: the
  kernel is inserted by the partitioner, so only the compiled module shows it; and a
  kernel with effects cannot run there (``custom_partitioning`` does not lower the
  Mosaic GPU kernel's mutable refs: ``BackendUnavailable``, use Explicit axes).

Why not one mechanism: ``shard_map`` needs the specs at trace time, which Auto axes
do not give; ``custom_partitioning`` traces its body once on the global, explicitly
sharded types, and a Pallas kernel's refs cannot be sliced along sharded axes there
(JAX 0.10.2 and 0.11.2: "sharded ref (array reference) can only be sliced along
unsharded axes"). The projects this follows: tokamax's attention takes ``q_sharding``
/ ``k_sharding`` arguments and calls ``shard_map`` inside the op; tpu-inference wraps
its ragged paged attention in ``shard_map`` over a mesh it is handed and uses
``custom_partitioning`` with a Shardy rule for its sampling kernel; MaxText
``shard_map``-s splash attention over its logical-axis specs. jaxrope reads the
sharding off the arrays instead of taking it as an argument, so ``apply_rope`` keeps
its signature.

Arrays on no mesh (one device), and arrays inside a ``shard_map`` (Manual axes: they
already are local blocks), call the kernel directly. A mesh that mixes Auto and Explicit
axes raises ``NotImplementedError``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  >>> import jaxrope as jr
  >>> mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Explicit,))
  >>> q = jax.device_put(jnp.ones((4, 2, 64)), NamedSharding(mesh, P(None, "model")))
  >>> k = jax.device_put(jnp.ones((4, 1, 64)), NamedSharding(mesh, P()))
  >>> q2, k2 = jr.apply_rope(q, k, jnp.arange(4, dtype=jnp.int32), jr.RopeConfig(head_dim=64))
  >>> tuple(q2.sharding.spec)
  (None, 'model', None)
  >>> [tuple(s) for s in local_specs(P(None, "model"), P(), P(), q.shape, k.shape, {"model": 1})]
  [(None, 'model', None), (None, None, None), (None,)]
  >>> [tuple(s) for s in runnable_specs(P(), P("model"), P(), (4, 2, 64), (4, 1, 64),
  ...                                   {"model": 2})]     # k's tokens follow q's
  [(None, None, None), (None, None, None), (None,)]
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, Optional, Sequence, Tuple

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxrope.errors import BackendUnavailable

_AXES = ("tokens", "heads", "head_dim")


def _entry(entry) -> Tuple[str, ...]:
    """A spec entry as a tuple of mesh axis names (``None`` -> ``()``)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _padded(spec: Optional[Sequence], rank: int) -> Tuple[Tuple[str, ...], ...]:
    entries = tuple(spec or ())
    return tuple(_entry(e) for e in entries + (None,) * (rank - len(entries)))


def _spec(entries: Sequence[Tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))


def local_specs(q_spec, k_spec, pos_spec, q_shape: Sequence[int], k_shape: Sequence[int],
                mesh_shape: Mapping[str, int]) -> Tuple[PartitionSpec, ...]:
    """The ``(q, k, pos_ids)`` specs each device's kernel call takes, or a clear error.

    Args:
      q_spec, k_spec: the ``PartitionSpec`` of ``q [T, Hq, D]`` and ``k [T, Hk, D]``
        (shorter specs leave trailing axes replicated).
      pos_spec: the ``PartitionSpec`` of ``pos_ids [T]``.
      q_shape, k_shape: global shapes.
      mesh_shape: ``{axis name: size}`` of the mesh.

    Returns:
      Full-rank specs; ``pos_ids``' is the tokens' (a replicated ``pos_ids`` is sliced
      on each device).

    Raises:
      ValueError: head_dim sharded, q and k tokens sharded differently, ``pos_ids``
        sharded other than like the tokens, or an axis that does not divide evenly.
    """
    q_axes, k_axes = _padded(q_spec, 3), _padded(k_spec, 3)
    (pos_axes,) = _padded(pos_spec, 1)
    for name, axes in (("q", q_axes), ("k", k_axes)):
        if axes[2]:
            raise ValueError(
                f"{name} is sharded over its head_dim (axis 2) by mesh axes {axes[2]}: a "
                f"rotation pairs dims of one head, so head_dim must be replicated; shard "
                f"tokens (axis 0) or heads (axis 1) instead")
    if q_axes[0] != k_axes[0]:
        raise ValueError(
            f"q's tokens (axis 0) are sharded over {q_axes[0] or 'no mesh axis'} but k's over "
            f"{k_axes[0] or 'no mesh axis'}: shard q's and k's tokens over the same mesh axes")
    tokens = q_axes[0]
    if pos_axes and pos_axes != tokens:
        raise ValueError(
            f"pos_ids is sharded over {pos_axes} but q's and k's tokens over "
            f"{tokens or 'no mesh axis'}: shard pos_ids like the tokens, or replicate it")
    for name, shape, axes in (("q", q_shape, q_axes), ("k", k_shape, k_axes)):
        for dim in (0, 1):
            devices = math.prod(mesh_shape[a] for a in axes[dim])
            if shape[dim] % devices:
                raise ValueError(
                    f"{name}.shape[{dim}]={shape[dim]} ({_AXES[dim]}) does not split evenly over "
                    f"mesh axes {axes[dim]} ({devices} devices): pick a mesh axis whose size "
                    f"divides it, or replicate that axis of {name}")
    return _spec(q_axes), _spec(k_axes), _spec((tokens,))


def runnable_specs(q_spec, k_spec, pos_spec, q_shape: Sequence[int], k_shape: Sequence[int],
                   mesh_shape: Mapping[str, int]) -> Tuple[PartitionSpec, ...]:
    """The layout nearest to the given one that :func:`local_specs` accepts (Auto axes).

    Arguments as :func:`local_specs`. The rule: q's tokens keep their mesh axes when
    they split T evenly (else tokens are replicated), and k and ``pos_ids`` follow
    them; each array's heads keep the axes that the tokens leave free when those split
    its heads evenly (else heads are replicated); head_dim is replicated. What differs
    from the given specs is what XLA reshards (``pos_ids`` sliced, or gathered).

    Returns:
      ``(q, k, pos_ids)`` specs, as :func:`local_specs` returns them for that layout.
    """
    q_axes, k_axes = _padded(q_spec, 3), _padded(k_spec, 3)

    def splits(size: int, axes: Tuple[str, ...]) -> Tuple[str, ...]:
        return axes if size % math.prod(mesh_shape[a] for a in axes) == 0 else ()

    tokens = splits(q_shape[0], q_axes[0])
    q_heads = splits(q_shape[1], tuple(a for a in q_axes[1] if a not in tokens))
    k_heads = splits(k_shape[1], tuple(a for a in k_axes[1] if a not in tokens))
    return local_specs(_spec((tokens, q_heads, ())), _spec((tokens, k_heads, ())),
                       _spec((tokens,)), q_shape, k_shape, mesh_shape)


def _mesh_kind(mesh) -> Optional[AxisType]:
    """``Explicit`` or ``Auto`` for a mesh to shard over, None for no mesh or only Manual axes.

    Raises:
      NotImplementedError: the mesh mixes Auto and Explicit axes.
    """
    kinds = {t for t in getattr(mesh, "axis_types", ()) if t != AxisType.Manual}
    if len(kinds) > 1:
        raise NotImplementedError(
            f"the arrays are on a mesh mixing Auto and Explicit axes ({mesh}); jaxrope shards "
            f"over meshes of one axis type: make them all Auto or all Explicit")
    return kinds.pop() if kinds else None


def per_shard(impl: Callable, q, k, pos_ids) -> Callable:
    """``impl`` itself, or ``impl`` run on each device's block when q / k are on a mesh.

    Args:
      impl: a kernel with the signature of
        :func:`jaxrope.ops.rope.reference.rope_reference`.
      q, k, pos_ids: the call's arrays (concrete or traced); their types (and, outside
        ``jit``, their shardings) are read, not their values.

    Returns:
      A callable with ``impl``'s signature.

    Raises:
      ValueError: on Explicit axes, a sharding :func:`local_specs` refuses (Auto axes
        run it resharded to :func:`runnable_specs`).
      NotImplementedError: a mesh mixing Auto and Explicit axes, or M-RoPE ``pos_ids
        [3, T]`` on a mesh.
      BackendUnavailable: Auto axes and a kernel with effects (the Mosaic GPU kernel's
        mutable refs), which ``custom_partitioning`` cannot lower.
    """
    kind = _mesh_kind(jax.typeof(q).sharding.mesh)
    if kind is None:
        return impl
    if pos_ids.ndim != 1:
        # The per-shard specs are written for pos_ids [T]; an M-RoPE [3, T] would need its
        # row axis kept whole. Refused rather than guessed.
        raise NotImplementedError(
            f"M-RoPE pos_ids.shape={tuple(pos_ids.shape)} with q on a mesh: sharded apply_rope "
            "takes 1-D positions only; run M-RoPE under your own shard_map (check_vma=False)")
    if kind == AxisType.Explicit:
        return _explicit(impl, q, k, pos_ids)
    return functools.partial(_auto, impl)


def like(reference, *values):
    """``values``, computed whole on every device, laid out like ``reference``.

    A replicated value taking a sharded array's layout is a local slice on each device,
    no communication. :func:`jaxrope.positions.plan` numbers every token of a step on
    every device (the step's views are replicated) and keeps each device's slice when
    its ``out`` buffer is sharded over the tokens. Without this, the compiler shards
    the running max that finds each token's view (a prefix scan, which then needs an
    all-gather) under Auto axes, and ``jnp.where`` of a replicated and a sharded array
    is a type error under Explicit axes.

    Returns:
      The tuple of ``values``, unchanged when ``reference`` is on no mesh.
    """
    kind = _mesh_kind(jax.typeof(reference).sharding.mesh)
    if kind is None:
        return values
    if not any(isinstance(v, jax.core.Tracer) for v in values):
        return tuple(jax.device_put(v, reference.sharding) for v in values)
    if kind == AxisType.Explicit:
        return tuple(jax.sharding.reshard(v, jax.typeof(reference).sharding) for v in values)
    # Auto: pin the values replicated, so the layout of `reference` is not propagated
    # back into the computation that made them.
    replicated = NamedSharding(jax.typeof(reference).sharding.mesh, PartitionSpec())
    return tuple(jax.lax.with_sharding_constraint(v, replicated) for v in values)


def _explicit(impl: Callable, q, k, pos_ids) -> Callable:
    types = [jax.typeof(x).sharding for x in (q, k, pos_ids)]
    mesh = types[0].mesh
    specs = local_specs(*(t.spec for t in types), q.shape, k.shape, dict(mesh.shape))
    q_spec, k_spec, pos_spec = specs

    def call(q, k, pos_ids, tables, **kwargs):
        if _padded(types[2].spec, 1) != _padded(pos_spec, 1) or types[2].mesh != mesh:
            pos_ids = _place(pos_ids, q, pos_spec)
        return jax.shard_map(functools.partial(impl, **kwargs), mesh=mesh,
                             in_specs=(q_spec, k_spec, pos_spec, PartitionSpec()),
                             out_specs=(q_spec, k_spec), check_vma=False)(q, k, pos_ids, tables)

    return call


def _place(pos_ids, q, spec: PartitionSpec):
    """``pos_ids`` on ``q``'s Explicit mesh with ``spec``: a local slice of a replicated
    array, or a transfer of one that is on no mesh yet (numpy, one device)."""
    if isinstance(q, jax.core.Tracer):
        return jax.sharding.reshard(pos_ids, NamedSharding(jax.typeof(q).sharding.mesh, spec))
    return jax.device_put(pos_ids, NamedSharding(q.sharding.mesh, spec))


def _auto(impl: Callable, q, k, pos_ids, tables, **kwargs):
    kwargs = tuple(sorted(kwargs.items()))
    avals = tuple((x.shape, x.dtype) for x in (q, k, pos_ids, tables))
    if _has_effects(impl, kwargs, avals):
        raise BackendUnavailable(
            f"{getattr(impl, '__name__', impl)!r} has effects (mutable refs or callbacks, as "
            f"the Mosaic GPU kernel and its interpreter do), which custom_partitioning cannot "
            f"lower (JAX {jax.__version__}); q is on Auto mesh axes: use Explicit axes "
            f"(jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))) or another backend")
    return _partitioned(impl, kwargs)(q, k, pos_ids, tables)


@functools.lru_cache(maxsize=256)
def _has_effects(impl: Callable, kwargs, avals) -> bool:
    body = functools.partial(impl, **dict(kwargs))
    return bool(jax.make_jaxpr(body)(*(jax.ShapeDtypeStruct(s, d) for s, d in avals)).effects)


@functools.lru_cache(maxsize=256)
def _partitioned(impl: Callable, kwargs: Tuple[Tuple[str, object], ...]) -> Callable:
    """``impl`` with its static keywords bound, as a ``custom_partitioning`` op."""
    body = functools.partial(impl, **dict(kwargs))

    @custom_partitioning
    def op(q, k, pos_ids, tables):
        return body(q, k, pos_ids, tables)

    def shardings(mesh, arg_shapes):
        q, k, pos_ids, _ = arg_shapes
        specs = runnable_specs(q.sharding.spec, k.sharding.spec, pos_ids.sharding.spec,
                               q.shape, k.shape, dict(mesh.shape))
        return tuple(NamedSharding(mesh, s) for s in specs)

    def partition(mesh, arg_shapes, result_shape):
        q_sharding, k_sharding, pos_sharding = shardings(mesh, arg_shapes)
        arg_shardings = (q_sharding, k_sharding, pos_sharding, NamedSharding(mesh, PartitionSpec()))
        return mesh, body, (q_sharding, k_sharding), arg_shardings

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[:2]

    # Separate factors for q's, k's and pos_ids' axes: the partitioner passes each
    # operand's own sharding to `partition`, where runnable_specs settles the layout.
    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule="t h d, s g e, p, r f -> t h d, s g e",
                     need_replication_factors=("r", "f"))
    return op
