"""The slab: one preallocated file of 4 KiB-aligned row slots per layout fingerprint.

A slab is always row-shaped, whatever the local cache: every member of the layout is packed
into one row (each local region's row extent back to back, members at their offsets inside
it), and slot ``s`` holds that row at file offset ``HEADER + s * stride``, ``stride`` being
the row rounded up to 4 KiB. :func:`slab_spec` describes the file as a block-outermost
:class:`~kvxfer.KVCacheSpec` whose "addresses" are file offsets, so the unchanged planner
pairs a local cache with it: one descriptor per row for a row-shaped cache, one per page for
a layer-outermost one (gathered into the row). docs/storage.md has the file formats.

Files are created 0600. The slab is preallocated with ``posix_fallocate`` before it is
published (renamed into place), so "disk full" is a :class:`~kvxfer.errors.StoreFullError`
at creation and never a torn row later. One store object at a time holds the slab: an
exclusive ``flock`` on a lock file next to it refuses a second opener.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SpecError, StoreBusyError, StoreError, StoreFullError
from ..geometry._spec import KVCacheSpec, Member, PackedLayout, Region
from ..memory import Allocation, MemoryKind
from .digest import DIGEST_NAME

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


def _read_header(fd: int) -> dict[str, Any]:
    raw = os.pread(fd, HEADER, 0)
    if len(raw) < 16 or raw[:8] != _MAGIC:
        raise StoreError("the slab file has no kvxfer header; move it away or choose another path")
    version, n = struct.unpack_from("<II", raw, 8)
    if version != _VERSION or n > HEADER - 16:
        raise StoreError(f"slab header version {version} is not {_VERSION}; it was written by another kvxfer")
    try:
        d = json.loads(raw[16:16 + n])
    except ValueError:
        raise StoreError("the slab header is corrupt; move the slab away") from None
    if not isinstance(d, dict):
        raise StoreError("the slab header is corrupt; move the slab away")
    return d


class Slab:
    """An open, locked, preallocated slab file and a read-only map of it (for digests)."""

    def __init__(self, directory: str, g: Geometry, slots: int) -> None:
        if slots < 1:
            raise StoreError(f"capacity holds no row: one slot is {g.stride} bytes")
        self.g, self.slots = g, slots
        self.size = HEADER + slots * g.stride
        os.makedirs(directory, mode=0o700, exist_ok=True)
        base = os.path.join(directory, f"slab-{g.fingerprint}")
        self.path, self.index_path = base + ".kv", base + ".idx"
        self._lock = os.open(base + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise StoreBusyError(f"{self.path} is open in another store (this or another process); "
                                 "one store object per slab: share it, or close the other first") from None
        try:
            self.created = not os.path.exists(self.path)
            self.fd = self._create() if self.created else self._open()
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(self._lock)
            raise
        self._u8 = np.frombuffer(self.map, dtype=np.uint8, count=slots * g.stride, offset=HEADER)
        self.rows = self._u8.reshape(slots, g.stride)  # slot s is rows[s, :row_len]
        # The slab as a host cache over the map (what row digests are computed on).
        self.mapped = slab_spec(g, slots, self._u8.ctypes.data)

    def _create(self) -> int:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
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
            os.rename(tmp, self.path)
            _fsync_dir(os.path.dirname(self.path))
            return fd
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _open(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            d = _read_header(fd)
            if d.get("fingerprint") != self.g.fingerprint:
                raise StoreError(f"{self.path} was written for another layout; move it away")
            if d.get("slots") != self.slots or d.get("stride") != self.g.stride:
                raise StoreError(f"{self.path} has {d.get('slots')} slots of {d.get('stride')} bytes; open it "
                                 f"with capacity={d.get('slots', 0) * d.get('stride', 0)} or move it away")
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

    def close(self) -> None:
        self.rows = self._u8 = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:  # a digest view still alive; the map goes with it
            pass
        os.close(self.fd)
        os.close(self._lock)  # releases the flock


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
