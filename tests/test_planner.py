"""The planner: descriptor counts of the planner table in docs/geometry.md, real bytes moved, typed errors.

Plans are applied as memcpy on numpy arenas by :func:`geometry_strategies.apply_plan`, which
only sees explicit ``(address, nbytes)`` descriptors. Expected memory comes from
:func:`geometry_strategies.reference_copy`, which copies member by member from the geometry
description and never looks at a plan.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geometry_strategies import (SENTINEL, Model, RegionGeom, SideGeom, apply_plan, block_pairs, inside_allocations, models,
                                 no_overlap, pattern, reference_copy, side_geoms)
from kvxfer import (Allocation, BlockCountMismatchError, BlockIdOutOfRangeError, BlockIdTypeError, HeadSliceMismatchError, KVCacheSpec,
                    LayoutMismatchError,
                    Member, Op, PackedLayout, Region, TransferPlan, plan)

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------
# Independent expectations
# ---------------------------------------------------------------------------------------

def whole_row_regions(lg: SideGeom, rg: SideGeom) -> list[int]:
    """Local regions whose remote counterpart lists the same members at the same offsets."""
    out = []
    for i, r in enumerate(lg.regions):
        rr, _ = rg.where(r.members[0].name)

        def canon(reg: RegionGeom) -> set[tuple[int, str, int]]:
            lo = min(m.offset for m in reg.members)
            return {(m.offset - lo, m.name, m.size) for m in reg.members}

        if canon(r) == canon(rr):
            out.append(i)
    return out


def refused(model: Model, lg: SideGeom, rg: SideGeom) -> bool:
    """Head-split pages pair only with the same slice; replicated or TP-1 pages hold every head."""

    def slice_of(side: SideGeom, name: str) -> tuple[int, int]:
        return (0, 1) if model.replicated[name] or side.tp_size == 1 else (side.tp_rank, side.tp_size)

    return any(slice_of(lg, n) != slice_of(rg, n) for n in model.names + list(model.aliases))


def expected_per_block(model: Model, lg: SideGeom, rg: SideGeom) -> int:
    """1 per whole-row region, else one per (non-alias) member of the region."""
    whole = set(whole_row_regions(lg, rg))
    return sum(1 if i in whole else sum(m.name not in model.aliases for m in r.members)
               for i, r in enumerate(lg.regions))


def with_extents(expected: np.ndarray, src: SideGeom, dst: SideGeom, src_regions: list[RegionGeom],
                 sb: np.ndarray, db: np.ndarray) -> np.ndarray:
    """Whole rows also carry bytes between members (never before the first or after the last)."""
    out = expected.copy()
    for r in src_regions:
        first = min(r.members, key=lambda m: m.offset)
        lo = first.offset
        hi = max(m.offset + m.size for m in r.members)
        for s, d in zip(sb, db):
            so = src.member_off(first.name, int(s))
            do = dst.member_off(first.name, int(d))
            out[do:do + hi - lo] = src.arena[so:so + hi - lo]
    return out


def merge_reference(la: np.ndarray, ra: np.ndarray, lspec: KVCacheSpec, rspec: KVCacheSpec) -> list[tuple[int, int, int]]:
    """Merge consecutive descriptors contiguous on both sides and inside one allocation."""

    def alloc_of(spec: KVCacheSpec, addr: int) -> int:
        return next(i for i, a in enumerate(spec.allocations) if a.address <= addr < a.end)

    out: list[list[int]] = []
    for (l0, n, _), (r0, _, _) in zip(la.tolist(), ra.tolist()):
        if out:
            pl, pr, pn = out[-1]
            if (pl + pn == l0 and pr + pn == r0 and alloc_of(lspec, pl) == alloc_of(lspec, l0)
                    and alloc_of(rspec, pr) == alloc_of(rspec, r0)):
                out[-1][2] += n
                continue
        out.append([l0, r0, n])
    return [tuple(x) for x in out]  # type: ignore[misc]


def explicit_pairs(p: TransferPlan) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(p.explicit(leg)[0].array.copy(), p.explicit(leg)[1].array.copy()) for leg in p.legs]


# ---------------------------------------------------------------------------------------
# Property tests over random geometries
# ---------------------------------------------------------------------------------------

@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Model, SideGeom, SideGeom, np.ndarray, np.ndarray, Op]:
    model = draw(models())
    lg = draw(side_geoms(model))
    rg = draw(side_geoms(model, mirror=lg if draw(st.booleans()) else None))
    lb, rb = draw(block_pairs(lg.num_blocks, rg.num_blocks))
    return model, lg, rg, lb, rb, draw(st.sampled_from([Op.READ, Op.WRITE]))


@PROPS
@given(sc=scenarios(), seed=st.integers(0, 2**32 - 1), shuffle=st.integers(0, 2**32 - 1))
def test_plans_move_exactly_the_requested_member_bytes(sc, seed: int, shuffle: int) -> None:
    model, lg, rg, lb, rb, op = sc
    src, dst = (rg, lg) if op is Op.READ else (lg, rg)
    sb, db = (rb, lb) if op is Op.READ else (lb, rb)
    src.make_arena(pattern(src.arena_bytes, seed))
    dst.make_arena(SENTINEL)
    src_before, dst_before = src.arena.copy(), dst.arena.copy()
    names = model.names + list(model.aliases)

    lspec, rspec = lg.spec(), rg.spec(shuffle=shuffle)
    if refused(model, lg, rg):
        with pytest.raises(HeadSliceMismatchError, match="TP rank"):
            plan(lspec, rspec, lb, rb, op)
        return
    p = plan(lspec, rspec, lb, rb, op)
    # Counts of the planner table (docs/geometry.md), computed from the geometry alone.
    assert p.descriptors == len(lb) * expected_per_block(model, lg, rg)
    assert p.nbytes == sum(leg.nbytes for leg in p.legs)
    whole = whole_row_regions(lg, rg)
    assert p.whole_row_regions == len(whole)
    for la, ra in explicit_pairs(p):
        assert np.array_equal(la[:, 1], ra[:, 1]), "paired lengths differ"
        assert inside_allocations(lspec, la) and inside_allocations(rspec, ra)
        assert no_overlap(la) and no_overlap(ra), "a byte is moved twice"

    apply_plan(p, lg, rg)
    got = dst.arena.copy()
    assert np.array_equal(src.arena, src_before), "the source changed"

    # Exact expectation: members copied one by one, plus the bytes between members of the
    # rows that moved whole. Everything else, including row padding, keeps the sentinel.
    dst.arena[:] = dst_before
    ref = reference_copy(src, dst, sb, db, names)
    whole_src = [rg.where(lg.regions[i].members[0].name)[0] if op is Op.READ else lg.regions[i] for i in whole]
    assert np.array_equal(got, with_extents(ref, src, dst, whole_src, sb, db))
    untouched = ~dst.row_mask(db)
    assert (got[untouched] == SENTINEL).all(), "bytes outside the requested rows changed"

    # The same memory described one region per member: a split plan, identical bytes.
    dst.arena[:] = dst_before
    ps = plan(lg.spec(split=True), rg.spec(split=True, shuffle=shuffle), lb, rb, op)
    assert ps.descriptors == len(lb) * len(model.names)
    apply_plan(ps, lg, rg)
    assert np.array_equal(dst.arena, ref)
    if not whole or with_extents(ref, src, dst, whole_src, sb, db).tobytes() == ref.tobytes():
        assert np.array_equal(got, dst.arena), "whole-row and split plans disagree"

    # The remote's member listing order does not matter.
    p2 = plan(lspec, rg.spec(shuffle=shuffle + 1), lb, rb, op)
    assert len(p2.legs) == len(p.legs)
    for (a1, b1), (a2, b2) in zip(explicit_pairs(p), explicit_pairs(p2)):
        assert np.array_equal(a1, a2) and np.array_equal(b1, b2)


@PROPS
@given(sc=scenarios(), seed=st.integers(0, 2**32 - 1))
def test_coalescing_merges_only_contiguous_runs_and_keeps_bytes(sc, seed: int) -> None:
    model, lg, rg, lb, rb, op = sc
    if len(lb) and seed % 2:  # consecutive ids make runs likely
        lb = np.arange(len(lb)) + (lg.num_blocks - len(lb)) // 2
        rb = np.arange(len(rb)) + (rg.num_blocks - len(rb)) // 2
    src, dst = (rg, lg) if op is Op.READ else (lg, rg)
    src.make_arena(pattern(src.arena_bytes, seed))
    dst.make_arena(SENTINEL)
    lspec, rspec = lg.spec(), rg.spec()
    if refused(model, lg, rg):
        return  # refusals are checked by the test above
    plain = plan(lspec, rspec, lb, rb, op)
    merged = plan(lspec, rspec, lb, rb, op, coalesce=True)
    assert merged.coalesced and merged.nbytes == plain.nbytes
    assert merged.descriptors == plain.runs <= plain.descriptors
    for (pla, pra), (mla, mra) in zip(explicit_pairs(plain), explicit_pairs(merged)):
        want = merge_reference(pla, pra, lspec, rspec)
        assert [(int(a), int(b), int(n)) for (a, n, _), (b, _, _) in zip(mla.tolist(), mra.tolist())] == want
        assert inside_allocations(lspec, mla) and inside_allocations(rspec, mra)
    dst0 = dst.arena.copy()
    apply_plan(plain, lg, rg)
    after_plain = dst.arena.copy()
    dst.arena[:] = dst0
    apply_plan(merged, lg, rg)
    assert np.array_equal(dst.arena, after_plain)


# ---------------------------------------------------------------------------------------
# The planner table of docs/geometry.md, concrete
# ---------------------------------------------------------------------------------------

L, NB, PAGE = 5, 8, 32


def packed(base: int = 1 << 20, *, rep: bool = True, stride_pad: int = 0, order: list[int] | None = None,
           tp_rank: int = 0, tp_size: int = 1, nb: int = NB) -> KVCacheSpec:
    stride = L * PAGE + stride_pad
    ms = [Member(f"layer.{i}", PAGE, i * PAGE, rep) for i in range(L)]
    if order is not None:
        ms = [ms[i] for i in order]
    return KVCacheSpec((Allocation(base, stride * nb),), (Region(0, 0, nb, PackedLayout(stride, tuple(ms))),),
                       tp_rank=tp_rank, tp_size=tp_size)


def per_member(base: int = 1 << 30, *, rep: bool = True, one_storage: bool = False, tp_rank: int = 0,
               tp_size: int = 1, nb: int = NB) -> KVCacheSpec:
    if one_storage:
        allocs = (Allocation(base, L * PAGE * nb),)
        regions = tuple(Region(0, i * PAGE * nb, nb, PackedLayout(PAGE, (Member(f"layer.{i}", PAGE, 0, rep),)))
                        for i in range(L))
    else:
        allocs = tuple(Allocation(base + i * 4096, PAGE * nb) for i in range(L))
        regions = tuple(Region(i, 0, nb, PackedLayout(PAGE, (Member(f"layer.{i}", PAGE, 0, rep),)))
                        for i in range(L))
    return KVCacheSpec(allocs, regions, layout="LBHNC", tp_rank=tp_rank, tp_size=tp_size)


BLOCKS = ([0, 3, 5], [7, 2, 4])


def test_packed_same_members_replicated_is_one_descriptor_per_block() -> None:
    p = plan(packed(), packed(base=1 << 24, stride_pad=64), *BLOCKS)
    assert p.descriptors == 3 and p.mode == "whole-row" and p.nbytes == 3 * L * PAGE
    la, ra = p.explicit(p.legs[0])
    assert la.addresses.tolist() == [(1 << 20) + b * L * PAGE for b in BLOCKS[0]]
    assert ra.addresses.tolist() == [(1 << 24) + b * (L * PAGE + 64) for b in BLOCKS[1]]
    assert la.lengths.tolist() == [L * PAGE] * 3  # padding is not moved


def test_packed_remote_listing_members_in_another_order_still_whole_rows() -> None:
    p = plan(packed(), packed(base=1 << 24, order=[3, 1, 4, 0, 2]), *BLOCKS)
    assert p.descriptors == 3 and p.mode == "whole-row"


@pytest.mark.parametrize("one_storage", [False, True])
def test_packed_against_per_member_splits_rows(one_storage: bool) -> None:
    for lspec, rspec in ((packed(), per_member(one_storage=one_storage)),
                         (per_member(one_storage=one_storage), packed())):
        p = plan(lspec, rspec, *BLOCKS)
        assert p.descriptors == 3 * L and p.nbytes == 3 * L * PAGE


def test_per_member_both_sides_is_one_descriptor_per_member() -> None:
    p = plan(per_member(), per_member(base=1 << 32, one_storage=True), *BLOCKS)
    assert p.descriptors == 3 * L


def test_head_split_members_between_different_ranks_are_refused() -> None:
    lspec = packed(rep=False, tp_rank=0, tp_size=2)
    with pytest.raises(HeadSliceMismatchError) as ei:
        plan(lspec, packed(base=1 << 24, rep=False, tp_rank=1, tp_size=2), *BLOCKS)
    assert ("members[layer.0, layer.1, layer.2, layer.3 (+1 more)].heads", "TP rank 0 of 2 (heads not described)",
            "TP rank 1 of 2 (heads not described)") in ei.value.diff
    # Same head slice: whole rows.
    assert plan(lspec, packed(base=1 << 24, rep=False, tp_rank=0, tp_size=2), *BLOCKS).descriptors == 3
    # Replicated (MLA) pages move whole whatever the ranks.
    assert plan(packed(tp_rank=0, tp_size=2), packed(base=1 << 24, tp_rank=1, tp_size=2), *BLOCKS).descriptors == 3


def test_coalescing_consecutive_blocks_of_packed_rows() -> None:
    p = plan(packed(), packed(base=1 << 24), [1, 2, 3, 6], [4, 5, 6, 0], coalesce=True)
    assert p.descriptors == 2 and p.nbytes == 4 * L * PAGE
    la, ra = p.explicit(p.legs[0])
    assert la.lengths.tolist() == [3 * L * PAGE, L * PAGE]
    assert ra.addresses.tolist() == [(1 << 24) + 4 * L * PAGE, 1 << 24]
    # With padding on one side rows are not contiguous there: nothing merges.
    assert plan(packed(), packed(base=1 << 24, stride_pad=8), [1, 2, 3], [4, 5, 6], coalesce=True).descriptors == 3


def test_coalescing_never_crosses_an_allocation_boundary() -> None:
    """Two storages that happen to sit back to back in memory are still two registrations."""
    nb = 4
    a0 = 1 << 20  # layer.0's storage, then layer.1's right after it
    a1 = a0 + PAGE * nb
    local = KVCacheSpec((Allocation(a0, PAGE * nb), Allocation(a1, PAGE * nb)),
                        tuple(Region(i, 0, nb, PackedLayout(PAGE, (Member(f"layer.{i}", PAGE, 0, True),)))
                              for i in range(2)))
    remote = KVCacheSpec((Allocation(1 << 30, 2 * PAGE * nb),),
                         tuple(Region(0, i * PAGE * nb, nb, PackedLayout(PAGE, (Member(f"layer.{i}", PAGE, 0, True),)))
                               for i in range(2)))
    # Per-member regions on both sides are planned member by member: layer.0 of blocks 0
    # and 3, then layer.1 of blocks 0 and 3. layer.0 of block 3 ends exactly where layer.1
    # of block 0 begins on both sides, but locally that crosses into the next allocation.
    blocks = ([0, 3], [0, 3])
    p = plan(local, remote, *blocks)
    assert p.descriptors == 4 and p.runs == 4
    merged = plan(local, remote, *blocks, coalesce=True)
    assert merged.descriptors == 4
    for leg in merged.legs:
        la, ra = merged.explicit(leg)
        assert inside_allocations(local, la.array) and inside_allocations(remote, ra.array)
    # Within one allocation on both sides the same pattern does merge.
    one = KVCacheSpec((Allocation(a0, 2 * PAGE * nb),),
                      tuple(Region(0, i * PAGE * nb, nb, PackedLayout(PAGE, (Member(f"layer.{i}", PAGE, 0, True),)))
                            for i in range(2)))
    assert plan(one, remote, *blocks, coalesce=True).descriptors == 3


def test_empty_block_lists_plan_nothing() -> None:
    p = plan(packed(), per_member(), [], [])
    assert p.descriptors == 0 and p.nbytes == 0
    assert plan(packed(), per_member(), [], [], coalesce=True).descriptors == 0


def test_aliasing_members_never_move_bytes_twice() -> None:
    """A compressor ring viewing each row from byte 0 is not a second copy of those bytes."""
    stride = 3 * PAGE
    ms = (Member("layer.0", PAGE, 0, True), Member("layer.1", PAGE, PAGE, True), Member("ring", PAGE // 2, 0, True))
    local = KVCacheSpec((Allocation(1 << 20, stride * NB),), (Region(0, 0, NB, PackedLayout(stride, ms)),))
    remote_packed = KVCacheSpec((Allocation(1 << 24, stride * NB),), (Region(0, 0, NB, PackedLayout(stride, ms)),))
    p = plan(local, remote_packed, *BLOCKS)
    assert p.descriptors == 3 and p.nbytes == 3 * 2 * PAGE
    # Remote per member; its ring aliases layer.0's pages too.
    remote = KVCacheSpec((Allocation(1 << 24, 2 * PAGE * NB),), (
        Region(0, 0, NB, PackedLayout(PAGE, (Member("layer.0", PAGE, 0, True),))),
        Region(0, PAGE * NB, NB, PackedLayout(PAGE, (Member("layer.1", PAGE, 0, True),))),
        Region(0, 0, NB, PackedLayout(PAGE, (Member("ring", PAGE // 2, 0, True),))),
    ))
    for a, b in ((local, remote), (remote, local), (remote, remote)):
        p = plan(a, b, *BLOCKS)
        assert p.descriptors == 3 * 2 and p.nbytes == 3 * 2 * PAGE
        for leg in p.legs:
            la, ra = p.explicit(leg)
            assert no_overlap(la.array) and no_overlap(ra.array)


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------

def test_layout_mismatch_lists_missing_members_and_size_differences() -> None:
    other = KVCacheSpec((Allocation(1 << 24, 4096 * NB),), (Region(0, 0, NB, PackedLayout(4096, (
        Member("layer.0", PAGE, 0), Member("layer.1", PAGE + 8, PAGE), Member("extra", 8, 3 * PAGE),
        Member("layer.2", PAGE, 200), Member("layer.3", PAGE, 300)))),))
    with pytest.raises(LayoutMismatchError) as ei:
        plan(packed(), other, *BLOCKS)
    diff = {f: (lv, rv) for f, lv, rv in ei.value.diff}
    assert diff["members"] == ("layer.4", "extra")
    assert diff["members[layer.1].size"] == (PAGE, PAGE + 8)
    assert "layer.4" in str(ei.value) and "members[layer.1].size" in str(ei.value)
    assert "members[layer.0].size" not in diff


def test_layout_mismatch_diff_includes_other_fields() -> None:
    small = KVCacheSpec((Allocation(1 << 24, PAGE * NB),),
                        (Region(0, 0, NB, PackedLayout(PAGE, (Member("layer.0", PAGE),))),), layout="LBNHC",
                        block_tokens=16)
    with pytest.raises(LayoutMismatchError) as ei:
        plan(packed(), small, [0], [0])
    fields = {f for f, _, _ in ei.value.diff}
    assert {"layout", "block_tokens", "members"} <= fields


@pytest.mark.parametrize("blocks,error", [
    ([-1], BlockIdOutOfRangeError), ([NB], BlockIdOutOfRangeError), ([0, 2**40], BlockIdOutOfRangeError),
    (np.array([2**63], dtype=np.uint64), BlockIdOutOfRangeError),
    # Not integers: a typed error of their own, never rounded to a block.
    (np.array([1.0]), BlockIdTypeError), ([1.0], BlockIdTypeError), (np.array([True]), BlockIdTypeError),
    (["a"], BlockIdTypeError), ("01", BlockIdTypeError), ([[0], [1, 2]], BlockIdTypeError)])
def test_block_ids_out_of_range_or_not_integers(blocks, error) -> None:
    n = len(blocks)
    with pytest.raises(error):
        plan(packed(), packed(base=1 << 24), blocks, [0] * n)
    with pytest.raises(error):
        plan(packed(), packed(base=1 << 24), [0] * n, blocks)


def test_block_counts_must_match() -> None:
    with pytest.raises(BlockCountMismatchError):
        plan(packed(), packed(base=1 << 24), [0, 1], [0])


def test_numpy_int_dtypes_are_accepted() -> None:
    for dt in (np.int32, np.uint16, np.int64):
        assert plan(packed(), packed(base=1 << 24), np.array([1, 2], dt), np.array([3, 4], dt)).descriptors == 2


def test_different_block_counts_per_side_are_fine() -> None:
    p = plan(packed(nb=4), packed(base=1 << 24, nb=100), [3], [99])
    assert p.explicit(p.legs[0])[1].addresses.tolist() == [(1 << 24) + 99 * L * PAGE]
