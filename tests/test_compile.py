"""``torch.compile`` of layers that call the bridge (CPU): no graph break, T dynamic, eager's result.

Each compiled layer runs beside an eager twin with the same weights (and a twin
manager fed the same steps): :func:`torch._dynamo.explain` finds 0 graph breaks, one
compile serves every token count, and outputs agree within float32 rounding (the
rotation and the cache writes are the same implementation, bit for bit; inductor's
matmul and softmax may round differently). Bad input through the custom ops gets the
methods' refusals with the tensors untouched. Three inductor compiles in all.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch._dynamo.testing  # noqa: E402

import jaxrope as jr  # noqa: E402
from bad_input_harness import busy_manager, finish, raises_naming_it_and_changes_nothing  # noqa: E402
from bench.compile_layers import FusedQKVAttention, ManagerRotary, PagedAttention  # noqa: E402
from test_bad_inputs_manager import MANAGER_CASES  # noqa: E402
from torch_bridge import (PositionConfig, PositionStep, RopeManager,  # noqa: E402
                          RotaryEmbedding, Segment, StepContext)
from torch_bridge import custom_ops  # noqa: E402
from torch_bridge.op_arguments import APPEND_OPTIONS_OFF  # noqa: E402

HIDDEN, HQ, HK, D = 32, 4, 2, 16
TOKENS = (5, 3, 8, 6)  # the compiled steps: no recompile between them
ROPE = jr.RopeConfig(head_dim=D, theta=5e5)
# float32 outputs of a 32-wide projection of attention: compiled vs eager rounding.
ATOL = 4 * 2.0 ** -23


@pytest.fixture(autouse=True)
def _seeded_torch(rng):
    torch.manual_seed(int(rng.integers(2 ** 31)))  # the rng fixture reports the seed


def _manager(rope=ROPE) -> RopeManager:
    mgr = RopeManager(PositionConfig(rope=rope), "cpu", max_seq_len=1024, launcher="jax")
    mgr.ingest_request("r0")
    return mgr


def _step(mgr, tokens, run):
    step, ctx = PositionStep([Segment("r0", "text", tokens)]), StepContext(("r0",))
    mgr.plan(step, ctx)
    with torch.no_grad():
        out = run()
    mgr.commit(step, ctx)
    return out


def _compile(layer):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    return torch.compile(layer, backend=counter, fullgraph=True, dynamic=True), counter


def _graph_breaks(layer, *args) -> int:
    with torch.no_grad():
        explained = torch._dynamo.explain(layer)(*args)
    torch._dynamo.reset()
    return explained.graph_break_count


def check_paged_twins(layers, managers, compile_layer, mark_dynamic=False):
    """Paged-attention ``layers`` (eager, to compile, to explain) with one set of weights,
    on ``managers`` fed the same steps: 0 graph breaks, one compile (``compile_layer(layer)
    -> (compiled, counter)``) for every T in TOKENS, eager's outputs and cache. With
    ``mark_dynamic``, T is marked dynamic on each call (vLLM's way) rather than by
    ``dynamic=True``. Returns the compiled layer and the last step's inputs."""
    eager_mgr, compiled_mgr, explain_mgr = managers
    # A prefill first, eager on both: a compiled step then has more context than tokens
    # (a first call with S == T would duck-size them into one symbol, and recompile).
    start, x = 4, torch.randn(4, HIDDEN)
    for mgr, layer in zip((eager_mgr, compiled_mgr), layers):
        _step(mgr, 4, lambda: layer(x, torch.arange(4), torch.arange(4)))
    args = (torch.randn(3, HIDDEN), torch.arange(3), torch.arange(3))
    assert _step(explain_mgr, 3, lambda: _graph_breaks(layers[2], *args)) == 0
    compiled, counter = compile_layer(layers[1])
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN)
        slots, context = torch.arange(start, start + tokens), torch.arange(start + tokens)
        for t in (x, slots, context) if mark_dynamic else ():
            torch._dynamo.mark_dynamic(t, 0)
        want = _step(eager_mgr, tokens, lambda: layers[0](x, slots, context))
        got = _step(compiled_mgr, tokens, lambda: compiled(x, slots, context))
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        start += tokens
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for T in {TOKENS}"
    assert torch.equal(layers[1].kv_cache, layers[0].kv_cache)  # the same kernel wrote both
    return compiled, (x, slots, context)


def test_paged_attention_compiles_whole_for_every_token_count(rng):
    managers = (_manager(), _manager(), _manager())
    torch.manual_seed(int(rng.integers(2 ** 31)))
    layers = [PagedAttention(mgr, HIDDEN, HQ, HK, pages=8, page_size=16) for mgr in managers]
    for layer in layers[1:]:
        layer.load_state_dict(layers[0].state_dict())
    compiled, last_step = check_paged_twins(layers, managers, _compile)
    # A refusal inside the compiled graph is the method's, at run time: no plan here.
    with pytest.raises(ValueError, match="no positions planned for label='text'"):
        with torch.no_grad():
            compiled(*last_step)


def _fused(rotary, seed):
    torch.manual_seed(seed)
    return FusedQKVAttention(rotary, HIDDEN, HQ, HK, D)


def test_fused_qkv_views_rotated_by_the_manager_compile_whole(rng):
    seed = int(rng.integers(2 ** 31))
    eager_mgr, compiled_mgr = _manager(), _manager()
    eager, twin = _fused(ManagerRotary(eager_mgr), seed), _fused(ManagerRotary(compiled_mgr), seed)
    explain_mgr = _manager()
    args = (torch.arange(5), torch.randn(5, HIDDEN))
    assert _step(explain_mgr, 5, lambda: _graph_breaks(_fused(ManagerRotary(explain_mgr), seed),
                                                       *args)) == 0
    compiled, counter = _compile(twin)
    for tokens in TOKENS:
        x, positions = torch.randn(tokens, HIDDEN), torch.zeros(tokens, dtype=torch.int64)
        want = _step(eager_mgr, tokens, lambda: eager(positions, x))
        got = _step(compiled_mgr, tokens, lambda: compiled(positions, x))
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for T in {TOKENS}"


def test_vllm_shaped_layer_with_mrope_positions_compiles_whole(rng):
    seed = int(rng.integers(2 ** 31))
    cfg = jr.RopeConfig(head_dim=D, theta=1e6, mrope_section=(2, 3, 3))
    eager, twin = _fused(RotaryEmbedding(cfg), seed), _fused(RotaryEmbedding(cfg), seed)

    def positions(tokens):
        return torch.from_numpy(rng.integers(0, 4096, (3, tokens)))  # int64, rows differ

    with torch.no_grad():
        assert torch._dynamo.explain(eager)(positions(5), torch.randn(5, HIDDEN)).graph_break_count == 0
    torch._dynamo.reset()
    compiled, counter = _compile(twin)
    for tokens in TOKENS:
        x, pos = torch.randn(tokens, HIDDEN), positions(tokens)
        with torch.no_grad():
            torch.testing.assert_close(compiled(pos, x), eager(pos, x), rtol=0, atol=ATOL)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for T in {TOKENS}"


# -- refusals through the ops ----------------------------------------------------------------


def _planned_pair(tokens=3):
    managers = (_manager(), _manager())
    for mgr in managers:
        mgr.plan(PositionStep([Segment("r0", "text", tokens)]), StepContext(("r0",)))
    return managers


def _refusal(call, tensors):
    before = [t.clone() for t in tensors]
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), "a refused call changed a tensor"
    return type(info.value), str(info.value)


BAD_QK = {
    "int q": lambda: (torch.ones(3, HQ, D, dtype=torch.int32), torch.ones(3, HK, D)),
    "head size": lambda: (torch.ones(3, HQ, D + 2), torch.ones(3, HK, D + 2)),
    "flat size": lambda: (torch.ones(3, HQ * D + 1), torch.ones(3, HK * D)),
    "k tokens": lambda: (torch.ones(3, HQ, D), torch.ones(2, HK, D)),
    "k dtype": lambda: (torch.ones(3, HQ, D), torch.ones(3, HK, D, dtype=torch.float16)),
    "grad": lambda: (torch.ones(3, HQ, D, requires_grad=True), torch.ones(3, HK, D)),
}
_NO_OVERRIDES = (None,) * 7  # rotary_dim, interleave, rope_scale, rope_theta, the llama31 three


@pytest.mark.parametrize("case", sorted(BAD_QK))
def test_apply_qk_op_refuses_as_the_method(case):
    method_mgr, op_mgr = _planned_pair()
    q, k = BAD_QK[case]()
    want = _refusal(lambda: method_mgr.apply_qk(q, k, "text"), (q, k))
    got = _refusal(lambda: torch.ops.jaxrope.apply_qk(q, k, op_mgr._op_key, "text", *_NO_OVERRIDES),
                   (q, k))
    assert got == want


@pytest.mark.parametrize("label", ["image", "nope"])
def test_apply_qk_op_refuses_an_unplanned_label_as_the_method(label):
    method_mgr, op_mgr = _planned_pair()
    q, k = torch.randn(3, HQ, D), torch.randn(3, HK, D)
    want = _refusal(lambda: method_mgr.apply_qk(q, k, label), (q, k))
    assert _refusal(lambda: torch.ops.jaxrope.apply_qk(q, k, op_mgr._op_key, label, *_NO_OVERRIDES),
                    (q, k)) == want


def _append_args(**change):
    args = dict(q=torch.randn(3, HQ, D), k=torch.randn(3, HK, D), v=torch.randn(3, HK, D),
                cache=torch.zeros(4, 2, 16, HK, D), slots=torch.arange(3), layout="NHD",
                k_quant_scale=None)
    args.update(change)
    return args


BAD_APPEND = {
    "v shape": dict(v=torch.randn(3, HK + 1, D)),
    "cache heads": dict(cache=torch.zeros(4, 2, 16, HK + 1, D)),
    "slots shape": dict(slots=torch.arange(4)),
    "slots dtype": dict(slots=torch.zeros(3)),
    "layout": dict(layout="HDN"),
    "scale on a float cache": dict(k_quant_scale=2.0),
}


APPEND_OPS = {
    "apply_qk_and_append_kv": lambda a, mgr: torch.ops.jaxrope.apply_qk_and_append_kv(
        a["q"], a["k"], a["v"], a["cache"], None, a["slots"], mgr._op_key, "text", a["layout"],
        a["k_quant_scale"], None, **APPEND_OPTIONS_OFF),
    "rope_append_kv_": lambda a, mgr: torch.ops.jaxrope.rope_append_kv_(
        a["q"], a["k"], a["v"], torch.arange(3), a["cache"], None, a["slots"],
        custom_ops.config_key(ROPE), a["layout"], a["k_quant_scale"], None,
        **APPEND_OPTIONS_OFF),
}


@pytest.mark.parametrize("op", sorted(APPEND_OPS))
@pytest.mark.parametrize("case", sorted(BAD_APPEND))
def test_append_ops_refuse_as_the_method(case, op):
    method_mgr, op_mgr = _planned_pair()
    a = _append_args(**BAD_APPEND[case])
    tensors = (a["q"], a["k"], a["v"], a["cache"], a["slots"])
    want = _refusal(lambda: method_mgr.apply_qk_and_append_kv(
        a["q"], a["k"], a["v"], "text", a["cache"], a["slots"], layout=a["layout"],
        k_quant_scale=a["k_quant_scale"]), tensors)
    assert _refusal(lambda: APPEND_OPS[op](a, op_mgr), tensors) == want


@pytest.mark.parametrize("case", sorted(BAD_QK))
def test_rope_op_refuses_q_and_k_as_the_method(case):
    method_mgr, _ = _planned_pair()
    q, k = BAD_QK[case]()
    want_type, want = _refusal(lambda: method_mgr.apply_qk(q, k, "text"), (q, k))
    pos = torch.arange(q.shape[0])
    got_type, got = _refusal(lambda: torch.ops.jaxrope.rope_(q, k, pos, custom_ops.config_key(ROPE)),
                             (q, k, pos))
    assert (got_type, got) == (want_type, want.replace("the manager's device", "q's device"))


BAD_POSITIONS = {
    "float": torch.zeros(3),
    "length": torch.arange(4),
    "M-RoPE rows for a 1-D config": torch.zeros(3, 3, dtype=torch.int64),
}


@pytest.mark.parametrize("case", sorted(BAD_POSITIONS))
def test_rope_op_refuses_positions_as_apply_rope(case):
    q, k, pos = torch.randn(3, HQ, D), torch.randn(3, HK, D), BAD_POSITIONS[case]
    want = _refusal(lambda: jr.apply_rope(q.numpy(), k.numpy(), pos.numpy(), ROPE), ())
    key = custom_ops.config_key(ROPE)
    got_type, got = _refusal(lambda: torch.ops.jaxrope.rope_(q, k, pos, key), (q, k, pos))
    assert (got_type, got.replace("torch.", "")) == want  # dtypes named as numpy names them


def test_rope_op_refuses_an_unknown_config_key():
    q, k = torch.randn(3, HQ, D), torch.randn(3, HK, D)
    _, message = _refusal(lambda: torch.ops.jaxrope.rope_(q, k, torch.arange(3), "no-such-key"),
                          (q, k))
    assert "config='no-such-key' is not a registered RopeConfig key" in message


def test_config_keys_differ_in_one_field_and_agree_for_equal_configs():
    other = jr.RopeConfig(head_dim=D, theta=5e5 + 1)
    assert custom_ops.config_key(ROPE) != custom_ops.config_key(other)
    assert custom_ops.config_of(custom_ops.config_key(jr.RopeConfig(head_dim=D, theta=5e5))) == ROPE


def test_traced_apply_qk_needs_a_str_label():
    mgr = _manager()
    with pytest.raises(TypeError, match=r"label=\('text',\) must be a str under torch.compile"):
        custom_ops.traced_apply_qk(mgr, torch.randn(3, HQ, D), torch.randn(3, HK, D), ("text",),
                                   (None,) * 5, {})


def test_a_dropped_manager_is_refused_by_key():
    key = _manager()._op_key
    gc.collect()  # the manager's bound launches hold cycles
    with pytest.raises(ValueError, match=f"manager='{key}' names no live RopeManager"):
        custom_ops.manager_of(key)


def test_rope_op_rotates_as_the_manager(rng):
    mgr, _ = _planned_pair(5)
    q, k = (torch.from_numpy(rng.standard_normal((5, h, D)).astype(np.float32)) for h in (HQ, HK))
    q2, k2 = q.clone(), k.clone()
    mgr.apply_qk(q, k, "text")
    torch.ops.jaxrope.rope_(q2, k2, mgr.pos_ids("text").to(torch.int64),
                            custom_ops.config_key(ROPE))
    assert torch.equal(q, q2) and torch.equal(k, k2)


# -- the fused append at explicit positions ------------------------------------------------


def test_rope_append_kv_op_writes_what_the_manager_writes(rng):
    mgr, _ = _planned_pair(5)
    a = _append_args(q=torch.randn(5, HQ, D), k=torch.randn(5, HK, D), v=torch.randn(5, HK, D),
                     slots=torch.tensor([3, 17, -1, 40, -2 ** 33]))
    q2, cache2 = a["q"].clone(), a["cache"].clone()
    mgr.apply_qk_and_append_kv(a["q"], a["k"], a["v"], "text", a["cache"], a["slots"])
    torch.ops.jaxrope.rope_append_kv_(q2, a["k"], a["v"], mgr.pos_ids("text"), cache2, None,
                                      a["slots"], custom_ops.config_key(ROPE), "NHD", None, None,
                                      **APPEND_OPTIONS_OFF)
    assert torch.equal(q2, a["q"]) and torch.equal(cache2, a["cache"])
    # A slot past the cache is refused by both, with the same message, nothing written.
    past = a["slots"].clone()
    past[-1] = 2 ** 33
    refusals = []
    for call in (lambda: mgr.apply_qk_and_append_kv(q2, a["k"], a["v"], "text", cache2, past),
                 lambda: torch.ops.jaxrope.rope_append_kv_(
                     q2, a["k"], a["v"], mgr.pos_ids("text"), cache2, None, past,
                     custom_ops.config_key(ROPE), "NHD", None, None, **APPEND_OPTIONS_OFF)):
        with pytest.raises(ValueError, match="slots must be < ") as raised:
            call()
        refusals.append(str(raised.value))
    assert refusals[0] == refusals[1]
    assert torch.equal(q2, a["q"]) and torch.equal(cache2, a["cache"])


def test_rope_append_kv_traces_whole_with_a_cache_pair(rng):
    """Functionalization of the op's two mutated caches (aot_eager: no inductor compile)."""
    key = custom_ops.config_key(ROPE)

    def step(pos, q, k, v, k_cache, v_cache, slots):
        q = q * 1
        custom_ops.rope_append_kv_(q, k, v, pos, (k_cache, v_cache), slots, key)
        return q + 0, k_cache.sum() + v_cache.sum()

    def inputs(tokens):
        return (torch.arange(tokens), torch.randn(tokens, HQ, D), torch.randn(tokens, HK, D),
                torch.randn(tokens, HK, D), torch.zeros(4, 16, HK, D), torch.zeros(4, 16, HK, D),
                torch.arange(tokens) * 2)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in (5, 9):
        eager_args = inputs(tokens)
        compiled_args = tuple(x.clone() for x in eager_args)
        want, got = step(*eager_args), compiled(*compiled_args)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert torch.equal(eager_args[4], compiled_args[4]) and torch.equal(eager_args[5],
                                                                            compiled_args[5])


# -- the manager catalogue's apply_qk cases, routed as torch.compile routes them ------------

# Out of the op's domain: arguments whose type the op schema fixes (torch refuses them
# before any implementation runs, as for every op) and a meta tensor (dispatched to the
# fake implementation). Under torch.compile such arguments never reach the op as given.
_SCHEMA_TYPED = {"apply_qk with q not a tensor", "apply_qk with interleave as a string",
                 "apply_qk with q on another device"}
APPLY_CASES = [c for c in MANAGER_CASES
               if c.name.startswith("apply_qk") and c.name not in _SCHEMA_TYPED]
_COMPILING = {"now": False, "calls": 0}


class _InsideOp:
    """A manager as the op's implementation sees it: not compiling."""

    def __init__(self, mgr):
        self._mgr = mgr

    def apply_qk(self, *args, **kwargs):
        _COMPILING["calls"] += 1
        _COMPILING["now"] = False
        try:
            return self._mgr.apply_qk(*args, **kwargs)
        finally:
            _COMPILING["now"] = True


@pytest.mark.parametrize("case", APPLY_CASES, ids=lambda c: c.name)
def test_catalogue_apply_qk_cases_through_the_op(case, monkeypatch):
    """Each case calls ``apply_qk`` as a compiled graph would (``traced_apply_qk``, then the
    op): the same error, the manager's state unchanged, then it ends as an untouched twin."""
    manager_of = custom_ops.manager_of
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: _COMPILING["now"])
    monkeypatch.setattr(custom_ops, "manager_of", lambda key: _InsideOp(manager_of(key)))
    monkeypatch.setitem(_COMPILING, "now", True)
    monkeypatch.setitem(_COMPILING, "calls", 0)
    raises_naming_it_and_changes_nothing(case, busy_manager, finish)
    assert _COMPILING["calls"] >= 2  # finish() on both managers went through the op
