"""A request's published streams as bytes: compact, versioned, fingerprinted, checksummed.

A prefill process publishes where each of a request's streams has reached; a decode
process admits it. Between them the record travels as bytes, and the receiver must be
able to tell that both sides rotate the same way (the fingerprint) and that the bytes
are the ones sent (the checksum): a foreign, truncated or corrupted record is refused
with a reason, never decoded into a wrong position. No dependency beyond ``struct`` and
``zlib``; the layout is fixed.

Layout, format version 2 (integers little-endian):

==========  ======  =========================================================
offset      bytes   field
==========  ======  =========================================================
0           4       magic ``b"JRPR"``
4           1       format version, ``2`` (u8)
5           1       flags, ``0`` (u8; version 2 defines none, a set bit is refused)
6           2       stream count ``n`` (u16)
8           32      fingerprint (the manager's ``fingerprint()``, SHA-256)
40          ...     ``n`` streams, each:
+0          1         label length ``L``, 1 to 48 (u8)
+1          L         label, UTF-8
+1+L        4         next position, 0 to 2**31 - 1 (i32)
+5+L        4         M-RoPE delta, -2**31 to 2**31 - 1 (i32; 0 for 1-D RoPE)
+9+L        1         rewinding writers ``W``, 0 to 16 (u8)
+10+L       8 W       ``W`` pairs, writers ascending: writer id (u32), its rollbacks of
                      the stream, 1 to 2**31 - 1 (u32)
end - 4     4       CRC-32 (zlib) of every byte before it (u32)
==========  ======  =========================================================

A stream takes ``10 + L + 8 W`` bytes, at most 186; the header and checksum 44. Its
publish epoch is the sum of its rollback counts, 0 to 2**31 - 1 (a stream never rolled
back has ``W = 0``, epoch 0). The pairs say whose rewinds the position includes, so a
receiver can tell a record that includes all of its own rewinds (newer), one that
another writer made without seeing them (a conflict), or a stale one
(:func:`rewind_order`). Positions and epochs fit the int32
columns of :class:`jaxrope.PositionTable`. CRC-32 catches every error
burst of up to 32 bits and a random corruption with probability ``1 - 2**-32``; it
guards against accidents, not against a sender forging records.

A record decodes only if it is exactly what :func:`encode` writes for some input
(decode then encode gives the same bytes): labels unique, non-empty, valid UTF-8, no
trailing bytes. Every refusal raises :class:`WireFormatError`, whose ``reason`` names
the check and whose message says where.

For the torch bridge: ``PublishedPositionInfo.to_bytes()`` is ``encode(info.fingerprint,
[StreamRecord(label, position, delta, rewinds) for each label of info.counters])``;
``admit_retrieve`` of bytes decodes them with ``expect_fingerprint=mgr.fingerprint()``
and turns a ``WireFormatError`` into ``AdmitOutcome(ok=False, ready=False, reason=...)``
naming ``error.reason`` (``"fingerprint"`` for a record from another configuration,
anything else for a damaged one).

Example:
  >>> import jaxrope as jr
  >>> from jaxrope import wire
  >>> fingerprint = jr.RopeConfig(head_dim=128).fingerprint()
  >>> data = wire.encode(fingerprint, [wire.StreamRecord("text", 1027),
  ...                                  wire.StreamRecord("image", 64, delta=-3)])
  >>> len(data)  # 44 + (10 + 4) + (10 + 5)
  73
  >>> _, streams = wire.decode(data, expect_fingerprint=fingerprint)
  >>> {s.label: s.position for s in streams}
  {'text': 1027, 'image': 64}
  >>> wire.decode(data[:-1])
  Traceback (most recent call last):
  ...
  jaxrope.wire.WireFormatError: truncated at byte 72: stream 1 ends at byte 69, then the 4-byte checksum
  >>> other = jr.RopeConfig(head_dim=64).fingerprint()
  >>> wire.decode(data, expect_fingerprint=other)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  jaxrope.wire.WireFormatError: fingerprint mismatch: the record's is ...
"""

from __future__ import annotations

import dataclasses
import numbers
import struct
import zlib
from typing import Iterable, Optional, Tuple

__all__ = ["MAGIC", "MAX_EPOCH", "MAX_LABEL_BYTES", "MAX_WRITERS", "VERSION", "Rewinds",
           "StreamRecord", "WireFormatError", "decode", "encode", "rewind_order", "rewinds_problem",
           "rewound"]

MAGIC = b"JRPR"
VERSION = 2
MAX_LABEL_BYTES = 48
FINGERPRINT_BYTES = 32
# Epochs are int32 columns of the position table, as positions.
MAX_EPOCH = 2**31 - 1
MAX_WRITERS = 16

_HEADER = struct.Struct("<4sBBH32s")  # magic, version, flags, stream count, fingerprint
_VALUES = struct.Struct("<iiB")  # position, delta, rewinding writers
_REWIND = struct.Struct("<II")  # writer id, its rollbacks
_CHECKSUM = struct.Struct("<I")
_MAX_STREAMS = 0xFFFF
_MAX_WRITER = 2**32 - 1
_RANGES = {"position": (0, 2**31 - 1), "delta": (-2**31, 2**31 - 1)}


class WireFormatError(ValueError):
    """A record that cannot be encoded or must not be decoded.

    Attributes:
      reason: which check refused it: ``"type"``, ``"truncated"``, ``"magic"``,
        ``"version"``, ``"length"``, ``"checksum"``, ``"flags"``, ``"fingerprint"``,
        ``"count"``, ``"label"``, ``"value"`` or ``"rewinds"``.

    Example:
      >>> from jaxrope import wire
      >>> try:
      ...     wire.decode(b"JRPR" + bytes(40))
      ... except wire.WireFormatError as e:
      ...     print(e.reason, "|", e)
      version | unknown format version 0 (this decoder reads version 2)
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class StreamRecord:
    """One published stream: its label, next position, M-RoPE delta and rewinds.

    Args:
      label: the stream's label, a non-empty str of at most 48 UTF-8 bytes.
      position: the next position, in ``[0, 2**31)``.
      delta: the M-RoPE position delta, a signed int32 (default 0).
      rewinds: ``((writer, rollbacks), ...)``, writers ascending and distinct in
        ``[0, 2**32)``, each with ``rollbacks >= 1`` (default ``()``: never rolled
        back); at most :data:`MAX_WRITERS` pairs, their rollbacks summing to at most
        :data:`MAX_EPOCH`.

    Attributes:
      epoch: the publish epoch, the sum of the rollbacks.

    Checked by :func:`encode`; :func:`decode` only returns valid records.

    Example:
      >>> from jaxrope.wire import StreamRecord
      >>> StreamRecord("text", 12, rewinds=((3, 2), (9, 1))).epoch
      3
    """

    label: str
    position: int
    delta: int = 0
    rewinds: Tuple[Tuple[int, int], ...] = ()

    @property
    def epoch(self) -> int:
        return sum(count for _, count in self.rewinds)


Rewinds = Tuple[Tuple[int, int], ...]


def rewind_order(mine: Rewinds, theirs: Rewinds) -> str:
    """How a record's rewinds relate to a stream's: ``"same"``, ``"newer"``, ``"older"`` or
    ``"conflict"``.

    Each side says how many times each writer rolled the stream back (the rewinds its
    position includes). ``"newer"``: the record includes every rewind of ``mine`` and
    more, so it was written after them and wins even with a lower position;
    ``"older"``: the reverse (a stale echo); ``"same"``: the same rewinds, where the
    larger position wins (admit's monotonic max); ``"conflict"``: each side holds a
    rewind the other has not seen, two writers rolled the stream back independently,
    and no position is right for both. A stream never rolled back (``()``) is older
    than any rewound one, so within epoch 0 the order is exactly a max over positions.

    Example:
      >>> from jaxrope.wire import rewind_order
      >>> rewind_order((), ((1, 1),)), rewind_order(((1, 2),), ((1, 1),))
      ('newer', 'older')
      >>> rewind_order(((1, 1),), ((1, 1), (2, 1))), rewind_order(((1, 1),), ((2, 1),))
      ('newer', 'conflict')
    """
    if mine == theirs:
        return "same"
    a, b = dict(mine), dict(theirs)
    writers = a.keys() | b.keys()
    if all(b.get(w, 0) >= a.get(w, 0) for w in writers):
        return "newer"
    if all(b.get(w, 0) <= a.get(w, 0) for w in writers):
        return "older"
    return "conflict"


def rewound(rewinds: Rewinds, writer: int) -> Rewinds:
    """``rewinds`` with one more rollback by ``writer`` (kept ascending by writer).

    Example:
      >>> from jaxrope.wire import rewound
      >>> rewound(rewound((), 7), 3), rewound(((3, 1), (7, 1)), 7)
      (((3, 1), (7, 1)), ((3, 1), (7, 2)))
    """
    counts = dict(rewinds)
    counts[writer] = counts.get(writer, 0) + 1
    return tuple(sorted(counts.items()))


def _problem(record: StreamRecord) -> Optional[Tuple[str, str]]:
    """``(reason, message)`` for a stream the format cannot carry, or None: the one place
    the per-stream rules live, for :func:`encode` and :func:`decode` alike."""
    if not isinstance(record.label, str):
        return "type", f"label={record.label!r} must be a str"
    size = len(record.label.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= MAX_LABEL_BYTES:
        return "label", (f"label={record.label!r} is {size} bytes in UTF-8, the format "
                         f"carries 1 to {MAX_LABEL_BYTES}")
    for name, (low, high) in _RANGES.items():
        value = getattr(record, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return "type", f"{name}={value!r} must be an int"
        if not low <= value <= high:
            word = "negative " if name != "delta" and value < 0 else ""
            return "value", f"{word}{name}={value} outside [{low}, {high}]"
    return rewinds_problem(record.rewinds)


def rewinds_problem(rewinds: Rewinds) -> Optional[Tuple[str, str]]:
    """``(reason, message)`` for rewinds the format cannot carry (see :class:`StreamRecord`),
    or None."""
    if not isinstance(rewinds, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and all(
                isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pair)
            for pair in rewinds):
        return "type", f"rewinds={rewinds!r} must be a tuple of (writer, rollbacks) int pairs"
    if len(rewinds) > MAX_WRITERS:
        return "rewinds", (f"rewinds name {len(rewinds)} writers, the format carries at most "
                           f"{MAX_WRITERS}")
    writers = [writer for writer, _ in rewinds]
    if any(not 0 <= writer <= _MAX_WRITER for writer in writers):
        return "rewinds", f"rewinds={rewinds!r}: writer ids must be in [0, {_MAX_WRITER}]"
    if any(a >= b for a, b in zip(writers, writers[1:])):
        return "rewinds", f"rewinds={rewinds!r}: writers must be distinct and ascending"
    if any(count < 1 for _, count in rewinds):
        return "rewinds", f"rewinds={rewinds!r}: each writer's rollbacks must be >= 1"
    epoch = sum(count for _, count in rewinds)
    if epoch > MAX_EPOCH:
        return "value", (f"epoch={epoch} (the sum of rewinds={rewinds!r}) outside "
                         f"[0, {MAX_EPOCH}]")
    return None


def encode(fingerprint: bytes, streams: Iterable[StreamRecord]) -> bytes:
    """The record of ``streams`` under ``fingerprint``, as bytes (layout in the module doc).

    Args:
      fingerprint: 32 bytes, the publisher's ``fingerprint()``.
      streams: :class:`StreamRecord` s with distinct labels, kept in this order.

    Returns:
      ``44 + sum(10 + len(label in UTF-8) + 8 * len(rewinds))`` bytes.

    Raises:
      WireFormatError: a fingerprint that is not 32 bytes, a stream the format cannot
        carry (label empty, longer than 48 bytes, not encodable as UTF-8 or repeated;
        a value out of range or not an int; malformed rewinds), or more than 65535
        streams.

    Example:
      >>> from jaxrope import wire
      >>> len(wire.encode(bytes(32), [wire.StreamRecord("text", 5)]))
      58
    """
    if not isinstance(fingerprint, (bytes, bytearray)) or len(fingerprint) != FINGERPRINT_BYTES:
        raise WireFormatError("type", f"fingerprint must be {FINGERPRINT_BYTES} bytes, got "
                                      f"{_describe(fingerprint)}")
    streams = tuple(streams)
    if len(streams) > _MAX_STREAMS:
        raise WireFormatError("count", f"{len(streams)} streams, the format carries at most "
                                       f"{_MAX_STREAMS}")
    parts = [_HEADER.pack(MAGIC, VERSION, 0, len(streams), bytes(fingerprint))]
    seen = set()
    for i, record in enumerate(streams):
        if not isinstance(record, StreamRecord):
            raise WireFormatError("type", f"streams[{i}] must be a StreamRecord, got "
                                          f"{type(record).__name__}")
        problem = _problem(record)
        if problem is None and record.label in seen:
            problem = "label", f"label={record.label!r} repeats an earlier stream's"
        if problem is None:
            try:
                label = record.label.encode("utf-8")
            except UnicodeEncodeError as e:
                problem = "label", f"label={record.label!r} is not encodable as UTF-8 ({e.reason})"
        if problem is not None:
            raise WireFormatError(problem[0], f"streams[{i}]: {problem[1]}")
        seen.add(record.label)
        parts += [bytes((len(label),)), label,
                  _VALUES.pack(record.position, record.delta, len(record.rewinds))]
        parts += [_REWIND.pack(*pair) for pair in record.rewinds]
    body = b"".join(parts)
    return body + _CHECKSUM.pack(zlib.crc32(body))


def decode(data: bytes, *, expect_fingerprint: Optional[bytes] = None
           ) -> Tuple[bytes, Tuple[StreamRecord, ...]]:
    """The fingerprint and streams of a record :func:`encode` wrote, or a refusal.

    Args:
      data: the record (bytes, bytearray or memoryview).
      expect_fingerprint: if given, the 32 bytes the record's fingerprint must equal
        (the receiver's own ``fingerprint()``).

    Returns:
      ``(fingerprint, streams)``: 32 bytes and a tuple of :class:`StreamRecord` in the
      order they were encoded.

    Raises:
      WireFormatError: the bytes are not such a record (too short or truncated, bad
        magic, unknown version, trailing bytes, checksum mismatch, flags set, label
        empty, not UTF-8 or repeated, a negative position, malformed rewinds or an
        epoch past :data:`MAX_EPOCH`) or its fingerprint is not
        ``expect_fingerprint``; ``reason`` says which.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError("type", f"data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if expect_fingerprint is not None and (not isinstance(expect_fingerprint, (bytes, bytearray))
                                           or len(expect_fingerprint) != FINGERPRINT_BYTES):
        raise WireFormatError("type", f"expect_fingerprint must be {FINGERPRINT_BYTES} bytes, "
                                      f"got {_describe(expect_fingerprint)}")
    minimum = _HEADER.size + _CHECKSUM.size
    if data[:len(MAGIC)] != MAGIC[:len(data)]:
        raise WireFormatError("magic", f"bad magic {data[:len(MAGIC)]!r} (expected {MAGIC!r}): "
                                       f"not a jaxrope position record")
    if len(data) > len(MAGIC) and data[len(MAGIC)] != VERSION:
        raise WireFormatError("version", f"unknown format version {data[len(MAGIC)]} (this "
                                         f"decoder reads version {VERSION})")
    if len(data) < minimum:
        raise WireFormatError("truncated", f"truncated at byte {len(data)}: a record has at "
                                           f"least {minimum} bytes (header and checksum)")
    _, _, flags, count, fingerprint = _HEADER.unpack_from(data)
    end, body_end, spans = _HEADER.size, len(data) - _CHECKSUM.size, []
    for i in range(count):
        size = data[end] if end < body_end else 0
        stream_end = end + 1 + size + _VALUES.size
        if stream_end <= body_end:  # the writer count is the stream's last fixed byte
            stream_end += _REWIND.size * data[stream_end - 1]
        if stream_end > body_end:
            raise WireFormatError("truncated", f"truncated at byte {len(data)}: stream {i} ends "
                                               f"at byte {stream_end}, then the "
                                               f"{_CHECKSUM.size}-byte checksum")
        spans.append((end, size))
        end = stream_end
    if end != body_end:
        raise WireFormatError("length", f"{body_end - end} bytes between the last stream's end "
                                        f"(byte {end}) and the checksum: {count} streams "
                                        f"make a {end + _CHECKSUM.size}-byte record, got "
                                        f"{len(data)}")
    (stored,) = _CHECKSUM.unpack_from(data, body_end)
    computed = zlib.crc32(data[:body_end])
    if stored != computed:
        raise WireFormatError("checksum", f"checksum mismatch (stored {stored:#010x}, computed "
                                          f"{computed:#010x}): the record is corrupted")
    if flags:
        raise WireFormatError("flags", f"flags {flags:#04x} set; version {VERSION} defines none")
    if expect_fingerprint is not None and fingerprint != bytes(expect_fingerprint):
        raise WireFormatError("fingerprint", f"fingerprint mismatch: the record's is "
                                             f"{fingerprint.hex()[:16]}..., this side's "
                                             f"{bytes(expect_fingerprint).hex()[:16]}...: it "
                                             f"was published under another RoPE config or "
                                             f"scheme")
    streams, seen = [], set()
    for i, (start, size) in enumerate(spans):
        try:
            label = data[start + 1:start + 1 + size].decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireFormatError("label", f"stream {i} (byte {start}): label is not UTF-8 "
                                           f"({e.reason})") from None
        position, delta, writers = _VALUES.unpack_from(data, start + 1 + size)
        pairs = start + 1 + size + _VALUES.size
        rewinds = tuple(_REWIND.unpack_from(data, pairs + j * _REWIND.size)
                        for j in range(writers))
        record = StreamRecord(label, position, delta, rewinds)
        problem = _problem(record)
        if problem is None and label in seen:
            problem = "label", f"label={label!r} repeats an earlier stream's"
        if problem is not None:
            raise WireFormatError(problem[0], f"stream {i} (byte {start}): {problem[1]}")
        seen.add(label)
        streams.append(record)
    return fingerprint, tuple(streams)


def _describe(value) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return type(value).__name__
