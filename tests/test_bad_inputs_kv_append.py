"""Bad input to the fused RoPE + paged KV append, in the bridge (apply_qk_and_append_kv)
and in the core (apply_rope_and_append_kv's M-RoPE positions): each refused naming the
argument, every tensor of the call and the manager's state unchanged (:mod:`bad_input_harness`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.testing import oracle

from bad_input_harness import (HEAD_DIM, MROPE_CURRENT_POSITIONS, SEEDS, Bad, bridge_catalogue_test,
                               busy_manager, finish, mrope_finish, mrope_manager, needs_torch, qk,
                               torch)


# ------------------------------------------------------------------------------ fused KV append
# apply_qk_and_append_kv on the busy manager: each case changes one argument of a valid call
# (KvCall: q, k, v of the current plan's 4 "cond" tokens, a (k_cache, v_cache) pair of 3
# NHD pages of 4, slots with a padding token). Beyond the state checks, every tensor of
# the valid call (q, k, v, the cache, the slots) must be bit for bit as before.


class KvCall:
    """A valid ``apply_qk_and_append_kv`` call on the busy manager; ``run(**changes)`` varies it."""

    def __init__(self, mgr):
        gen = torch.Generator().manual_seed(next(SEEDS))
        self.mgr = mgr
        self.args = dict(q=torch.randn(4, 3, HEAD_DIM, generator=gen),
                         k=torch.randn(4, 2, HEAD_DIM, generator=gen),
                         v=torch.randn(4, 2, HEAD_DIM, generator=gen), label="cond",
                         kv_cache=tuple(torch.randn(3, 4, 2, HEAD_DIM, generator=gen)
                                        for _ in "kv"),
                         slots=torch.tensor([0, 5, 9, -1], dtype=torch.int32))
        # A valid fp8 q for the cases that vary its scale; it must not change either.
        self.q_out = torch.full((4, 3, HEAD_DIM), 3.0, dtype=torch.float8_e4m3fn)

    def tensors(self):
        a = self.args
        return [a["q"], a["k"], a["v"], *a["kv_cache"], a["slots"], self.q_out]

    def run(self, **changes):
        a = {**self.args, **changes}
        kwargs = {key: a.pop(key) for key in list(a) if key not in ("q", "k", "v", "label",
                                                                    "kv_cache", "slots")}
        return self.mgr.apply_qk_and_append_kv(a["q"], a["k"], a["v"], a["label"], a["kv_cache"],
                                               a["slots"], **kwargs)


def _cache(shape=(3, 4, 2, HEAD_DIM), dtype=None, **kwargs):
    return torch.zeros(shape, dtype=dtype or torch.float32, **kwargs)


def _pair(shape=(3, 4, 2, HEAD_DIM), dtype=None):
    return (_cache(shape, dtype), _cache(shape, dtype))


def _kv_cases():
    fp8 = _pair(dtype=torch.float8_e4m3fn)
    return [
        Bad("append on an unknown label", lambda c: c.run(label="nope"), ValueError,
            "label='nope' is unknown"),
        Bad("append on a label the current plan lacks", lambda c: c.run(label="attn"), ValueError,
            "no positions planned for label='attn'"),
        Bad("append on an unhashable label", lambda c: c.run(label=["cond"]), TypeError,
            "label=['cond']"),
        Bad("append with q not a tensor", lambda c: c.run(q=np.ones((4, 3, HEAD_DIM), np.float32)),
            TypeError, "q must be a torch.Tensor"),
        Bad("append with v not a tensor", lambda c: c.run(v=np.ones((4, 2, HEAD_DIM), np.float32)),
            TypeError, "v must be a torch.Tensor"),
        Bad("append with k in another dtype", lambda c: c.run(k=qk(dtype=torch.float16)[1]),
            ValueError, "k.dtype=torch.float16 must equal q.dtype"),
        Bad("append with v in another dtype",
            lambda c: c.run(v=torch.zeros(4, 2, HEAD_DIM, dtype=torch.float16)), ValueError,
            "v ((4, 2, 16), torch.float16) must match k ((4, 2, 16), torch.float32)"),
        Bad("append with v of other heads", lambda c: c.run(v=torch.zeros(4, 1, HEAD_DIM)),
            ValueError, "v ((4, 1, 16), torch.float32) must match k"),
        Bad("append with v of fewer tokens", lambda c: c.run(v=torch.zeros(3, 2, HEAD_DIM)),
            ValueError, "v ((3, 2, 16), torch.float32) must match k"),
        Bad("append with v of the wrong head size", lambda c: c.run(v=torch.zeros(4, 2, 8)),
            ValueError, "v.shape=(4, 2, 8) must be [T, H, 16]"),
        Bad("append with v on another device",
            lambda c: c.run(v=torch.empty(4, 2, HEAD_DIM, device="meta")), ValueError,
            "v is on meta"),
        Bad("append with v tracked by autograd",
            lambda c: c.run(v=torch.zeros(4, 2, HEAD_DIM, requires_grad=True)), ValueError,
            "v.requires_grad=True"),
        Bad("append with an unknown layout", lambda c: c.run(layout="NDH"), ValueError,
            "layout='NDH' must be one of ('NHD', 'HND')"),
        Bad("append with an unknown keyword", lambda c: c.run(rope_theta=1e4), TypeError,
            "rope_theta"),
        Bad("append with the cache a list of one tensor", lambda c: c.run(kv_cache=[_cache()]),
            TypeError, "kv_cache must be a (k_cache, v_cache) pair of tensors or one tensor, got a "
            "list of ['Tensor']"),
        Bad("append with the cache a dict", lambda c: c.run(kv_cache={"k": _cache()}), TypeError,
            "kv_cache must be a (k_cache, v_cache) pair of tensors or one tensor, got dict"),
        Bad("append with the cache a pair of numpy arrays",
            lambda c: c.run(kv_cache=(np.zeros((3, 4, 2, HEAD_DIM)),) * 2), TypeError,
            "got a tuple of ['ndarray', 'ndarray']"),
        Bad("append with one 4-D cache tensor", lambda c: c.run(kv_cache=_cache()), ValueError,
            "kv_cache.shape=(3, 4, 2, 16) must be [pages, 2, page_size, Hk, D] (layout='NHD') "
            "(or pass a (k_cache, v_cache) pair)"),
        Bad("append with a combined cache of 3 components",
            lambda c: c.run(kv_cache=_cache((3, 3, 4, 2, HEAD_DIM))), ValueError,
            "kv_cache.shape=(3, 3, 4, 2, 16) must be [pages, 2, page_size, Hk, D]"),
        Bad("append with a rank-3 k_cache",
            lambda c: c.run(kv_cache=(_cache((3, 4, 32)), _cache((3, 4, 32)))), ValueError,
            "k_cache.shape=(3, 4, 32) must be rank 4: [pages, page_size, Hk, D] (layout='NHD')"),
        Bad("append with v_cache unlike k_cache",
            lambda c: c.run(kv_cache=(_cache(), _cache((3, 4, 2, 8)))), ValueError,
            "v_cache ((3, 4, 2, 8), torch.float32) must match k_cache ((3, 4, 2, 16), torch.float32)"),
        Bad("append with an HND cache read as NHD",
            lambda c: c.run(kv_cache=_pair((3, 2, 4, HEAD_DIM))), ValueError,
            "k_cache.shape=(3, 2, 4, 16) must be [pages, page_size, Hk, D] (layout='NHD') with Hk=2 "
            "and D=16 (k's heads and head_dim)"),
        Bad("append with a combined cache of the wrong head size in HND",
            lambda c: c.run(kv_cache=_cache((3, 2, 2, 4, 8)), layout="HND"), ValueError,
            "kv_cache.shape=(3, 2, 2, 4, 8) must be [pages, 2, Hk, page_size, D] (layout='HND') with "
            "Hk=2 and D=16"),
        Bad("append with a float16 cache for float32 k",
            lambda c: c.run(kv_cache=_pair(dtype=torch.float16)), ValueError,
            "k_cache.dtype=torch.float16 must be k's dtype (torch.float32) or torch.float8_e4m3fn"),
        Bad("append with the cache on another device",
            lambda c: c.run(kv_cache=(_cache(device="meta"), _cache(device="meta"))), ValueError,
            "k_cache is on meta, expected cpu"),
        Bad("append with a combined cache tracked by autograd",
            lambda c: c.run(kv_cache=_cache((3, 2, 4, 2, HEAD_DIM), requires_grad=True)), ValueError,
            "kv_cache.requires_grad=True"),
        Bad("append with slots as a list", lambda c: c.run(slots=[0, 5, 9, -1]), TypeError,
            "slots must be an integer torch.Tensor [T]"),
        Bad("append with float slots", lambda c: c.run(slots=torch.zeros(4)), ValueError,
            "slots.dtype=torch.float32 must be an integer dtype"),
        Bad("append with bool slots", lambda c: c.run(slots=torch.zeros(4, dtype=torch.bool)),
            ValueError, "slots.dtype=torch.bool must be an integer dtype"),
        Bad("append with slots for fewer tokens",
            lambda c: c.run(slots=torch.tensor([0, 5, 9], dtype=torch.int32)), ValueError,
            "slots.shape=(3,) must be [T] with T=4"),
        Bad("append with 2-D slots", lambda c: c.run(slots=torch.zeros(4, 1, dtype=torch.int32)),
            ValueError, "slots.shape=(4, 1) must be [T] with T=4"),
        Bad("append with slots on another device",
            lambda c: c.run(slots=torch.empty(4, dtype=torch.int64, device="meta")), ValueError,
            "slots is on meta"),
        Bad("append with a scale for a float32 cache", lambda c: c.run(k_quant_scale=0.5),
            ValueError, "k_quant_scale=0.5 applies only to a float8_e4m3fn cache"),
        Bad("append with an fp8 scale of 0", lambda c: c.run(kv_cache=fp8, v_quant_scale=0.0),
            ValueError, "v_quant_scale=0.0 must be finite and > 0"),
        Bad("append with an infinite fp8 scale",
            lambda c: c.run(kv_cache=fp8, k_quant_scale=float("inf")), ValueError,
            "k_quant_scale=inf must be finite and > 0"),
        Bad("append with an fp8 scale 0 as a float32",
            lambda c: c.run(kv_cache=fp8, k_quant_scale=1e-46), ValueError,
            "k_quant_scale=1e-46 must be finite and > 0 as the float32 the kernels read"),
        Bad("append with an fp8 scale inf as a float32",
            lambda c: c.run(kv_cache=fp8, v_quant_scale=1e39), ValueError,
            "v_quant_scale=1e+39 must be finite and > 0 as the float32"),
        Bad("append with an fp8 scale as a tensor",
            lambda c: c.run(kv_cache=fp8, k_quant_scale=torch.tensor(0.5)), TypeError,
            "k_quant_scale must be a float"),
        Bad("append with an fp8 scale as a bool", lambda c: c.run(kv_cache=fp8, v_quant_scale=True),
            TypeError, "v_quant_scale must be a float"),
        *_q_out_cases(),
    ]


def _q_out_cases():
    fp8 = torch.float8_e4m3fn
    return [
        Bad("append with q_out of q's dtype", lambda c: c.run(q_out=torch.zeros(4, 3, HEAD_DIM)),
            ValueError, "q_out.dtype=torch.float32 must be torch.float8_e4m3fn"),
        Bad("append with q_out of other heads",
            lambda c: c.run(q_out=torch.zeros(4, 2, HEAD_DIM, dtype=fp8)), ValueError,
            "q_out.shape=(4, 2, 16) must be q's shape (4, 3, 16)"),
        Bad("append with q_out flat for a 3-D q",
            lambda c: c.run(q_out=torch.zeros(4, 3 * HEAD_DIM, dtype=fp8)), ValueError,
            "q_out.shape=(4, 48) must be q's shape (4, 3, 16)"),
        Bad("append with q_out on another device",
            lambda c: c.run(q_out=torch.empty(4, 3, HEAD_DIM, dtype=fp8, device="meta")),
            ValueError, "q_out is on meta, expected cpu"),
        Bad("append with q_out a numpy array",
            lambda c: c.run(q_out=np.zeros((4, 3, HEAD_DIM), np.uint8)), TypeError,
            "q_out must be a torch.float8_e4m3fn tensor shaped like q, got ndarray"),
        Bad("append with a q scale without q_out", lambda c: c.run(q_quant_scale=2.0), ValueError,
            "q_quant_scale=2.0 applies only to q_out (a float8_e4m3fn tensor)"),
        Bad("append with a q scale of 0", lambda c: c.run(q_out=c.q_out, q_quant_scale=0.0),
            ValueError, "q_quant_scale=0.0 must be finite and > 0"),
        Bad("append with a NaN q scale",
            lambda c: c.run(q_out=c.q_out, q_quant_scale=float("nan")), ValueError,
            "q_quant_scale=nan must be finite and > 0"),
        Bad("append with a q scale as a string", lambda c: c.run(q_out=c.q_out, q_quant_scale="2"),
            TypeError, "q_quant_scale must be a float"),
    ]


KV_CASES = _kv_cases() if torch is not None else []


@needs_torch
def test_the_append_call_the_kv_cases_vary_is_valid():
    mgr = busy_manager()
    call = KvCall(mgr)
    cache = [c.clone() for c in call.args["kv_cache"]]
    call.run()
    # Slots 0, 5 and 9 are written; the padding token writes nothing.
    changed = [torch.nonzero((new != old).any(-1).any(-1)).tolist()
               for new, old in zip(call.args["kv_cache"], cache)]
    assert changed == [[[0, 0], [1, 1], [2, 1]]] * 2


@needs_torch
@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: c.name)
def test_append_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    mgr, twin = busy_manager(), busy_manager()
    call = KvCall(mgr)
    before, tensors = mgr.state_snapshot(), [t.clone() for t in call.tensors()]
    with pytest.raises(case.error) as raised:
        case.call(call)
    assert case.fragment in str(raised.value), str(raised.value)
    assert mgr.state_snapshot() == before
    for now, then in zip(call.tensors(), tensors):
        assert torch.equal(now.view(torch.uint8), then.view(torch.uint8))
    assert finish(mgr) == finish(twin)


# ------------------------------------------------------------------------------ fused KV append, M-RoPE
# apply_rope_and_append_kv takes apply_rope's positions: [3, T] for an M-RoPE config, [T]
# for a 1-D one, refused with apply_rope's own message (one validator). Each case runs on
# both ops; q, k, v, the cache and the slots must be as before.


class KvMropeEnv:
    """Inputs of a valid fused call; ``op`` is "append" or "rope" (apply_rope, the twin on
    the same inputs when given the same ``seed``)."""

    def __init__(self, op: str, seed: int):
        rng = np.random.default_rng(seed)
        self.op = op
        self.mrope = jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024, mrope_section=(4, 2, 2))
        self.one_d = jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024)
        self.q = jnp.asarray(rng.standard_normal((5, 3, HEAD_DIM)), jnp.float32)
        self.k, self.v = (jnp.asarray(rng.standard_normal((5, 2, HEAD_DIM)), jnp.float32)
                          for _ in "kv")
        self.pos = jnp.asarray(rng.integers(0, 1024, (3, 5)), jnp.int32)
        self.kv_cache = tuple(jnp.asarray(rng.standard_normal((2, 4, 2, HEAD_DIM)), jnp.float32)
                              for _ in "kv")
        self.slots = jnp.array([0, 3, -1, 7, 4], jnp.int32)

    def run(self, pos_ids, cfg):
        if self.op == "rope":
            return jr.apply_rope(self.q, self.k, pos_ids, cfg)
        return jr.apply_rope_and_append_kv(self.q, self.k, self.v, pos_ids, self.kv_cache,
                                           self.slots, cfg)

    def state(self):
        return [np.asarray(x).tolist() for x in (self.q, self.k, self.v, self.pos, *self.kv_cache,
                                                 self.slots)]


KV_MROPE_CORE_CASES = [
    Bad("append M-RoPE config with 1-D pos_ids", lambda e: e.run(e.pos[0], e.mrope), ValueError,
        "pos_ids.shape=(5,) must be [3, T] (t, h, w rows) with T=5 for an M-RoPE config "
        "(cfg.mrope_section=(4, 2, 2)"),
    Bad("append 1-D config with M-RoPE pos_ids", lambda e: e.run(e.pos, e.one_d), ValueError,
        "pos_ids.shape=(3, 5) is M-RoPE positions [3, T], but cfg is a 1-D config"),
    Bad("append M-RoPE pos_ids of the wrong length", lambda e: e.run(e.pos[:, :4], e.mrope),
        ValueError, "pos_ids.shape=(3, 4) must be [3, T]"),
    Bad("append M-RoPE pos_ids with two rows", lambda e: e.run(e.pos[:2], e.mrope), ValueError,
        "pos_ids.shape=(2, 5) must be [3, T]"),
    Bad("append M-RoPE pos_ids negative on the w row",
        lambda e: e.run(e.pos.at[2, 1].set(-1), e.mrope), ValueError,
        "pos_ids must lie in [0, 1024) (cfg.max_position)"),
    Bad("append M-RoPE float pos_ids", lambda e: e.run(e.pos.astype(jnp.float32), e.mrope),
        ValueError, "pos_ids.dtype=float32 must be an integer type"),
]


@pytest.mark.parametrize("case", KV_MROPE_CORE_CASES, ids=lambda c: c.name)
def test_append_mrope_positions_are_refused_as_apply_rope_refuses_them(case):
    messages, seed = [], next(SEEDS)
    for op in ("append", "rope"):
        env = KvMropeEnv(op, seed)
        before = env.state()
        with pytest.raises(case.error) as raised:
            case.call(env)
        assert case.fragment in str(raised.value), str(raised.value)
        assert env.state() == before
        messages.append(str(raised.value))
    assert messages[0] == messages[1], "the fused op and apply_rope give one message"


def test_the_mrope_append_call_the_cases_vary_is_valid():
    env = KvMropeEnv("append", next(SEEDS))
    q, (k_cache, v_cache) = env.run(env.pos, env.mrope)
    assert np.asarray(q).shape == (5, 3, HEAD_DIM)
    np.testing.assert_array_equal(np.asarray(v_cache).reshape(8, 2, HEAD_DIM)[[0, 3, 7, 4]],
                                  np.asarray(env.v)[[0, 1, 3, 4]])


if torch is not None:
    def _mrope_kv(tokens=3, slots=(0, 5, -1)):
        gen = torch.Generator().manual_seed(next(SEEDS))
        q, k = qk(tokens)
        return dict(q=q, k=k, v=torch.randn(tokens, 2, HEAD_DIM, generator=gen),
                    cache=_pair(), slots=torch.tensor(slots, dtype=torch.int32))

    def _mrope_append(m, **changes):
        a = {**_mrope_kv(), **changes}
        return m.apply_qk_and_append_kv(a["q"], a["k"], a["v"], "cond", a["cache"], a["slots"],
                                         **a.get("kwargs", {}))

MROPE_KV_CASES = [
    Bad("M-RoPE append: slots for fewer tokens",
        lambda m: _mrope_append(m, slots=torch.tensor([0, 5], dtype=torch.int32)), ValueError,
        "slots.shape=(2,) must be [T] with T=3"),
    Bad("M-RoPE append: an unknown layout", lambda m: _mrope_append(m, kwargs={"layout": "NDH"}),
        ValueError, "layout='NDH' must be one of"),
] if torch is not None else []


@needs_torch
def test_the_mrope_append_call_the_kv_cases_vary_is_valid():
    mgr, a = mrope_manager(), _mrope_kv()
    q_in = a["q"].numpy().copy()
    mgr.apply_qk_and_append_kv(a["q"], a["k"], a["v"], "cond", a["cache"], a["slots"])
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    want = oracle.rope_oracle(q_in, np.asarray(MROPE_CURRENT_POSITIONS["cond"]), inv_freq,
                              attention, HEAD_DIM, False, mgr.rope.mrope_section, False)
    np.testing.assert_allclose(a["q"].numpy(), want, rtol=0, atol=2e-5)
    # Slots 0 and 5: page 0 entry 0, page 1 entry 1; the padding token writes nothing.
    assert torch.equal(a["cache"][1][0, 0], a["v"][0]) and torch.equal(a["cache"][1][1, 1], a["v"][1])
    assert int((a["cache"][1] != 0).any(-1).any(-1).sum()) == 2


test_mrope_append_bad_input_raises_and_changes_nothing = bridge_catalogue_test(
    MROPE_KV_CASES, mrope_manager, mrope_finish)
