"""The slab: one preallocated file of 4 KiB-aligned row slots per layout fingerprint.

A slab is always row-shaped, whatever the local cache: every member of the layout is packed
into one row (each local region's row extent back to back, members at their offsets inside
it), and slot ``s`` holds that row at file offset ``HEADER + s * stride``, ``stride`` being
the row rounded up to 4 KiB. :func:`slab_spec` describes the file as a block-outermost
:class:`~kvxfer.KVCacheSpec` whose "addresses" are file offsets, so the unchanged planner
pairs a local cache with it: one descriptor per row for a row-shaped cache, one per page for
a layer-outermost one (gathered into the row). docs/storage.md has the file formats.

Files are created 0600 in a directory of this uid (:mod:`.dirs`). The slab is preallocated
with ``posix_fallocate`` before it is published (renamed into place), so "disk full" is a
:class:`~kvxfer.errors.StoreFullError` at creation and never a torn row later (the journal
can still meet a full disk: :mod:`.journal`). One store object at a time holds the slab: an
exclusive ``flock`` on a lock file next to it refuses a second opener. A header is read
bounded: its nesting is checked before parsing, and its numbers are checked before any use.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SpecError, StoreError, StoreFullError
from ..geometry._spec import KVCacheSpec, Member, PackedLayout, Region
from ..memory import Allocation, MemoryKind
from .digest import DIGEST_NAME
from .dirs import StoreDir, typed

__all__ = ["HEADER", "ALIGN", "Geometry", "geometry", "slab_spec", "Slab"]

HEADER = 4096  # the slab's first page: magic, version, geometry (JSON)
ALIGN = 4096  # row slots start on 4 KiB boundaries (O_DIRECT and GDS want them)
_MAGIC = b"KVXFSLAB"
_VERSION = 1
_LABELS = {"LBHNC": "BLHNC", "LBNHC": "BLNHC"}


@dataclass(frozen=True)
class Geometry:
    """What one slab row holds, and its fingerprint (the slab's file name)."""

    members: tuple[Member, ...]
    row_len: int
    stride: int
    label: str
    block_tokens: int
    tp_rank: int
    tp_size: int
    fingerprint: str

    def describe(self) -> dict[str, Any]:
        return {"members": [m.to_dict() for m in self.members], "row_len": self.row_len, "stride": self.stride,
                "block_tokens": self.block_tokens, "tp_rank": self.tp_rank, "tp_size": self.tp_size}


def geometry(layout: KVCacheSpec, model: str = "") -> Geometry:
    """Pack ``layout``'s members into one row and fingerprint the result.

    The fingerprint covers every member (name, size, offset, page format, role, head slice,
    layer), block tokens, the TP slice and the caller's ``model`` string (not the digest: a
    slab written with another digest is reused, its entries dropped):
    two caches that would pair byte for byte share a slab; any other pair gets its own.
    """
    if not isinstance(layout, KVCacheSpec):
        raise SpecError(f"layout must be a KVCacheSpec, got {type(layout).__name__}")
    if not isinstance(model, str) or len(model) > 256:
        raise SpecError("model must be a string of at most 256 characters")
    members: list[Member] = []
    at = 0
    for r in layout.regions:
        rs = r.layout.row_start
        members += [dataclasses.replace(m, offset=at + m.offset - rs) for m in r.members]
        at += r.layout.row_len
    stride = -(-at // ALIGN) * ALIGN
    label = _LABELS.get(layout.layout, layout.layout)
    g = Geometry(tuple(members), at, stride, label, layout.block_tokens, layout.tp_rank, layout.tp_size, "")
    blob = json.dumps({"model": model, **g.describe()}, sort_keys=True).encode()
    return dataclasses.replace(g, fingerprint=hashlib.sha256(blob).hexdigest()[:20])


def slab_spec(g: Geometry, slots: int, address: int = HEADER) -> KVCacheSpec:
    """The slab as a row-shaped spec: allocation address = file offset of slot 0 (or, with
    ``address``, where slot 0 is mapped)."""
    alloc = Allocation(address, slots * g.stride, MemoryKind.DRAM, 0)
    region = Region(0, 0, slots, PackedLayout(g.stride, g.members))
    return KVCacheSpec((alloc,), (region,), layout=g.label, block_tokens=g.block_tokens, tp_rank=g.tp_rank,
                       tp_size=g.tp_size)


def _header(g: Geometry, slots: int) -> bytes:
    body = json.dumps({"fingerprint": g.fingerprint, "slots": slots, "digest": DIGEST_NAME, **g.describe()},
                      sort_keys=True).encode()
    head = _MAGIC + struct.pack("<II", _VERSION, len(body))
    if len(head) + len(body) > HEADER:
        # Very wide layouts: the header keeps the fingerprint only; the name already binds it.
        body = json.dumps({"fingerprint": g.fingerprint, "slots": slots, "stride": g.stride,
                           "row_len": g.row_len, "digest": DIGEST_NAME}, sort_keys=True).encode()
        head = _MAGIC + struct.pack("<II", _VERSION, len(body))
    return (head + body).ljust(HEADER, b"\0")


#: The deepest nesting a header of ours has (members hold dicts of lists); a crafted one is refused before parsing.
_MAX_DEPTH = 16


def _read_header(fd: int) -> dict[str, Any]:
    raw = os.pread(fd, HEADER, 0)
    if len(raw) < 16 or raw[:8] != _MAGIC:
        raise StoreError("the slab file has no kvxfer header; move it away or choose another path")
    version, n = struct.unpack_from("<II", raw, 8)
    if version != _VERSION or n > HEADER - 16:
        raise StoreError("the slab header is of another version; it was written by another kvxfer: move it away")
    body = raw[16:16 + n]
    b = np.frombuffer(body, dtype=np.uint8)
    depth = np.cumsum((b == ord("[")) | (b == ord("{")), dtype=np.int64) \
        - np.cumsum((b == ord("]")) | (b == ord("}")), dtype=np.int64)
    if depth.size and int(depth.max()) > _MAX_DEPTH:
        raise StoreError("the slab header is corrupt (nested too deep); move the slab away")
    try:
        d = json.loads(body)
    except (ValueError, RecursionError):
        raise StoreError("the slab header is corrupt; move the slab away") from None
    if not isinstance(d, dict):
        raise StoreError("the slab header is corrupt; move the slab away")
    return d


def _count(v: Any) -> int | None:
    """A header number as an int, or None (a crafted header's values never reach a message)."""
    return v if type(v) is int and 0 <= v < 1 << 62 else None


class Slab:
    """An open, locked, preallocated slab file in a checked directory, and a read-only map of
    it (for digests). A refused creation leaves no file behind, its lock file included."""

    def __init__(self, d: StoreDir, g: Geometry, slots: int) -> None:
        if slots < 1:
            raise StoreError(f"capacity holds no row: one slot is {g.stride} bytes")
        self.g, self.slots, self.dir = g, slots, d
        self.size = HEADER + slots * g.stride
        base = f"slab-{g.fingerprint}"
        self.name, self.index_name, self._lock_name = base + ".kv", base + ".idx", base + ".lock"
        self.path, self.index_path = d.join(self.name), d.join(self.index_name)
        self._lock = d.lock(self._lock_name, f"{self.path} is open in another store (this or another process); "
                            "one store object per slab: share it, or close the other first")
        try:
            d.sweep(base)  # temporaries of a killed creation or compaction (only a lock holder makes them)
            self.created = not d.exists(self.name)
            self.fd = self._create() if self.created else self._open()
            try:
                self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
            except BaseException:
                os.close(self.fd)
                raise
        except BaseException:
            self.release(remove=self.created)
            raise
        self._u8 = np.frombuffer(self.map, dtype=np.uint8, count=slots * g.stride, offset=HEADER)
        self.rows = self._u8.reshape(slots, g.stride)  # slot s is rows[s, :row_len]
        # The slab as a host cache over the map (what row digests are computed on).
        self.mapped = slab_spec(g, slots, self._u8.ctypes.data)

    def _create(self) -> int:
        fd, tmp = self.dir.create(self.name)
        try:
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise StoreFullError(exc.errno, f"cannot preallocate a {self.size}-byte slab at {self.path}: "
                                         f"{os.strerror(exc.errno)}; lower capacity or free space") from None
                raise StoreError(f"cannot preallocate {self.path}: {exc}") from exc
            os.pwrite(fd, _header(self.g, self.slots), 0)
            os.fsync(fd)
            self.dir.publish(tmp, self.name)
            return fd
        except BaseException as exc:
            os.close(fd)
            self.dir.unlink(tmp)
            if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                raise typed(exc, f"cannot create {self.path}") from None
            raise

    def _open(self) -> int:
        fd = self.dir.open(self.name, os.O_RDWR)
        try:
            d = _read_header(fd)
            if d.get("fingerprint") != self.g.fingerprint:
                raise StoreError(f"{self.path} was written for another layout; move it away")
            slots, stride = _count(d.get("slots")), _count(d.get("stride"))
            if slots is None or stride is None:
                raise StoreError(f"the header of {self.path} is corrupt; move the slab away")
            if slots != self.slots or stride != self.g.stride:
                raise StoreError(f"{self.path} has {slots} slots of {stride} bytes; open it "
                                 f"with capacity={slots * stride} or move it away")
            if os.fstat(fd).st_size < self.size:
                raise StoreError(f"{self.path} is shorter than its {self.size} bytes (truncated); move it away")
            if d.get("digest") != DIGEST_NAME:  # rows of another digest: the journal drops them too
                os.pwrite(fd, _header(self.g, self.slots), 0)
                os.fsync(fd)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def intact(self) -> bool:
        """The file still spans every slot (reading the map past its end would kill the process)."""
        return os.fstat(self.fd).st_size >= self.size

    def release(self, remove: bool) -> None:
        """Give up the slab's lock; ``remove``: delete the slab, its index and the lock file
        first (a store that failed to come up leaves nothing behind)."""
        if remove:
            for name in (self.name, self.index_name):
                try:
                    self.dir.unlink(name)
                except OSError:
                    pass
        self.dir.unlock(self._lock, self._lock_name, remove)

    def close(self, remove: bool = False) -> None:
        """Unmap and close, releasing the lock on every path."""
        try:
            self.rows = self._u8 = None  # type: ignore[assignment]
            try:
                self.map.close()
            except BufferError:  # a digest view still alive; the map goes with it
                pass
            os.close(self.fd)
        finally:
            self.release(remove)
