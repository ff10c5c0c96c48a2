"""The device path's part of a backend's connection blob: who exports what, as plain bytes.

Layout (little-endian, fixed-size records read with numpy; no pickle, nothing executable)::

    magic "KVXCUDA2" | identity (kvxfer.peers.encode: boot id, pid, start time, token, page) | instance 16
    n_devices u16 | n_handles u32 | n_chunks u32 | n_allocs u32
    devices   n_devices x uuid(16)
    handles   n_handles x (kind u8, device u16, base u64, size u64, first_chunk u32, n_chunks u32)
    chunks    n_chunks  x (offset u64, size u64, payload 64)
    allocs    n_allocs  x (address u64, nbytes u64, handle u32)

A *handle* is one span of the exporter's address space that the importer maps as a unit:
a ``cudaMalloc`` allocation (kind 1: one chunk whose payload is the IPC handle), or a run of
VMM mappings (kind 2: chunks tiling the span, each payload a file descriptor number in the
exporter, fetched with ``pidfd_getfd``). *Allocs* are the registered allocations, each inside
one handle. Everything is validated on decode: a malformed blob raises
:class:`~kvxfer.errors.MetadataError`, it never reaches CUDA. A well-formed blob is still
only a claim: the importer opens it only if the exporter's proof page (:mod:`kvxfer.peers`)
lists :func:`digest` of these very bytes, so bounds and handles are the exporter's word.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import MetadataError
from .. import peers
from ..peers import Identity

__all__ = ["KIND_LEGACY", "KIND_VMM", "Export", "decode", "digest", "encode", "ALLOC", "CHUNK", "HANDLE"]

MAGIC = b"KVXCUDA2"
KIND_LEGACY, KIND_VMM = 1, 2
_HEAD = struct.Struct(f"<8s{peers.IDENTITY.size}s16sHIII")
HANDLE = np.dtype([("kind", "<u1"), ("device", "<u2"), ("base", "<u8"), ("size", "<u8"), ("first", "<u4"),
                   ("count", "<u4")])
CHUNK = np.dtype([("offset", "<u8"), ("size", "<u8"), ("payload", "V64")])
ALLOC = np.dtype([("address", "<u8"), ("nbytes", "<u8"), ("handle", "<u4")])
MAX_HANDLES, MAX_CHUNKS, MAX_ALLOCS, MAX_DEVICES = 1 << 16, 1 << 20, 1 << 20, 1 << 10


@dataclass(frozen=True)
class Export:
    """A decoded (or to-be-encoded) export: identity, device uuids, handles, chunks, allocs."""

    identity: Identity
    instance: bytes
    devices: tuple[bytes, ...]
    handles: np.ndarray  # HANDLE records
    chunks: np.ndarray  # CHUNK records
    allocs: np.ndarray  # ALLOC records

    @property
    def empty(self) -> bool:
        return self.allocs.shape[0] == 0


def encode(e: Export) -> bytes:
    head = _HEAD.pack(MAGIC, peers.encode(e.identity), e.instance, len(e.devices), e.handles.shape[0],
                      e.chunks.shape[0], e.allocs.shape[0])
    return b"".join([head, *e.devices, e.handles.astype(HANDLE).tobytes(), e.chunks.astype(CHUNK).tobytes(),
                     e.allocs.astype(ALLOC).tobytes()])


def digest(blob: bytes) -> bytes:
    """What an exporter lists in its proof page for each export it stands behind."""
    return hashlib.sha256(bytes(blob)).digest()


def _bad(why: str) -> MetadataError:
    return MetadataError(f"device-path export: {why}")


def decode(blob: bytes) -> Export:
    """Parse and validate; raises :class:`MetadataError` on anything malformed."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise _bad("not bytes")
    blob = bytes(blob)
    if len(blob) < _HEAD.size:
        raise _bad(f"{len(blob)} bytes is shorter than the header")
    magic, ident, inst, nd, nh, nc, na = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise _bad(f"bad magic {magic!r}")
    if nd > MAX_DEVICES or nh > MAX_HANDLES or nc > MAX_CHUNKS or na > MAX_ALLOCS:
        raise _bad("too many devices, handles, chunks or allocations")
    want = _HEAD.size + 16 * nd + HANDLE.itemsize * nh + CHUNK.itemsize * nc + ALLOC.itemsize * na
    if len(blob) != want:
        raise _bad(f"length {len(blob)} does not match its counts (expected {want})")
    pos = _HEAD.size
    devices = tuple(blob[pos + 16 * k: pos + 16 * (k + 1)] for k in range(nd))
    pos += 16 * nd
    handles = np.frombuffer(blob, HANDLE, nh, pos)
    pos += HANDLE.itemsize * nh
    chunks = np.frombuffer(blob, CHUNK, nc, pos)
    pos += CHUNK.itemsize * nc
    allocs = np.frombuffer(blob, ALLOC, na, pos)
    _validate(handles, chunks, allocs, nd)
    return Export(peers.decode(ident, "device-path export"), inst, devices, handles, chunks, allocs)


def _validate(handles: np.ndarray, chunks: np.ndarray, allocs: np.ndarray, n_devices: int) -> None:
    """Every index in range, no wrap-around, chunks tile their handle, allocs inside a handle."""
    u64 = np.uint64
    if handles.shape[0]:
        if not np.isin(handles["kind"], (KIND_LEGACY, KIND_VMM)).all():
            raise _bad("unknown handle kind")
        if (handles["device"] >= n_devices).any():
            raise _bad("handle names a device that is not listed")
        base, size = handles["base"], handles["size"]
        if (size == 0).any() or (base + size < base).any():
            raise _bad("empty or wrapping handle")
        first, count = handles["first"].astype(np.int64), handles["count"].astype(np.int64)
        if (count < 1).any() or (first + count > chunks.shape[0]).any():
            raise _bad("handle chunk range out of bounds")
        if int(count.sum()) != chunks.shape[0] or not np.array_equal(first, np.cumsum(count) - count):
            raise _bad("handles must list their chunks in order, each chunk once")
        if ((handles["kind"] == KIND_LEGACY) & (count != 1)).any():
            raise _bad("a legacy IPC handle has exactly one chunk")
        # chunks of each handle tile [0, size): first offset 0, each next starts where the last ends
        off, csz = chunks["offset"], chunks["size"]
        if (csz == 0).any() or (off + csz < off).any():
            raise _bad("empty or wrapping chunk")
        owner = np.repeat(np.arange(handles.shape[0]), count)
        starts = np.zeros(chunks.shape[0], dtype=bool)
        starts[first] = True
        ends = off + csz
        prev_end = np.concatenate([[u64(0)], ends[:-1]]).astype(u64)
        expect = np.where(starts, u64(0), prev_end)
        if not np.array_equal(off, expect):
            raise _bad("chunks do not tile their handle")
        last = first + count - 1
        if not np.array_equal(ends[last], size) or not np.array_equal(owner[last], np.arange(handles.shape[0])):
            raise _bad("chunks do not cover their handle")
    if allocs.shape[0]:
        if (allocs["handle"] >= handles.shape[0]).any():
            raise _bad("allocation names a handle that is not listed")
        h = handles[allocs["handle"].astype(np.int64)]
        a, n = allocs["address"], allocs["nbytes"]
        if (n == 0).any() or (a + n < a).any():
            raise _bad("empty or wrapping allocation")
        if ((a < h["base"]) | (a + n > h["base"] + h["size"])).any():
            raise _bad("allocation lies outside its handle")
