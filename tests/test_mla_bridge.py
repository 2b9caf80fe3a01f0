"""MLA through the torch bridge on CPU: ``RopeManager.apply_mla_and_append_kv``.

Its result is the core's (:func:`jaxrope.apply_mla_rope_and_append` at the planned
positions, up to the rounding of another fusion: the JAX path runs that op jitted); bad input is refused before anything
is written or the plan moves on; under ``torch.compile(fullgraph=True)`` the call is
the ``jaxrope::apply_mla_and_append_kv`` op with eager's result.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope.testing import kv_oracle  # noqa: E402
from jaxrope.testing.kv_oracle import bits  # noqa: E402
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext  # noqa: E402
from torch_bridge.dlpack import NotZeroCopyError, jax_dtype_name  # noqa: E402

R, H, L, N, PAGES, PAGE_SIZE = 16, 3, 32, 8, 4, 8
CFG = jr.RopeConfig(head_dim=R, interleave=True,
                    scaling=jr.Yarn(factor=40.0, original_max_position=4096, mscale=1.0),
                    max_position=163840)
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _seeded_torch(rng):
    torch.manual_seed(int(rng.integers(2 ** 31)))  # the rng fixture reports the seed


def _manager():
    mgr = RopeManager(PositionConfig(rope=CFG), "cpu", launcher="jax")
    mgr.ingest_request("r")
    return mgr


def _plan(mgr, tokens):
    step, ctx = PositionStep([Segment("r", "text", tokens)]), StepContext(("r",))
    mgr.plan(step, ctx)
    return step, ctx


def _inputs(tokens, dtype=torch.bfloat16, combined=True, cache_dtype=None, fp8_q=False):
    cache_dtype = cache_dtype or dtype
    widths = (L + R,) if combined else (L, R)
    caches = tuple(torch.randn(PAGES, PAGE_SIZE, w).to(cache_dtype) for w in widths)
    x = dict(q_pe=torch.randn(tokens, H, R, dtype=dtype), k_pe=torch.randn(tokens, R, dtype=dtype),
             ckv=torch.randn(tokens, L, dtype=dtype),
             mla_cache=caches[0] if combined else caches,
             slots=torch.randperm(PAGES * PAGE_SIZE)[:tokens])
    x["slots"][-1] = -1
    if fp8_q:
        x.update(q_nope=torch.randn(tokens, H, N, dtype=dtype),
                 q_pe_out=torch.zeros(tokens, H, R, dtype=FP8),
                 q_nope_out=torch.zeros(tokens, H, N, dtype=FP8))
    return x


def _jax(t):
    if t is None:
        return None
    if t.dtype in (torch.bfloat16, FP8):
        width = torch.int16 if t.dtype == torch.bfloat16 else torch.uint8
        return jnp.asarray(t.view(width).numpy().view(jnp.dtype(jax_dtype_name(t.dtype))))
    return jnp.asarray(t.numpy())


def _np(t):
    return np.asarray(_jax(t))


def _core(x, pos, scales):
    """The core op on copies of the call's inputs: numpy ``(q_pe, q_nope, cache leaves)``."""
    cache = x["mla_cache"]
    cache = _jax(cache) if isinstance(cache, torch.Tensor) else tuple(map(_jax, cache))
    fp8_q = "q_pe_out" in x
    q_pe, q_nope, cache = jr.apply_mla_rope_and_append(
        _jax(x["q_pe"]), _jax(x["k_pe"]), _jax(x["ckv"]), jnp.asarray(pos), cache,
        x["slots"].numpy(), CFG, q_nope=_jax(x.get("q_nope")),
        q_dtype=jnp.float8_e4m3fn if fp8_q else None, **scales)
    leaves = cache if isinstance(cache, tuple) else (cache,)
    return np.asarray(q_pe), None if q_nope is None else np.asarray(q_nope), leaves


def _same(got, want, label: str) -> None:
    """Equal up to rounding: the bridge's jitted call (a token bucket) and the eager core op
    may fuse the float32 rotation differently (an FMA), a float32 ulp of the row's scale,
    which can move an fp8 rounding by one step."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == jnp.float8_e4m3fn:
        assert kv_oracle.ulps(got, want).max(initial=0) <= 1, label
    else:
        assert kv_oracle.row_ulps(got, want).max(initial=0) <= 2, label


def _clone(x):
    return {k: (tuple(c.clone() for c in v) if isinstance(v, tuple) else v.clone())
            for k, v in x.items()}


CASES = {
    "one_buffer_bf16": dict(),
    "pair_fp8_cache_fp8_q": dict(combined=False, cache_dtype=FP8, fp8_q=True,
                                 scales=dict(q_quant_scale=0.5, kv_quant_scale=2.0)),
    "one_buffer_float32_fp8_q": dict(dtype=torch.float32, fp8_q=True, scales={}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_call_is_the_core_op_at_the_planned_positions(name):
    case = dict(CASES[name])
    scales = case.pop("scales", {})
    mgr = _manager()
    x = _inputs(5, **case)
    before = _clone(x)
    step, ctx = _plan(mgr, 5)
    pos = mgr.pos_ids("text").clone()
    with torch.no_grad():
        out = mgr.apply_mla_and_append_kv(**x, label="text", **scales)
    mgr.commit(step, ctx)
    q_want, nope_want, cache_want = _core(before, pos.numpy(), scales)
    if "q_pe_out" in x:
        assert out[0] is x["q_pe_out"] and out[1] is x["q_nope_out"]
        np.testing.assert_array_equal(bits(_np(x["q_pe"])), bits(_np(before["q_pe"])),
                                      err_msg="q_pe itself is left unchanged")
        np.testing.assert_array_equal(bits(_np(x["q_nope_out"])), bits(nope_want))
    else:
        assert out[0] is x["q_pe"] and out[1] is None
    _same(_np(out[0]), q_want, "q_pe")
    assert out[2] is x["mla_cache"]
    leaves = x["mla_cache"] if isinstance(x["mla_cache"], tuple) else (x["mla_cache"],)
    for got, want in zip(leaves, cache_want):
        _same(_np(got), want, "cache")


def test_a_padded_batch_caches_only_the_planned_tokens():
    mgr = _manager()
    x = _inputs(7)
    x["slots"][-1] = 3
    before = _clone(x)
    step, ctx = _plan(mgr, 5)                       # 7 tokens given, 5 planned
    pos = mgr.pos_ids("text")[:5].clone()
    with torch.no_grad():
        mgr.apply_mla_and_append_kv(**x, label="text")
    mgr.commit(step, ctx)
    planned = {k: (v[:5] if k != "mla_cache" else v) for k, v in before.items()}
    q_want, _, (cache_want,) = _core(planned, pos.numpy(), {})
    _same(_np(x["q_pe"][:5]), q_want, "q_pe")
    np.testing.assert_array_equal(bits(_np(x["q_pe"][5:])), bits(_np(before["q_pe"][5:])))
    _same(_np(x["mla_cache"]), cache_want, "cache")


def _refusal(change):
    x = _inputs(5, combined=False)
    change(x)
    return x


BAD = {
    "q_nope without q_pe_out": (lambda x: x.update(q_nope=torch.zeros(5, H, N, dtype=torch.bfloat16)),
                                ValueError, "q_nope is only read to quantize it"),
    "q_pe_out in bf16": (lambda x: x.update(q_pe_out=torch.zeros(5, H, R, dtype=torch.bfloat16)),
                         ValueError, "q_pe_out.dtype=torch.bfloat16 must be torch.float8_e4m3fn"),
    "kv scale on a bf16 cache": (lambda x: x.update(kv_quant_scale=2.0), ValueError,
                                 "kv_quant_scale=2.0 applies only to a float8_e4m3fn cache"),
    "q scale without q_pe_out": (lambda x: x.update(q_quant_scale=2.0), ValueError,
                                 "q_quant_scale=2.0 applies only with q_pe_out"),
    "slot past the cache": (lambda x: x["slots"].fill_(-1).__setitem__(0, 32), ValueError,
                            r"slots must be < 32"),
    "repeated slot": (lambda x: x["slots"].copy_(torch.tensor([4, 4, -1, -1, -1])), ValueError,
                      "must not repeat a slot"),
    "k_pe with two heads": (lambda x: x.update(k_pe=torch.zeros(5, 2 * R, dtype=torch.bfloat16)),
                            ValueError, r"k_pe.shape=\(5, 32\) must be \[T, r\]"),
    "k_pe in float32": (lambda x: x.update(k_pe=torch.zeros(5, R)), ValueError,
                        "k_pe.dtype=torch.float32 must equal q_pe.dtype=torch.bfloat16"),
    "kpe_cache pages": (lambda x: x.update(mla_cache=(x["mla_cache"][0],
                                                      torch.zeros(3, PAGE_SIZE, R, dtype=torch.bfloat16))),
                        ValueError, r"kpe_cache.shape=\(3, 8, 16\)"),
    "one cache tensor twice": (lambda x: x.update(mla_cache=(x["mla_cache"][0],) * 2), ValueError,
                               "share memory|must be"),
    "slots a list": (lambda x: x.update(slots=[0, 1, 2, 3, 4]), TypeError,
                     "slots must be an integer torch.Tensor"),
}


@pytest.mark.parametrize("label", sorted(BAD))
def test_bad_input_is_refused_before_anything_changes(label):
    change, error, message = BAD[label]
    mgr = _manager()
    x = _refusal(change)
    before = _clone({k: v for k, v in x.items() if isinstance(v, (torch.Tensor, tuple))})
    step, ctx = _plan(mgr, 5)
    with torch.no_grad(), pytest.raises(error, match=message):
        mgr.apply_mla_and_append_kv(**x, label="text")
    for key, value in before.items():
        for got, want in zip(*(v if isinstance(v, tuple) else (v,) for v in (x[key], value))):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
    # The plan did not move on: a good call still gets the planned positions.
    good = _inputs(5, combined=False)
    with torch.no_grad():
        mgr.apply_mla_and_append_kv(**good, label="text")
    mgr.commit(step, ctx)


def test_without_allow_copy_a_strided_cache_is_refused_by_name_before_the_plan_moves():
    mgr = RopeManager(PositionConfig(rope=CFG), "cpu", launcher="jax", allow_copy=False)
    mgr.ingest_request("r")
    # A preplan, staged until its first use: a refused call must not promote it.
    step, ctx = PositionStep([Segment("r", "text", 5)]), StepContext(("r",), is_preplan=True)
    mgr.plan(step, ctx)
    x = _inputs(5, combined=False)
    wide, kpe = (torch.zeros(PAGES, PAGE_SIZE, w, dtype=torch.bfloat16) for w in (2 * L, R))
    q_before = x["q_pe"].clone()
    with torch.no_grad(), pytest.raises(NotZeroCopyError,
                                        match=r"mla_cache\[0\] with shape=.* is not contiguous"):
        mgr.apply_mla_and_append_kv(**{**x, "mla_cache": (wide[..., :L], kpe)}, label="text")
    assert not wide.any() and not kpe.any() and torch.equal(x["q_pe"], q_before)
    assert mgr._plans.current is None and mgr._plans.staged is not None
    with torch.no_grad():
        mgr.apply_mla_and_append_kv(**x, label="text")
    assert not torch.equal(x["q_pe"], q_before)
    mgr.commit(step, ctx)


def test_the_managers_kernel_backend_runs_the_mla_kernel():
    # backend="interpret": the Triton-lowered MLA body in Pallas's interpreter, through the
    # bridge's JAX path, writes what the XLA reference writes.
    x = _inputs(5, combined=False, cache_dtype=FP8, fp8_q=True)
    scales = dict(q_quant_scale=0.5, kv_quant_scale=2.0)
    outputs = []
    for backend in ("xla", "interpret"):
        mgr = RopeManager(PositionConfig(rope=CFG), "cpu", launcher="jax", backend=backend)
        mgr.ingest_request("r")
        step, ctx = _plan(mgr, 5)
        y = _clone(x)
        with torch.no_grad():
            mgr.apply_mla_and_append_kv(**y, label="text", **scales)
        mgr.commit(step, ctx)
        outputs.append([_np(y["q_pe_out"]), _np(y["q_nope_out"]), *map(_np, y["mla_cache"])])
    for label, got, want in zip(("q_pe", "q_nope", "ckv", "kpe"), *outputs):
        _same(got, want, label)


def test_torch_compile_records_the_op_with_eagers_result():
    def layer(mgr, q_pe, k_pe, ckv, cache, slots, q_nope, q_pe_out, q_nope_out):
        q8, n8, cache = mgr.apply_mla_and_append_kv(
            q_pe, k_pe, ckv, "text", cache, slots, q_nope=q_nope, q_pe_out=q_pe_out,
            q_nope_out=q_nope_out, q_quant_scale=0.5)
        return q8.float().sum() + n8.float().sum()

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    x = _inputs(5, fp8_q=True)
    results = []
    for run in (layer, compiled):
        mgr, y = _manager(), _clone(x)
        step, ctx = _plan(mgr, 5)
        with torch.no_grad():
            total = run(mgr, y["q_pe"], y["k_pe"], y["ckv"], y["mla_cache"], y["slots"],
                        y["q_nope"], y["q_pe_out"], y["q_nope_out"])
        mgr.commit(step, ctx)
        results.append((total, y))
    (eager_total, eager), (compiled_total, traced) = results
    assert torch.equal(eager_total, compiled_total)
    for key in ("q_pe_out", "q_nope_out", "mla_cache", "q_pe"):
        assert torch.equal(eager[key].view(torch.uint8), traced[key].view(torch.uint8)), key
    torch._dynamo.reset()
