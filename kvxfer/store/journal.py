"""The index journal: append-only, length-prefixed, checksummed records next to the slab.

Record: ``<u32 payload length><u32 crc32 of payload><payload>``; payload byte 0 is the type:

* ``H`` header: ``fingerprint`` (ASCII, 20 bytes), ``slots`` (u64): which slab this indexes;
  ``version`` (u16) and the digest's name (ASCII, 24 bytes): how its entries' digests were
  computed. A journal of another version or digest (version 1 had neither field) is replayed
  as empty: its entries become misses, never errors;
* ``P`` put: ``generation`` (u64), ``slot`` (u64), ``digest`` (u64), ``key length`` (u16), key;
* ``D`` drop: ``key length`` (u16), key.

Replay reads records in order and stops at the first one that is short, over-long or fails
its checksum: a crash while appending leaves at most a torn tail, which is ignored (and cut
off by the compaction that follows every open). A put is appended only after its row's write
completed, so a crash mid-write leaves no record; see docs/storage.md for the fsync policy.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable

from ..errors import StoreError
from .digest import DIGEST_NAME

__all__ = ["Record", "MAX_KEY", "encode_put", "encode_drop", "replay", "rewrite", "Journal"]

MAX_KEY = 1024  # keys are opaque bytes (a prefix hash), bounded so a record stays small
_HEAD = struct.Struct("<II")
_PUT = struct.Struct("<cQQQH")
_DROP = struct.Struct("<cH")
_MAX_PAYLOAD = _PUT.size + MAX_KEY
VERSION = 2
_H1, _H2 = 29, 29 + 2 + 24  # header payload lengths of versions 1 and 2


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


def replay(data: bytes, fingerprint: str, slots: int) -> tuple[list[Record], int]:
    """Valid records in order, and the byte length of the valid prefix.

    A journal whose header names another slab is refused; anything after the first bad
    record is a torn tail and ignored. Slots and key lengths are bounded here: a record
    that parses but points outside the slab ends the replay like a torn one.
    """
    at, out = 0, []
    first = True
    while at + _HEAD.size <= len(data):
        n, crc = _HEAD.unpack_from(data, at)
        if n == 0 or n > _MAX_PAYLOAD or at + _HEAD.size + n > len(data):
            break
        payload = data[at + _HEAD.size: at + _HEAD.size + n]
        if zlib.crc32(payload) != crc:
            break
        kind = payload[:1]
        if first:
            if kind != b"H" or len(payload) < _H1:
                raise StoreError("the index journal has no header; move it away")
            fp = payload[1:21].rstrip(b"\0").decode("ascii", "replace")
            (nslots,) = struct.unpack_from("<Q", payload, 21)
            if fp != fingerprint or nslots != slots:
                raise StoreError(f"the index journal belongs to slab {fp} with {nslots} slots; move it away")
            if len(payload) != _H2 or struct.unpack_from("<H", payload, _H1)[0] != VERSION \
                    or payload[_H1 + 2:].rstrip(b"\0") != DIGEST_NAME.encode("ascii"):
                return [], 0  # written by another version or digest: every entry a miss
            first = False
        elif kind == b"P" and len(payload) >= _PUT.size:
            _, gen, slot, digest, klen = _PUT.unpack_from(payload)
            if len(payload) != _PUT.size + klen or slot >= slots:
                break
            out.append(Record("P", payload[_PUT.size:], gen, slot, digest))
        elif kind == b"D" and len(payload) >= _DROP.size:
            _, klen = _DROP.unpack_from(payload)
            if len(payload) != _DROP.size + klen:
                break
            out.append(Record("D", payload[_DROP.size:]))
        else:
            break
        at += _HEAD.size + n
    return out, at


def rewrite(path: str, fingerprint: str, slots: int, live: Iterable[Record]) -> None:
    """Compact: write the live entries (oldest first) to a new file, fsync, rename over."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        buf = bytearray(_header(fingerprint, slots))
        for r in live:
            buf += encode_put(r.key, r.generation, r.slot, r.digest)
        os.write(fd, bytes(buf))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Journal:
    """The open journal: appends whole batches of records in one ``write``."""

    def __init__(self, path: str, durable: bool) -> None:
        self.path, self.durable = path, durable
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def append(self, records: bytes) -> None:
        if not records:
            return
        view = memoryview(records)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        if self.durable:
            os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def load(path: str, fingerprint: str, slots: int) -> list[Record]:
    """Read and replay the journal at ``path``; an absent file is an empty index."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    return replay(data, fingerprint, slots)[0]
