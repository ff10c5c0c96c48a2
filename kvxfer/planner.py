"""The transfer planner: as few descriptors as the two sides' layouts allow.

For every local region the planner looks for a remote region with the same packed layout
(same member names, sizes and relative offsets, compared in row order). If one exists and
the whole row may move (every member replicated, or both sides hold the same head slice),
that region pair moves as **one descriptor per block**. Otherwise the row is split at the
member offsets and each member moves on its own, matched by name; row strides may differ
and padding is never moved. Per-member regions on both sides are the one-member case of the
first rule, so the table of DESIGN.md section 3 falls out without special cases.

Everything after name matching is vectorized over blocks: a 95k-descriptor split plan is a
handful of numpy broadcasts, not a Python loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import BlockCountMismatchError, BlockIdOutOfRangeError, LayoutMismatchError
from .layout import Granularity, KVCacheSpec, spec_diff
from .memory import DescriptorList, MemoryKind, Op

__all__ = ["plan", "TransferPlan", "Leg", "as_block_ids"]


def as_block_ids(blocks: Any, num_blocks: int, side: str) -> np.ndarray:
    """Validate block ids once, at the API boundary, as a 1-D integer array.

    This runs on every transfer, so the common case (an int64/int32 numpy array) skips the
    conversions; anything else goes through ``np.asarray`` once.
    """
    arr = blocks if type(blocks) is np.ndarray else np.asarray(blocks)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    kind = arr.dtype.kind
    if kind not in "iu":
        if arr.size:
            raise BlockIdOutOfRangeError(f"{side} block ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    elif kind == "u" or arr.dtype.itemsize > 8:
        arr = arr.astype(np.int64)  # uint64 ids past 2**63 wrap negative and are refused below
    if arr.size:
        if arr.size <= 64:  # numpy reductions cost more than the work on a handful of ids
            vals = arr.tolist()
            lo, hi = min(vals), max(vals)
        else:
            lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise BlockIdOutOfRangeError(
                f"{side} block id {bad} is out of range: that side has {num_blocks} blocks (0..{num_blocks - 1})")
    return arr


class Leg:
    """One backend post: index arrays into one local and one remote prepared list.

    A plan has one leg per ``(local kind, local granularity, remote kind, remote granularity)``
    it touches; the common cases have exactly one. Descriptors are in block-major order:
    block ``i``'s pieces (``sizes``), then block ``i+1``'s. When the plan was coalesced the
    leg carries explicit descriptor lists instead (``local_idx``/``remote_idx`` are ``None``).
    """

    __slots__ = ("local_granularity", "local_kind", "remote_granularity", "remote_kind", "local_idx",
                 "remote_idx", "sizes", "blocks", "local_descs", "remote_descs", "descriptors", "nbytes")

    def __init__(self, local_granularity: Granularity, local_kind: MemoryKind, remote_granularity: Granularity,
                 remote_kind: MemoryKind, local_idx: np.ndarray | None, remote_idx: np.ndarray | None,
                 sizes: np.ndarray, blocks: int, local_descs: DescriptorList | None = None,
                 remote_descs: DescriptorList | None = None, block_bytes: int | None = None) -> None:
        self.local_granularity = local_granularity
        self.local_kind = local_kind
        self.remote_granularity = remote_granularity
        self.remote_kind = remote_kind
        self.local_idx = local_idx
        self.remote_idx = remote_idx
        self.sizes = sizes
        self.blocks = blocks
        self.local_descs = local_descs
        self.remote_descs = remote_descs
        # Plain attributes, computed once: every transfer reads them.
        self.descriptors: int = len(local_descs) if local_descs is not None else blocks * int(sizes.shape[0])
        if local_descs is not None:
            self.nbytes: int = local_descs.nbytes
        else:
            self.nbytes = blocks * (int(sizes.sum()) if block_bytes is None else block_bytes)

    def __repr__(self) -> str:
        return (f"Leg({self.local_kind.value}/{self.local_granularity.value} <-> "
                f"{self.remote_kind.value}/{self.remote_granularity.value}, {self.descriptors} descriptors)")

    @property
    def lengths(self) -> np.ndarray:
        """Bytes of every descriptor, in order."""
        if self.local_descs is not None:
            return self.local_descs.lengths.astype(np.int64)
        return np.tile(self.sizes, self.blocks)


class TransferPlan:
    """Paired descriptor indices for one request, plus what they cost.

    Counts (``descriptors``, ``nbytes``) are read without materializing addresses;
    ``runs`` and the explicit arrays are computed on request.
    """

    def __init__(self, local: KVCacheSpec, remote: KVCacheSpec, op: Op, legs: tuple[Leg, ...],
                 whole_rows: int, split_rows: int, coalesced: bool):
        self.local_spec = local
        self.remote_spec = remote
        self.op = op
        self.legs = legs
        self.whole_row_regions = whole_rows
        self.split_regions = split_rows
        self.coalesced = coalesced
        self.descriptors = sum(leg.descriptors for leg in legs)
        self.nbytes = sum(leg.nbytes for leg in legs)

    def __repr__(self) -> str:
        return (f"TransferPlan({self.op.value}, {self.descriptors} descriptors, {self.nbytes} bytes, "
                f"{len(self.legs)} leg(s), whole-row regions={self.whole_row_regions}, split={self.split_regions})")

    @property
    def mode(self) -> str:
        if self.split_regions == 0:
            return "whole-row"
        return "split" if self.whole_row_regions == 0 else "mixed"

    def explicit(self, leg: Leg) -> tuple[DescriptorList, DescriptorList]:
        """``(local, remote)`` explicit ``N x 3`` lists for one leg."""
        if leg.local_descs is not None and leg.remote_descs is not None:
            return leg.local_descs, leg.remote_descs
        assert leg.local_idx is not None and leg.remote_idx is not None
        la = self.local_spec.descriptor_list(leg.local_granularity, leg.local_kind).array[leg.local_idx]
        ra = self.remote_spec.descriptor_list(leg.remote_granularity, leg.remote_kind).array[leg.remote_idx]
        return DescriptorList(la, leg.local_kind), DescriptorList(ra, leg.remote_kind)

    def local_descriptors(self) -> list[DescriptorList]:
        return [self.explicit(leg)[0] for leg in self.legs]

    def remote_descriptors(self) -> list[DescriptorList]:
        return [self.explicit(leg)[1] for leg in self.legs]

    @functools.cached_property
    def runs(self) -> int:
        """Contiguous runs: descriptors that would merge if adjacent on both sides."""
        total = 0
        for leg in self.legs:
            la, ra = self.explicit(leg)
            total += int(_run_starts(la.array, ra.array, _alloc_starts(self.local_spec, leg.local_kind),
                                     _alloc_starts(self.remote_spec, leg.remote_kind)).sum())
        return total


def _alloc_starts(spec: KVCacheSpec, kind: MemoryKind) -> np.ndarray:
    """Start addresses of the spec's allocations of one kind.

    Two storages can sit back to back in memory; a run must not cross from one registered
    allocation into the next, or the merged descriptor spans two registrations. Allocations
    of one kind and device never overlap, so two contiguous descriptors lie in different
    allocations exactly when the second starts where an allocation starts.
    """
    key = ("alloc_starts", kind)
    if key not in spec._cache:  # read on every coalesced transfer: compute once per spec
        spec._cache[key] = np.array(sorted({a.address for a in spec.allocations if a.kind is kind}), dtype=np.uint64)
    return spec._cache[key]  # type: ignore[no-any-return]


def _run_starts(la: np.ndarray, ra: np.ndarray, lstarts: np.ndarray | None = None,
                rstarts: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask: descriptor i starts a new run (not contiguous with i-1 on both sides)."""
    n = la.shape[0]
    starts = np.ones(n, dtype=bool)
    if n > 1:
        cont_l = (la[:-1, 0] + la[:-1, 1] == la[1:, 0]) & (la[:-1, 2] == la[1:, 2])
        cont_r = (ra[:-1, 0] + ra[:-1, 1] == ra[1:, 0]) & (ra[:-1, 2] == ra[1:, 2])
        cont = cont_l & cont_r
        cand = np.flatnonzero(cont)  # only these can merge: check allocation boundaries there
        for side, st in ((la, lstarts), (ra, rstarts)):
            if st is not None and cand.size:
                cont[cand[np.isin(side[cand + 1, 0], st)]] = False
        starts[1:] = ~cont
    return starts


def _coalesce(la: np.ndarray, ra: np.ndarray, lstarts: np.ndarray | None = None,
              rstarts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    starts = _run_starts(la, ra, lstarts, rstarts)
    first = np.flatnonzero(starts)
    lengths = np.add.reduceat(la[:, 1], first) if la.shape[0] else la[:0, 1]
    lo, ro = la[first].copy(), ra[first].copy()
    lo[:, 1] = lengths
    ro[:, 1] = lengths
    return lo, ro


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


def _drop_aliases(segs: list[_Seg]) -> list[_Seg]:
    """Drop segments whose bytes another segment already moves to the same place.

    Members that alias (a ring viewing each row from byte 0, or per-member regions over the
    same pages) would otherwise move those bytes twice. Segment ``m`` is redundant when some
    kept segment ``k`` with the same kinds, devices and strides on both sides contains ``m``'s
    local bytes and maps them with the same displacement to the remote side: then copying
    ``k`` already copies ``m`` for every block pair. Runs once per spec pair (cached).
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


def _pairing(local: KVCacheSpec, remote: KVCacheSpec) -> tuple[list[_Group], int, int]:
    """Decide, per local region, whole rows or split members (cached per spec pair)."""
    # Keyed by identity (hashing a 100-member spec per plan would cost more than planning);
    # the remote object is kept in the entry so its id cannot be reused while cached.
    key = ("pairing", id(remote))
    hit = local._cache.get(key)
    if hit is not None and hit[0] is remote:
        return hit[1]
    rmem = {m.name: (ri, mi, m) for ri, r in enumerate(remote.regions) for mi, m in enumerate(r.members)}
    diff = spec_diff(local, remote)
    bad = [d for d in diff if d[0] == "members" or d[0].startswith("members[") and d[0].endswith(".size")]
    if bad:
        raise LayoutMismatchError("the two KV cache specs do not hold the same members", diff)
    same_slice = local.tp_rank == remote.tp_rank and local.tp_size == remote.tp_size
    lrow, rrow = local.list_bases(Granularity.ROWS), remote.list_bases(Granularity.ROWS)
    lmb, rmb = local.list_bases(Granularity.MEMBERS), remote.list_bases(Granularity.MEMBERS)
    segs: list[_Seg] = []
    whole = split = 0

    def place(spec: KVCacheSpec, ri: int, offset: int) -> tuple[int, int, int]:
        r = spec.regions[ri]
        a = spec.allocations[r.allocation]
        return (a.device, a.address + r.offset + offset, r.block_stride)

    for li, lr in enumerate(local.regions):
        first = lr.members[0].name
        ri = rmem[first][0]
        rr = remote.regions[ri]
        replicated = same_slice or all(m.replicated for m in lr.members)
        if replicated and lr.layout.canonical == rr.layout.canonical:
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
    out = (_groups(segs, local.num_blocks, remote.num_blocks), whole, split)
    local._cache[key] = (remote, out)
    return out


@dataclass(frozen=True)
class _Group:
    """The segments of one leg as arrays, built once per spec pair (not per transfer)."""

    key: tuple[Granularity, MemoryKind, Granularity, MemoryKind]
    lbase: np.ndarray
    rbase: np.ndarray
    sizes: np.ndarray
    dtype: type
    block_bytes: int


def _groups(segs: Sequence[_Seg], lblocks: int, rblocks: int) -> list[_Group]:
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
        out.append(_Group(key, lbase.astype(dtype), rbase.astype(dtype),  # type: ignore[arg-type]
                          sizes, dtype, int(sizes.sum())))
    return out


def plan(local_spec: KVCacheSpec, remote_spec: KVCacheSpec, local_blocks: Any, remote_blocks: Any,
         op: Op | str = Op.READ, *, coalesce: bool = False) -> TransferPlan:
    """Plan moving ``local_blocks[i] <-> remote_blocks[i]`` for every ``i``.

    ``op`` is from the local side's point of view: READ pulls remote bytes into the local
    blocks, WRITE pushes local bytes into the remote blocks. With ``coalesce=True``, runs
    that are contiguous on both sides become one descriptor (for backends that do not
    merge runs themselves); the legs then carry explicit descriptor lists.
    """
    op = Op(op)
    lb = as_block_ids(local_blocks, local_spec.num_blocks, "local")
    rb = as_block_ids(remote_blocks, remote_spec.num_blocks, "remote")
    if lb.shape[0] != rb.shape[0]:
        raise BlockCountMismatchError(
            f"local and remote block lists differ in length ({lb.shape[0]} vs {rb.shape[0]}); pair every block")
    groups, whole, split = _pairing(local_spec, remote_spec)
    legs = _legs(groups, lb, rb)
    if coalesce:
        tmp = TransferPlan(local_spec, remote_spec, op, legs, whole, split, False)
        merged = []
        for leg in legs:
            la, ra = tmp.explicit(leg)
            lo, ro = _coalesce(la.array, ra.array, _alloc_starts(local_spec, leg.local_kind),
                               _alloc_starts(remote_spec, leg.remote_kind))
            merged.append(Leg(leg.local_granularity, leg.local_kind, leg.remote_granularity, leg.remote_kind,
                              None, None, leg.sizes, leg.blocks, DescriptorList(lo, leg.local_kind),
                              DescriptorList(ro, leg.remote_kind)))
        legs = tuple(merged)
    return TransferPlan(local_spec, remote_spec, op, legs, whole, split, coalesce)


def _legs(groups: Sequence[_Group], lb: np.ndarray, rb: np.ndarray) -> tuple[Leg, ...]:
    n = int(lb.shape[0])
    legs = []
    for g in groups:
        lbi: np.ndarray = lb.astype(g.dtype, copy=False)
        rbi: np.ndarray = rb.astype(g.dtype, copy=False)
        if g.lbase.shape[0] == 1:  # whole rows: one descriptor per block
            li, ri = lbi + g.lbase[0], rbi + g.rbase[0]
        else:  # block-major: all of block i's pieces, then block i+1's
            li = (lbi[:, None] + g.lbase[None, :]).reshape(-1)
            ri = (rbi[:, None] + g.rbase[None, :]).reshape(-1)
        legs.append(Leg(*g.key, li, ri, g.sizes, n, block_bytes=g.block_bytes))
    return tuple(legs)
