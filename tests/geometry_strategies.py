"""Random KV geometries over real numpy memory, and an independent reference for them.

The property tests need two things the planner must not provide itself: memory whose bytes
can be checked, and an answer computed without the planner's logic. A :class:`SideGeom` is
a plain description (arena offsets, strides, member offsets) that builds a
:class:`~kvxfer.KVCacheSpec` over a numpy arena and also computes, on its own, where each
member of each block lives. :func:`apply_plan` copies bytes by explicit descriptors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from kvxfer import Allocation, KVCacheSpec, Member, Op, PackedLayout, Region, TransferPlan

SENTINEL = 0xAA


@dataclass
class MemberGeom:
    """One member inside one region row: byte offset in the row, size, replication."""

    name: str
    offset: int
    size: int
    replicated: bool


@dataclass
class RegionGeom:
    """A region: allocation index, byte offset of block 0, row stride, members (listing order)."""

    alloc: int
    offset: int
    stride: int
    members: list[MemberGeom]


@dataclass
class SideGeom:
    """One worker's geometry over its own numpy arena."""

    allocs: list[tuple[int, int]]  # (offset in arena, nbytes)
    regions: list[RegionGeom]
    num_blocks: int
    tp_rank: int = 0
    tp_size: int = 1
    arena_bytes: int = 0
    arena: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]

    def make_arena(self, fill: int | np.ndarray) -> np.ndarray:
        """A fresh arena: a sentinel byte everywhere, or the given pattern."""
        if isinstance(fill, np.ndarray):
            self.arena = fill.copy()
        else:
            self.arena = np.full(self.arena_bytes, fill, dtype=np.uint8)
        return self.arena

    @property
    def base(self) -> int:
        return int(self.arena.__array_interface__["data"][0])

    def spec(self, *, shuffle: int | None = None, split: bool = False) -> KVCacheSpec:
        """The spec over the current arena.

        ``shuffle``: a seed that reorders every region's member listing (the row layout, i.e.
        every member's offset, is unchanged). ``split``: describe the same bytes as one region per member,
        which forces the planner to move members one by one.
        """
        allocs = tuple(Allocation(self.base + off, n) for off, n in self.allocs)
        regions = []
        for r in self.regions:
            ms = list(r.members)
            if shuffle is not None:
                ms = [ms[i] for i in np.random.default_rng(shuffle).permutation(len(ms))]
            if split:
                for m in ms:
                    regions.append(Region(r.alloc, r.offset + m.offset, self.num_blocks,
                                          PackedLayout(r.stride, (Member(m.name, m.size, 0, m.replicated),))))
            else:
                regions.append(Region(r.alloc, r.offset, self.num_blocks, PackedLayout(
                    r.stride, tuple(Member(m.name, m.size, m.offset, m.replicated) for m in ms))))
        return KVCacheSpec(allocs, tuple(regions), layout="BLHNC", tp_rank=self.tp_rank, tp_size=self.tp_size)

    def where(self, name: str) -> tuple[RegionGeom, MemberGeom]:
        for r in self.regions:
            for m in r.members:
                if m.name == name:
                    return r, m
        raise KeyError(name)

    def member_off(self, name: str, block: int) -> int:
        """Arena offset of member ``name`` in ``block``, computed from the geometry alone."""
        r, m = self.where(name)
        return self.allocs[r.alloc][0] + r.offset + block * r.stride + m.offset

    def row_mask(self, blocks: np.ndarray) -> np.ndarray:
        """Arena bytes covered by any member's extent in the given blocks."""
        mask = np.zeros(self.arena_bytes, dtype=bool)
        for r in self.regions:
            lo = min(m.offset for m in r.members)
            hi = max(m.offset + m.size for m in r.members)
            for b in blocks:
                start = self.allocs[r.alloc][0] + r.offset + int(b) * r.stride
                mask[start + lo:start + hi] = True
        return mask

    @property
    def names(self) -> list[str]:
        return [m.name for r in self.regions for m in r.members]


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

@dataclass
class Model:
    """What both sides agree on: member names, sizes, replication, and prefix aliases."""

    names: list[str]
    sizes: dict[str, int]
    replicated: dict[str, bool]
    aliases: dict[str, tuple[str, int]]  # alias name -> (target member, size <= target size)


@st.composite
def models(draw: st.DrawFn, *, max_layers: int = 6, aliases: bool = True) -> Model:
    n = draw(st.integers(1, max_layers))
    names = [f"layer.{i}" for i in range(n)]
    sizes = {nm: draw(st.integers(1, 24)) for nm in names}
    rep_mode = draw(st.sampled_from(["all", "none", "mixed"]))
    rep = {nm: rep_mode == "all" or (rep_mode == "mixed" and draw(st.booleans())) for nm in names}
    al: dict[str, tuple[str, int]] = {}
    if aliases and draw(st.booleans()):
        for j in range(draw(st.integers(1, 3))):
            t = draw(st.sampled_from(names))
            al[f"ring.{j}"] = (t, draw(st.integers(1, sizes[t])))
            rep[f"ring.{j}"] = rep[t]
    return Model(names, sizes, rep, al)


@st.composite
def side_geoms(draw: st.DrawFn, model: Model, *, style: str | None = None,
               mirror: SideGeom | None = None, interior_gaps: bool = True) -> SideGeom:
    """One side. ``style``: packed | per_member | groups. ``mirror``: copy its row layouts
    (same groups and relative offsets) but re-draw placement, strides and block count."""
    num_blocks = draw(st.integers(1, 10))
    if mirror is not None:
        groups = [[(m.name, m.offset) for m in r.members if m.name not in model.aliases] for r in mirror.regions]
        groups = [g for g in groups if g]
    else:
        style = style or draw(st.sampled_from(["packed", "per_member", "groups"]))
        order = draw(st.permutations(model.names))
        if style == "packed":
            cuts: list[int] = []
        elif style == "per_member":
            cuts = list(range(1, len(order)))
        else:
            cuts = sorted(draw(st.sets(st.integers(1, max(1, len(order) - 1)), max_size=len(order))))
            cuts = [c for c in cuts if c < len(order)]
        bounds = [0, *cuts, len(order)]
        groups = []
        for a, b in zip(bounds, bounds[1:]):
            cursor, g = 0, []
            for nm in order[a:b]:
                if interior_gaps and draw(st.booleans()):
                    cursor += draw(st.integers(1, 5))
                g.append((nm, cursor))
                cursor += model.sizes[nm]
            g0 = g[0][1]
            groups.append([(nm, off - g0) for nm, off in g])  # rows start at their first member
    regions: list[RegionGeom] = []
    for g in groups:
        lead = draw(st.integers(0, 3))
        ms = [MemberGeom(nm, off + lead, model.sizes[nm], model.replicated[nm]) for nm, off in g]
        for al, (t, size) in model.aliases.items():
            for m in list(ms):
                if m.name == t:  # the alias views the target member's bytes from its start
                    ms.append(MemberGeom(al, m.offset, size, m.replicated))
        extent = max(m.offset + m.size for m in ms)
        stride = extent + draw(st.integers(0, 6))
        listing = draw(st.permutations(ms))
        regions.append(RegionGeom(-1, 0, stride, list(listing)))
    # Place regions into allocations inside one arena: one allocation per region, or all in
    # one layer-major storage. Allocations may touch each other (adjacent storages).
    one_alloc = draw(st.booleans())
    allocs: list[tuple[int, int]] = []
    cursor = draw(st.integers(0, 8))
    if one_alloc:
        start, off = cursor, draw(st.integers(0, 4))
        for r in regions:
            r.alloc, r.offset = 0, off
            off += r.stride * num_blocks + draw(st.integers(0, 4))
        allocs.append((start, off + draw(st.integers(0, 4))))
        cursor = start + allocs[0][1]
    else:
        sized = []
        for i, r in enumerate(regions):
            lead = draw(st.integers(0, 4))
            r.alloc, r.offset = i, lead
            sized.append(lead + r.stride * num_blocks + draw(st.integers(0, 4)))
        # Storages land in memory in any order, often back to back.
        place = {}
        for i in draw(st.permutations(range(len(regions)))):
            place[i] = cursor
            cursor += sized[i] + draw(st.sampled_from([0, 0, 3]))
        allocs = [(place[i], sized[i]) for i in range(len(regions))]
    tp_size = draw(st.sampled_from([1, 2, 4]))
    tp_rank = draw(st.integers(0, tp_size - 1))
    return SideGeom(allocs, regions, num_blocks, tp_rank, tp_size, arena_bytes=cursor + 8)


@st.composite
def block_pairs(draw: st.DrawFn, nl: int, nr: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct local and remote block ids of equal length, in random order."""
    n = draw(st.integers(0, min(nl, nr)))
    lb = draw(st.permutations(range(nl)))[:n]
    rb = draw(st.permutations(range(nr)))[:n]
    return np.array(lb, dtype=np.int64), np.array(rb, dtype=np.int64)


# ---------------------------------------------------------------------------------------
# Reference and applier
# ---------------------------------------------------------------------------------------

def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic source bytes that are never the sentinel."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 255, nbytes, dtype=np.uint8)
    out[out == SENTINEL] = 0x55
    return out


def reference_copy(src: SideGeom, dst: SideGeom, sb: np.ndarray, db: np.ndarray, names: list[str]) -> np.ndarray:
    """Destination arena after copying every member of ``sb[i]`` into ``db[i]``, one by one."""
    out = dst.arena.copy()
    for s, d in zip(sb, db):
        for nm in names:
            size = src.where(nm)[1].size
            so, do = src.member_off(nm, int(s)), dst.member_off(nm, int(d))
            out[do:do + size] = src.arena[so:so + size]
    return out


def apply_plan(p: TransferPlan, local: SideGeom, remote: SideGeom) -> None:
    """memcpy every descriptor pair of the plan, mapping addresses back to the arenas."""
    for leg in p.legs:
        la, ra = p.explicit(leg)
        assert np.array_equal(la.lengths, ra.lengths)
        lo = la.addresses.astype(np.int64) - local.base
        ro = ra.addresses.astype(np.int64) - remote.base
        for l_off, r_off, n in zip(lo.tolist(), ro.tolist(), la.lengths.tolist()):
            assert 0 <= l_off and l_off + n <= local.arena_bytes
            assert 0 <= r_off and r_off + n <= remote.arena_bytes
            if p.op is Op.READ:
                local.arena[l_off:l_off + n] = remote.arena[r_off:r_off + n]
            else:
                remote.arena[r_off:r_off + n] = local.arena[l_off:l_off + n]


def inside_allocations(spec: KVCacheSpec, descs: np.ndarray) -> bool:
    """Every ``(address, nbytes)`` row lies wholly inside one allocation of ``spec``."""
    if descs.shape[0] == 0:
        return True
    a = descs[:, 0].astype(object)
    e = a + descs[:, 1].astype(object)
    starts = np.array([x.address for x in spec.allocations], dtype=object)
    ends = np.array([x.end for x in spec.allocations], dtype=object)
    ok = (a[:, None] >= starts[None, :]) & (e[:, None] <= ends[None, :])
    return bool(ok.any(axis=1).all())


def no_overlap(descs: np.ndarray) -> bool:
    """No byte is covered by two descriptors."""
    if descs.shape[0] < 2:
        return True
    order = np.argsort(descs[:, 0], kind="stable")
    a = descs[order, 0]
    e = a + descs[order, 1]
    return bool((a[1:] >= e[:-1]).all())
