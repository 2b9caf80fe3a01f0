"""The pinned ring's arithmetic: where each step's positions go before their copy to the device.

The ring itself needs CUDA (tests/gpu/test_bridge_gpu.py laps it under a late device);
its cursor is plain arithmetic and is checked here for every sequence of span sizes.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

upload = pytest.importorskip("torch_bridge.upload", reason="torch_bridge needs torch")

SIZE, PARTS = 64, 4


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, SIZE // PARTS + 2), max_size=60))
def test_spans_stay_inside_one_part_and_every_new_part_is_reported(sizes):
    cursor = upload.RingCursor(SIZE, PARTS)
    part_size, part = SIZE // PARTS, 0
    for n in sizes:
        start, entered = cursor.take(n)
        if n > part_size:
            assert (start, entered) == (None, None)
            continue
        if n == 0:  # copies nothing, may sit at a part's end, never opens a part
            assert entered is None
            continue
        here = start // part_size
        assert start + n <= (here + 1) * part_size  # never crosses into the next part
        if here != part:
            assert entered == here == (part + 1) % PARTS and start == here * part_size
        else:
            assert entered is None
        part = here


def test_a_part_filled_exactly_to_its_end_hands_the_next_span_to_the_next_part():
    # The bug of the first ring: an offset exactly at a part's end was read as the next
    # part without leaving the current one, and the last part's next span fell off the end.
    cursor = upload.RingCursor(SIZE, PARTS)
    part_size = SIZE // PARTS
    starts = [cursor.take(part_size) for _ in range(PARTS + 1)]
    assert starts == [(0, None), (16, 1), (32, 2), (48, 3), (0, 0)]
