"""The index journal: append-only, length-prefixed, checksummed records next to the slab.

Record: ``<u32 payload length><u32 crc32 of payload><payload>``; payload byte 0 is the type:

* ``H`` header: ``fingerprint`` (ASCII, 20 bytes), ``slots`` (u64): which slab this indexes;
  ``version`` (u16) and the digest's name (ASCII, 24 bytes): how its entries' digests were
  computed. A journal of version 2 (the page-wise row digest, :data:`~.digest.LEGACY_NAME`)
  is replayed with ``legacy`` set, and the store migrates its entries (:mod:`.digest`); one of
  any other version or digest (version 1 had neither field) is replayed as empty: its entries
  become misses, never errors;
* ``P`` put: ``generation`` (u64), ``slot`` (u64), ``digest`` (u64), ``key length`` (u16), key;
* ``D`` drop: ``key length`` (u16), key.

Replay reads records in order and stops at the first one that is short, over-long or fails
its checksum: a crash while appending leaves at most a torn tail, which is ignored (and cut
off by the compaction that follows every open). A put is appended only after its row's write
completed, so a crash mid-write leaves no record; see docs/storage.md for the fsync policy.

The journal is the one file that grows, so it is where a full disk shows: the store appends
before it changes its index, and a batch the file system takes only in part is cut off
again (:class:`Journal`), so a failed offload, eviction or discard leaves both as they were.
Files are replayed a chunk at a time (:class:`Reader`), never read whole.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..errors import StoreError
from .digest import DIGEST_NAME, LEGACY_NAME
from .dirs import StoreDir, typed

__all__ = ["Record", "MAX_KEY", "encode_put", "encode_drop", "encode_puts", "encode_drops", "Reader", "replay",
           "records", "load", "rewrite", "reopen", "Journal"]

MAX_KEY = 1024  # keys are opaque bytes (a prefix hash), bounded so a record stays small
_HEAD = struct.Struct("<II")
_PUT = struct.Struct("<cQQQH")
_DROP = struct.Struct("<cH")
_MAX_PAYLOAD = _PUT.size + MAX_KEY
VERSION = 3  # 3: row digests hash whole rows (:mod:`.digest`); 2 is migrated at open
_H1, _H2 = 29, 29 + 2 + 24  # header payload lengths of versions 1 and 2
CHUNK = 1 << 20  # bytes read at a time when replaying a file


@dataclass(frozen=True)
class Record:
    kind: str  # "P" or "D"
    key: bytes
    generation: int = 0
    slot: int = 0
    digest: int = 0


def _frame(payload: bytes) -> bytes:
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _header(fingerprint: str, slots: int) -> bytes:
    return _frame(b"H" + fingerprint.encode("ascii").ljust(20, b"\0")[:20] + struct.pack("<QH", slots, VERSION)
                  + DIGEST_NAME.encode("ascii").ljust(24, b"\0")[:24])


def encode_put(key: bytes, generation: int, slot: int, digest: int) -> bytes:
    return _frame(_PUT.pack(b"P", generation, slot, digest, len(key)) + key)


def encode_drop(key: bytes) -> bytes:
    return _frame(_DROP.pack(b"D", len(key)) + key)


def encode_puts(keys: Sequence[bytes], first_generation: int, slots: np.ndarray, digests: np.ndarray) -> bytes:
    """The put records of one offload (generations ``first_generation``, +1, ...), byte for
    byte :func:`encode_put`'s, without a :class:`Record` per key: publishing 1,024 rows that way
    cost about 1 ms of the offload's critical path (BENCHMARKS.md, "Issue 37: store offload,
    store4")."""
    return b"".join(encode_put(k, g, s, d) for g, k, s, d in
                    zip(range(first_generation, first_generation + len(keys)), keys, slots.tolist(), digests.tolist()))


def encode_drops(keys: Iterable[bytes]) -> bytes:
    """Drop records for ``keys``, one after another."""
    return b"".join(encode_drop(k) for k in keys)


class Reader:
    """Replays a journal from chunks as they are read, so memory holds one chunk and one
    record, never the file (a journal can be large; the scheduler's view re-reads it).

    ``at`` counts the bytes of valid records consumed; ``ended`` is set by the first record
    that is over-long, fails its checksum or points outside the slab (a torn tail), and by a
    header of another version or digest (replayed as empty). ``headed``: the header was read
    before (a view reading on from where it stopped). ``legacy``: the header is version 2's,
    whose digests the store migrates."""

    def __init__(self, fingerprint: str, slots: int, headed: bool = False) -> None:
        self.fingerprint, self.slots, self.headed = fingerprint, slots, headed
        self.at = 0
        self.ended = False
        self.legacy = False
        self.tail = b""  # the last bytes of the valid prefix (how a view tells an append from a new file)
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Record]:
        data = self._buf + chunk if self._buf else chunk
        out: list[Record] = []
        pos = 0
        while not self.ended and pos + _HEAD.size <= len(data):
            n, crc = _HEAD.unpack_from(data, pos)
            if n == 0 or n > _MAX_PAYLOAD:
                self.ended = True
                break
            if pos + _HEAD.size + n > len(data):
                break  # the rest of this record is in the next chunk (or torn)
            payload = data[pos + _HEAD.size: pos + _HEAD.size + n]
            if zlib.crc32(payload) != crc:
                self.ended = True
                break
            if not self._record(payload, out):
                break
            pos += _HEAD.size + n
        if self.ended and not self.headed:
            return []  # another version or digest: every entry a miss
        self.at += pos
        self.tail = (self.tail + data[max(0, pos - 32):pos])[-32:]
        self._buf = b"" if self.ended else data[pos:]
        return out

    def _record(self, payload: bytes, out: list[Record]) -> bool:
        """Parse one checked payload into ``out``; False (and ``ended``) where replay stops."""
        kind = payload[:1]
        if not self.headed:
            if kind != b"H" or len(payload) < _H1:
                raise StoreError("the index journal has no header; move it away")
            fp = payload[1:21].rstrip(b"\0").decode("ascii", "replace")
            (nslots,) = struct.unpack_from("<Q", payload, 21)
            if fp != self.fingerprint or nslots != self.slots:
                raise StoreError(f"the index journal belongs to another slab ({fp!r:.40}); move it away")
            version = struct.unpack_from("<H", payload, _H1)[0] if len(payload) == _H2 else 0
            name = payload[_H1 + 2:].rstrip(b"\0")
            self.legacy = (version, name) == (2, LEGACY_NAME.encode("ascii"))
            if not self.legacy and (version, name) != (VERSION, DIGEST_NAME.encode("ascii")):
                self.ended = True  # written by another version or digest
                return False
            self.headed = True
        elif kind == b"P" and len(payload) >= _PUT.size:
            _, gen, slot, digest, klen = _PUT.unpack_from(payload)
            if len(payload) != _PUT.size + klen or slot >= self.slots:
                self.ended = True
                return False
            out.append(Record("P", payload[_PUT.size:], gen, slot, digest))
        elif kind == b"D" and len(payload) >= _DROP.size:
            _, klen = _DROP.unpack_from(payload)
            if len(payload) != _DROP.size + klen:
                self.ended = True
                return False
            out.append(Record("D", payload[_DROP.size:]))
        else:
            self.ended = True
            return False
        return True


def replay(data: bytes, fingerprint: str, slots: int) -> tuple[list[Record], int]:
    """Valid records in order, and the byte length of the valid prefix (one buffer; files
    are read with :func:`records`).

    A journal whose header names another slab is refused; anything after the first bad
    record is a torn tail and ignored. Slots and key lengths are bounded here: a record
    that parses but points outside the slab ends the replay like a torn one.
    """
    r = Reader(fingerprint, slots)
    out = r.feed(data)
    return out, r.at


def records(d: StoreDir, name: str, r: Reader) -> Iterator[Record]:
    """Stream the journal ``name`` of ``d``'s records in order through ``r`` (which then says
    how long the valid prefix is); an absent file has none."""
    try:
        fd = d.open(name, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        while not r.ended:
            data = os.read(fd, CHUNK)
            if not data:
                break
            yield from r.feed(data)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def rewrite(d: StoreDir, name: str, fingerprint: str, slots: int, live: Iterable[Record], durable: bool = False
            ) -> "Journal":
    """Compact: write the live entries (oldest first) to a new file, fsync, rename over, and
    return it open for appending. On failure (a full disk) the old journal stays as it was,
    and complete."""
    buf = bytearray(_header(fingerprint, slots))
    for r in live:
        buf += encode_put(r.key, r.generation, r.slot, r.digest)
    fd, tmp = d.create(name)
    try:
        _write_all(fd, bytes(buf), 0)
        os.fsync(fd)
        d.publish(tmp, name)
    except BaseException as exc:
        os.close(fd)
        d.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, StoreError):
            raise typed(exc, f"cannot write the index journal {d.join(name)}") from None
        raise
    return Journal(fd, d.join(name), durable)


def reopen(d: StoreDir, name: str, valid: int, durable: bool) -> "Journal":
    """The journal as it is, for appending, its torn tail (past ``valid`` bytes) cut off: what
    an opening store uses when a full disk leaves no room to compact (cutting needs none)."""
    fd = d.open(name, os.O_WRONLY)
    try:
        os.ftruncate(fd, valid)
    except OSError as exc:
        os.close(fd)
        raise typed(exc, f"cannot cut the index journal {d.join(name)}") from None
    return Journal(fd, d.join(name), durable)


class Journal:
    """The open journal (the file :func:`rewrite` made): appends whole batches of records in
    one ``write``, or none of them.

    A batch the file system refuses part way (a full disk) is cut off again, so the journal
    never keeps a torn record in its middle (replay would stop there and lose every later
    record) nor a batch its caller was told failed."""

    def __init__(self, fd: int, path: str, durable: bool) -> None:
        self.fd, self.path, self.durable = fd, path, durable
        self.size = os.fstat(fd).st_size
        self._torn = False  # a failed batch could not be cut off yet

    def append(self, records: bytes) -> None:
        if not records:
            return
        try:
            if self._torn:
                os.ftruncate(self.fd, self.size)
                self._torn = False
            _write_all(self.fd, records, self.size)
            if self.durable:
                os.fdatasync(self.fd)
        except OSError as exc:
            self._torn = True
            try:
                os.ftruncate(self.fd, self.size)  # shrinking needs no space
                self._torn = False
            except OSError:
                pass  # cut before the next append
            raise typed(exc, f"cannot append to the index journal {self.path}") from None
        self.size += len(records)

    def close(self) -> None:
        os.close(self.fd)


def load(path: str, fingerprint: str, slots: int) -> list[Record]:
    """The records of the journal file at ``path``, read a chunk at a time (for readers
    outside a store; an open store streams through :func:`records`). Absent: none."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    out: list[Record] = []
    with f:
        r = Reader(fingerprint, slots)
        while not r.ended:
            data = f.read(CHUNK)
            if not data:
                break
            out += r.feed(data)
    return out
