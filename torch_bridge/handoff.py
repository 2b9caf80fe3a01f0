"""A request handed between processes: its position record and rotated KV, over torch.distributed.

Disaggregated serving prefills a request on one process and decodes it on another. What
crosses over, per request (:class:`Handoff`): the record of where its streams stand
(``PublishedPositionInfo.to_bytes()``, the layout of :mod:`jaxrope.wire`), the prompt's
token ids, and the KV the prefill computed, keys already rotated at their positions. The
receiver admits the record's bytes as they came
(``mgr.admit_retrieve(rid, node, walk, handoff.record)``): a record of another RoPE
config, or one damaged in transit, is refused with a reason, never turned into a position.

- :func:`send_handoff` / :func:`recv_handoff`: one handoff over a ``torch.distributed``
  point-to-point channel (gloo for CPU tensors; the same calls move device tensors
  over NCCL): a fixed header of sizes, then the bytes, the ids, ``k`` and ``v``.
- :class:`RecordStore`: the latest record each request's decode side published, with
  the token ids it decoded, in a ``torch.distributed.Store`` (a ``TCPStore`` that outlives
  the decode process): what a restarted decode process resumes from.
- :func:`join_session`: a process group of its own for each incarnation of a peer, so
  a survivor can meet a restarted peer after the old one died mid-transfer.

Example (one process, an in-memory store):
  >>> import torch.distributed as dist
  >>> records = RecordStore(dist.HashStore())
  >>> records.latest("r0") is None
  True
  >>> records.publish("r0", b"JRPR...", [5, 17])
  >>> records.latest("r0")
  (b'JRPR...', [5, 17])
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import struct
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Handoff", "RecordStore", "join_session", "recv_handoff", "send_handoff"]

# KV dtypes on the channel, by the code its header carries.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# rid bytes, record bytes, token ids, then k's shape [n, Hk, D] and dtype code.
_HEADER_FIELDS = 7
_RECORD_LENGTH = struct.Struct("<I")


@dataclasses.dataclass
class Handoff:
    """What the prefill side ships for one request.

    Attributes:
      rid: the request id (a str: it crosses the process boundary).
      record: the request's published record, ``PublishedPositionInfo.to_bytes()``.
      ids: the prompt's token ids, in order.
      k: rotated keys ``[n, Hk, D]`` (float32, float16 or bfloat16), token ``i`` at
        position ``i`` of the stream.
      v: values ``[n, Hk, D]``, same dtype and device as ``k``.

    Raises:
      TypeError: a field of the wrong type.
      ValueError: ``k`` and ``v`` of different shapes, dtypes or devices, or a dtype
        the channel does not carry.

    Example:
      >>> import torch
      >>> h = Handoff("r0", b"...", [3, 1], torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
      >>> h.rid, h.k.shape[0]
      ('r0', 2)
    """

    rid: str
    record: bytes
    ids: List[int]
    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str):
            raise TypeError(f"rid={self.rid!r} must be a str")
        if not isinstance(self.record, (bytes, bytearray)):
            raise TypeError(f"record must be bytes, got {type(self.record).__name__}")
        if not isinstance(self.k, torch.Tensor) or not isinstance(self.v, torch.Tensor):
            raise TypeError("k and v must be torch tensors")
        if self.k.dim() != 3 or self.k.shape != self.v.shape:
            raise ValueError(f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must both be "
                             "[n, Hk, D]")
        if self.k.dtype != self.v.dtype or self.k.dtype not in _DTYPES:
            raise ValueError(f"k.dtype={self.k.dtype} and v.dtype={self.v.dtype} must be equal and "
                             f"one of {list(_DTYPES)}")
        if self.k.device != self.v.device:
            raise ValueError(f"k on {self.k.device} and v on {self.v.device} must share a device")
        self.ids = [int(i) for i in self.ids]


def send_handoff(handoff: Handoff, dst: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Send ``handoff`` to rank ``dst``, which calls :func:`recv_handoff` (blocking).

    Up to five messages on the group: the header (int64 ``[7]``: byte sizes, id count,
    ``k``'s shape, dtype code), the rid and record bytes (uint8), the ids (int64), ``k``,
    ``v`` (an empty one is not sent); all on ``k``'s device.

    Raises:
      RuntimeError: from torch.distributed, e.g. the peer died mid-transfer.
    """
    rid = handoff.rid.encode("utf-8")
    device = handoff.k.device
    n, heads, dim = handoff.k.shape
    header = torch.tensor([len(rid), len(handoff.record), len(handoff.ids), n, heads, dim,
                           _DTYPES.index(handoff.k.dtype)], dtype=torch.int64, device=device)
    payload = torch.from_numpy(np.frombuffer(rid + bytes(handoff.record), dtype=np.uint8).copy())
    ids = torch.tensor(handoff.ids, dtype=torch.int64)
    dist.send(header, dst, group=group)
    for tensor in (payload.to(device), ids.to(device), handoff.k.contiguous(),
                   handoff.v.contiguous()):
        if tensor.numel():  # both sides know the sizes from the header: empty ones are skipped
            dist.send(tensor, dst, group=group)


def recv_handoff(src: int, group: Optional[dist.ProcessGroup] = None,
                 device: torch.device = torch.device("cpu")) -> Handoff:
    """Receive the :class:`Handoff` rank ``src`` sends with :func:`send_handoff` (blocking).

    The record arrives as the bytes that were sent; whether they are an intact record
    of the same RoPE config is for ``admit_retrieve`` to decide.

    Raises:
      RuntimeError: from torch.distributed (the peer died), or a header out of range.
    """
    header = torch.empty(_HEADER_FIELDS, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    fields = header.tolist()
    rid_size, record_size, count, n, heads, dim, code = fields
    if min(fields) < 0 or code >= len(_DTYPES):
        raise RuntimeError(f"handoff header {fields} is not one send_handoff writes")
    payload = torch.empty(rid_size + record_size, dtype=torch.uint8, device=device)
    ids = torch.empty(count, dtype=torch.int64, device=device)
    k = torch.empty((n, heads, dim), dtype=_DTYPES[code], device=device)
    v = torch.empty_like(k)
    for tensor in (payload, ids, k, v):
        if tensor.numel():
            dist.recv(tensor, src, group=group)
    raw = payload.cpu().numpy().tobytes()
    return Handoff(raw[:rid_size].decode("utf-8"), raw[rid_size:], ids.tolist(), k, v)


class RecordStore:
    """Each request's latest published record and the token ids it decoded, in a Store.

    One key per request, written in one ``set``: a reader sees the previous value or
    the new one, never half of each, so the ids always match the record beside them.

    Args:
      store: a ``torch.distributed.Store`` (``TCPStore`` across processes, ``HashStore``
        in one).
      prefix: the keys' prefix (default ``"records"``).

    Example:
      >>> import torch.distributed as dist
      >>> records = RecordStore(dist.HashStore())
      >>> records.publish("r0", b"record-1", [4]); records.publish("r0", b"record-2", [4, 9])
      >>> records.latest("r0")
      (b'record-2', [4, 9])
    """

    def __init__(self, store: dist.Store, prefix: str = "records"):
        self._store, self._prefix = store, prefix

    def publish(self, rid: str, record: bytes, ids: Sequence[int]) -> None:
        """Replace ``rid``'s entry: ``record`` (bytes) and the token ids it covers."""
        value = (_RECORD_LENGTH.pack(len(record)) + bytes(record)
                 + np.asarray(ids, dtype="<i4").tobytes())
        self._store.set(self._key(rid), value)

    def latest(self, rid: str) -> Optional[Tuple[bytes, List[int]]]:
        """``(record, ids)`` last published for ``rid``, or None if nothing was.

        Raises:
          ValueError: the entry was not written by :meth:`publish`.
        """
        key = self._key(rid)
        if not self._store.check([key]):
            return None
        value = bytes(self._store.get(key))
        if len(value) < _RECORD_LENGTH.size:
            raise ValueError(f"record store entry {key!r} has {len(value)} bytes: not one "
                             "RecordStore.publish wrote")
        (size,) = _RECORD_LENGTH.unpack_from(value)
        rest = len(value) - _RECORD_LENGTH.size - size
        if rest < 0 or rest % 4:
            raise ValueError(f"record store entry {key!r}: a {size}-byte record and {rest} "
                             "bytes of ids: not one RecordStore.publish wrote")
        start = _RECORD_LENGTH.size
        ids = np.frombuffer(value[start + size:], dtype="<i4").tolist()
        return value[start:start + size], ids

    def _key(self, rid: str) -> str:
        return f"{self._prefix}/{rid}"


@contextlib.contextmanager
def join_session(store: dist.Store, session: int, rank: int, *, world_size: int = 2,
                 timeout: float = 60.0) -> Iterator[dist.ProcessGroup]:
    """A gloo process group for one incarnation of the peers, torn down on exit.

    Each session's rendezvous keys live under their own prefix of ``store``, so the
    surviving process of a session whose peer died joins the next session with the
    peer's new incarnation. Blocking operations in the group time out after
    ``timeout`` seconds; a peer that dies makes them raise RuntimeError at once.

    Yields:
      the default process group of this session.
    """
    dist.init_process_group("gloo", store=dist.PrefixStore(f"session/{session}", store),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
