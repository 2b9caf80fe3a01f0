"""Checked mode (``jaxrope.checked``): every out-of-range value of a jitted step raises,
naming it; good values give the unchecked step's results bit for bit; the default path
lowers as if the checks did not exist."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope import checks, positions
from jaxrope import speculative_positions as speculative
from jaxrope.positions import PAD, PositionTable

CFG = jr.RopeConfig(head_dim=64, max_position=4096)
VL = jr.RopeConfig(head_dim=64, max_position=4096, mrope_section=(8, 12, 12))
TOP = 2 ** 31 - 1


def _qk(tokens=4):
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((tokens, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((tokens, 2, 64)), jnp.float32)
    return q, k


def _cache(pages=2):
    return tuple(jnp.zeros((pages, 16, 2, 64), jnp.float32) for _ in "kv")


def _i32(*values):
    return jnp.asarray(values, jnp.int32)


def _rope(pos, cfg=CFG, backend="xla"):
    q, k = _qk(pos.shape[-1])
    return lambda p: jr.apply_rope(q, k, p, cfg, backend=backend), (pos,)


def _append(pos, slots, backend="xla"):
    q, k = _qk(pos.shape[-1])

    def step(p, s, cache):
        return jr.apply_rope_and_append_kv(q, k, k, p, cache, s, CFG, backend=backend)
    return step, (pos, slots, _cache())


def _fp8_append(backend="xla", **scales):
    # Traced fp8 scales (the keys of ``scales``) on an fp8 cache with an fp8 q.
    q, k = _qk()
    cache = tuple(jnp.zeros((2, 16, 2, 64), jnp.float8_e4m3fn) for _ in "kv")

    def step(values):
        return jr.apply_rope_and_append_kv(q, k, k, _i32(0, 1, 2, 3), cache, _i32(0, 1, 2, 3),
                                           CFG, q_dtype=jnp.float8_e4m3fn, backend=backend,
                                           **values)
    return step, ({name: jnp.float32(value) for name, value in scales.items()},)


def _mla_fp8(**scales):
    # Traced fp8 scales of the MLA op, q_pe and the one-buffer cache in fp8.
    rng = np.random.default_rng(11)
    q_pe = jnp.asarray(rng.standard_normal((4, 4, 64)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    ckv = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    cache = jnp.zeros((2, 16, 32 + 64), jnp.float8_e4m3fn)

    def step(values):
        return jr.apply_mla_rope_and_append(q_pe, k_pe, ckv, _i32(0, 1, 2, 3), cache,
                                            _i32(0, 1, 2, 3), CFG, q_dtype=jnp.float8_e4m3fn,
                                            **values)
    return step, ({name: jnp.float32(value) for name, value in scales.items()},)


def _table(*counters, deltas=None, epochs=None):
    as_array = lambda v: None if v is None else _i32(*v)  # noqa: E731
    return PositionTable(_i32(*counters), as_array(deltas), as_array(epochs))


T4 = _table(3, 0, 5, 9)
OUT4 = jnp.zeros((4,), jnp.int32)

# (what is bad, step, traced arguments, the message's start)
BAD = [
    ("position past max_position", *_rope(_i32(0, 1, 4096, 3)),
     "pos_ids[2]=4096 must lie in [0, 4095]"),
    ("negative position", *_rope(_i32(0, -5, 1, 2)), "pos_ids[1]=-5 must lie in [0, 4095]"),
    ("M-RoPE position, row h", *_rope(jnp.zeros((3, 4), jnp.int32).at[1, 3].set(5000), VL),
     "pos_ids[1, 3]=5000 must lie in [0, 4095]"),
    ("position in the interpreted kernel", *_rope(_i32(0, 1, 2, 4100), backend="interpret"),
     "pos_ids[3]=4100"),
    ("fused append position", *_append(_i32(0, 9999, 1, 2), _i32(0, 1, 2, 3)),
     "pos_ids[1]=9999"),
    ("slot past the cache", *_append(_i32(0, 1, 2, 3), _i32(0, 32, -1, 3)),
     "slots[1]=32 must be < 32 (pages * page_size) or negative"),
    ("slot twice", *_append(_i32(0, 1, 2, 3), _i32(5, 7, -1, 5)), "slots[3]=5 repeats a slot"),
    ("slot past the cache, interpreted kernel",
     *_append(_i32(0, 1, 2, 3), _i32(0, 1, 2, 40), backend="interpret"), "slots[3]=40"),
    ("fp8 k scale below 0", *_fp8_append(k_quant_scale=-1.0),
     "k_quant_scale=-1.0 must be finite and > 0 (a normal float32)"),
    ("fp8 q scale NaN", *_fp8_append(q_quant_scale=np.nan), "q_quant_scale=nan must be finite"),
    ("fp8 v scale 0 as a float32", *_fp8_append(v_quant_scale=1e-46), "v_quant_scale=0.0"),
    ("fp8 scale, interpreted kernel", *_fp8_append("interpret", k_quant_scale=np.inf),
     "k_quant_scale=inf"),
    ("MLA kv scale 0", *_mla_fp8(kv_quant_scale=0.0), "kv_quant_scale=0.0 must be finite"),
    ("MLA q scale below 0", *_mla_fp8(q_quant_scale=-2.0), "q_quant_scale=-2.0"),
    ("plan: row off the table",
     lambda r, c: positions.plan(T4, r, c, OUT4), (_i32(0, 4), _i32(1, 1)),
     "rows[1]=4 is no row of the table (rows [0, 4), or PAD="),
    ("plan: negative row", lambda r: positions.read(T4, r), (_i32(-1, 0),), "rows[0]=-1"),
    ("plan: negative count", lambda c: positions.plan(T4, _i32(0, 1), c, OUT4),
     (_i32(2, -1),), "counts[1]=-1 must lie in [0, 2147483647]"),
    ("plan: more tokens than out", lambda c: positions.plan(T4, _i32(0, 1), c, OUT4),
     (_i32(3, 2),), "counts[1]=2 ends past out's 4 tokens"),
    ("plan: a PAD view with tokens", lambda c: positions.plan(T4, _i32(0, PAD), c, OUT4),
     (_i32(1, 1),), "counts[1]=1 is a PAD view's count"),
    ("plan: counter + count past int32", lambda t: positions.plan(t, _i32(0), _i32(3), OUT4),
     (_table(TOP - 1),), "out[2]: counter 2147483646 + delta 0 + 2 plans a position outside"),
    ("plan: M-RoPE counter + delta below 0",
     lambda t: positions.plan(t, _i32(0), _i32(1), jnp.zeros((3, 4), jnp.int32)),
     (_table(2, deltas=[-3]),), "out[0]: counter 2 + delta -3 + 0"),
    ("plan: M-RoPE counter + delta past int32",
     lambda t: positions.plan(t, _i32(0), _i32(1), jnp.zeros((3, 4), jnp.int32)),
     (_table(TOP, deltas=[1]),), "out[0]: counter 2147483647 + delta 1"),
    ("plan: depths past int32",
     lambda d: positions.plan(_table(TOP - 2), _i32(0), _i32(2), OUT4, depths=d),
     (_i32(0, 5, 0, 0),), "out[1]: counter 2147483645 + delta 0 + 5"),
    ("commit: counter + count past int32", lambda t: positions.commit(t, _i32(0, 0), _i32(1, 1)),
     (_table(TOP - 1),), "counts would carry row 0 from 2147483646 past the int32"),
    ("commit: two big counts of one row",
     lambda c: positions.commit(_table(0), _i32(0, 0, 0), c), (_i32(TOP, TOP, TOP),),
     "counts would carry row 0 from 0"),
    ("commit: block_step 0",
     lambda b: positions.commit(T4, _i32(0), _i32(1), scheme="block", block_step=b),
     (jnp.int32(0),), "block_step=0 must lie in [1, 2147483647]"),
    ("advance: negative amount", lambda a: positions.advance(T4, _i32(0), a), (_i32(-2),),
     "amounts[0]=-2"),
    ("advance: past int32", lambda t: positions.advance(t, _i32(0), _i32(1)), (_table(TOP),),
     "amounts would carry row 0 from 2147483647"),
    ("fork: destination off the table", lambda d: positions.fork(T4, _i32(0), d), (_i32(9),),
     "dst_rows[0]=9 is no row"),
    ("fork: source off the table", lambda s: positions.fork(T4, s, _i32(1)), (_i32(4),),
     "src_rows[0]=4 is no row"),
    ("raise_to: negative position", lambda p: positions.raise_to(T4, _i32(0), p), (_i32(-1),),
     "positions[0]=-1"),
    ("admit: a row twice",
     lambda r: positions.admit(T4, r, _i32(1, 2), _i32(0, 0), _i32(0, 0)), (_i32(1, 1),),
     "rows[1]=1 repeats a row (one entry per stream)"),
    ("admit: negative epoch",
     lambda e: positions.admit(T4, _i32(0, 1), _i32(1, 2), _i32(0, 0), e), (_i32(0, -1),),
     "epochs[1]=-1"),
    ("set_deltas: row off the table", lambda r: positions.set_deltas(T4, r, _i32(-3)),
     (_i32(6),), "rows[0]=6 is no row"),
    ("rollback: a row twice", lambda r: positions.rollback(T4, r, _i32(0, 0)), (_i32(2, 2),),
     "rows[1]=2 repeats a row"),
    ("rollback: at the last epoch", lambda t: positions.rollback(t, _i32(0), _i32(1)),
     (_table(5, epochs=[TOP]),), "rows[0]=0 is rolled back at publish epoch 2147483647"),
    ("reset: row off the table", lambda r: positions.reset(T4, r), (_i32(0, 4),), "rows[1]=4"),
    ("plan_chain: negative drafts", lambda d: speculative.plan_chain(T4, _i32(0), d, OUT4),
     (_i32(-1),), "drafts[0]=-1 must lie in [0, 2147483646]"),
    ("plan_chain: drafts + 1 past int32",
     lambda d: speculative.plan_chain(T4, _i32(0), d, OUT4), (_i32(TOP),), "drafts[0]=2147483647"),
    ("plan_tree: not a tree",
     lambda d: speculative.plan_tree(T4, _i32(0, 1), _i32(2, 2), d, OUT4),
     (_i32(0, 1, 0, 2),), "the depths of view 1 are not a draft tree"),
    ("tree_depths: a parent after its child", speculative.tree_depths, (_i32(-1, 2, 0),),
     "parents[1]=2 must be -1 (a root) or an earlier token"),
    ("accept: negative accepted", lambda a: speculative.accept(T4, _i32(0), a), (_i32(-3),),
     "accepted[0]=-3"),
    ("accept: past int32", lambda t: speculative.accept(t, _i32(0), _i32(5)), (_table(TOP - 3),),
     "amounts would carry row 0"),
    ("plan_draft: counter + step past int32",
     lambda s: speculative.plan_draft(_table(TOP - 1), _i32(0), _i32(1), OUT4, step=s,
                                      max_seq_len=4096), (jnp.int32(3),),
     "out[0]: counter 2147483646 + delta 0 + 2"),
]


@pytest.mark.parametrize("what, step, args, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_under_jit_raises_naming_it_when_checked(what, step, args, message):
    jax.jit(step)(*args)  # unchecked: silent, as documented
    with pytest.raises(ValueError, match=re.escape(message)):
        jr.checked(step)(*args)


GOOD = [
    ("apply_rope", *_rope(_i32(0, 7, 4095, 3))),
    ("apply_rope interpreted", *_rope(_i32(0, 7, 4095, 3), backend="interpret")),
    ("apply_rope M-RoPE", *_rope(jnp.arange(12, dtype=jnp.int32).reshape(3, 4), VL)),
    ("fused append", *_append(_i32(0, 1, 4095, 3), _i32(31, -1, 0, 17))),
    ("fused append interpreted",
     *_append(_i32(0, 1, 4095, 3), _i32(31, -1, 0, 17), backend="interpret")),
    ("fused append, fp8 scales", *_fp8_append(k_quant_scale=0.5, v_quant_scale=2.0,
                                               q_quant_scale=1.5)),
    ("MLA, fp8 scales", *_mla_fp8(q_quant_scale=0.25, kv_quant_scale=3.0)),
    ("plan and commit", lambda t, r, c: (positions.plan(t, r, c, OUT4), positions.commit(t, r, c)),
     (T4, _i32(2, PAD, 0), _i32(3, 0, 1))),
    ("M-RoPE plan", lambda t: positions.plan(t, _i32(1), _i32(2), jnp.zeros((3, 4), jnp.int32)),
     (_table(0, 9, deltas=[0, -4]),)),
    ("admit and rollback", lambda t: positions.rollback(
        positions.admit(t, _i32(0, 1), _i32(4, 2), _i32(0, 0), _i32(1, 0)), _i32(1, 2), _i32(0, 1)),
     (T4,)),
    ("speculative", lambda t: (speculative.plan_chain(t, _i32(1, PAD), _i32(2, 0), OUT4),
                               speculative.plan_tree(t, _i32(3), _i32(3), _i32(0, 1, 1, 0), OUT4),
                               speculative.accept(t, _i32(0), _i32(2)),
                               speculative.plan_draft(t, _i32(0, 3), _i32(1, 1), OUT4, step=2,
                                                      max_seq_len=10)), (T4,)),
]


@pytest.mark.parametrize("what, step, args", GOOD, ids=[g[0] for g in GOOD])
def test_good_values_give_the_unchecked_results_bit_for_bit(what, step, args):
    plain = jax.jit(step)(*args)
    with_checks = jr.checked(step)(*args)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(with_checks), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), what


def test_checked_takes_jit_keywords_and_donates():
    q, k = _qk()
    step = jr.checked(jr.apply_rope_and_append_kv, static_argnames=("cfg", "backend"),
                      donate_argnums=(0, 4))
    cache = _cache()
    out_q, (k_cache, v_cache) = step(q, k, k, _i32(0, 1, 2, 3), cache, _i32(0, 1, 2, 3),
                                     cfg=CFG, backend="xla")
    assert cache[0].is_deleted() and q.is_deleted()  # donated, as under plain jit
    assert float(jnp.abs(k_cache[0, :4]).sum()) > 0 and out_q.shape == (4, 4, 64)
    q, k = _qk()
    with pytest.raises(ValueError, match=r"slots\[0\]=99"):
        step(q, k, k, _i32(0, 1, 2, 3), _cache(), _i32(99, 1, 2, 3), cfg=CFG)


def test_a_step_jitted_before_is_traced_again_with_the_checks():
    # The switch is part of every jit cache key: an unchecked trace never serves it.
    step = jax.jit(lambda p: positions.read(T4, p))
    assert step(_i32(7)).tolist() == [0]  # row 7 acts as PAD, silently
    with pytest.raises(ValueError, match=r"rows\[0\]=7 is no row"):
        jr.checked(step)(_i32(7))
    assert step(_i32(7)).tolist() == [0] and not checks.enabled()


def test_checkified_returns_the_error_for_a_caller_that_jits_it():
    step = jax.jit(checks.checkified(lambda p: positions.read(T4, p)))
    error, out = step(_i32(1, 2))
    assert error.get() is None and out.tolist() == [0, 5]
    error, _ = step(_i32(1, 12))
    assert error.get().startswith("rows[1]=12 is no row")
    with pytest.raises(TypeError, match="fn must be callable"):
        checks.checkified("step")


def _lowered(step, args) -> str:
    return jax.jit(step).lower(*args).as_text()


LOWERED = [g for g in GOOD if g[0] in {"apply_rope", "fused append", "fused append, fp8 scales",
                                       "MLA, fp8 scales", "plan and commit", "M-RoPE plan",
                                       "speculative"}]


@pytest.mark.parametrize("what, step, args", LOWERED, ids=[g[0] for g in LOWERED])
def test_the_default_path_lowers_as_if_the_checks_did_not_exist(what, step, args, monkeypatch):
    default, default_jaxpr = _lowered(step, args), str(jax.make_jaxpr(step)(*args))
    on = jax.jit(checks.checkified(step)).lower(*args).as_text()
    assert on != default  # the checks do lower into the step when on
    # Every hook replaced by nothing: the call sites as they were before checked mode.
    monkeypatch.setattr(checks, "enabled", lambda: False)
    for hook in ("in_range", "rows", "slots", "no_overflow", "planned", "plan_counts",
                 "last_epoch", "refuse", "require"):
        monkeypatch.setattr(checks, hook, lambda *a, **k: None)
    monkeypatch.setattr(checks.checkify, "check", lambda *a, **k: pytest.fail("a check emitted"))
    assert _lowered(step, args) == default
    assert str(jax.make_jaxpr(step)(*args)) == default_jaxpr
    assert "check" not in default_jaxpr and "callback" not in default


def test_wide_values_are_compared_at_their_own_width_before_the_int32_cast():
    # int64 under jax_enable_x64: cast to int32, 2**32 + 1 would read as 1 (in range).
    with jax.enable_x64(True):
        wide = jnp.asarray([0, 2 ** 32 + 1, 2, 3], jnp.int64)
        for step, args, message in (
                (*_rope(wide), "pos_ids[1]=4294967297 must lie in [0, 4095]"),
                (*_append(_i32(0, 1, 2, 3), wide), "slots[1]=4294967297 must be < 32"),
                (lambda c: positions.commit(T4, _i32(0, 1, 2, 3), c), (wide,),
                 "counts[1]=4294967297 must lie in [0, 2147483647]")):
            with pytest.raises(ValueError, match=re.escape(message)):
                jr.checked(step)(*args)


def test_narrow_rows_and_slots_are_checked_where_their_dtype_reaches():
    # PAD does not fit int8: no int8 row is PAD, and every int8 slot is below 1000 slots.
    with pytest.raises(ValueError, match=re.escape("rows[1]=-3 is no row")):
        jr.checked(lambda r: positions.read(T4, r))(jnp.asarray([1, -3], jnp.int8))
    step, (pos, _, cache) = _append(_i32(0, 1, 2, 3), _i32(0, 1, 2, 3))
    narrow = jnp.asarray([0, 1, 127, -1], jnp.int8)
    with pytest.raises(ValueError, match=re.escape("slots[2]=127 must be < 32")):
        jr.checked(step)(pos, narrow, cache)
    big = tuple(jnp.zeros((64, 16, 2, 64), jnp.float32) for _ in "kv")  # 1024 slots
    jr.checked(step)(pos, narrow, big)
