"""Checked mode: the range checks of a jitted step, turned on for development.

Outside ``jax.jit`` every public entry checks the values it sees and raises a
``ValueError`` naming the argument. Under ``jax.jit`` the values are traced and, by
default, not checked (README "What is guaranteed on bad input" says what a bad one does
there). :func:`checked` turns the same checks on for a traced step: each becomes a
``jax.experimental.checkify`` check compiled into the step, and a call whose values
break one raises ``ValueError`` naming the first that failed: argument, index, value
and the range expected, e.g. ``pos_ids[3]=5000 must lie in [0, 4095]``.

Use it in place of ``jax.jit`` (same keywords, donation included)::

    step = jaxrope.checked(engine_step, donate_argnums=(0, 4), static_argnames="cfg")
    q, kv_cache, table = step(q, k, v, pos_ids, kv_cache, slots, table, cfg=cfg)

or, to compose with other transformations, :func:`checkified` gives the
``checkify``-transformed step, ``(error, outputs)``, to jit yourself
(:func:`throw` raises). Off by default: without :func:`checked` the hooks below
emit nothing, so a step's jaxpr and HLO are what they were (tests/test_checked.py
compares the lowered text). The switch is a ``jax.make_user_context`` value, part of
every jit cache key: a function jitted inside the step is traced again with the checks
rather than reusing an unchecked trace. Checks trace into the step, not into the
kernels; a Pallas or Mosaic GPU call passes through ``checkify`` untouched. A failed
check does not stop the step: its outputs (and donated buffers) are as the unchecked
step would leave them, and the error names the first check that failed.

The rules, one per argument. Each is the eager rule of the same call site with the same
bounds (in parentheses: the function that enforces it outside ``jit``, whose traced twin
runs here):

- ``pos_ids`` (``apply_rope``, ``apply_rope_and_append_kv``): every value in
  ``[0, cfg.max_position)``, on every row of M-RoPE ``[3, T]`` (``apply.validate``);
- ``slots`` (``apply_rope_and_append_kv``): below ``pages * page_size`` or negative
  (skipped), at their own width; no slot twice (``rope_append_kv.api._slots``);
- the fp8 scales (``k_quant_scale``, ``v_quant_scale``, ``q_quant_scale`` of
  ``apply_rope_and_append_kv``; ``q_quant_scale``, ``kv_quant_scale`` of
  ``apply_mla_rope_and_append``) passed as arrays: finite and > 0 as a normal float32
  (``rope_append_kv.api._scale``, via :func:`jaxrope.numbers.check_float32_positive`);
- ``rows``, ``src_rows``, ``dst_rows`` (every transition of :mod:`jaxrope.positions`):
  in ``[0, capacity)`` or ``PAD``; in ``admit`` and ``rollback`` each live row once
  (``positions._rows``);
- ``counts``, ``amounts``, ``positions``, ``epochs`` in ``[0, 2**31)``; ``deltas``,
  ``depths`` and ``out`` within int32 (``int_arrays.in_range``, via ``values``);
- ``counts`` of ``plan``: ``sum(counts) <= N``, a PAD view has 0 tokens
  (``positions.plan``); of ``commit``, and ``amounts`` of ``advance``: no counter carried
  past ``2**31 - 1`` (``positions._no_overflow``); ``block_step`` in ``[1, 2**31)``
  (``positions.commit``);
- ``rows`` of ``rollback``: none moved back at the last epoch, ``2**31 - 1``
  (``positions.rollback``);
- planned positions (``plan``, so the speculative plans and M-RoPE's ``counter + delta``
  too): ``counter + delta + offset`` in ``[0, 2**31)`` (checked mode only);
- ``drafts`` of ``plan_chain``, ``accepted`` of ``accept``: in ``[0, 2**31 - 1)``, so
  that ``+ 1`` fits (``int_arrays.in_range``; ``speculative_positions.accept``); ``depths`` of
  ``plan_tree``: each view's a tree (``valid_trees``, as ``speculative_positions.plan_tree``);
  ``parents`` of ``tree_depths``: ``-1 <= parents[t] < t`` (``speculative_positions.tree_depths``).

What checked mode costs: ``python -m bench.checked_bench`` times jitted steps with the
checks off and on, paired in one run. A checked call also reads the error back, so it
waits for the step: one host sync per call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxrope.numbers import FLOAT32_TINY

__all__ = ["checked", "checkified", "throw"]

_INT32_MAX = int(np.iinfo(np.int32).max)
# Part of every jit cache key (a user context): a trace with the checks never serves a
# call without them, nor the reverse. Thread-local, like every JAX config context.
_ON = jax.make_user_context(default_value=False)


def enabled() -> bool:
    """Whether the step being traced is checked (inside :func:`checked`)."""
    return bool(_ON.value)


def checkified(fn: Callable) -> Callable:
    """``fn`` with jaxrope's checks on, ``checkify``-transformed: it returns
    ``(error, outputs)``; :func:`throw` (or ``error.throw()``) raises ``ValueError`` for
    a failed check.

    Jit it (``jax.jit(checkified(step), donate_argnums=...)``) and call ``throw`` outside.
    Array arguments (JAX and numpy arrays, and the leaves of pytrees such as
    :class:`jaxrope.PositionTable`) are traced; every other value (a
    :class:`jaxrope.RopeConfig`, a Python int) is passed as it is, as ``jit`` passes a
    static argument.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

        def with_checks(*values):
            full = list(leaves)
            for i, value in zip(traced, values):
                full[i] = value
            inner_args, inner_kwargs = jax.tree.unflatten(tree, full)
            with _ON(True):
                return fn(*inner_args, **inner_kwargs)

        return checkify.checkify(with_checks, errors=checkify.user_checks)(
            *(leaves[i] for i in traced))

    return run


def checked(fn: Callable, **jit_kwargs: Any) -> Callable:
    """``jax.jit(fn, **jit_kwargs)`` with every jaxrope range check compiled in.

    A call returns ``fn``'s outputs, or raises ``ValueError`` naming the first value
    out of range (argument, index, value, expected range). Donated buffers are consumed
    either way. ``fn`` is traced afresh even if it is itself a ``jax.jit`` function.

    Example:
      >>> import jax.numpy as jnp, jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=64, max_position=4096)
      >>> step = jr.checked(jr.apply_rope, static_argnames=("cfg", "backend"))
      >>> q = k = jnp.ones((3, 2, 64), jnp.float32)
      >>> step(q, k, jnp.array([0, 1, 2]), cfg=cfg)[0].shape
      (3, 2, 64)
      >>> step(q, k, jnp.array([0, 4096, 2]), cfg=cfg)
      Traceback (most recent call last):
      ...
      ValueError: pos_ids[1]=4096 must lie in [0, 4095] (`check` failed)
    """
    jitted = jax.jit(checkified(fn), **jit_kwargs)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        error, out = jitted(*args, **kwargs)
        throw(error)
        return out

    return run


def throw(error: checkify.Error) -> None:
    """Raise ``ValueError`` with the first failed check's message, if any failed.

    ``error.throw()`` does the same through an eager primitive (about 0.1 ms a call on a
    CPU host); this reads the error's few scalars instead.
    """
    message = error.get()
    if message is not None:
        raise ValueError(message)


# -- the traced checks (each called only with a traced value, while enabled()) ---------


def _fail_at(name: str, x: jax.Array, bad: jax.Array, expected: str, *extra) -> None:
    """One check: no entry of ``bad`` is set; else name the first, ``name[i]=value``."""
    if not x.size:
        return
    flat = jnp.reshape(bad, (-1,))
    first = jnp.argmax(flat)
    value = jnp.reshape(x, (-1,))[first]
    if x.ndim == 0:
        where, index = "", ()
    else:
        where = "[" + ", ".join(["{}"] * x.ndim) + "]"
        index = tuple(jnp.unravel_index(first, x.shape))
    checkify.check(~jnp.any(flat), f"{name}{where}={{}} {expected}", *index, value, *extra)


def _outside(x: jax.Array, low: Optional[int], high: Optional[int]) -> jax.Array:
    """Values of ``x`` outside ``[low, high]``, compared at ``x``'s own width: a bound
    its dtype cannot hold leaves that side unchecked instead of being converted."""
    info = np.iinfo(x.dtype)
    bad = jnp.zeros(x.shape, bool)
    if low is not None and low > info.min:
        bad = bad | (x < low)
    if high is not None and high < info.max:
        bad = bad | (x > high)
    return bad


def _equals(x: jax.Array, value: int) -> jax.Array:
    """``x == value``, all False where ``x``'s dtype cannot hold ``value`` (PAD in int8)."""
    info = np.iinfo(x.dtype)
    if not info.min <= value <= info.max:
        return jnp.zeros(x.shape, bool)
    return x == value


def in_range(name: str, x, low: int, high: int) -> None:
    """Traced ``x`` in ``[low, high]``: :func:`jaxrope.int_arrays.in_range`'s twin."""
    if not enabled():
        return
    x = jnp.asarray(x)
    _fail_at(name, x, _outside(x, low, high), f"must lie in [{low}, {high}]")


def float32_positive(name: str, x: jax.Array) -> None:
    """Traced float32 scalar ``x`` finite and at least the smallest normal float32:
    :func:`jaxrope.numbers.check_float32_positive`'s twin (``x`` already is the float32
    the kernels read, so a value past the range is inf)."""
    if enabled():
        _fail_at(name, x, ~(jnp.isfinite(x) & (x >= FLOAT32_TINY)),
                 "must be finite and > 0 (a normal float32)")


def rows(name: str, x: jax.Array, capacity: int, pad: int, *, distinct: bool = False) -> None:
    """Traced rows on the table (``[0, capacity)``) or ``pad``; ``distinct``: each live
    row once. :func:`jaxrope.positions._rows`'s twin."""
    if not enabled():
        return
    bad = _outside(x, 0, capacity - 1) & ~_equals(x, pad)
    _fail_at(name, x, bad, f"is no row of the table (rows [0, {capacity}), or PAD={pad} "
             "for padding)")
    if distinct:
        _fail_at(name, x, _repeats(x, ~_equals(x, pad)), "repeats a row (one entry per stream)")


def _repeats(x: jax.Array, counted: jax.Array) -> jax.Array:
    """Entries of 1-D ``x`` equal to an earlier counted entry (in sorted order)."""
    if x.shape[0] < 2:
        return jnp.zeros(x.shape, bool)
    order = jnp.argsort(x, stable=True)
    ordered, counted = x[order], counted[order]
    again = (ordered[1:] == ordered[:-1]) & counted[1:]
    return jnp.zeros(x.shape, bool).at[order[1:]].set(again)


def slots(x: jax.Array, num_slots: int) -> None:
    """Traced KV slots below ``num_slots`` or negative, none twice (at their own width):
    :func:`jaxrope.ops.rope_append_kv.api._slots`' twin."""
    if not enabled() or not x.size:
        return
    _fail_at("slots", x, _outside(x, None, num_slots - 1),
             f"must be < {num_slots} (pages * page_size) or negative (skipped)")
    _fail_at("slots", x, _repeats(x, x >= 0),
             "repeats a slot (which write would win is undefined)")


def _split(x: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Non-negative int32 ``x`` as its high and low 16 bits."""
    return x >> 16, x & 0xFFFF


def _sum_over(high: jax.Array, low: jax.Array, limit) -> jax.Array:
    """Whether ``high * 2**16 + low`` (sums of :func:`_split` halves, each below 2**31)
    exceeds ``limit`` (in ``[0, 2**31)``), decided without forming it."""
    high = high + (low >> 16)
    limit_high, limit_low = _split(jnp.asarray(limit, jnp.int32))
    return (high > limit_high) | ((high == limit_high) & ((low & 0xFFFF) > limit_low))


def no_overflow(name: str, counters: jax.Array, x_rows: jax.Array, amounts: jax.Array) -> None:
    """Traced counters plus ``amounts`` summed per row stay within int32.

    Summed in two 16-bit halves so that no partial sum wraps (exact for fewer than
    2**15 views); a negative amount, reported by its own check, counts as 0. The twin of
    :func:`jaxrope.positions._no_overflow`.
    """
    if not enabled() or not amounts.size:
        return
    add = functools.partial(jnp.zeros_like(counters).at[x_rows].add, mode="drop",
                            wrap_negative_indices=False)
    high, low = _split(jnp.maximum(amounts, 0))
    over = _sum_over(add(high), add(low), _INT32_MAX - jnp.maximum(counters, 0))
    row = jnp.argmax(over)
    checkify.check(~jnp.any(over), f"{name} would carry row {{}} from {{}} past the int32 "
                   f"counters' {_INT32_MAX}", row, counters[row])


def _sum_outside(a: jax.Array, b: jax.Array) -> jax.Array:
    """Whether ``a + b`` (int32) lies outside ``[0, 2**31 - 1]``, decided without forming
    a sum that wraps."""
    return (a < 0) | jnp.where(b > 0, a > _INT32_MAX - b, a + b < 0)


def planned(name: str, counters: jax.Array, deltas: Optional[jax.Array],
            offsets: Optional[jax.Array], live: jax.Array) -> None:
    """Each live token's position ``counter (+ delta) (+ offset)`` in ``[0, 2**31)``.

    ``counters``, ``deltas``, ``offsets``: int32 ``[N]``, each token's stream's counter
    and delta and its offset from the counter (index in the view, or depth)."""
    if not enabled() or not counters.size:
        return
    zero = jnp.zeros_like(counters)
    deltas = zero if deltas is None else deltas
    offsets = zero if offsets is None else offsets
    bad = _sum_outside(counters, deltas)
    bad = bad | _sum_outside(counters + jnp.where(bad, 0, deltas), offsets)
    bad = bad & live
    token = jnp.argmax(bad)
    checkify.check(~jnp.any(bad), f"{name}[{{}}]: counter {{}} + delta {{}} + {{}} plans a "
                   f"position outside [0, {_INT32_MAX}]", token, counters[token],
                   deltas[token], offsets[token])


def refuse(name: str, x: jax.Array, bad: jax.Array, expected: str) -> None:
    """Traced ``x`` has no entry where ``bad`` is set (``expected`` says what it must be)."""
    if enabled():
        _fail_at(name, x, bad, expected)


def require(ok: jax.Array, message: str, *values) -> None:
    """A traced condition ``ok`` (bool scalar); ``message`` formats ``values``."""
    if enabled():
        checkify.check(ok, message, *values)


def plan_counts(x_rows: jax.Array, counts: jax.Array, tokens: int, pad: int) -> None:
    """Traced ``counts`` of :func:`jaxrope.positions.plan`: ``sum(counts) <= tokens``
    (``out``'s length), and a ``pad`` view has none."""
    if not enabled() or not counts.size:
        return
    high, low = _split(jnp.maximum(counts, 0))  # running sums that never wrap
    _fail_at("counts", counts, _sum_over(jnp.cumsum(high), jnp.cumsum(low), tokens),
             f"ends past out's {tokens} tokens (out.shape[-1]): sum(counts) must be <= {tokens}")
    _fail_at("counts", counts, _equals(x_rows, pad) & (counts > 0),
             "is a PAD view's count: a padding view has 0 tokens")


def last_epoch(x_rows: jax.Array, moved: jax.Array, epochs: jax.Array, last: int) -> None:
    """No stream :func:`jaxrope.positions.rollback` moves back is at the ``last`` epoch."""
    if not enabled():
        return
    _fail_at("rows", x_rows, moved & (epochs >= last),
             f"is rolled back at publish epoch {last}, the last: epochs are int32, "
             f"in [0, {last}]")
