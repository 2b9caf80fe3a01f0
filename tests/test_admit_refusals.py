"""Every refusal of ``admit_retrieve`` speaks one vocabulary: ``published record refused
(<check>): <why>``, the check named, the value and its range in the why, nothing changed.

One case per kind of refusal, objects and bytes: an unknown or removed request, a foreign
fingerprint, a malformed argument, an unknown label, a position past ``max_seq_len``, a
delta into 1-D RoPE or out of range, an epoch out of int32 or not its rewinds' count,
malformed rewinds, conflicting rewinds, a newer epoch for a planned stream, and each
check of the wire format.
"""

from __future__ import annotations

import re
import struct
import zlib

import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope import wire  # noqa: E402
from torch_bridge import (PositionConfig, PositionManager, PositionStep,  # noqa: E402
                          PublishedPositionInfo, Segment, StepContext)

REFUSED = "published record refused"
MAX_SEQ_LEN = 64
MROPE = jr.RopeConfig(head_dim=8, mrope_section=(2, 1, 1))


def make(rope=None, writer=1) -> PositionManager:
    mgr = PositionManager(PositionConfig(rope=rope, labels=("text", "image")), "cpu",
                          max_seq_len=MAX_SEQ_LEN, writer=writer)
    for rid in ("r0", "gone", "planned"):
        mgr.ingest_request(rid, {"text": 10})
    mgr.rollback("r0", "text", 8)
    mgr.remove_request("gone")
    mgr.plan(PositionStep([Segment("planned", "text", 2)]), StepContext(("planned",)))
    return mgr


def info(counters, **kwargs) -> PublishedPositionInfo:
    return PublishedPositionInfo(counters, **kwargs)


def _foreign():
    other = PositionManager(PositionConfig(labels=("text", "image"), block_step=2), "cpu")
    other.ingest_request("r0")
    return other.publish("r0")


def _conflicting():
    other = make(writer=2)
    other.rollback("r0", "text", 3)
    return other.publish("r0")


def _bytes(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _record(*streams) -> bytes:
    return wire.encode(make().fingerprint(), list(streams))


def _header(count: int, version: int = wire.VERSION, flags: int = 0) -> bytes:
    return struct.pack("<4sBBH", wire.MAGIC, version, flags, count) + make().fingerprint()


CASES = [
    # (what, rid, published, check, the why (a regular expression), manager kwargs)
    ("unknown request", "ghost", info({"text": 1}), "request",
     r"request_id='ghost' was never ingested \(call ingest_request first\)", {}),
    ("removed request", "gone", info({"text": 1}), "request",
     r"request_id='gone' was removed \(remove_request\)", {}),
    ("foreign fingerprint", "r0", _foreign(), "fingerprint",
     r"published.fingerprint differs from this manager's: .* \(the publisher rotates another "
     r"way", {}),
    ("counters not a mapping", "r0", info([("text", 1)]), "type",
     r"published.counters=\[\('text', 1\)\] must be a mapping \{label: position\}", {}),
    ("unknown label", "r0", info({"audio": 1}), "label",
     r"published.counters names label='audio', not one of \['text', 'image'\]", {}),
    ("position past max_seq_len", "r0", info({"text": MAX_SEQ_LEN + 1}), "position",
     r"published.counters\['text'\]=65 must be an int in \[0, 64\] \(max_seq_len\)", {}),
    ("negative position", "r0", info({"text": -1}), "position", r"=-1 must be an int in \[0, 64\]",
     {}),
    ("delta into 1-D RoPE", "r0", info({"text": 1}, deltas={"text": -3}), "delta",
     r"published.deltas=\{'text': -3\}: M-RoPE deltas need an M-RoPE config", {}),
    ("delta out of range", "r0", info({"text": 1}, deltas={"text": -65}), "delta",
     r"published.deltas\['text'\]=-65 must be an int in \[-64, 64\]", {"rope": MROPE}),
    ("epoch past int32", "r0", info({"text": 1}, epochs={"text": 2**31}), "epoch",
     r"published.epochs\['text'\]=2147483648 must be an int in \[0, 2147483647\] \(epochs are "
     r"int32\)", {}),
    ("negative epoch", "r0", info({"text": 1}, epochs={"text": -1}), "epoch",
     r"=-1 must be an int in \[0, 2147483647\]", {}),
    ("epoch not its rewinds' count", "r0",
     info({"text": 1}, epochs={"text": 3}, rewinds={"text": ((1, 2),)}), "epoch",
     r"published stream 'text': epoch 3 is not the 2 rollbacks its rewinds \(\(1, 2\),\) count",
     {}),
    ("malformed rewinds", "r0", info({"text": 1}, epochs={"text": 2},
                                     rewinds={"text": ((2, 1), (1, 1))}), "rewinds",
     r"published.rewinds\['text'\]: rewinds=.* writers must be distinct and ascending", {}),
    ("conflicting rewinds", "r0", _conflicting(), "conflict",
     r"stream \('r0', 'text'\): rewinds \(\(2, 2\),\) conflict with \(\(1, 1\),\): two "
     r"writers", {}),
    ("newer epoch for a planned stream", "planned",
     info({"text": 3}, epochs={"text": 1}, rewinds={"text": ((1, 1),)}), "planned",
     r"the record starts a newer epoch, but stream \('planned', 'text'\) is in a plan not yet "
     r"committed", {}),
    # The wire's own checks, on bytes.
    ("truncated bytes", "r0", _record(wire.StreamRecord("text", 1))[:-2], "truncated",
     r"truncated at byte 56", {}),
    ("bad magic", "r0", b"JRPX" + bytes(60), "magic", r"bad magic b'JRPX'", {}),
    ("foreign version", "r0", b"JRPR\x01" + bytes(60), "version",
     r"unknown format version 1 \(this decoder reads version 2\)", {}),
    ("trailing bytes", "r0", _bytes(_record(wire.StreamRecord("text", 1))[:-4] + b"\x00"),
     "length", r"1 bytes between the last stream's end", {}),
    ("corrupted bytes", "r0", _record(wire.StreamRecord("text", 1))[:-1] + b"\x00", "checksum",
     r"checksum mismatch", {}),
    ("flags set", "r0", _bytes(_header(0, flags=1)), "flags", r"flags 0x01 set", {}),
    ("label not UTF-8", "r0", _bytes(_header(1) + b"\x01\xff" + bytes(9)), "label",
     r"label is not UTF-8", {}),
    ("epoch past int32 on the wire", "r0", _bytes(_header(1) + b"\x04text" + struct.pack(
        "<iiBII", 1, 0, 1, 1, 2**31)), "value",
     r"epoch=2147483648 \(the sum of rewinds=.*\) outside \[0, 2147483647\]", {}),
    ("wrong fingerprint on the wire", "r0", _foreign().to_bytes(), "fingerprint",
     r"fingerprint mismatch", {}),
]


@pytest.mark.parametrize("what, rid, published, check, why, kwargs", CASES,
                         ids=[case[0] for case in CASES])
def test_every_refusal_starts_with_the_prefix_and_names_its_check(what, rid, published, check,
                                                                  why, kwargs):
    mgr = make(**kwargs)
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve(rid, None, None, published)
    assert (outcome.ok, outcome.ready) == (False, False)
    prefix = f"{REFUSED} ({check}): "
    assert outcome.reason.startswith(prefix), outcome.reason
    assert re.search(why, outcome.reason[len(prefix):]), outcome.reason
    assert mgr.state_snapshot() == before


def test_the_cases_walk_every_check_of_the_wire_and_of_the_record():
    checks = {case[3] for case in CASES}
    assert checks >= {"request", "fingerprint", "type", "label", "position", "delta", "epoch",
                      "rewinds", "conflict", "planned", "truncated", "magic", "version",
                      "length", "checksum", "flags", "value"}
