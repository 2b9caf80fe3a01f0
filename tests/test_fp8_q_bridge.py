"""fp8 q through the torch bridge on CPU: ``RopeManager.apply_qk_and_append_kv(...,
q_out=, q_quant_scale=)``, the custom ops, and ``torch.compile``.

The launchers have no fp8 q: such a call never reaches a launcher nor a bound launch and
takes the JAX path, whose fp8 q is the core's (:func:`jaxrope.apply_rope_and_append_kv`
with ``q_dtype=float8_e4m3fn``) within an e4m3 ulp, q itself unchanged. Bad ``q_out`` /
``q_quant_scale`` are refused naming them before anything is written or the plan moves
on (the catalogue's cases, tests/test_bad_inputs_kv_append.py); the ops refuse them as the
method does, and a compiled step writes what eager does.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from bad_input_harness import CURRENT_POSITIONS, busy_manager  # noqa: E402
from jaxrope.testing import kv_oracle, oracle  # noqa: E402
from test_bad_inputs_kv_append import KvCall  # noqa: E402
from test_qk_norm_bridge import CFG, HQ, TOKENS, _Launcher, _inputs, _manager, _plan  # noqa: E402
from torch_bridge import custom_ops  # noqa: E402
from torch_bridge.op_arguments import APPEND_OPTIONS_OFF  # noqa: E402

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy() if t.dtype == FP8 else kv_oracle.bits(t.numpy())


def _core_fp8_q(q, k, v, cache, slots, scale) -> np.ndarray:
    q8, _ = jr.apply_rope_and_append_kv(
        jnp.asarray(q.reshape(TOKENS, HQ, -1).numpy()), jnp.asarray(k.numpy()),
        jnp.asarray(v.numpy()), jnp.arange(TOKENS), tuple(jnp.asarray(c.numpy()) for c in cache),
        jnp.asarray(slots.numpy()), CFG, q_dtype=jnp.float8_e4m3fn, q_quant_scale=scale,
        backend="xla")
    return np.asarray(q8)


@pytest.mark.parametrize("flat", [False, True], ids=["q [T, Hq, D]", "q [T, Hq * D]"])
def test_an_fp8_q_call_skips_the_launchers_and_matches_the_core(flat, rng):
    launcher = _Launcher()
    mgr = _manager(launcher)
    q, k, v, cache, slots = _inputs(rng)
    if flat:
        q = q.reshape(TOKENS, -1)
    # A first call without fp8 q is launched and bound for this signature.
    step, ctx = _plan(mgr)
    plain_cache = tuple(c.clone() for c in cache)
    mgr.apply_qk_and_append_kv(q.clone(), k, v, "text", plain_cache, slots)
    mgr.commit(step, ctx)
    mgr.remove_request("r")
    mgr.ingest_request("r")
    step, ctx = _plan(mgr)
    q0, got_cache = q.clone(), tuple(c.clone() for c in cache)
    q_out = torch.full(q.shape, 7.0, dtype=FP8)
    returned, kv = mgr.apply_qk_and_append_kv(q, k, v, "text", got_cache, slots, q_out=q_out,
                                              q_quant_scale=24.0)
    mgr.commit(step, ctx)
    assert (launcher.calls, launcher.bound_calls) == (1, 0)
    assert returned is q_out and kv is got_cache
    np.testing.assert_array_equal(_bits(q), _bits(q0), err_msg="q changed")
    got = q_out.view(TOKENS, HQ, -1).view(torch.uint8).numpy().view(kv_oracle.E4M3)
    assert kv_oracle.ulps(got, _core_fp8_q(q0, k, v, cache, slots, 24.0)).max() <= 1
    want = kv_oracle.e4m3(oracle.rope_of(CFG, q0.view(TOKENS, HQ, -1).numpy(),
                                         np.arange(TOKENS)) * 24.0)
    assert kv_oracle.ulps(got, want).max() <= 1
    for a, b in zip(got_cache, plain_cache):  # the cache as the plain call writes it
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_rows_of_q_out_past_the_planned_tokens_are_left_as_they_are(rng):
    mgr = _manager()
    q, k, v, cache, slots = _inputs(rng)
    pad = 3  # an engine's padded batch: tokens past the plan's
    q, k, v = (torch.cat([x, torch.ones(pad, *x.shape[1:])]) for x in (q, k, v))
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=slots.dtype)])
    step, ctx = _plan(mgr)
    q_out = torch.full(q.shape, -2.0, dtype=FP8)
    mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots, q_out=q_out)
    mgr.commit(step, ctx)
    assert (q_out[TOKENS:].float() == -2.0).all()
    want = kv_oracle.e4m3(oracle.rope_of(CFG, q[:TOKENS].numpy(), np.arange(TOKENS)))
    got = q_out[:TOKENS].view(torch.uint8).numpy().view(kv_oracle.E4M3)
    assert kv_oracle.ulps(got, want).max() <= 1


def test_the_q_out_call_the_bad_input_cases_vary_is_valid():
    # tests/test_bad_inputs_kv_append.py varies this call's q_out and q_quant_scale.
    call = KvCall(busy_manager())
    q = call.args["q"].clone()
    returned, _ = call.run(q_out=call.q_out, q_quant_scale=2.0)
    assert returned is call.q_out and torch.equal(call.args["q"], q)
    want = kv_oracle.e4m3(oracle.rope_of(call.mgr.rope, q.numpy(), np.asarray(
        CURRENT_POSITIONS["cond"])) * 2.0)
    assert kv_oracle.ulps(call.q_out.view(torch.uint8).numpy().view(kv_oracle.E4M3),
                          want).max() <= 1


# -- the custom ops and torch.compile --------------------------------------------------------


def _planned(rng):
    mgr = _manager()
    q, k, v, cache, slots = _inputs(rng)
    return mgr, _plan(mgr), (q, k, v, cache, slots)


def test_the_explicit_op_writes_the_fp8_q_the_manager_writes(rng):
    mgr, step, (q, k, v, cache, slots) = _planned(rng)
    q0, cache2 = q.clone(), tuple(c.clone() for c in cache)
    outs = [torch.zeros(q.shape, dtype=FP8) for _ in range(2)]
    mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots, q_out=outs[0], q_quant_scale=0.5)
    custom_ops.rope_append_kv_(q, k, v, mgr.pos_ids("text"), cache2, slots,
                               custom_ops.config_key(CFG), q_out=outs[1], q_quant_scale=0.5)
    np.testing.assert_array_equal(_bits(outs[0]), _bits(outs[1]))
    np.testing.assert_array_equal(_bits(q), _bits(q0))
    for a, b in zip(cache, cache2):
        np.testing.assert_array_equal(_bits(a), _bits(b))


BAD_OP = {"dtype": dict(q_out=torch.zeros(TOKENS, HQ, 32)),
          "scale without q_out": dict(q_quant_scale=4.0)}


@pytest.mark.parametrize("case", sorted(BAD_OP))
def test_the_ops_refuse_q_out_as_the_method(case, rng):
    mgr, _, (q, k, v, cache, slots) = _planned(rng)
    given = BAD_OP[case]
    refusals = []
    for call in (lambda: mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots, **given),
                 lambda: torch.ops.jaxrope.apply_qk_and_append_kv(
                     q, k, v, *cache, slots, mgr._op_key, "text", "NHD", None, None,
                     **{**APPEND_OPTIONS_OFF, **given}),
                 lambda: torch.ops.jaxrope.rope_append_kv_(
                     q, k, v, mgr.pos_ids("text"), *cache, slots, custom_ops.config_key(CFG),
                     "NHD", None, None, **{**APPEND_OPTIONS_OFF, **given})):
        before = [t.clone() for t in (q, *cache)]
        with pytest.raises(ValueError) as raised:
            call()
        assert all(torch.equal(a, b) for a, b in zip((q, *cache), before))
        refusals.append(str(raised.value).replace("q's device", "the manager's device"))
    assert refusals[0] == refusals[1] == refusals[2]


def test_a_compiled_step_with_q_out_is_one_graph_and_writes_what_eager_writes(rng):
    eager_mgr, eager_step, (q, k, v, cache, slots) = _planned(rng)
    compiled_mgr, compiled_step, _ = _planned(rng)

    def step(mgr, q, k, v, k_cache, v_cache, slots, q_out):
        q = q * 1  # a producer in the graph, as a projection would be
        q_out, _ = mgr.apply_qk_and_append_kv(q, k, v, "text", (k_cache, v_cache), slots,
                                              q_out=q_out, q_quant_scale=0.5)
        return q_out.float() * 2, k_cache.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    runs = []
    for mgr, stepped, fn in ((eager_mgr, eager_step, step),
                             (compiled_mgr, compiled_step, compiled)):
        args = [x.clone() for x in (q, k, v, *cache, slots)] + [torch.zeros(q.shape, dtype=FP8)]
        with torch.no_grad():
            out = fn(mgr, *args)
        mgr.commit(*stepped)
        runs.append((out, args))
    (want, eager_args), (got, compiled_args) = runs
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    for a, b in zip(eager_args, compiled_args):  # q unchanged in both; q_out and caches alike
        np.testing.assert_array_equal(_bits(a), _bits(b))
    np.testing.assert_array_equal(_bits(eager_args[0]), _bits(q))
