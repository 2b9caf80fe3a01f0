"""The wire format: valid records round-trip exactly; anything else is refused cleanly.

Fuzzed with hypothesis over more than 2.5 * 10^4 decoded inputs: every single change
of 40 random records (each truncation, bit flip, byte substitution and insertion: at
least 485 inputs per record), 5000 random strings (half behind a valid magic and
version), and 700 random bodies behind a valid header and a recomputed checksum. Every refusal must be a WireFormatError; nothing may decode to
a record other than the one encoded. A record that decodes must be canonical: encoding
what it decoded to gives back the same bytes.
"""

from __future__ import annotations

import re
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxrope as jr
from jaxrope import wire
from jaxrope.wire import StreamRecord, WireFormatError

FINGERPRINT = jr.RopeConfig(head_dim=128).fingerprint()
HEADER = 40  # magic 4, version 1, flags 1, count 2, fingerprint 32
CHECKSUM = 4


def _labels():
    # Up to 12 characters of any plane: at most 48 UTF-8 bytes, the format's limit.
    return st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)


@st.composite
def rewinds(draw, max_writers=3):
    writers = sorted(draw(st.sets(st.integers(0, 2**32 - 1), max_size=max_writers)))
    budget, pairs = wire.MAX_EPOCH, []
    for writer in writers:
        if budget < 1:
            break
        count = draw(st.integers(1, min(budget, 2**31 - 1)))
        budget -= count
        pairs.append((writer, count))
    return tuple(pairs)


@st.composite
def records(draw, max_streams=6):
    labels = draw(st.lists(_labels(), max_size=max_streams, unique=True))
    streams = [StreamRecord(label, draw(st.integers(0, 2**31 - 1)),
                            draw(st.integers(-2**31, 2**31 - 1)), draw(rewinds()))
               for label in labels]
    return draw(st.binary(min_size=32, max_size=32)), streams


def _size(record: StreamRecord) -> int:
    return 10 + len(record.label.encode()) + 8 * len(record.rewinds)


def _refused(data: bytes, **kwargs) -> WireFormatError:
    with pytest.raises(WireFormatError) as info:
        wire.decode(data, **kwargs)
    return info.value


def _with_checksum(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@settings(max_examples=300, deadline=None)
@given(records())
def test_a_valid_record_round_trips_exactly(record):
    fingerprint, streams = record
    data = wire.encode(fingerprint, streams)
    assert len(data) == HEADER + CHECKSUM + sum(map(_size, streams))
    assert wire.decode(data) == (fingerprint, tuple(streams))
    assert wire.decode(bytearray(data), expect_fingerprint=fingerprint)[1] == tuple(streams)


def _damaged(data: bytes, value: int):
    """Every single change of ``data``: each truncation, each bit flipped, each byte
    replaced by another, a byte inserted at each offset, one appended."""
    for i in range(len(data)):
        yield "truncate", data[:i]
        for bit in range(8):
            yield "flip", data[:i] + bytes((data[i] ^ (1 << bit),)) + data[i + 1:]
        other = (data[i] + 1 + (value + i) % 255) % 256  # never data[i]
        yield "substitute", data[:i] + bytes((other,)) + data[i + 1:]
        yield "insert", data[:i] + bytes(((value + i) % 256,)) + data[i:]
    yield "append", data + bytes((value % 256,))


@settings(max_examples=40, deadline=None)
@given(records(max_streams=3), st.integers(0, 255))
def test_every_single_change_of_a_record_is_refused(record, value):
    # 11 inputs per byte of a 44-300 byte record, ~500-3300 per example. One change is
    # always caught (CRC-32 catches every burst of up to 32 bits, the layout's lengths the
    # rest), so none can be a lucky collision.
    data = wire.encode(*record)
    for kind, damaged in _damaged(data, value):
        error = _refused(damaged)
        if kind == "truncate":
            assert error.reason == "truncated", error


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=160), min_size=10, max_size=10))
def test_random_bytes_are_refused(strings):
    for data in strings:
        _refused(data)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=120), min_size=10, max_size=10))
def test_random_bytes_behind_the_magic_and_version_are_refused(tails):
    for tail in tails:
        _refused(wire.MAGIC + bytes((wire.VERSION,)) + tail)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.integers(0, 6), st.binary(min_size=32, max_size=32),
       st.binary(max_size=120))
def test_a_checksummed_record_decodes_canonically_or_is_refused(flags, count, fingerprint, body):
    # A valid checksum over arbitrary content reaches every check after it (flags,
    # labels, values): whatever decodes must be what encode writes.
    data = _with_checksum(struct.pack("<4sBBH", wire.MAGIC, wire.VERSION, flags, count)
                          + fingerprint + body)
    try:
        decoded = wire.decode(data)
    except WireFormatError:
        return
    assert wire.encode(*decoded) == data


_PAIRS = st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=3)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=0, max_size=8), st.integers(-2**31, 2**31 - 1),
                          st.integers(-2**31, 2**31 - 1), _PAIRS | st.just([])),
                max_size=4))
def test_structurally_sound_records_with_bad_fields_are_refused_for_the_right_reason(raw):
    # Well-formed layout and checksum, raw label bytes, signed positions and any rewind
    # pairs: a label that is empty, not UTF-8 or repeated, a negative position, writers
    # not ascending, a writer with no rollback or an epoch past 2**31 - 1 is refused and
    # named.
    body = struct.pack("<4sBBH", wire.MAGIC, wire.VERSION, 0, len(raw)) + FINGERPRINT
    for label, position, delta, pairs in raw:
        body += bytes((len(label),)) + label + struct.pack("<iiB", position, delta, len(pairs))
        body += b"".join(struct.pack("<II", *pair) for pair in pairs)
    data = _with_checksum(body)
    labels = []
    for label, position, _, pairs in raw:
        try:
            text = label.decode("utf-8")
        except UnicodeDecodeError:
            assert _refused(data).reason == "label"
            return
        if not text:
            assert _refused(data).reason == "label"
            return
        if position < 0:
            assert "negative position" in str(_refused(data))
            return
        writers = [w for w, _ in pairs]
        if any(a >= b for a, b in zip(writers, writers[1:])):
            assert "writers must be distinct and ascending" in str(_refused(data))
            return
        if any(count < 1 for _, count in pairs):
            assert "rollbacks must be >= 1" in str(_refused(data))
            return
        if sum(count for _, count in pairs) > wire.MAX_EPOCH:
            error = _refused(data)
            assert error.reason == "value" and "outside [0, 2147483647]" in str(error)
            return
        if text in labels:
            assert "repeats an earlier stream's" in str(_refused(data))
            return
        labels.append(text)
    assert [s.label for s in wire.decode(data)[1]] == labels


def _record(*streams):
    return wire.encode(FINGERPRINT, list(streams) or [StreamRecord("text", 7)])


@pytest.mark.parametrize("data, reason, message", [
    (b"", "truncated", "truncated at byte 0: a record has at least 44 bytes"),
    (b"JRPR\x02" + bytes(20), "truncated", "truncated at byte 25"),
    (b"XRPR" + bytes(60), "magic", r"bad magic b'XRPR' \(expected b'JRPR'\)"),
    (b"JRPR\x01" + bytes(60), "version", r"unknown format version 1 \(this decoder reads "
                                         r"version 2\)"),
    (b"JRPR\x03" + bytes(60), "version", r"unknown format version 3"),
    (_record()[:-1], "truncated", "truncated at byte 57: stream 0 ends at byte 54, then the "
                                  "4-byte checksum"),
    (_record(StreamRecord("t", 1, 0, ((5, 1),)))[:-5], "truncated",
     "stream 0 ends at byte 59"),
    (_record() + b"\x00", "length", "1 bytes between the last stream's end"),
    (_record()[:-1] + bytes(((_record()[-1] ^ 1),)), "checksum",
     "checksum mismatch .*: the record is corrupted"),
    (_with_checksum(b"JRPR\x02\x80\x00\x00" + FINGERPRINT), "flags",
     "flags 0x80 set; version 2 defines none"),
    (_with_checksum(b"JRPR\x02\x00\x01\x00" + FINGERPRINT + b"\x02\xc3\x28" + bytes(9)),
     "label", r"stream 0 \(byte 40\): label is not UTF-8"),
    (_with_checksum(b"JRPR\x02\x00\x01\x00" + FINGERPRINT + b"\x01a" + struct.pack("<iiB", -5, 0, 0)),
     "value", r"stream 0 \(byte 40\): negative position=-5 outside \[0, 2147483647\]"),
    (_with_checksum(b"JRPR\x02\x00\x02\x00" + FINGERPRINT + (b"\x01a" + bytes(9)) * 2),
     "label", r"stream 1 \(byte 51\): label='a' repeats an earlier stream's"),
    # The epoch is the sum of the rollbacks: 2**31 of them wrap an int32 epoch.
    (_with_checksum(b"JRPR\x02\x00\x01\x00" + FINGERPRINT + b"\x01a" + struct.pack(
        "<iiBII", 5, 0, 1, 7, 2**31)), "value",
     r"stream 0 \(byte 40\): epoch=2147483648 \(the sum of rewinds=\(\(7, 2147483648\),\)\) "
     r"outside \[0, 2147483647\]"),
    (_with_checksum(b"JRPR\x02\x00\x01\x00" + FINGERPRINT + b"\x01a" + struct.pack(
        "<iiBIIII", 5, 0, 2, 7, 2**30, 8, 2**30)), "value", r"epoch=2147483648 .* outside"),
    (_with_checksum(b"JRPR\x02\x00\x01\x00" + FINGERPRINT + b"\x01a" + struct.pack(
        "<iiBIIII", 5, 0, 2, 8, 1, 7, 1)), "rewinds", "writers must be distinct and ascending"),
    (_with_checksum(b"JRPR\x02\x00\x01\x00" + FINGERPRINT + b"\x01a" + struct.pack(
        "<iiBII", 5, 0, 1, 7, 0)), "rewinds", r"each writer's rollbacks must be >= 1"),
    (_with_checksum(b"JRPR\x02\x00\x01\x00" + FINGERPRINT + b"\x01a" + struct.pack(
        "<iiB", 5, 0, 17) + b"".join(struct.pack("<II", w, 1) for w in range(17))), "rewinds",
     "rewinds name 17 writers, the format carries at most 16"),
])
def test_each_refusal_says_what_is_wrong(data, reason, message):
    error = _refused(data)
    assert error.reason == reason
    assert re.search(message, str(error)), str(error)


def test_a_foreign_fingerprint_is_refused_only_when_one_is_expected():
    data = _record()
    other = jr.RopeConfig(head_dim=64).fingerprint()
    error = _refused(data, expect_fingerprint=other)
    assert error.reason == "fingerprint"
    assert f"the record's is {FINGERPRINT.hex()[:16]}..., this side's {other.hex()[:16]}" in str(error)
    assert wire.decode(data)[0] == FINGERPRINT
    assert wire.decode(data, expect_fingerprint=FINGERPRINT)[0] == FINGERPRINT
    assert _refused(data, expect_fingerprint=b"short").reason == "type"
    assert _refused("not bytes").reason == "type"


def test_a_stream_takes_10_bytes_and_its_label_plus_8_per_rewinding_writer():
    pairs = tuple((w, 1) for w in range(wire.MAX_WRITERS))
    longest = StreamRecord("x" * wire.MAX_LABEL_BYTES, 2**31 - 1, -2**31, pairs)
    assert len(wire.encode(FINGERPRINT, [longest])) - HEADER - CHECKSUM == 10 + 48 + 8 * 16
    many = [StreamRecord(f"s{i}", i) for i in range(1000)]
    assert len(wire.encode(FINGERPRINT, many)) <= HEADER + CHECKSUM + 15 * len(many)


@pytest.mark.parametrize("streams, reason, message", [
    ([StreamRecord("", 1)], "label", r"streams\[0\]: label='' is 0 bytes in UTF-8, the format "
                                     r"carries 1 to 48"),
    ([StreamRecord("é" * 25, 1)], "label", "is 50 bytes in UTF-8"),
    ([StreamRecord("\ud800", 1)], "label", "not encodable as UTF-8"),
    ([StreamRecord("a", 1), StreamRecord("a", 2)], "label",
     r"streams\[1\]: label='a' repeats an earlier stream's"),
    ([StreamRecord("a", -1)], "value", r"negative position=-1 outside \[0, 2147483647\]"),
    ([StreamRecord("a", 2**31)], "value", "position=2147483648 outside"),
    ([StreamRecord("a", 0, delta=2**31)], "value", "delta=2147483648 outside"),
    ([StreamRecord("a", 0, rewinds=((1, 2**31 - 1), (2, 1)))], "value",
     r"epoch=2147483648 \(the sum of rewinds=\(\(1, 2147483647\), \(2, 1\)\)\) outside "
     r"\[0, 2147483647\]"),
    ([StreamRecord("a", 0, rewinds=((1, 0),))], "rewinds", "rollbacks must be >= 1"),
    ([StreamRecord("a", 0, rewinds=((2, 1), (1, 1)))], "rewinds", "distinct and ascending"),
    ([StreamRecord("a", 0, rewinds=((2**32, 1),))], "rewinds", r"writer ids must be in "
                                                               r"\[0, 4294967295\]"),
    ([StreamRecord("a", 0, rewinds=[(1, 1)])], "type", "must be a tuple of"),
    ([StreamRecord("a", 1.0)], "type", r"position=1.0 must be an int"),
    ([StreamRecord("a", True)], "type", r"position=True must be an int"),
    ([StreamRecord(3, 1)], "type", r"label=3 must be a str"),
    (["text"], "type", r"streams\[0\] must be a StreamRecord, got str"),
])
def test_encode_refuses_what_the_format_cannot_carry(streams, reason, message):
    with pytest.raises(WireFormatError, match=message) as info:
        wire.encode(FINGERPRINT, streams)
    assert info.value.reason == reason


def test_encode_refuses_a_bad_fingerprint_and_too_many_streams():
    with pytest.raises(WireFormatError, match="fingerprint must be 32 bytes, got 31 bytes"):
        wire.encode(FINGERPRINT[:31], [])
    with pytest.raises(WireFormatError, match="65536 streams, the format carries at most 65535"):
        wire.encode(FINGERPRINT, [StreamRecord("a", 0)] * 65536)


def test_numpy_integers_encode_as_their_value():
    np = pytest.importorskip("numpy")
    data = wire.encode(FINGERPRINT, [StreamRecord("text", np.int64(9), np.int32(-2))])
    assert wire.decode(data)[1] == (StreamRecord("text", 9, -2),)
