"""QK-norm through the torch bridge: ``RopeManager.apply_qk_and_append_kv(...,
q_norm_weight=, k_norm_weight=, qk_norm=)`` on CPU.

A launcher that does not declare the norm (``accepts``) never sees a normalised call, nor
does a bound launch: the JAX path serves it, and its result is the core's
(:func:`jaxrope.apply_rope_and_append_kv` with the same norm). A launcher that declares
``norm`` and ``q_out`` (the CUDA ones) gets them, with the q scale third. Bad norm
arguments are refused before anything is written or the plan moves on.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext  # noqa: E402
from torch_bridge import kv_append  # noqa: E402

D, HQ, HK, TOKENS, PAGES, PAGE_SIZE = 32, 4, 2, 5, 4, 8
CFG = jr.RopeConfig(head_dim=D, theta=1e6)


class _Launcher:
    """Records every launch and bound launch; does the work through the JAX path."""

    def __init__(self):
        self.calls, self.bound_calls = 0, 0
        self._jax = kv_append.JaxAppend(torch.device("cpu"), "xla")

    def rotate_(self, q, k, pos_ids, cfg):
        raise jr.BackendUnavailable("rope alone is not what this test launches")

    def rotate_and_append_kv_(self, q, k, v, pos_ids, caches, slots, cfg, geometry, scales):
        self.calls += 1
        self._jax(q, k, v, caches, geometry, pos_ids, slots, cfg, scales)

    def bind(self, q, k, v, caches, slots, cfg, geometry, scales):
        def run(q, k, v, pos_ids, kv_cache, slots):
            self.bound_calls += 1
            self._jax(q, k, v, tuple(kv_cache), geometry, pos_ids, slots, cfg, scales)
            return True
        return run


def _manager(launcher=None):
    mgr = RopeManager(PositionConfig(rope=CFG), "cpu", launcher="jax")
    mgr.kv_launcher = launcher
    mgr.ingest_request("r")
    return mgr


def _plan(mgr):
    step, ctx = PositionStep([Segment("r", "text", TOKENS)]), StepContext(("r",))
    mgr.plan(step, ctx)
    return step, ctx


def _inputs(rng):
    q = torch.from_numpy(rng.standard_normal((TOKENS, HQ, D)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((TOKENS, HK, D)).astype(np.float32))
            for _ in "kv")
    cache = tuple(torch.zeros(PAGES, PAGE_SIZE, HK, D) for _ in "kv")
    slots = torch.from_numpy(rng.permutation(PAGES * PAGE_SIZE)[:TOKENS].astype(np.int64))
    return q, k, v, cache, slots


def _core(q, k, v, cache, slots, **norm):
    jnorm = {name: (jnp.asarray(w.detach().numpy()) if isinstance(w, torch.Tensor) else w)
             for name, w in norm.items()}
    out_q, kv = jr.apply_rope_and_append_kv(
        jnp.asarray(q.numpy()), jnp.asarray(k.numpy()), jnp.asarray(v.numpy()),
        jnp.arange(TOKENS), tuple(jnp.asarray(c.numpy()) for c in cache),
        jnp.asarray(slots.numpy()), CFG, backend="xla", **jnorm)
    return np.asarray(out_q), [np.asarray(c) for c in kv]


@pytest.mark.parametrize("qk_norm", [jr.QKNorm(eps=1e-6), jr.QKNorm(eps=1e-6, convention="gemma"),
                                     jr.QKNorm(eps=1e-5, per_head=False)],
                         ids=["qwen3", "gemma3", "olmo2"])
def test_a_normalised_call_skips_the_launchers_and_matches_the_core(qk_norm, rng):
    launcher = _Launcher()
    mgr = _manager(launcher)
    q, k, v, cache, slots = _inputs(rng)
    # A first call without a norm is launched and bound for this signature.
    step, ctx = _plan(mgr)
    mgr.apply_qk_and_append_kv(q.clone(), k, v, "text", tuple(c.clone() for c in cache), slots)
    mgr.commit(step, ctx)
    mgr.remove_request("r")
    mgr.ingest_request("r")
    weights = [torch.nn.Parameter(torch.from_numpy(
        (0.5 * rng.standard_normal(qk_norm.weight_length(h, D))).astype(np.float32)))
        for h in (HQ, HK)]
    norm = dict(q_norm_weight=weights[0], k_norm_weight=weights[1], qk_norm=qk_norm)
    step, ctx = _plan(mgr)
    got_q, got_cache = q.clone(), tuple(c.clone() for c in cache)
    mgr.apply_qk_and_append_kv(got_q, k, v, "text", got_cache, slots, **norm)
    mgr.commit(step, ctx)
    assert (launcher.calls, launcher.bound_calls) == (1, 0)
    want_q, want_cache = _core(q, k, v, cache, slots, **norm)
    np.testing.assert_allclose(got_q.numpy(), want_q, rtol=1e-6, atol=1e-6)
    for got, want in zip(got_cache, want_cache):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    plain_q, _ = _core(q, k, v, cache, slots)
    assert not np.allclose(want_q, plain_q, atol=1e-3)


class _Accepting(_Launcher):
    """A launcher that takes the norm and an fp8 q output, as the CUDA launchers do."""

    accepts = frozenset({"norm", "q_out"})

    def __init__(self):
        super().__init__()
        self.seen = []

    def rotate_and_append_kv_(self, q, k, v, pos_ids, caches, slots, cfg, geometry, scales, *,
                              norm=None, q_out=None):
        self.calls += 1
        self.seen.append((norm is not None, q_out is not None, len(scales)))
        self._jax(q, k, v, caches, geometry, pos_ids, slots, cfg, scales[:2], norm=norm,
                  q_out=q_out, q_scale=scales[2] if q_out is not None else 1.0)


def test_a_launcher_that_accepts_the_norm_and_q_out_gets_them(rng):
    launcher = _Accepting()
    mgr = _manager(launcher)
    q, k, v, cache, slots = _inputs(rng)
    weights = [torch.from_numpy((0.5 * rng.standard_normal(D)).astype(np.float32))
               for _ in "qk"]
    norm = dict(q_norm_weight=weights[0], k_norm_weight=weights[1], qk_norm=jr.QKNorm())
    q_out = torch.zeros(TOKENS, HQ, D, dtype=torch.float8_e4m3fn)
    step, ctx = _plan(mgr)
    got_q, got_cache = q.clone(), tuple(c.clone() for c in cache)
    mgr.apply_qk_and_append_kv(got_q, k, v, "text", got_cache, slots, q_out=q_out,
                               q_quant_scale=2.0, **norm)
    mgr.commit(step, ctx)
    assert launcher.seen == [(True, True, 3)] and launcher.bound_calls == 0
    torch.testing.assert_close(got_q, q, rtol=0, atol=0)   # q only read
    want_q, want_cache = _core(q, k, v, cache, slots, q_dtype=jnp.float8_e4m3fn,
                               q_quant_scale=2.0, **norm)
    np.testing.assert_array_equal(q_out.view(torch.uint8).numpy(), want_q.view(np.uint8))
    for got, want in zip(got_cache, want_cache):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


W = torch.ones(D)
BAD = {
    "length": (dict(q_norm_weight=torch.ones(D + 1), qk_norm=jr.QKNorm()), ValueError,
               r"q_norm_weight.shape=\(33,\) must be \(32,\)"),
    "dtype": (dict(k_norm_weight=torch.ones(D, dtype=torch.int32), qk_norm=jr.QKNorm()),
              ValueError, "k_norm_weight.dtype=torch.int32"),
    "type": (dict(k_norm_weight=np.ones(D, np.float32), qk_norm=jr.QKNorm()), TypeError,
             "k_norm_weight must be a torch.Tensor"),
    "no-qk-norm": (dict(q_norm_weight=W), ValueError, "qk_norm=None"),
    "qk-norm-alone": (dict(qk_norm=jr.QKNorm()), ValueError, "without q_norm_weight"),
    "qk-norm-type": (dict(q_norm_weight=W, qk_norm="gemma"), TypeError, "jaxrope.QKNorm"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_norm_arguments_are_refused_before_anything_is_written(name, rng):
    kwargs, error, message = BAD[name]
    mgr = _manager()
    q, k, v, cache, slots = _inputs(rng)
    step, ctx = _plan(mgr)
    q0, cache0 = q.clone(), tuple(c.clone() for c in cache)
    with pytest.raises(error, match=message):
        mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots, **kwargs)
    assert torch.equal(q, q0) and all(map(torch.equal, cache, cache0))
    # The plan is still staged: the same call without the bad norm goes through.
    mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots)
    mgr.commit(step, ctx)
    want_q, _ = _core(q0, k, v, cache0, slots)
    np.testing.assert_allclose(q.numpy(), want_q, rtol=1e-6, atol=1e-6)
