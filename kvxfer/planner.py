"""The transfer planner: as few descriptors as the two sides' layouts allow, or a refusal.

A spec pair is checked and turned into leg templates once (:mod:`kvxfer.pairing._templates`): every
member pair must mean the same bytes on both sides (:mod:`kvxfer.pairing._rules`), else the pair
is refused before any byte moves. A local region whose remote counterpart lists the same
members at the same relative offsets moves as **one descriptor per block**; otherwise the
row is split at the member offsets and each member moves on its own, matched by name; row
strides may differ and padding is never moved. docs/geometry.md has the table.

Pairs another TP size, PP stage or block size take gather templates (:mod:`kvxfer.pairing._reshard`)
instead; :func:`plan_gather` broadcasts those over block ids. Per request, everything is
vectorized over blocks: a 95k-descriptor split plan is a
handful of numpy broadcasts, not a Python loop.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import (BlockCountMismatchError, BlockIdOutOfRangeError, BlockIdTypeError, DuplicateBlockIdError,
                     InvalidArgumentError, LayoutMismatchError)
from .geometry import Granularity, KVCacheSpec
from ._legs import ExplicitLeg, Leg, SlicedLeg, SpecLeg
from .memory import DescriptorList, Op, as_op
from .pairing import Group, Pairing, cached_pairing
from .pairing import Gather
from .pairing import may_merge as _may_merge

__all__ = ["plan", "plan_gather", "TransferPlan", "Leg", "ExplicitLeg", "SlicedLeg", "SpecLeg",
           "as_block_ids", "check_unique"]


#: Block ids one request may name (128 MiB as int64): a lazy ``range`` is refused, not expanded.
MAX_BLOCK_IDS = 1 << 24


def as_block_ids(blocks: Any, num_blocks: int, side: str) -> np.ndarray:
    """Validate block ids once, at the API boundary, as a 1-D integer array.

    This runs on every transfer, so the common case (an int64/int32 numpy array) skips the
    conversions; anything else goes through ``np.asarray`` once.
    """
    if type(blocks) is np.ndarray:
        arr = blocks
    elif isinstance(blocks, (str, bytes, bytearray, memoryview)):
        raise BlockIdTypeError(f"{side} block ids must be a sequence of integers, got {type(blocks).__name__}")
    else:
        if hasattr(blocks, "__len__") and len(blocks) > MAX_BLOCK_IDS:  # range(10**9) would be 8 GB
            raise BlockCountMismatchError(f"{side}: {len(blocks)} block ids in one request; at most {MAX_BLOCK_IDS}")
        if isinstance(blocks, (list, tuple)):  # numpy would turn [0, True] into [0, 1]: look first
            kinds = set(map(type, blocks))  # one C-level pass, no Python loop per id
            if bool in kinds or np.bool_ in kinds:
                raise BlockIdTypeError(f"{side} block ids must be integers, got a bool among them; "
                                       "True is not block 1")
        try:
            arr = np.asarray(blocks)
        except (TypeError, ValueError) as exc:  # ragged lists, objects numpy cannot hold
            raise BlockIdTypeError(f"{side} block ids must be a sequence of integers: {exc}") from None
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    kind = arr.dtype.kind
    if kind not in "iu":
        if arr.size:
            first = arr.reshape(-1)[0]
            first = first.item() if isinstance(first, np.generic) else first
            raise BlockIdTypeError(f"{side} block ids must be integers, got {type(first).__name__} "
                                   f"({first!r}); ids are never rounded")
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


def check_unique(blocks: np.ndarray, num_blocks: int, side: str) -> None:
    """Refuse a destination block named twice: which source lands there would be undefined.

    ``blocks`` has passed :func:`as_block_ids`. A scatter into a flag array is the cheapest
    test for the pool sizes engines use; huge sparse pools sort instead.
    """
    n = int(blocks.shape[0])
    if n < 2:
        return
    if n <= 16:
        vals = blocks.tolist()
        if len(set(vals)) == n:
            return
    elif num_blocks <= 16 * n + 65536:
        seen = np.zeros(num_blocks, dtype=bool)
        seen[blocks] = True
        if int(np.count_nonzero(seen)) == n:
            return
        vals = blocks.tolist()
    else:
        s = np.sort(blocks)
        if not (s[1:] == s[:-1]).any():
            return
        vals = s.tolist()
    seen_ids: set[int] = set()
    dup = next(v for v in vals if v in seen_ids or seen_ids.add(v))  # type: ignore[func-returns-value]
    raise DuplicateBlockIdError(f"{side} block id {dup} is a destination more than once in one request; "
                                "each destination block takes exactly one source block")


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
        return leg.explicit(self.local_spec, self.remote_spec)

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
            total += int(_run_starts(la.array, ra.array, self.local_spec.allocation_starts(leg.local_kind),
                                     self.remote_spec.allocation_starts(leg.remote_kind)).sum())
        return total


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


def plan(local_spec: KVCacheSpec, remote_spec: KVCacheSpec, local_blocks: Any, remote_blocks: Any,
         op: Op | str = Op.READ, *, coalesce: bool = False, pairing: Pairing | Gather | None = None) -> TransferPlan:
    """Plan moving ``local_blocks[i] <-> remote_blocks[i]`` for every ``i``.

    ``op`` is from the local side's point of view: READ pulls remote bytes into the local
    blocks, WRITE pushes local bytes into the remote blocks; the destination side's ids must
    be distinct. With ``coalesce=True``, runs that are contiguous on both sides become one
    descriptor (for backends that do not merge runs themselves); the legs then carry
    explicit descriptor lists. ``pairing``: the result of :func:`pair` for these two specs,
    kept by the caller; without it the pairing is remembered with the remote spec.
    Incompatible specs raise a :class:`~kvxfer.errors.LayoutMismatchError` subclass; a
    :class:`~kvxfer.pairing._reshard.Gather` pairing (another TP size, PP stage or block size) is
    planned by :mod:`kvxfer.pairing._reshard`.
    """
    op = as_op(op)
    if not isinstance(local_spec, KVCacheSpec) or not isinstance(remote_spec, KVCacheSpec):
        raise InvalidArgumentError(f"plan() takes two KVCacheSpecs, got {type(local_spec).__name__} and "
                                   f"{type(remote_spec).__name__}")
    if isinstance(pairing, Gather) and pairing.matches(local_spec, remote_spec):
        return plan_gather(pairing, local_spec, {"": remote_spec}, local_blocks, remote_blocks, op)[""]  # type: ignore[no-any-return]
    if not coalesce and isinstance(pairing, Pairing) and pairing.matches(local_spec, remote_spec):
        few = _few_legs(pairing.groups, local_blocks, remote_blocks, local_spec.num_blocks, remote_spec.num_blocks,
                        op)
        if few is not None:
            return TransferPlan(local_spec, remote_spec, op, few, pairing.whole_rows, pairing.split_rows, False)
    lb = as_block_ids(local_blocks, local_spec.num_blocks, "local")
    rb = as_block_ids(remote_blocks, remote_spec.num_blocks, "remote")
    if lb.shape[0] != rb.shape[0]:
        raise BlockCountMismatchError(
            f"local and remote block lists differ in length ({lb.shape[0]} vs {rb.shape[0]}); pair every block")
    if op is Op.READ:
        check_unique(lb, local_spec.num_blocks, "local")
    else:
        check_unique(rb, remote_spec.num_blocks, "remote")
    if not isinstance(pairing, Pairing) or not pairing.matches(local_spec, remote_spec):
        pairing = cached_pairing(local_spec, remote_spec)
    whole, split = pairing.whole_rows, pairing.split_rows
    legs = _legs(pairing.groups, lb, rb)
    if coalesce:
        tmp = TransferPlan(local_spec, remote_spec, op, legs, whole, split, False)
        merged = []
        for leg in legs:
            la, ra = tmp.explicit(leg)
            lo, ro = _coalesce(la.array, ra.array, local_spec.allocation_starts(leg.local_kind),
                               remote_spec.allocation_starts(leg.remote_kind))
            merged.append(ExplicitLeg(leg.local_granularity, leg.local_kind, leg.remote_granularity, leg.remote_kind,
                                      DescriptorList(lo, leg.local_kind), DescriptorList(ro, leg.remote_kind),
                                      leg.sizes, leg.blocks, member_major=leg.member_major))
        legs = tuple(merged)
    return TransferPlan(local_spec, remote_spec, op, legs, whole, split, coalesce)


#: Requests of at most this many blocks, given as lists of ints, are planned without numpy
#: round trips: a one-block transfer's index arrays are built straight from its ints.
FEW_BLOCKS = 16


def _few_legs(groups: Sequence[Group], local: Any, remote: Any, local_n: int, remote_n: int,
              op: Op) -> tuple[Leg, ...] | None:
    """:func:`_legs` for a few whole-row blocks given as ints, or None for the general path.

    Anything the general path would refuse (out of range, duplicates, not ints, mismatched
    lengths) also returns None, so its typed errors and messages stay the only ones.
    """
    if type(local) is not list or type(remote) is not list:
        return None
    n = len(local)
    if not 0 < n <= FEW_BLOCKS or len(remote) != n or any(g.lbase.shape[0] != 1 for g in groups):
        return None
    for v in local + remote:
        if type(v) is not int:
            return None
    if min(local) < 0 or max(local) >= local_n or min(remote) < 0 or max(remote) >= remote_n:
        return None
    if n > 1 and len(set(local if op is Op.READ else remote)) != n:
        return None
    legs = []
    for g in groups:
        l0, r0 = int(g.lbase[0]), int(g.rbase[0])
        li = np.array([v + l0 for v in local], dtype=g.dtype)
        ri = np.array([v + r0 for v in remote], dtype=g.dtype)
        legs.append(SpecLeg(*g.key, li, ri, g.sizes, n, block_bytes=g.block_bytes, member_major=g.member_major))
    return tuple(legs)


def _legs(groups: Sequence[Group], lb: np.ndarray, rb: np.ndarray) -> tuple[Leg, ...]:
    n = int(lb.shape[0])
    legs = []
    for g in groups:
        lbi: np.ndarray = lb.astype(g.dtype, copy=False)
        rbi: np.ndarray = rb.astype(g.dtype, copy=False)
        if g.lbase.shape[0] == 1:  # one piece per block (whole rows of one region)
            li, ri = lbi + g.lbase[0], rbi + g.rbase[0]
        elif g.member_major:  # piece by piece: consecutive blocks of a piece sit side by side
            li = (g.lbase[:, None] + lbi[None, :]).reshape(-1)
            ri = (g.rbase[:, None] + rbi[None, :]).reshape(-1)
        else:  # block by block: all of block i's pieces, then block i+1's
            li = (lbi[:, None] + g.lbase[None, :]).reshape(-1)
            ri = (rbi[:, None] + g.rbase[None, :]).reshape(-1)
        legs.append(SpecLeg(*g.key, li, ri, g.sizes, n, block_bytes=g.block_bytes, member_major=g.member_major))
    return tuple(legs)


# -- gather pairings, per request ----------------------------------------------------------------------------
def plan_gather(g: Gather, local: KVCacheSpec, remotes: Mapping[str, KVCacheSpec], local_blocks: Any,
                remote_blocks: Mapping[str, Any] | Any, op: Op | str = Op.READ) -> dict[str, Any]:
    """One :class:`~kvxfer.planner.TransferPlan` per peer read, for one request.

    ``remote_blocks``: the peer's block ids (a mapping per peer, or one list for all).
    Remote id ``j`` lands in local block ``local_blocks[j // k]`` at token ``(j % k) * remote
    block tokens``; the last local block may be partly covered.
    """
    op = as_op(op)
    if g.missing:
        raise LayoutMismatchError(
            "no peer given holds every page this rank needs; read the other tensor- or pipeline-parallel "
            "ranks together with Agent.read_many", [("missing", ", ".join(g.missing[:6])
                                                     + (f" (+{len(g.missing) - 6} more)" if len(g.missing) > 6
                                                        else ""), "-")])
    lb = as_block_ids(local_blocks, local.num_blocks, "local")
    if op is Op.READ:
        check_unique(lb, local.num_blocks, "local")
    todo: list[tuple[str, KVCacheSpec, np.ndarray, np.ndarray, np.ndarray, list[Any]]] = []
    for n, tabs in g.tables.items():
        spec = remotes[n]
        ids = remote_blocks[n] if isinstance(remote_blocks, Mapping) else remote_blocks
        rb = as_block_ids(ids, spec.num_blocks, "remote" if n == "" else f"peer {n!r}")
        if -(-rb.shape[0] // g.k) != lb.shape[0]:
            raise BlockCountMismatchError(
                f"{lb.shape[0]} local blocks take {lb.shape[0] * g.k - g.k + 1} to {lb.shape[0] * g.k} remote blocks "
                f"({g.k} per local block); {rb.shape[0]} given for peer {n!r}")
        if op is Op.WRITE:
            check_unique(rb, spec.num_blocks, "remote")
        if g.k == 1:
            lblk, sub = lb.astype(np.int64, copy=False), np.zeros(rb.shape[0], dtype=np.int64)
        else:
            j = np.arange(rb.shape[0], dtype=np.int64)
            lblk, sub = lb.astype(np.int64)[j // g.k], j % g.k
        rb = rb.astype(np.int64, copy=False)
        # Per leg: its index-array size, or None where descriptors meet and must be coalesced.
        sizes = [None if _may_merge(t, g.lists[n][kk].combos, lblk, sub, rb) else t.shape[0] * rb.shape[0]
                 for kk, t in tabs.items()]
        todo.append((n, spec, rb, lblk, sub, sizes))
    # Every index array of the request is a view into one buffer: one large allocation is
    # far cheaper than dozens of fresh ones, whose page faults would dominate planning.
    total = sum(x for *_, sizes in todo for x in sizes if x is not None)
    wide = any(sl.dtype is np.int64 for per in g.lists.values() for sl in per.values())
    buf = np.empty(2 * total, dtype=np.int64 if wide else np.int32)
    at = 0
    out: dict[str, Any] = {}
    for n, spec, rb, lblk, sub, sizes in todo:
        legs = []
        for ((lk, rk), t), size in zip(g.tables[n].items(), sizes):
            if size is not None:  # index arrays into the prepared sliced lists
                sl = g.lists[n][(lk, rk)]
                li, ri = buf[at:at + size], buf[at + size:at + 2 * size]
                at += 2 * size
                lbase = sl.lbase[:, 0:1] if g.k == 1 else sl.lbase[:, sub]
                np.add(lbase, lblk.astype(buf.dtype)[None, :], out=li.reshape(t.shape[0], -1))
                np.add(sl.rbase[:, None], rb.astype(buf.dtype)[None, :], out=ri.reshape(t.shape[0], -1))
                legs.append(SlicedLeg(lk, rk, li, ri, t[:, 7], int(rb.shape[0]), sl))
                continue
            la = t[:, 0:1] + lblk[None, :] * t[:, 1:2] + sub[None, :] * t[:, 2:3]  # piece-major: blocks merge
            ra = t[:, 4:5] + rb[None, :] * t[:, 5:6]
            ln = np.repeat(t[:, 7], rb.shape[0])
            ld = np.stack([la.reshape(-1), ln, np.repeat(t[:, 3], rb.shape[0])], axis=1).astype(np.uint64)
            rd = np.stack([ra.reshape(-1), ln, np.repeat(t[:, 6], rb.shape[0])], axis=1).astype(np.uint64)
            lo, ro = _coalesce(ld, rd, local.allocation_starts(lk), spec.allocation_starts(rk))
            legs.append(ExplicitLeg(Granularity.MEMBERS, lk, Granularity.MEMBERS, rk, DescriptorList(lo, lk),
                                    DescriptorList(ro, rk), t[:, 7], int(rb.shape[0]), member_major=True))
        out[n] = TransferPlan(local, spec, op, tuple(legs), 0, len(local.regions), True)
    return out
