"""Per-request gather planning as index arrays: the sliced lists a gather leg indexes into.

:mod:`kvxfer.pairing._reshard` decides once which byte ranges of which peer pages fill each local
page; this module turns those templates into lists a backend prepares once, so that a
request costs a broadcast of block ids instead of an address per descriptor.
"""

from __future__ import annotations

import numpy as np

from ..memory import DescriptorList, MemoryKind

__all__ = ["SlicedLists", "may_merge"]


class SlicedLists:
    """The descriptor lists one gather leg indexes into, one row per (piece, block).

    Built once per set of specs, like a spec's own prepared lists: row ``(p * k + s) *
    local blocks + b`` is piece ``p`` of sub-block ``s`` of local block ``b``, row ``p *
    remote blocks + b`` piece ``p`` of remote block ``b``. A request is then index arrays
    (block ids plus a per-piece base), not addresses. Kept by identity as the key under
    which an agent keeps the backend's prepared handles.
    """

    __slots__ = ("_strided", "_plain", "lbase", "rbase", "dtype", "combos", "__weakref__")

    def __init__(self, t: np.ndarray, k: int, lcount: int, rcount: int, lkind: MemoryKind, rkind: MemoryKind):
        p = int(t.shape[0])
        sub = np.arange(k, dtype=np.int64)
        rep = lambda col: np.repeat(t[:, col], k)  # noqa: E731
        lrows = np.stack([(t[:, 0:1] + sub[None, :] * t[:, 2:3]).reshape(-1), rep(7), rep(3), rep(1),
                          np.full(p * k, lcount, dtype=np.int64)], axis=1)
        rrows = np.stack([t[:, 4], t[:, 7], t[:, 6], t[:, 5], np.full(p, rcount, dtype=np.int64)], axis=1)
        self._strided = (DescriptorList(lrows.reshape(-1, 5), lkind), DescriptorList(rrows.reshape(-1, 5), rkind))
        self._plain: list[DescriptorList | None] = [None, None]
        fits = p * k * lcount < 2**31 and p * rcount < 2**31
        self.dtype: type = np.int32 if fits else np.int64
        self.lbase = (np.arange(p * k, dtype=np.int64) * lcount).reshape(p, k).astype(self.dtype)
        self.rbase = (np.arange(p, dtype=np.int64) * rcount).astype(self.dtype)
        # Distinct (local stride, local sub-block step, remote stride, length): which
        # pieces could run on into the next block, checked per request in O(blocks) each.
        self.combos = np.unique(t[:, [1, 2, 5, 7]], axis=0)

    def local(self, strided: bool = False) -> DescriptorList:
        return self._side(0, strided)

    def remote(self, strided: bool = False) -> DescriptorList:
        return self._side(1, strided)

    def _side(self, i: int, strided: bool) -> DescriptorList:
        if strided:
            return self._strided[i]
        plain = self._plain[i]
        if plain is None:
            plain = self._plain[i] = self._strided[i].expand()
        return plain


def may_merge(t: np.ndarray, combos: np.ndarray, lblk: np.ndarray, sub: np.ndarray, rb: np.ndarray) -> bool:
    """Whether any two descriptors of this leg, in piece-major order, are adjacent on both sides.

    False is exact (nothing would merge), so the caller may skip materializing addresses;
    True only says coalescing is worth running. Allocation and device boundaries, which only
    prevent merges, are left to the coalescer.
    """
    n = int(rb.shape[0])
    if n == 0:
        return False
    if n > 1:
        dl = dsub = dr = None
        for ls, lsub, rs, ln in combos.tolist():
            if rs == 0 or ln % rs:  # the remote ids step by whole blocks: never lands on ln bytes
                continue
            if dl is None:
                dl, dsub, dr = np.diff(lblk), np.diff(sub), np.diff(rb)
            if bool(((dl * ls + dsub * lsub == ln) & (dr * rs == ln)).any()):
                return True
    la0 = t[:, 0] + int(lblk[0]) * t[:, 1] + int(sub[0]) * t[:, 2]
    la1 = t[:, 0] + int(lblk[-1]) * t[:, 1] + int(sub[-1]) * t[:, 2]
    ra0, ra1 = t[:, 4] + int(rb[0]) * t[:, 5], t[:, 4] + int(rb[-1]) * t[:, 5]
    return bool(((la1[:-1] + t[:-1, 7] == la0[1:]) & (ra1[:-1] + t[:-1, 7] == ra0[1:])).any())
