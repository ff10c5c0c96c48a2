"""A verified READ checked while it is copied: the source's digests handed to the device path.

The device path's fused kernel (:mod:`kvxfer.cuda.digest`, ``DevicePath.post(expect=)``) copies
each descriptor and hashes what it moves in one pass, then compares with one expected ``mm8``
digest per descriptor. A plan's descriptors are runs (a block's member pages back to back,
consecutive blocks merged), so :class:`Expected` cuts each run at the cells the source digested
and hands every piece its digest. A run that is not exactly whole cells is not cut: that post
stays a plain copy, and the check after DONE (:mod:`kvxfer.integrity.verified`) runs as before.
Only when every cell was moved by a fused post is that second pass over the bytes left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import IntegrityError
from ..memory import MemoryKind
from .verified import PairingCheck

__all__ = ["Expected", "Pieces"]


class Expected:
    """The destination's cells of one verified READ: where each lies here, and its expected digest.

    Built only for ``mm8`` cell digests (the fused kernel's function; not row digests, which
    name no cell) whose cells all lie in VRAM, at distinct addresses."""

    __slots__ = ("addr", "length", "digest", "check", "_flat", "_covered")

    def __init__(self, addr: np.ndarray, length: np.ndarray, digest: np.ndarray, check: Any = None) -> None:
        order = np.argsort(addr, kind="stable")
        self.addr, self.length, self.digest = addr[order], length[order], digest[order]
        self.check = check  # the PairingCheck it stands in for: names a mismatch's block and member
        self._flat = order  # each cell's position in the check's [blocks, cells] order
        self._covered = np.zeros(addr.shape[0], dtype=bool)

    @classmethod
    def of(cls, check: Any) -> "Expected | None":
        """The table for a :class:`PairingCheck`, or None where the fused kernel cannot stand in for it."""
        if type(check) is not PairingCheck:
            return None
        e, spans = check.expect, check.spans
        if e.algorithm != "mm8" or e.row or not spans.block.shape[0] or spans.kinds() != {MemoryKind.VRAM}:
            return None
        addr = spans.addresses().astype(np.uint64).ravel()
        length = np.broadcast_to(spans.length.astype(np.uint64)[None, :], (spans.block.shape[0],
                                                                          spans.length.shape[0])).ravel()
        if (length == 0).any():
            return None
        t = cls(addr, length, np.asarray(e.values, np.uint64).ravel(), check)
        if t.addr.shape[0] > 1 and (t.addr[1:] < t.addr[:-1] + t.length[:-1]).any():
            return None  # cells that overlap (a block read twice): no run cuts into them one way
        return t

    def cut(self, addr: np.ndarray, nbytes: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Cut runs (``addr``/``nbytes``: where each lands here) into whole cells: per piece, its
        run, its offset in the run, its length, its expected digest and its cell (for
        :meth:`cover`); None unless every run is exactly a sequence of adjacent cells not yet covered."""
        a, n = np.asarray(addr, np.uint64), np.asarray(nbytes, np.uint64)
        m = self.addr.shape[0]
        if not a.shape[0] or not m:
            return None
        first = np.searchsorted(self.addr, a)
        stop = np.searchsorted(self.addr, a + n)  # one past the last cell that starts inside each run
        if (first >= m).any() or (self.addr[np.minimum(first, m - 1)] != a).any() or (stop <= first).any():
            return None
        ends = self.addr + self.length
        if (ends[stop - 1] != a + n).any():
            return None
        gaps = np.concatenate([[0], np.cumsum(self.addr[1:] != ends[:-1])])  # breaks before each cell
        if (gaps[stop - 1] != gaps[first]).any():
            return None
        count = stop - first
        run = np.repeat(np.arange(a.shape[0], dtype=np.int64), count)
        cell = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()), dtype=np.int64)
        hit = np.zeros(m, dtype=bool)
        hit[cell] = True  # a mask, not np.unique: 0.3 ms for 8,192 cells, on every verified post
        if int(np.count_nonzero(hit)) != cell.shape[0] or self._covered[cell].any():
            return None  # a cell twice in one request: the check after DONE decides
        return run, self.addr[cell] - a[run], self.length[cell], self.digest[cell], cell

    def mismatch(self, cells: np.ndarray, bad: np.ndarray) -> IntegrityError:
        """The error for a fused post whose pieces ``bad`` (of ``cells``) hashed otherwise than the
        source's digests: named as the check after DONE names it (block, source block, member)."""
        n = int(bad.shape[0])
        if self.check is None:
            return IntegrityError(f"{n} cells arrived with another mm8 digest than the source's", mismatches=n)
        e = self.check.expect
        b, c = divmod(int(self._flat[int(cells[int(bad[0])])]), int(e.values.shape[1]))
        lb, rb, member = int(self.check.lb[b]), int(e.blocks[b]), e.cells.members[c]
        return IntegrityError(f"block {lb} (source block {rb}): member {member!r} bytes {int(e.cells.offsets[c])}+"
                              f"{int(e.cells.lengths[c])} differs from the source's digest ({n} of {len(cells)} "
                              "cells of one device-path post differ, compared as they were copied). The bytes are "
                              "not the source's: recompute this request", block=lb, remote_block=rb, member=member,
                              mismatches=n)

    def cover(self, cells: np.ndarray) -> None:
        """These cells were moved by a fused post: its completion compares their digests."""
        self._covered[cells] = True

    def complete(self) -> bool:
        """Whether fused posts moved every cell (then the check after DONE has nothing left to do)."""
        return bool(self._covered.all())


class Pieces:
    """One fused post's expected digests (``values``, one per descriptor), and how its
    mismatches are named (``error``), as the device path takes them (``DevicePath.post(expect=)``)."""

    __slots__ = ("values", "cells", "table")

    def __init__(self, values: np.ndarray, cells: np.ndarray, table: Expected) -> None:
        self.values, self.cells, self.table = values, cells, table

    def error(self, bad: np.ndarray) -> IntegrityError:
        return self.table.mismatch(self.cells, bad)
