"""Whole-row objects for a cluster tier: their names, their header, and the bounce buffer.

One object per row: a 64-byte header, then the row exactly as the slab packs it
(:func:`kvxfer.store.slab.geometry`: every member of the layout back to back, whatever the
local cache's shape). The header says what the bytes claim to be, and is checked on every
restore *before* a byte reaches the cache, because the cluster store trusts nobody's bytes
for us: a put that lost a race, an object evicted and its name reused, another writer's
object under our name.

====== ====== =====================================================
offset bytes  field
====== ====== =====================================================
0      8      magic ``KVXFTIER``
8      4      version (1), little-endian
12     4      header length (64)
16     8      row length in bytes
24     8      row digest (:mod:`kvxfer.store.digest`: kvxfer.integrity's xxh3 row digest)
32     16     BLAKE2b-128 of the object's name (binds the bytes to one key of one layout)
48     16     zero
====== ====== =====================================================

Names are ``<namespace>/<layout fingerprint>/<key as hex>``: caches that do not pair byte
for byte (another fingerprint) never read each other's objects.

:class:`Bounce` is the registered host memory every object passes through: offloads gather
the cache's pages into rows there, restores fetch objects there, check them, and only then
scatter them into the cache. The planner moves the pages (the bounce is described as a
row-shaped cache, the slab's spec at another address), so every cache shape the slab takes
is taken here too.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import struct
import numpy as np

from ..errors import InvalidArgumentError, UnsupportedError
from ..geometry import KVCacheSpec
from ..memory import MemoryKind, Op
from ..pairing import Pairing, pair
from ..planner import TransferPlan, plan
from ..store.digest import row_digests
from ..store.slab import Geometry, slab_spec

__all__ = ["HEADER", "Bounce", "object_name", "name_tag", "pack_header", "check_objects", "copy_plan"]

HEADER = 64
_MAGIC = b"KVXFTIER"
_VERSION = 1
_FMT = struct.Struct("<8sIIQQ16s16s")
_ZERO = bytes(16)
#: Longest name a key may give (hex doubles it); Mooncake keys are plain strings.
MAX_NAME = 4096


def object_name(namespace: str, fingerprint: str, key: bytes) -> str:
    return f"{namespace}/{fingerprint}/{key.hex()}"


def name_tag(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def pack_header(row_len: int, digest: int, name: str) -> bytes:
    return _FMT.pack(_MAGIC, _VERSION, HEADER, row_len, digest, name_tag(name), _ZERO)


def check_objects(heads: np.ndarray, got: np.ndarray, digests: np.ndarray, names: list[str],
                  row_len: int) -> np.ndarray:
    """A bool per object: whole (``got``: bytes the store returned), its header ours for this
    name and row length, and its row's digest (``digests``, computed on the fetched bytes)
    the one the header records. ``heads``: the fetched headers, ``(n, HEADER)`` uint8."""
    ok = got == HEADER + row_len
    for i in np.flatnonzero(ok).tolist():
        magic, version, hlen, length, digest, tag, pad = _FMT.unpack(heads[i].tobytes())
        ok[i] = (magic == _MAGIC and version == _VERSION and hlen == HEADER and length == row_len
                 and pad == _ZERO and tag == name_tag(names[i]) and digest == int(digests[i]))
    return ok


class Bounce:
    """``slots`` objects of host memory, registered once with the store's client.

    Slot ``s``'s object starts at ``address + s * stride``: its header, then the row. The
    rows are described to the planner as a row-shaped host cache (:func:`slab_spec` at
    ``address + HEADER``), so a request's pages are gathered or scattered with the plans the
    slab path uses."""

    def __init__(self, g: Geometry, nbytes: int) -> None:
        stride = -(-(HEADER + g.row_len) // 64) * 64
        self.g = dataclasses.replace(g, stride=stride)
        self.stride, self.row_len = stride, g.row_len
        self.slots = max(1, (nbytes - HEADER) // stride)
        self.nbytes = self.slots * stride + HEADER
        self.mem = np.zeros(self.nbytes, dtype=np.uint8)
        self.address = int(self.mem.ctypes.data)
        self.spec = slab_spec(self.g, self.slots, self.address + HEADER)
        self._pairings: dict[int, Pairing] = {}

    @property
    def object_len(self) -> int:
        return HEADER + self.row_len

    def pointers(self, n: int) -> list[int]:
        return [self.address + s * self.stride for s in range(n)]

    def heads(self, n: int) -> np.ndarray:
        return self.mem[:n * self.stride].reshape(n, self.stride)[:, :HEADER]

    def digests(self, n: int) -> np.ndarray:
        """Row digests of slots ``0..n-1`` as they are in the bounce now."""
        return row_digests(self.spec, np.arange(n, dtype=np.int64))

    def plan(self, spec: KVCacheSpec, blocks: np.ndarray, op: Op) -> TransferPlan:
        """``blocks[i]`` (validated ids) of the cache against slot ``i`` (WRITE: cache -> bounce)."""
        if any(a.kind is not MemoryKind.DRAM for a in spec.allocations):
            raise UnsupportedError("the cluster tier moves host caches; stage a VRAM cache through host memory first")
        n = int(blocks.shape[0])
        if n > self.slots:
            raise InvalidArgumentError(f"{n} rows for a bounce of {self.slots}")  # the caller splits requests
        hit = self._pairings.get(id(spec))
        if hit is None or not hit.matches(spec, self.spec):
            hit = pair(spec, self.spec)  # refuses, typed, a cache that does not pair with the rows
            self._pairings = {k: v for k, v in self._pairings.items() if v._local() is not None}
            self._pairings[id(spec)] = hit
        return plan(spec, self.spec, blocks, np.arange(n, dtype=np.int64), op, coalesce=True, pairing=hit)


def copy_plan(p: TransferPlan, to_cache: bool) -> None:
    """Move a plan's bytes between the cache and the bounce (``memmove`` per descriptor: the
    planner merged the runs)."""
    mm = ctypes.memmove
    for leg in p.legs:
        la, ra = p.explicit(leg)
        loc, rem = la.array, ra.array
        dst, src = (loc, rem) if to_cache else (rem, loc)
        for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), loc[:, 1].tolist()):
            mm(d, s, n)
