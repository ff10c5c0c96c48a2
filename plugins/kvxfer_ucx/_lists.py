"""Prepared descriptor lists: checked once against registrations, resolved per post.

A strided row ``(address, nbytes, device, stride, count)`` stays one row: it is inside an
allocation when its first and its last span are inside the same one (the spans in between
lie between them), so preparing costs O(rows) however many blocks a region has, and a post
computes only the addresses of the indices it moves.
"""

from __future__ import annotations

import numpy as np

from kvxfer import BackendError, DescriptorList, MemoryKind, OutOfRegistrationError
from kvxfer.plugin import SpanIndex

__all__ = ["Prepared"]

_U64 = np.uint64((1 << 64) - 1)


class Prepared:
    """A list checked against ``spans``; ``owner`` is the peer it belongs to (None: local)."""

    __slots__ = ("owner", "size", "_addr", "_len", "_slot", "_stride", "_first")

    def __init__(self, descs: DescriptorList, spans: SpanIndex, who: str, owner: object = None) -> None:
        self.owner = owner
        arr = descs.array
        if not descs.strided:
            self._slot = spans.check(arr, MemoryKind.DRAM, who)
            self._addr, self._len = arr[:, 0], arr[:, 1]
            self._stride = self._first = None
            self.size = len(arr)
            return
        arr = arr[arr[:, 4] > 0]
        base, n, dev, stride, count = (arr[:, i] for i in range(5))
        steps = count - np.uint64(1)
        # stride * (count - 1) must not wrap: compare against what is left above the base.
        room = (_U64 - base) // np.maximum(stride, np.uint64(1))
        ok = (stride == 0) | (steps <= room)
        last = base + stride * np.where(ok, steps, np.uint64(0))
        first_slot = spans.find(base, n, dev, MemoryKind.DRAM)
        last_slot = spans.find(last, n, dev, MemoryKind.DRAM)
        ok &= (first_slot >= 0) & (first_slot == last_slot)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise OutOfRegistrationError(f"{who}: strided row {i} ({int(base[i]):#x}, {int(n[i])} bytes x "
                                         f"{int(count[i])}, stride {int(stride[i])}) leaves the registered memory")
        self._addr, self._len, self._slot, self._stride = base, n, first_slot, stride
        counts = count.astype(np.int64)
        self._first = np.cumsum(counts) - counts
        self.size = int(counts.sum())

    def resolve(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(addresses, lengths, allocation slots)`` of the spans ``idx`` points at."""
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.size):
            raise BackendError(f"ucx backend: descriptor index out of range of the prepared list ({self.size})")
        if self._first is None:
            return self._addr[idx], self._len[idx], self._slot[idx]
        row = np.searchsorted(self._first, idx, side="right") - 1
        k = (idx - self._first[row]).astype(np.uint64)
        assert self._stride is not None
        return self._addr[row] + self._stride[row] * k, self._len[row], self._slot[row]
