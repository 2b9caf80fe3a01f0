"""Where each step's positions go: the pinned ring's arithmetic before their copy to the
device, and the device chunks the copy lands in.

The ring and the driver's copy need CUDA (tests/gpu/test_bridge_gpu.py laps the ring
under a late device and copies on two streams); the cursor and the chunks' bookkeeping
are checked here for every sequence of span sizes.
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


@settings(max_examples=300, deadline=None)
@given(takes=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([0, 7])), max_size=60))
def test_device_chunk_spans_are_aligned_fresh_and_tell_the_allocator_of_other_streams(takes):
    # Each span is memory no earlier span of a live chunk holds (a returned tensor is never
    # rewritten under its holder), starts aligned, and a chunk used on a second stream is
    # reported once for it (torch's record_stream before the chunk is freed).
    torch = pytest.importorskip("torch")
    reported = []
    chunks = upload.DeviceChunks(lambda n: torch.zeros(n, dtype=torch.int32), size=32, align=8,
                                 on_stream=lambda chunk: reported.append(chunk))
    taken, streams_of = {}, {}
    for n, stream in takes:
        chunk, start = chunks.take(n, stream)
        if n > 32:
            assert (chunk, start) == (None, None)
            continue
        assert start % 8 == 0 and start + n <= 32
        spans = taken.setdefault(id(chunk), [])
        assert all(start >= end or start + n <= begin for begin, end in spans if n)
        spans.append((start, start + n))
        streams_of.setdefault(id(chunk), [chunk, set()])[1].add(stream)
    for chunk, streams in streams_of.values():
        assert sum(c is chunk for c in reported) == len(streams) - 1
