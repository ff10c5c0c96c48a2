"""A checked spec pair: the per-block copy templates every request between two specs reuses.

:func:`pair` first applies the pairing rules of :mod:`kvxfer.pairing._rules` (refusing, with a typed
error, any pair whose bytes a copy would not move correctly), then decides per local region
whether rows move whole or split at member offsets, and builds the index arrays the planner
broadcasts over block ids. The result is a :class:`Pairing` owned by whoever owns the pair:
an :class:`~kvxfer.Agent` keeps it in its ``Peer``, so dropping the peer frees it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ._rules import check_pairing
from ..geometry import Granularity, KVCacheSpec
from ..memory import MemoryKind

__all__ = ["Pairing", "pair", "cached_pairing"]


@dataclass(frozen=True)
class _Seg:
    """One per-block copy: a descriptor template on each side (index base and multiplier)."""

    lkind: MemoryKind
    lgran: Granularity
    lbase: int
    rkind: MemoryKind
    rgran: Granularity
    rbase: int
    size: int
    # Where block 0's bytes sit on each side, and the block strides: what alias detection needs.
    lplace: tuple[int, int, int] = (0, 0, 0)  # (device, address, stride)
    rplace: tuple[int, int, int] = (0, 0, 0)


@dataclass(frozen=True)
class Group:
    """The segments of one leg as arrays, built once per spec pair (not per transfer).

    ``member_major``: descriptors run segment by segment (all blocks of segment 0, then of
    segment 1...) rather than block by block, chosen when that lets more of them merge.
    """

    key: tuple[Granularity, MemoryKind, Granularity, MemoryKind]
    lbase: np.ndarray
    rbase: np.ndarray
    sizes: np.ndarray
    dtype: type
    block_bytes: int
    member_major: bool


class Pairing:
    """A checked spec pair: its leg templates and how many regions move whole or split.

    Holds only weak references to the two specs, so caching it never keeps a spec alive.
    """

    __slots__ = ("groups", "whole_rows", "split_rows", "_local", "_remote", "__weakref__")

    def __init__(self, local: KVCacheSpec, remote: KVCacheSpec, groups: list[Group], whole: int, split: int):
        self.groups = groups
        self.whole_rows = whole
        self.split_rows = split
        self._local = weakref.ref(local)
        self._remote = weakref.ref(remote)

    def matches(self, local: KVCacheSpec, remote: KVCacheSpec) -> bool:
        """True when this pairing was built for exactly these two spec objects."""
        return self._local() is local and self._remote() is remote

    @property
    def mode(self) -> str:
        if self.split_rows == 0:
            return "whole-row"
        return "split" if self.whole_rows == 0 else "mixed"

    def __repr__(self) -> str:
        return f"Pairing({self.mode}, whole-row regions={self.whole_rows}, split={self.split_rows})"


def _drop_aliases(segs: list[_Seg]) -> list[_Seg]:
    """Drop segments whose bytes another segment already moves to the same place.

    Members that alias (a ring viewing each row from byte 0, or per-member regions over the
    same pages) would otherwise move those bytes twice. Segment ``m`` is redundant when some
    kept segment ``k`` with the same kinds, devices and strides on both sides contains ``m``'s
    local bytes and maps them with the same displacement to the remote side: then copying
    ``k`` already copies ``m`` for every block pair. Runs once per spec pair.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, s in enumerate(segs):
        (ld, la, ls), (rd, ra, rs) = s.lplace, s.rplace
        groups.setdefault((s.lkind, ld, ls, s.rkind, rd, rs, ra - la), []).append(i)
    drop: set[int] = set()
    for idx in groups.values():
        if len(idx) < 2:
            continue
        idx.sort(key=lambda i: (segs[i].lplace[1], -segs[i].size))
        end = -1
        for i in idx:
            e = segs[i].lplace[1] + segs[i].size
            if e <= end:
                drop.add(i)  # inside an earlier, kept segment
            else:
                end = e
    return [s for i, s in enumerate(segs) if i not in drop]


def pair(local: KVCacheSpec, remote: KVCacheSpec) -> Pairing:
    """Check two specs and build their leg templates; raises a ``LayoutMismatchError`` subclass.

    Whole rows when the local region and the remote region holding its first member list
    the same members at the same relative offsets; otherwise the row splits at member
    offsets. Every member pair has passed the pairing rules by then, so both choices move
    correct bytes; whole rows just need fewer descriptors.
    """
    check_pairing(local, remote)
    rmem = {m.name: (ri, mi, m) for ri, r in enumerate(remote.regions) for mi, m in enumerate(r.members)}
    lrow, rrow = local.list_bases(Granularity.ROWS), remote.list_bases(Granularity.ROWS)
    lmb, rmb = local.list_bases(Granularity.MEMBERS), remote.list_bases(Granularity.MEMBERS)
    segs: list[_Seg] = []
    whole = split = 0

    def place(spec: KVCacheSpec, ri: int, offset: int) -> tuple[int, int, int]:
        r = spec.regions[ri]
        a = spec.allocations[r.allocation]
        return (a.device, a.address + r.offset + offset, r.block_stride)

    for li, lr in enumerate(local.regions):
        ri = rmem[lr.members[0].name][0]
        rr = remote.regions[ri]
        if lr.layout.canonical == rr.layout.canonical:
            whole += 1
            segs.append(_Seg(local.region_kind(li), Granularity.ROWS, int(lrow[li]),
                             remote.region_kind(ri), Granularity.ROWS, int(rrow[ri]), lr.layout.row_len,
                             place(local, li, lr.layout.row_start), place(remote, ri, rr.layout.row_start)))
            continue
        split += 1
        for mi, m in enumerate(lr.members):
            rri, rmi, rm = rmem[m.name]
            rreg = remote.regions[rri]
            segs.append(_Seg(local.region_kind(li), Granularity.MEMBERS, int(lmb[li]) + mi * lr.num_blocks,
                             remote.region_kind(rri), Granularity.MEMBERS, int(rmb[rri]) + rmi * rreg.num_blocks,
                             m.size, place(local, li, m.offset), place(remote, rri, rm.offset)))
    segs = _drop_aliases(segs)
    return Pairing(local, remote, _groups(segs, local.num_blocks, remote.num_blocks), whole, split)


def _member_major(group: Sequence[_Seg]) -> bool:
    """Order descriptors segment by segment when that merges more of them.

    Segment-major order lets consecutive blocks of a segment merge when its blocks lie back
    to back on both sides (per-layer regions on both sides); block-major order lets
    neighbouring segments of one block merge when they touch on both sides. Count both
    chances once per spec pair and take the larger.
    """
    dense = sum(s.lplace[2] == s.size and s.rplace[2] == s.size for s in group)
    touching = sum(a.lplace[0] == b.lplace[0] and a.rplace[0] == b.rplace[0]
                   and a.lplace[1] + a.size == b.lplace[1] and a.rplace[1] + a.size == b.rplace[1]
                   for a, b in zip(group, group[1:]))
    return dense > touching


def _groups(segs: Sequence[_Seg], lblocks: int, rblocks: int) -> list[Group]:
    by_key: dict[tuple[Any, ...], list[_Seg]] = {}
    for s in segs:
        by_key.setdefault((s.lgran, s.lkind, s.rgran, s.rkind), []).append(s)
    out = []
    for key, group in by_key.items():
        lbase = np.array([s.lbase for s in group], dtype=np.int64)
        rbase = np.array([s.rbase for s in group], dtype=np.int64)
        # int32 indices (what NIXL wants) whenever every index of both lists fits.
        fits = max(int(lbase.max()) + lblocks, int(rbase.max()) + rblocks) < np.iinfo(np.int32).max
        dtype = np.int32 if fits else np.int64
        sizes = np.array([s.size for s in group], dtype=np.int64)
        out.append(Group(key, lbase.astype(dtype), rbase.astype(dtype),  # type: ignore[arg-type]
                         sizes, dtype, int(sizes.sum()), len(group) > 1 and _member_major(group)))
    return out


def cached_pairing(local: KVCacheSpec, remote: KVCacheSpec) -> Pairing:
    """:func:`pair`, remembered in the *remote* spec for callers that keep no pairing.

    Peers come and go while the local spec stays, so the entry lives with the remote spec
    and is freed with it; it refers to the local spec only weakly. Entries for local specs
    that no longer exist are swept whenever one is added.
    """
    key = ("pairing", id(local))
    hit = remote._cache.get(key)
    if hit is not None and hit.matches(local, remote):
        return hit  # type: ignore[no-any-return]
    p = pair(local, remote)
    for k in [k for k, v in remote._cache.items() if isinstance(v, Pairing) and v._local() is None]:
        del remote._cache[k]
    remote._cache[key] = p
    return p
