"""docs/guarantees.md, "What is guaranteed on bad input", claim by claim, each exercised for real.

``CLAIMS`` quotes each claim of that section (a phrase that must stay in it) beside the
test that exercises it, so a claim edited in the guide without its test, or a test
left without its claim, fails ``test_every_claim_is_in_the_readme_and_has_its_test``.

- A bad argument to every public entry point raises the documented type, naming the
  argument and its value: one call per entry point, and every public function of
  ``jaxrope.positions`` and every public method of ``RopeManager`` that takes an
  argument has one (``test_every_entry_point_has_a_bad_call``).
- What is not checked under ``jax.jit`` does what the section says it does.
- Counters move back only through the calls the section lists: a seeded random walk
  over the core's transitions, and one over a ``RopeManager`` (with forks, admits of
  both epochs, rollbacks, resets, removes and re-ingests), each explaining every
  decrease it sees.
"""

from __future__ import annotations

import inspect
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope import positions, speculative_positions, wire
from jaxrope.positions import PAD, PositionTable, RowMap

from bad_input_harness import raises_naming_it_and_leaves_the_table

try:
    import torch
except ImportError:  # the core leg (Python 3.12, no torch) walks the core claims only
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (core-only leg)")

GUIDE = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guarantees.md").read_text()
SECTION = GUIDE.split("# What is guaranteed on bad input")[1]
HEAD_DIM = 16

# (a phrase of the section, the test of this file that exercises it).
CLAIMS = [
    ("A bad argument raises before anything changes, with a message naming the argument",
     "test_a_bad_core_call_raises_naming_its_argument"),
    ("numbers may be Python or numpy scalars", "test_numpy_scalars_configure_exactly_as_python_numbers"),
    ("concrete `pos_ids` in `[0, cfg.max_position)`", "test_apply_rope_checks_concrete_positions_only"),
    ("one array passed as both caches is refused", "test_the_fused_append_refuses_one_array_as_both_caches"),
    ("concrete KV `slots` at their own integer width",
     "test_a_kv_slot_of_any_width_never_wraps_onto_another"),
    ("a slot out of range skips its token; no slot wraps onto another",
     "test_a_traced_kv_slot_out_of_range_skips_its_token"),
    ("Python lists are taken as int32 arrays", "test_positions_take_python_lists"),
    ("Traced values are not checked, and then a row off the table acts as `PAD`",
     "test_traced_positions_arguments_do_what_the_section_says"),
    ("the rows, counts, `out` and depths they pass on are checked by",
     "test_a_bad_core_call_raises_naming_its_argument"),
    ("whose `reason` names the check", "test_wire_refusals_name_their_check"),
    ("a call that raises leaves everything as it was",
     "test_a_bad_bridge_call_raises_naming_its_argument_and_changes_nothing"),
    ("every such reason starts with `published record refused (<check>)`",
     "test_every_admit_refusal_reason_starts_the_same_way"),
    ("Removing an unknown or removed request, publishing an unknown one and ingesting\n  again "
     "are no-ops", "test_remove_publish_and_ingest_again_are_no_ops"),
    ("it moves back only through `rollback`", "test_core_counters_move_back_only_through_the_listed_calls"),
    ("back only through `rollback`, `admit_retrieve` of a record holding rewinds the manager\nlacks",
     "test_bridge_counters_move_back_only_through_the_listed_calls"),
    ("No bridge counter passes `max_seq_len`",
     "test_bridge_counters_move_back_only_through_the_listed_calls"),
    ("a draft tree whose depths are no tree", "test_a_bad_bridge_call_raises_naming_its_argument_and_changes_nothing"),
    ("KV\n  slots that are no integer tensor",
     "test_a_bad_bridge_call_raises_naming_its_argument_and_changes_nothing"),
    ("KV slots of\n  any integer width outside the cache are skipped on the device",
     "test_a_bridge_kv_slot_of_any_width_outside_the_cache_is_refused_on_cpu"),
    # The claims of the later sections are exercised by their own files.
    ("checked once, where it enters, by one rule",
     "tests/test_integer_extremes.py::test_every_extreme_is_refused_naming_the_argument_or_acts_as_its_python_int"),
    ("a cached step never takes `True` for `1`",
     "tests/test_integer_extremes.py::test_a_cached_step_never_takes_an_equal_bool_float_or_wide_count_for_an_int"),
    ("that commit is the\nonly thing that moves the stream's counter",
     "tests/test_frozen_streams.py::test_the_issue_scenarios_end_where_the_kv_ends"),
    ("A preplan may not take the CUDA-graph slot",
     "tests/test_frozen_streams.py::test_a_preplan_takes_the_other_graph_slot_and_leaves_the_current_buffers"),
    ("each call is atomic",
     "tests/test_manager_threads.py::test_an_engine_thread_and_a_transfer_thread_agree_with_the_model"),
    ("a call whose values break one raises `ValueError`",
     "tests/test_checked.py::test_a_bad_value_under_jit_raises_naming_it_when_checked"),
    ("the default\nstep's jaxpr and HLO are the same as without it",
     "tests/test_checked.py::test_the_default_path_lowers_as_if_the_checks_did_not_exist"),
]


def test_every_claim_is_in_the_readme_and_has_its_test():
    text = " ".join(SECTION.split())
    tests = {name for name in globals() if name.startswith("test_")}
    for phrase, test in CLAIMS:
        assert " ".join(phrase.split()) in text, phrase
        if "::" in test:  # a test of another file
            path, name = test.split("::")
            source = (pathlib.Path(__file__).resolve().parents[1] / path).read_text()
            assert f"def {name}" in source, test
        else:
            assert test in tests, test


# -- a bad argument per core entry point --------------------------------------------

CFG = jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024)
TABLE = PositionTable(jnp.array([3, 9, 0, 5], jnp.int32))
ROWS = jnp.array([0, 1], jnp.int32)
TWO = jnp.array([1, 2], jnp.int32)
OUT = jnp.zeros((4,), jnp.int32)


def _qkv(tokens=3):
    rng = np.random.default_rng(20261202)
    q = jnp.asarray(rng.standard_normal((tokens, 2, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((tokens, 1, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((tokens, 1, HEAD_DIM)), jnp.float32)
    return q, k, v


def _cache(pages=4, page_size=4):
    return tuple(jnp.zeros((pages, page_size, 1, HEAD_DIM), jnp.float32) for _ in "kv")


def _append(slots, cache=None, **kwargs):
    q, k, v = _qkv(len(slots))
    return jr.apply_rope_and_append_kv(q, k, v, jnp.arange(len(slots), dtype=jnp.int32),
                                       _cache() if cache is None else cache, slots, CFG, **kwargs)


# (entry point, call, error, fragment naming the argument and its value).
CORE_CALLS = [
    ("RopeConfig", lambda: jr.RopeConfig(head_dim="128"), TypeError, "head_dim='128'"),
    ("RopeConfig", lambda: jr.RopeConfig(head_dim=16, scaling="llama3"), TypeError, "scaling='llama3'"),
    ("Llama3", lambda: jr.Llama3(factor=-1.0), ValueError, "factor=-1.0"),
    ("RopeConfig.from_hf", lambda: jr.RopeConfig.from_hf(
        {"model_type": "llama", "head_dim": 64, "rope_scaling": {"rope_type": "bogus"}}),
     ValueError, "rope_type='bogus'"),
    ("RopeConfig.from_hf", lambda: jr.RopeConfig.from_hf(42), TypeError, "config must be a dict"),
    ("apply_rope", lambda: jr.apply_rope([[[0.5] * 16]], _qkv()[1], jnp.arange(3), CFG), TypeError,
     "q must be an array"),
    ("apply_rope", lambda: jr.apply_rope(*_qkv()[:2], jnp.arange(3.0), CFG), ValueError,
     "pos_ids.dtype=float32"),
    ("apply_rope_and_append_kv", lambda: _append(jnp.array([0.0, 1.0, 2.0])), ValueError,
     "slots.dtype=float32"),
    ("apply_rope_and_append_kv", lambda: _append(jnp.array([0, 1, 16], jnp.int32)), ValueError,
     "slots must be < 16"),
    ("positions.init", lambda: positions.init(2.0), TypeError, "capacity=2.0"),
    ("positions.grow", lambda: positions.grow(TABLE, 2), ValueError, "capacity=2 must be >= current"),
    ("positions.read", lambda: positions.read(TABLE, [4]), ValueError, "rows[0]=4 is no row"),
    ("positions.plan", lambda: positions.plan(TABLE, ROWS, [3, 2], OUT), ValueError,
     "counts=[3, 2] plan 5 tokens, more than out's 4"),
    ("positions.commit", lambda: positions.commit(TABLE, ROWS, TWO.astype(jnp.float32)), ValueError,
     "counts.dtype=float32"),
    ("positions.advance", lambda: positions.advance(TABLE, ROWS, [1, -1]), ValueError,
     "amounts[1]=-1"),
    ("positions.fork", lambda: positions.fork(TABLE, ROWS, [2]), ValueError,
     "dst_rows.shape=(1,) must match src_rows.shape=(2,)"),
    ("positions.raise_to", lambda: positions.raise_to(TABLE, ROWS, np.array([2**31, 0])), ValueError,
     "positions[0]=2147483648"),
    ("positions.admit", lambda: positions.admit(TABLE, [1, 1], TWO, TWO, TWO), ValueError,
     "rows holds row 1 more than once"),
    ("positions.set_deltas", lambda: positions.set_deltas(TABLE, ROWS, np.array([0, -2**31 - 1])),
     ValueError, "deltas[1]=-2147483649"),
    ("positions.rollback", lambda: positions.rollback(TABLE, ROWS, [-1, 0]), ValueError,
     "positions[0]=-1"),
    ("positions.reset", lambda: positions.reset(TABLE, {0, 1}), TypeError,
     "rows must be an integer array or a list of ints, not set"),
    ("positions.pad_rows", lambda: positions.pad_rows([0, 1, 2], 2), ValueError,
     "3 entries do not fit the bucket of size=2"),
    ("positions.RowMap", lambda: RowMap(0), ValueError, "capacity=0"),
    ("speculative_positions.plan_chain", lambda: speculative_positions.plan_chain(TABLE, jnp.array([4], jnp.int32),
                                                              jnp.array([1], jnp.int32), OUT),
     ValueError, "rows[0]=4 is no row"),
    ("speculative_positions.plan_tree", lambda: speculative_positions.plan_tree(
        TABLE, ROWS, TWO, np.array([0, 2**32, 0, 0], np.int64), OUT), ValueError,
     "depths has values in [0, 4294967296]"),
    ("speculative_positions.plan_draft", lambda: speculative_positions.plan_draft(
        TABLE, ROWS, jnp.array([3, 3], jnp.int32), OUT, step=1, max_seq_len=64), ValueError,
     "plan 6 tokens, more than out's 4"),
    ("speculative_positions.accept", lambda: speculative_positions.accept(TABLE, jnp.array([-1], jnp.int32),
                                                      jnp.array([0], jnp.int32)),
     ValueError, "rows[0]=-1 is no row"),
    ("wire.encode", lambda: wire.encode(bytes(31), []), wire.WireFormatError,
     "fingerprint must be 32 bytes"),
    ("wire.decode", lambda: wire.decode(b"JRPR"), wire.WireFormatError, "truncated"),
]


@pytest.mark.parametrize("case", CORE_CALLS, ids=lambda c: f"{c[0]}: {c[3]}")
def test_a_bad_core_call_raises_naming_its_argument(case):
    _, call, error, fragment = case
    raises_naming_it_and_leaves_the_table(TABLE, call, error, fragment)


def test_every_entry_point_has_a_bad_call():
    named = {entry for entry, *_ in CORE_CALLS}
    functions = [name for name, obj in vars(positions).items()
                 if not name.startswith("_") and (inspect.isfunction(obj) or obj is RowMap)
                 and obj.__module__ in (positions.__name__, RowMap.__module__)]
    checked = ("plan_chain", "plan_tree", "plan_draft", "accept")  # the section's list
    wanted = ({f"positions.{name}" for name in functions} | {f"speculative_positions.{n}" for n in checked}
              | {"apply_rope", "apply_rope_and_append_kv", "RopeConfig", "RopeConfig.from_hf",
                 "wire.encode", "wire.decode"})
    assert wanted <= named, sorted(wanted - named)


def test_numpy_scalars_configure_exactly_as_python_numbers():
    plain = jr.RopeConfig(head_dim=64, theta=5e5, max_position=4096)
    numpy = jr.RopeConfig(head_dim=np.int64(64), theta=np.float32(5e5), max_position=np.int32(4096))
    assert numpy == plain and hash(numpy) == hash(plain)
    assert numpy.fingerprint() == plain.fingerprint() and type(numpy.head_dim) is int


def test_apply_rope_checks_concrete_positions_only():
    q, k, _ = _qkv()
    past = jnp.array([0, 1, 1024], jnp.int32)
    with pytest.raises(ValueError, match=r"pos_ids must lie in \[0, 1024\)"):
        jr.apply_rope(q, k, past, CFG)
    rotated, _ = jax.jit(jr.apply_rope, static_argnames="cfg")(q, k, past, cfg=CFG)
    assert rotated.shape == q.shape  # traced: not checked


def test_the_fused_append_refuses_one_array_as_both_caches():
    # Checked after merge: the KV-slot branch adds this refusal (issue 26, K3).
    cache = jnp.zeros((4, 4, 1, HEAD_DIM), jnp.float32)
    with pytest.raises(ValueError, match="kv_cache"):
        _append(jnp.array([0, 1, 2], jnp.int32), cache=(cache, cache))


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_a_kv_slot_of_any_width_never_wraps_onto_another(dtype):
    # A slot that int32 would wrap onto slot 5 either raises naming `slots` or writes
    # nothing; it never writes slot 5.
    wraps = {np.int64: -2**32 + 5, np.uint64: 2**32 + 5, np.uint32: 2**31 + 5}[dtype]
    slots = np.array([wraps, 7, -1 if dtype == np.int64 else 8], dtype)
    try:
        _, (k_cache, v_cache) = _append(slots)
    except ValueError as e:
        assert "slots" in str(e), str(e)
        return
    assert not np.asarray(v_cache).reshape(16, -1)[5].any()


def test_a_traced_kv_slot_out_of_range_skips_its_token():
    step = jax.jit(jr.apply_rope_and_append_kv, static_argnames="cfg")
    q, k, v = _qkv()
    slots = jnp.array([16, 3, -7], jnp.int32)  # past the 16 slots, in range, negative
    _, (k_cache, v_cache) = step(q, k, v, jnp.arange(3, dtype=jnp.int32), _cache(), slots, cfg=CFG)
    flat = np.asarray(v_cache).reshape(16, -1)
    np.testing.assert_array_equal(flat[3], np.asarray(v[1]).reshape(-1))
    assert not np.delete(flat, 3, axis=0).any()


def test_positions_take_python_lists():
    table = positions.commit(positions.init(4), [2, 0], [3, 1])
    assert positions.read(table, [0, 2, PAD]).tolist() == [1, 3, 0]
    assert positions.plan(table, [2], [2], [-1] * 3).tolist() == [3, 4, -1]


def test_traced_positions_arguments_do_what_the_section_says():
    table = PositionTable(jnp.array([3, 2**31 - 2], jnp.int32))
    commit, plan = jax.jit(positions.commit), jax.jit(positions.plan)
    one = jnp.array([0], jnp.int32)
    # A row off the table acts as PAD: its write is lost.
    assert commit(table, jnp.array([2], jnp.int32), one + 4).counters.tolist() == [3, 2**31 - 2]
    # Tokens past out's length are not planned while commit adds the whole count.
    assert plan(table, one, one + 6, jnp.full((4,), -1, jnp.int32)).tolist() == [3, 4, 5, 6]
    assert commit(table, one, one + 6).counters[0] == 9
    # A negative count moves a counter back; an overflowing one wraps.
    assert commit(table, one, one - 2).counters[0] == 1
    assert commit(table, one + 1, one + 3).counters[1] == -2**31 + 1
    # Of a row repeated in a rollback, one unspecified entry wins.
    rolled = jax.jit(positions.rollback)(table, jnp.array([0, 0], jnp.int32),
                                         jnp.array([1, 2], jnp.int32))
    assert int(rolled.counters[0]) in (1, 2)


def test_wire_refusals_name_their_check():
    fingerprint = CFG.fingerprint()
    record = wire.encode(fingerprint, [wire.StreamRecord("text", 9)])
    refusals = {"truncated": record[:-1], "checksum": record[:-1] + bytes([record[-1] ^ 1]),
                "magic": b"XRPR" + record[4:]}
    for reason, data in refusals.items():
        with pytest.raises(wire.WireFormatError) as raised:
            wire.decode(data)
        assert raised.value.reason == reason, (reason, raised.value.reason, str(raised.value))
    with pytest.raises(wire.WireFormatError) as raised:
        wire.decode(record, expect_fingerprint=bytes(32))
    assert raised.value.reason == "fingerprint"
    with pytest.raises(wire.WireFormatError) as raised:
        wire.encode(fingerprint, [wire.StreamRecord("text", -1)])
    assert raised.value.reason == "value" and "position=-1" in str(raised.value)
    assert zlib.crc32(record[:-4]) == int.from_bytes(record[-4:], "little")


# -- counters in the core: back only through rollback, admit (newer epoch), fork, reset --


def test_core_counters_move_back_only_through_the_listed_calls(rng):
    capacity, steps = 6, 400
    table = positions.init(capacity)
    backs = {"rollback": 0, "admit": 0, "fork": 0, "reset": 0}
    for _ in range(steps):
        op = str(rng.choice(["commit", "advance", "raise_to", "set_deltas", "rollback", "admit",
                             "fork", "reset", "grow"]))
        n = int(rng.integers(1, 4))
        rows = rng.choice(capacity, n, replace=False)
        values = rng.integers(0, 50, n)
        before = np.asarray(table.counters).copy()
        epochs_before = np.asarray(table.epochs).copy()
        if op == "commit":
            table = positions.commit(table, rows, values, scheme=str(rng.choice(["sequential", "block"])))
        elif op == "advance":
            table = positions.advance(table, rows, values)
        elif op == "raise_to":
            table = positions.raise_to(table, rows, values * 3)
        elif op == "set_deltas":
            table = positions.set_deltas(table, rows, -values)
        elif op == "rollback":
            table = positions.rollback(table, rows, values)
        elif op == "admit":
            epochs = epochs_before[rows] + rng.integers(-1, 2, n).clip(-epochs_before[rows])
            table = positions.admit(table, rows, values, -values, epochs)
        elif op == "fork":
            src = rng.choice(capacity, n, replace=False)
            table = positions.fork(table, src, rows)
        elif op == "reset":
            table = positions.reset(table, rows)
        else:
            table = positions.grow(table, capacity)
        after = np.asarray(table.counters)
        back = np.flatnonzero(after < before)
        if not back.size:
            continue
        assert op in backs, (op, before.tolist(), after.tolist())
        backs[op] += 1
        if op == "rollback":  # a rewind starts a new epoch
            assert (np.asarray(table.epochs)[back] == epochs_before[back] + 1).all()
        elif op == "admit":  # only a record of a newer epoch moves a counter back
            assert (np.asarray(table.epochs)[back] > epochs_before[back]).all()
        elif op == "fork":  # the destination takes the source's counter
            assert set(after[back]) <= set(before[src])
        else:
            assert not after[back].any()
    assert all(backs.values()), backs  # the walk saw every kind of move back


# -- the bridge --------------------------------------------------------------------------


def _manager(max_seq_len=64, labels=("cond", "uncond")):
    from torch_bridge import PositionConfig, RopeManager

    return RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024),
                                      labels=labels), "cpu", max_seq_len=max_seq_len,
                       launcher="jax")


def _busy():
    from torch_bridge import PositionStep, Segment, StepContext

    mgr = _manager()
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    mgr.apply_cached_prefix("a", None, None, None, {"cond": 10})
    step = PositionStep([Segment("a", "cond", 2), Segment("b", "cond", 1)])
    mgr.plan(step, StepContext(("a", "b")))
    return mgr


def _bridge_calls():
    from torch_bridge import PositionStep, PublishedPositionInfo, Segment, StepContext

    qk = lambda tokens=3: (torch.randn(tokens, 2, HEAD_DIM), torch.randn(tokens, 1, HEAD_DIM))  # noqa: E731
    cache = lambda: torch.zeros(4, 2, 4, 1, HEAD_DIM)  # noqa: E731
    step = PositionStep([Segment("a", "cond", 2), Segment("b", "cond", 1)])
    ctx = StepContext(("a", "b"))
    return [
        ("__init__", lambda m: _manager(max_seq_len=0), ValueError, "max_seq_len=0"),
        ("ingest_request", lambda m: m.ingest_request(["c"]), TypeError, "rid=['c']"),
        ("plan", lambda m: m.plan(PositionStep([Segment("a", "cond", -1)]), StepContext(("a",))),
         ValueError, "span=-1 must be an int in [0, 2147483647]"),
        ("plan", lambda m: m.plan(PositionStep([Segment("a", "uncond", 3)], tree={
            ("a", "uncond"): (1, 2, 2)}), StepContext(("a",))), ValueError, "is not a draft tree"),
        ("commit", lambda m: m.commit(PositionStep([Segment("a", "cond", 4)]), ctx), ValueError,
         "commit's step has 1 segments but the plan has 2"),
        ("apply_qk", lambda m: m.apply_qk(*(x.double() for x in qk()), "cond"), ValueError,
         "q.dtype=torch.float64 must be one of"),
        ("apply_qk_and_append_kv", lambda m: m.apply_qk_and_append_kv(
            *qk(), torch.randn(3, 1, HEAD_DIM), "cond", cache(), torch.zeros(3)), ValueError,
         "slots.dtype=torch.float32 must be an integer dtype"),
        ("apply_mla_and_append_kv", lambda m: m.apply_mla_and_append_kv(
            qk()[0], torch.randn(3, HEAD_DIM), torch.randn(3, 16), "cond",
            torch.zeros(4, 4, 16 + HEAD_DIM), torch.zeros(3)), ValueError,
         "slots.dtype=torch.float32 must be an integer dtype"),
        ("position", lambda m: m.position("a", "image"), ValueError, "label='image'"),
        ("delta", lambda m: m.delta("ghost", "cond"), ValueError, "'ghost'"),
        ("pos_ids", lambda m: m.pos_ids("nope"), ValueError, "label='nope'"),
        ("live", lambda m: m.live("nope"), ValueError, "label='nope'"),
        ("rollback", lambda m: m.rollback("b", "uncond", -1), ValueError, "to_position['uncond']=-1"),
        ("reset_request", lambda m: m.reset_request("a", free="yes"), TypeError, "free='yes'"),
        ("remove_request", lambda m: m.remove_request(["a"]), TypeError, "rid=['a']"),
        ("apply_cached_prefix", lambda m: m.apply_cached_prefix("a", None, None, None, {"cond": 65}),
         ValueError, "prefix"),
        ("admit_retrieve", lambda m: m.admit_retrieve("a", None, None, {"cond": 5}), TypeError,
         "published must be a PublishedPositionInfo"),
        ("publish", lambda m: m.publish(["a"]), TypeError, "['a']"),
        ("publish_snapshot_for_step", lambda m: m.publish_snapshot_for_step(["a"], None, None),
         TypeError, "['a']"),
        ("publish_from_snapshot", lambda m: m.publish_from_snapshot("a", ((1, 0),), None, None),
         TypeError, "snapshot=((1, 0),)"),
        ("admit_retrieve", lambda m: m.admit_retrieve(["a"], None, None,
                                                      PublishedPositionInfo({"cond": 5})),
         TypeError, "rid=['a']"),
    ]


@needs_torch
def test_a_bad_bridge_call_raises_naming_its_argument_and_changes_nothing():
    failures = []
    for method, call, error, fragment in _bridge_calls():
        mgr = _busy()
        before = mgr.state_snapshot()
        try:
            call(mgr)
        except error as e:
            if fragment not in str(e):
                failures.append(f"{method}: {fragment!r} not in {str(e)!r}")
        except Exception as e:  # noqa: BLE001 - a wrong type of error is a failure too
            failures.append(f"{method}: {type(e).__name__}: {e}")
        else:
            failures.append(f"{method}: no {error.__name__}")
        if mgr.state_snapshot() != before:
            failures.append(f"{method}: the state changed")
    assert not failures, "\n".join(failures)


@needs_torch
@pytest.mark.parametrize("dtype", ["int64", "uint32", "int16"])
def test_a_bridge_kv_slot_of_any_width_outside_the_cache_is_refused_on_cpu(dtype):
    # 2**32 + 5 cut to its low 32 bits would be slot 5; past the cache at any width, and
    # refused where the values are on the host, as the eager core op refuses it; a
    # negative slot (padding) is skipped.
    mgr = _busy()
    beyond = {"int64": 2**32 + 5, "uint32": 2**31 + 5, "int16": 2**14 + 5}[dtype]
    cache = torch.zeros(4, 2, 4, 1, HEAD_DIM)
    v = torch.randn(3, 1, HEAD_DIM)
    args = (torch.randn(3, 2, HEAD_DIM), torch.randn(3, 1, HEAD_DIM), v, "cond", cache)
    with pytest.raises(ValueError, match=f"got a maximum of {beyond}"):
        mgr.apply_qk_and_append_kv(*args, torch.tensor([beyond, 3, 9], dtype=getattr(torch, dtype)))
    assert not cache.any()
    if dtype == "uint32":   # no negative slot to skip
        return
    mgr.apply_qk_and_append_kv(*args, torch.tensor([-beyond, 3, 9], dtype=getattr(torch, dtype)))
    values = cache[:, 1].reshape(16, HEAD_DIM)
    written = [3, 9]
    torch.testing.assert_close(values[written], v[1:, 0], rtol=0, atol=0)
    assert not values[[i for i in range(16) if i not in written]].any()


@needs_torch
def test_every_public_bridge_method_with_arguments_has_a_bad_call():
    from torch_bridge import RopeManager

    named = {method for method, *_ in _bridge_calls()}
    takes_arguments = {name for name, member in inspect.getmembers(RopeManager, inspect.isfunction)
                       if not name.startswith("_") and name not in ("build", "depends_on")
                       and len(inspect.signature(member).parameters) > 1}
    assert takes_arguments <= named, sorted(takes_arguments - named)


@needs_torch
def test_every_admit_refusal_reason_starts_the_same_way():
    # Checked after merge: the admit vocabulary and the planned-stream refusal come from
    # other branches (issue 26, items 1 and 4).
    from torch_bridge import PublishedPositionInfo

    mgr = _busy()
    one_d_delta = PublishedPositionInfo({"cond": 5}, {"cond": -3})
    record = mgr.publish("b").to_bytes()
    refusals = {
        "unknown request": ("ghost", PublishedPositionInfo({"cond": 5})),
        "unknown label": ("b", PublishedPositionInfo({"image": 5})),
        "position past max_seq_len": ("b", PublishedPositionInfo({"uncond": 65})),
        "delta into 1-D RoPE": ("b", one_d_delta),
        "epoch out of range": ("b", PublishedPositionInfo({"uncond": 5}, {}, {"uncond": 2**31})),
        "damaged bytes": ("b", record[:-1]),
        "another config": ("b", PublishedPositionInfo({"uncond": 5}, fingerprint=bytes(32))),
        "a rollback record for a planned stream": (
            "a", PublishedPositionInfo({"cond": 5}, {}, {"cond": 1})),
    }
    before = mgr.state_snapshot()
    failures = []
    for name, (rid, published) in refusals.items():
        outcome = mgr.admit_retrieve(rid, None, None, published)
        if outcome.ok or not outcome.reason.startswith("published record refused ("):
            failures.append(f"{name}: {outcome}")
    assert not failures, "\n".join(failures)
    assert mgr.state_snapshot() == before


@needs_torch
def test_remove_publish_and_ingest_again_are_no_ops():
    mgr = _busy()
    mgr.remove_request("ghost")
    assert mgr.publish("ghost") is None
    mgr.ingest_request("b")
    before = mgr.state_snapshot()
    mgr.remove_request("ghost")
    mgr.ingest_request("a")  # never resets a counter
    assert mgr.state_snapshot() == before and mgr.position("a", "cond") == 10
    mgr.remove_request("b")
    after_remove = mgr.state_snapshot()
    mgr.remove_request("b")
    assert mgr.state_snapshot() == after_remove


@needs_torch
def test_bridge_counters_move_back_only_through_the_listed_calls(rng):
    from torch_bridge import (Fork, KVPlanOutput, KVView, PositionStep, PublishedPositionInfo,
                              Segment, StepContext)

    max_seq_len, labels = 48, ("cond", "uncond")
    mgr, peer = _manager(max_seq_len), _manager(max_seq_len)
    rids = ["r0", "r1", "r2"]
    for node in (mgr, peer):
        for rid in rids:
            node.ingest_request(rid)
    backs = set()

    def counters():
        return {(rid, label): mgr.position(rid, label) for rid in mgr.requests() for label in labels}

    for _ in range(300):
        op = str(rng.choice(["step", "fork_step", "prefix", "stale_admit", "newer_admit",
                             "rollback", "reset", "remove_ingest", "too_far"]))
        rid, label = str(rng.choice(rids)), str(rng.choice(labels))
        other = labels[1 - labels.index(label)]
        before = counters()
        explained = set()
        if op in ("step", "fork_step", "too_far"):
            span = int(rng.integers(1, 4)) if op != "too_far" else max_seq_len + 1
            step = PositionStep([Segment(rid, label, span)])
            forks = ({"kv": {"attn": KVPlanOutput([KVView(rid, label, span)],
                                                  post_forks=[Fork(rid, label, other)])}}
                     if op == "fork_step" else {})
            ctx = StepContext((rid,), plan_results=forks)
            try:
                mgr.plan(step, ctx)
            except ValueError as e:
                assert "max_seq_len" in str(e), str(e)
                assert counters() == before
                continue
            assert op != "too_far"
            mgr.commit(step, ctx)
            explained = {(rid, other)} if op == "fork_step" else set()
        elif op == "prefix":
            mgr.apply_cached_prefix(rid, None, None, None, {label: int(rng.integers(0, max_seq_len))})
        elif op == "stale_admit":  # a record of the same epoch: within an epoch, max
            published = mgr.publish(rid)
            lower = {k: max(0, v - 3) for k, v in published.counters.items()}
            assert mgr.admit_retrieve(rid, None, None, PublishedPositionInfo(
                lower, published.deltas, published.epochs, published.fingerprint,
                rewinds=published.rewinds)).ok
        elif op == "newer_admit":
            # r2 is rewound by the peer alone (one writer): the peer takes this node's
            # record, rolls the stream back and publishes; its rewind, which this node
            # lacks, wins here.
            rid = "r2"
            peer.admit_retrieve(rid, None, None, mgr.publish(rid))
            peer.rollback(rid, label, int(rng.integers(0, max(1, peer.position(rid, label)))))
            record, mine = peer.publish(rid), mgr.publish(rid).epochs
            explained = {(rid, l) for l in labels if record.epochs.get(l, 0) > mine.get(l, 0)}
            if not mgr.admit_retrieve(rid, None, None, record).ok:
                assert counters() == before
        elif op == "rollback":
            rid = str(rng.choice(rids[:2]))  # this node rewinds r0 and r1, the peer r2
            mgr.rollback(rid, label, int(rng.integers(0, max_seq_len)))
            explained = {(rid, label)}
        elif op == "reset":
            mgr.reset_request(rid)
            explained = {(rid, label_) for label_ in labels}
        else:
            mgr.remove_request(rid)
            mgr.ingest_request(rid)
            explained = {(rid, label_) for label_ in labels}
        after = counters()
        assert all(0 <= value <= max_seq_len for value in after.values()), after
        moved_back = {key for key in before if after.get(key, 0) < before[key]}
        assert moved_back <= explained, (op, moved_back, before, after)
        if moved_back:
            backs.add(op)
    assert backs == {"fork_step", "newer_admit", "rollback", "reset", "remove_ingest"}, backs
