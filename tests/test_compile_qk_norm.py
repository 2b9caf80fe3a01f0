"""QK-norm under ``torch.compile`` (CPU): a Qwen3-style layer traces whole, and the two
append ops carry the norm with the method's refusals.

The layer (:class:`bench.compile_layers.Qwen3Attention`) passes its ``q_norm.weight`` and
``k_norm.weight`` parameters and a :class:`jaxrope.QKNorm` to
``RopeManager.apply_qk_and_append_kv``; compiled beside an eager twin (same weights, a
twin manager fed the same steps) it has 0 graph breaks, one compile for every ``T`` (the
token dimension marked dynamic, as vLLM marks it) and eager's output, plain and with an
fp8 q. Through the ops (``jaxrope::apply_qk_and_append_kv`` as a compiled graph records
it, ``jaxrope::rope_append_kv_``) bad norm arguments get the method's error, every tensor
untouched, and a valid norm writes what the method writes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch._dynamo.testing  # noqa: E402

import jaxrope as jr  # noqa: E402
from bench.compile_layers import Qwen3Attention  # noqa: E402
from test_compile import D, HIDDEN, HK, HQ, check_paged_twins  # noqa: E402
from test_compile import _manager as _layer_manager  # noqa: E402
from test_qk_norm_bridge import BAD, CFG, _inputs, _manager, _plan  # noqa: E402
from torch_bridge import custom_ops  # noqa: E402
from torch_bridge.op_arguments import norm_args, qk_norm_of  # noqa: E402


def _twins(rng, q_quant_scale):
    """Three layers with one set of weights (norm weights away from 1) on three managers."""
    managers = [_layer_manager() for _ in range(3)]
    torch.manual_seed(int(rng.integers(2 ** 31)))  # the rng fixture reports the seed
    layers = [Qwen3Attention(mgr, HIDDEN, HQ, HK, pages=8, page_size=16,
                             q_quant_scale=q_quant_scale) for mgr in managers]
    with torch.no_grad():
        for norm in (layers[0].q_norm, layers[0].k_norm):
            norm.weight.copy_(1 + 0.5 * torch.randn(D))
    for layer in layers[1:]:
        layer.load_state_dict(layers[0].state_dict())
    return managers, layers


# aot_eager traces and functionalizes as inductor does, without its code generation (about
# 10 s a compile here); the inductor run (tests/test_compile.py compiles plain layers with
# it) is opt-in.
@pytest.mark.parametrize("q_quant_scale, backend", [
    pytest.param(None, "aot_eager", id="norm"), pytest.param(8.0, "aot_eager", id="norm + fp8 q"),
    pytest.param(None, "inductor", marks=pytest.mark.slow, id="norm, inductor")])
def test_a_qwen3_layer_with_qk_norm_compiles_whole_for_every_token_count(q_quant_scale, backend,
                                                                         rng):
    managers, layers = _twins(rng, q_quant_scale)
    assert isinstance(layers[0].q_norm.weight, torch.nn.Parameter)

    def compile_layer(layer):
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        return torch.compile(layer, backend=counter, fullgraph=True), counter

    # T marked dynamic (vLLM's way), so the norm's eps is a constant of the graph.
    check_paged_twins(layers, managers, compile_layer, mark_dynamic=True)


# -- the ops ----------------------------------------------------------------------------------


def _weights(rng, qk_norm):
    return [torch.from_numpy((0.5 * rng.standard_normal(qk_norm.weight_length(h, CFG.head_dim)))
                             .astype(np.float32)) for h in (4, 2)]


@pytest.mark.parametrize("qk_norm", [jr.QKNorm(eps=1e-6, convention="gemma"),
                                     jr.QKNorm(eps=1e-5, per_head=False)],
                         ids=["gemma3", "olmo2"])
def test_both_ops_write_what_the_method_writes(qk_norm, rng):
    mgr = _manager()
    q, k, v, cache, slots = _inputs(rng)
    step, ctx = _plan(mgr)
    q_w, k_w = _weights(rng, qk_norm)
    norm = dict(q_norm_weight=q_w, k_norm_weight=k_w, qk_norm=qk_norm)
    runs = [(q.clone(), tuple(c.clone() for c in cache)) for _ in range(3)]
    pos = mgr.pos_ids("text").clone()
    (q0, c0), (q1, c1), (q2, c2) = runs
    mgr.apply_qk_and_append_kv(q0, k, v, "text", c0, slots, **norm)
    custom_ops.rope_append_kv_(q1, k, v, pos, c1, slots, custom_ops.config_key(CFG), **norm)
    mgr.commit(step, ctx)
    mgr.remove_request("r")
    mgr.ingest_request("r")
    step, ctx = _plan(mgr)
    custom_ops.traced_apply_qk_and_append_kv(mgr, q2, k, v, "text", c2, slots, "NHD", None, None,
                                             None, None, q_w, k_w, qk_norm)
    mgr.commit(step, ctx)
    for got_q, got_cache in runs[1:]:
        assert torch.equal(got_q, q0) and all(map(torch.equal, got_cache, c0))
    assert not torch.allclose(q0, _plain_q(q, k, v, cache, slots), atol=1e-3)  # normalised


def _plain_q(q, k, v, cache, slots):
    q2 = q.clone()
    custom_ops.rope_append_kv_(q2, k, v, torch.arange(q.shape[0]), tuple(c.clone() for c in cache),
                               slots, custom_ops.config_key(CFG))
    return q2


def _op_routes(mgr, q, k, v, cache, slots, monkeypatch):
    """The three ways a norm reaches the work: the method, the op a compiled graph
    records for it, the explicit op (its wrapper under ``torch.compile``)."""
    def explicit(**norm):
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            custom_ops.rope_append_kv_(q, k, v, mgr.pos_ids("text"), cache, slots,
                                       custom_ops.config_key(CFG), **norm)

    return {
        "method": lambda **norm: mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots, **norm),
        "apply_qk_and_append_kv op": lambda **norm: custom_ops.traced_apply_qk_and_append_kv(
            mgr, q, k, v, "text", cache, slots, "NHD", None, None, **norm),
        "rope_append_kv_ op": explicit,
    }


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_ops_refuse_bad_norm_arguments_as_the_method(name, rng, monkeypatch):
    kwargs, error, message = BAD[name]
    mgr = _manager()
    q, k, v, cache, slots = _inputs(rng)
    _plan(mgr)
    before = [t.clone() for t in (q, k, v, *cache, slots)]
    refusals = {}
    for route, call in _op_routes(mgr, q, k, v, cache, slots, monkeypatch).items():
        with pytest.raises(error, match=message) as raised:
            call(**kwargs)
        refusals[route] = str(raised.value).replace("q's device", "the manager's device")
        assert all(torch.equal(a, b) for a, b in zip((q, k, v, *cache, slots), before)), route
    assert len(set(refusals.values())) == 1, refusals


def test_norm_args_round_trip_and_refuse_a_bad_eps():
    for qk_norm in (jr.QKNorm(), jr.QKNorm(eps=1e-5, convention="gemma", per_head=False)):
        weight = torch.ones(4)
        q_w, k_w, *scalars = norm_args(weight, None, qk_norm)
        assert q_w is weight and k_w is None and qk_norm_of(*scalars) == qk_norm
    assert qk_norm_of(*norm_args(None, None, None)[2:]) is None
    with pytest.raises(ValueError, match="eps=-1.0 must be finite and > 0"):
        qk_norm_of(-1.0, "rmsnorm", True)
    with pytest.raises(ValueError, match="convention='layernorm' must be one of"):
        qk_norm_of(1e-6, "layernorm", True)
