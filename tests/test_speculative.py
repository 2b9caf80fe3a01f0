"""Speculative decoding in the core (jaxrope.speculative_positions): no torch, so the JAX 0.11
leg runs it.

The rules against hand-worked cases and a per-token model here; the bridge's records in
tests/test_speculative_bridge.py; the two executors against each other in
tests/test_counter_rules.py; both against plain-Python re-implementations of vLLM's and
SGLang's rules in tests/test_speculative_reference.py; the manager against a core model
in tests/test_manager_state_machine.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrope import positions, speculative_positions
from jaxrope.positions import PAD, PositionTable


def _table(counters, deltas=None):
    counters = jnp.asarray(counters, jnp.int32)
    return PositionTable(counters, None if deltas is None else jnp.asarray(deltas, jnp.int32))


# ---------------------------------------------------------------------------- core


def test_a_chain_of_k_drafts_is_verified_at_n_to_n_plus_k():
    table = _table([5, 9])
    out = speculative_positions.plan_chain(table, jnp.array([1, 0], jnp.int32), jnp.array([3, 0], jnp.int32),
                                 jnp.full(6, -1, jnp.int32))
    assert out.tolist() == [9, 10, 11, 12, 5, -1]


def test_mrope_drafts_move_all_three_rows_together_from_counter_plus_delta():
    table = _table([20, 9], deltas=[-7, 0])
    slots = jnp.array([0, 1], jnp.int32)
    chain = speculative_positions.plan_chain(table, slots, jnp.array([2, 1], jnp.int32),
                                   jnp.zeros((3, 5), jnp.int32))
    assert chain.tolist() == [[13, 14, 15, 9, 10]] * 3
    draft, live = speculative_positions.plan_draft(table, slots, jnp.array([1, 1], jnp.int32),
                                         jnp.zeros((3, 2), jnp.int32), step=2, max_seq_len=21)
    # The bound is the sequence index (20 - 1 + 2 = 21), not the t row (14): vLLM #54498.
    assert live.tolist() == [False, True] and draft.tolist() == [[0, 10]] * 3


def test_draft_steps_number_from_the_last_accepted_token_or_from_seq_len():
    table = _table([10])
    args = (table, jnp.array([0], jnp.int32), jnp.array([4], jnp.int32), jnp.zeros(4, jnp.int32))
    vllm = [speculative_positions.plan_draft(*args, step=j, max_seq_len=100)[0].tolist() for j in (1, 2, 3)]
    sglang = [speculative_positions.plan_draft(*args, step=j, max_seq_len=100, offset=0)[0].tolist()
              for j in (1, 2, 3)]
    assert vllm == [[10] * 4, [11] * 4, [12] * 4]     # topk = 4 branches share the position
    assert sglang == [[11] * 4, [12] * 4, [13] * 4]


def test_a_jitted_draft_loop_never_retraces_for_a_new_step_or_new_counters(rng):
    traces = []

    def draft(table, slots, counts, out, step):
        traces.append(1)
        return speculative_positions.plan_draft(table, slots, counts, out, step=step, max_seq_len=64)

    draft = jax.jit(draft)
    slots, counts = jnp.asarray(positions.pad_rows([0, 2], 4)), jnp.array([1, 1, 0, 0], jnp.int32)
    for step in range(1, 6):
        table = _table(rng.integers(0, 64, 3))
        pos, live = draft(table, slots, counts, jnp.full(3, -1, jnp.int32), step)
        index = np.asarray(table.counters)[[0, 2]] - 1 + step
        assert pos.tolist() == [*np.where(index < 64, index, 0).tolist(), -1]
        assert live.tolist() == [*(index < 64).tolist(), False]
    assert len(traces) == 1


def test_tree_depths_from_sglang_parents_and_the_documented_positions():
    depths = speculative_positions.tree_depths(jnp.array([-1, 0, 0, 1], jnp.int32))
    assert depths.tolist() == [0, 1, 1, 2]
    got = speculative_positions.plan_tree(_table([7]), jnp.array([0], jnp.int32), jnp.array([4], jnp.int32),
                                depths, jnp.zeros(4, jnp.int32))
    assert got.tolist() == [7, 8, 8, 9]     # SGLang build_eagle_tree.py's comment


@pytest.mark.parametrize("depths,fragment", [
    (np.array([0, 5]), "depths has values in [0, 5]; a tree of 2 tokens has depths in [0, 2)"),
    (np.array([1, 2]), "depths has values in [1, 2]"),          # no root: 10 was never computed
    (np.array([0, 2 ** 64 - 1], np.uint64), "depths has values in [0, 18446744073709551615]"),
    (np.array([0, 0]), "the depths of view 0, [0, 0], are not a draft tree"),
])
def test_plan_tree_refuses_depths_that_are_not_a_tree_at_their_own_width(depths, fragment):
    # Depths (0, 5) were planned at [10, 15], (1, 2) at [11, 12] with position 10 never
    # computed, and uint64 2**64 - 1 wrapped to -1: [10, 9].
    one = jnp.array([0], jnp.int32)
    with pytest.raises(ValueError) as raised:
        speculative_positions.plan_tree(_table([10]), one, jnp.array([2], jnp.int32), depths,
                              jnp.zeros(2, jnp.int32))
    assert fragment in str(raised.value), str(raised.value)
    with pytest.raises(TypeError, match="depths must be an integer array, got dtype bool"):
        speculative_positions.plan_tree(_table([10]), one, jnp.array([2], jnp.int32), np.array([True, False]),
                              jnp.zeros(2, jnp.int32))


def test_valid_trees_masks_views_under_jit_where_plan_tree_cannot_raise():
    counts = jnp.array([4, 2, 2, 0, 1], jnp.int32)
    depths = jnp.array([0, 1, 1, 2, 1, 2, 0, 0, 0, 9], jnp.int32)   # the tail is ignored
    assert jax.jit(speculative_positions.valid_trees)(counts, depths).tolist() == [True, False, False, True, True]


def test_tree_depths_and_accept_refuse_what_would_wrap_or_loop():
    with pytest.raises(ValueError, match=r"parents\[1\]=1 must be -1 \(a root\) or an earlier token"):
        speculative_positions.tree_depths(jnp.array([-1, 1], jnp.int32))
    with pytest.raises(ValueError, match=r"accepted\[0\]=-1 must lie in \[0, 2147483646\]"):
        speculative_positions.accept(_table([5, 9]), jnp.array([0, 1], jnp.int32), np.array([-1, 0]))
    with pytest.raises(ValueError, match="18446744073709551615"):
        speculative_positions.accept(_table([5]), jnp.array([0], jnp.int32), np.array([2 ** 64 - 1], np.uint64))


def test_tree_depths_of_a_deep_chain_need_only_log_rounds():
    n = 1000
    parents = jnp.arange(-1, n - 1, dtype=jnp.int32)
    assert speculative_positions.tree_depths(parents).tolist() == list(range(n))


def test_accept_advances_by_the_accepted_drafts_plus_the_root_and_keeps_the_epoch():
    table = positions.rollback(_table([30, 9]), jnp.array([0], jnp.int32), jnp.array([20], jnp.int32))
    table = speculative_positions.accept(table, jnp.asarray(positions.pad_rows([0, 1], 3)),
                               jnp.array([2, 0, 5], jnp.int32))
    assert table.counters.tolist() == [23, 10] and table.epochs.tolist() == [1, 0]


def test_eagle_input_ids_match_vllms_documented_shift():
    a1, b1, b2, c1, c2, c3 = 11, 21, 22, 31, 32, 33
    a2, b3, c4 = 12, 23, 34
    got = speculative_positions.eagle_input_ids(jnp.array([a1, b1, b2, c1, c2, c3], jnp.int32),
                                      jnp.array([a2, b3, c4, 99], jnp.int32),
                                      jnp.array([0, 2, 5, PAD], jnp.int32))
    assert got.tolist() == [a2, b2, b3, c2, c3, c4]


def test_speculative_rules_lower_for_cuda():
    from jaxrope.testing import lowering

    def step(table, slots, counts, depths):
        tree = speculative_positions.plan_tree(table, slots, counts, depths, jnp.zeros(8, jnp.int32))
        draft, live = speculative_positions.plan_draft(table, slots, counts, jnp.zeros((3, 8), jnp.int32),
                                             step=2, max_seq_len=64)
        return speculative_positions.accept(table, slots, counts - 1), tree, draft, live

    args = (positions.init(8), jnp.asarray(positions.pad_rows([1, 3], 4)),
            jnp.array([3, 3, 0, 0], jnp.int32), jnp.zeros(8, jnp.int32))
    with lowering.cuda_target():
        text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo" in text
