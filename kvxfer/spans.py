"""Span arithmetic every data path needs: "is this inside what was registered?" and run merging.

Backends copy bytes where the core cannot watch, so each one must refuse a descriptor that
leaves the memory registered for it, and most merge descriptors that are contiguous on
both sides before they hand them to a copy engine. Both are written once, here, vectorized
over descriptors, so that no backend carries its own (subtly different) version.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .errors import OutOfRegistrationError
from .memory import Allocation, MemoryKind

__all__ = ["SpanIndex", "merge_runs"]


class SpanIndex:
    """Sorted registered spans of one side, for vectorized containment checks.

    ``find(addr, nbytes, device, kind)`` returns, for each descriptor, the index of the one
    allocation that holds it whole, or -1. Allocations of one kind and device never overlap
    (the spec validates that), so the allocation starting at or before an address is the
    only candidate.
    """

    __slots__ = ("_start", "_end", "_kind", "_device", "_order", "allocations")

    def __init__(self, allocations: Iterable[Allocation] = ()) -> None:
        self.allocations: tuple[Allocation, ...] = tuple(allocations)
        rows = np.array([(a.address, a.end, 0 if a.kind is MemoryKind.DRAM else 1, a.device)
                         for a in self.allocations], dtype=np.uint64).reshape(-1, 4)
        order = np.argsort(rows[:, 0], kind="stable")
        self._order = order.astype(np.int64)
        self._start = np.ascontiguousarray(rows[order, 0])
        self._end = np.ascontiguousarray(rows[order, 1])
        self._kind = np.ascontiguousarray(rows[order, 2])
        self._device = np.ascontiguousarray(rows[order, 3])

    def __len__(self) -> int:
        return len(self.allocations)

    def find(self, addr: np.ndarray, nbytes: np.ndarray, device: np.ndarray | int, kind: MemoryKind) -> np.ndarray:
        """Index into ``allocations`` of the allocation holding each span, -1 where none does."""
        addr = np.asarray(addr, dtype=np.uint64)
        nbytes = np.asarray(nbytes, dtype=np.uint64)
        if addr.shape[0] == 0 or self._start.shape[0] == 0:
            return np.full(addr.shape[0], -1, dtype=np.int64)
        pos = np.searchsorted(self._start, addr, side="right").astype(np.int64) - 1
        ok = pos >= 0
        p = np.where(ok, pos, 0)
        end = addr + nbytes
        ok &= (end >= addr) & (end <= self._end[p])  # no wrap-around, and ends inside
        ok &= self._kind[p] == (0 if kind is MemoryKind.DRAM else 1)
        ok &= self._device[p] == np.asarray(device, dtype=np.uint64)
        return np.where(ok, self._order[p], -1)

    def check(self, descs: np.ndarray, kind: MemoryKind, who: str) -> np.ndarray:
        """Raise :class:`OutOfRegistrationError` unless every ``(address, nbytes, device)`` row
        lies inside one allocation; return the allocation index of each row."""
        descs = np.asarray(descs)
        if descs.ndim != 2 or descs.shape[1] < 3:
            raise OutOfRegistrationError(f"{who}: descriptors must be an N x 3 array")
        slot = self.find(descs[:, 0], descs[:, 1], descs[:, 2], kind)
        bad = np.flatnonzero(slot < 0)
        if bad.size:
            i = int(bad[0])
            raise OutOfRegistrationError(
                f"{who}: descriptor {i} ({int(descs[i, 0]):#x}, {int(descs[i, 1])} bytes, {kind.value} device "
                f"{int(descs[i, 2])}) is outside the memory registered there ({bad.size} such descriptors)")
        return slot


def merge_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge copies that are contiguous on both sides into one: ``(dst, src, sizes)`` arrays.

    ``dst[i+1] == dst[i] + sizes[i]`` and the same for ``src`` joins copy ``i+1`` to copy
    ``i``. Callers that must not cross registration boundaries split their input there first.
    """
    dst = np.asarray(dst, dtype=np.uint64)
    src = np.asarray(src, dtype=np.uint64)
    sizes = np.asarray(sizes, dtype=np.uint64)
    n = sizes.shape[0]
    if n < 2:
        return dst, src, sizes
    cont = (dst[:-1] + sizes[:-1] == dst[1:]) & (src[:-1] + sizes[:-1] == src[1:])
    if not cont.any():
        return dst, src, sizes
    starts = np.ones(n, dtype=bool)
    starts[1:] = ~cont
    first = np.flatnonzero(starts)
    return (np.ascontiguousarray(dst[first]), np.ascontiguousarray(src[first]),
            np.add.reduceat(sizes, first).astype(np.uint64))
