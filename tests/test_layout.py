"""Geometry objects: validation at construction, JSON round trips, hostile dicts."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from docpaths import leaves, replaced

from kvxfer import (Allocation, DescriptorList, Granularity, KVCacheSpec, Member, MemoryKind, PackedLayout, Region,
                    SpecError)


def spec(**kw) -> KVCacheSpec:
    """Two allocations: a packed 3-member region and a per-member region."""
    allocs = (Allocation(1 << 20, 4 * 256, MemoryKind.DRAM, 0), Allocation(1 << 24, 4 * 64, MemoryKind.VRAM, 1))
    regions = (
        Region(0, 0, 4, PackedLayout(256, (Member("l.0", 64, 0), Member("l.1", 64, 64, False),
                                           Member("ring", 32, 0)))),
        Region(1, 0, 4, PackedLayout(64, (Member("l.2", 48, 8),))),
    )
    return KVCacheSpec(allocs, regions, **kw)


# -- validation -----------------------------------------------------------------------------

def test_member_must_fit_its_row() -> None:
    PackedLayout(128, (Member("a", 64, 64),))
    with pytest.raises(SpecError, match="exceeds row stride"):
        PackedLayout(128, (Member("a", 64, 65),))


def test_duplicate_member_names_in_a_region() -> None:
    with pytest.raises(SpecError, match="duplicate member names"):
        PackedLayout(128, (Member("a", 8, 0), Member("b", 8, 8), Member("a", 8, 16)))


def test_duplicate_member_names_across_regions() -> None:
    allocs = (Allocation(1 << 20, 1024),)
    regions = (Region(0, 0, 4, PackedLayout(64, (Member("a", 8),))),
               Region(0, 256, 4, PackedLayout(64, (Member("a", 8),))))
    with pytest.raises(SpecError, match="more than one region"):
        KVCacheSpec(allocs, regions)


def test_duplicate_and_overlapping_allocations() -> None:
    r = (Region(0, 0, 1, PackedLayout(8, (Member("a", 8),))),)
    with pytest.raises(SpecError, match="duplicate allocations"):
        KVCacheSpec((Allocation(4096, 64), Allocation(4096, 128)), r)
    with pytest.raises(SpecError, match="overlap"):
        KVCacheSpec((Allocation(4096, 64), Allocation(4096 + 63, 64)), r)
    # Touching is fine, and so is the same address on another device or memory kind.
    KVCacheSpec((Allocation(4096, 64), Allocation(4096 + 64, 64)), r)
    KVCacheSpec((Allocation(4096, 64, "VRAM", 0), Allocation(4096, 64, "VRAM", 1), Allocation(4096, 64, "DRAM")), r)


def test_region_must_lie_inside_its_allocation() -> None:
    layout = PackedLayout(64, (Member("a", 16, 32),))
    KVCacheSpec((Allocation(4096, 4 * 64),), (Region(0, 0, 4, layout),))
    # The last block's member ends at 3*64 + 48 = 240: offset 16 still fits, 17 does not.
    KVCacheSpec((Allocation(4096, 4 * 64),), (Region(0, 16, 4, layout),))
    with pytest.raises(SpecError, match="past its allocation"):
        KVCacheSpec((Allocation(4096, 4 * 64),), (Region(0, 17, 4, layout),))
    with pytest.raises(SpecError, match="past its allocation"):
        KVCacheSpec((Allocation(4096, 4 * 64),), (Region(0, 0, 5, layout),))
    with pytest.raises(SpecError, match="allocation index"):
        KVCacheSpec((Allocation(4096, 4 * 64),), (Region(1, 0, 4, layout),))


def test_regions_index_the_same_number_of_blocks() -> None:
    allocs = (Allocation(1 << 20, 1024),)
    with pytest.raises(SpecError, match="same number of blocks"):
        KVCacheSpec(allocs, (Region(0, 0, 4, PackedLayout(8, (Member("a", 8),))),
                             Region(0, 512, 5, PackedLayout(8, (Member("b", 8),)))))


@pytest.mark.parametrize("make", [
    lambda: Member("a", True),
    lambda: Member("a", 8, False),
    lambda: Member("a", 8.0),
    lambda: Member("a", "8"),
    lambda: Member("a", 0),
    lambda: Member("a", -1),
    lambda: Member("", 8),
    lambda: Member(7, 8),  # type: ignore[arg-type]
    lambda: Member("a", 8, 0, 1),  # replicated must be a real bool
    lambda: Member("x" * 257, 8),
    lambda: Allocation(True, 8),
    lambda: Allocation(4096, 0),
    lambda: Allocation(-1, 8),
    lambda: Allocation(4096, 8, "HBM"),
    lambda: Allocation(4096, 8, "DRAM", True),
    lambda: Allocation((1 << 64) - 4, 8),
    lambda: PackedLayout(True, (Member("a", 1),)),
    lambda: PackedLayout(0, (Member("a", 1),)),
    lambda: PackedLayout(8, ()),
    lambda: PackedLayout(8, ({"name": "a", "size": 1},)),  # type: ignore[arg-type]
    lambda: Region(0, 0, 0, PackedLayout(8, (Member("a", 1),))),
    lambda: Region(0, 0, True, PackedLayout(8, (Member("a", 1),))),
    lambda: Region(0, 0, 1, {"stride": 8}),  # type: ignore[arg-type]
    lambda: spec(tp_rank=2, tp_size=2),
    lambda: spec(tp_size=0),
    lambda: spec(tp_size=True),
    lambda: spec(block_tokens=0),
    lambda: spec(layout=""),
    lambda: spec(layout=5),
    lambda: KVCacheSpec((), ()),
    lambda: KVCacheSpec(("alloc",), (Region(0, 0, 1, PackedLayout(8, (Member("a", 1),))),)),  # type: ignore[arg-type]
])
def test_bad_values_raise_spec_error(make) -> None:
    with pytest.raises(SpecError):
        make()


def test_numpy_integers_are_accepted_and_normalised() -> None:
    m = Member("a", np.int64(8), np.uint32(4))
    assert m.size == 8 and type(m.size) is int and type(m.offset) is int


def test_objects_are_immutable() -> None:
    s = spec()
    with pytest.raises(AttributeError):
        s.tp_rank = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        s.regions[0].layout.members[0].size = 1  # type: ignore[misc]


def test_derived_facts() -> None:
    s = spec()
    r0 = s.regions[0]
    assert r0.packed and r0.block_stride == 256 and r0.block_bytes == 128  # aliasing ring inside
    assert not s.regions[1].packed and s.regions[1].block_bytes == 48
    assert s.num_blocks == 4 and s.row_bytes == 176
    assert [m.name for m in s.members] == ["l.0", "l.1", "ring", "l.2"]
    assert s.kinds == (MemoryKind.DRAM, MemoryKind.VRAM)
    # canonical is independent of listing order
    a = PackedLayout(256, (Member("x", 8, 16), Member("y", 8, 24)))
    b = PackedLayout(300, (Member("y", 8, 8), Member("x", 8, 0)))
    assert a.canonical == b.canonical


def test_prepared_lists_follow_the_documented_index_conventions() -> None:
    s = spec()
    rows = s.descriptor_list(Granularity.ROWS, MemoryKind.DRAM)
    assert rows.array.tolist() == [[(1 << 20) + b * 256, 128, 0] for b in range(4)]
    members = s.descriptor_list(Granularity.MEMBERS, MemoryKind.DRAM)
    base = s.list_bases(Granularity.MEMBERS)[0]
    for mi, m in enumerate(s.regions[0].members):
        for b in range(4):
            assert members.array[base + mi * 4 + b].tolist() == [(1 << 20) + b * 256 + m.offset, m.size, 0]
    vram = s.descriptor_list(Granularity.MEMBERS, MemoryKind.VRAM)
    assert s.list_bases(Granularity.MEMBERS)[1] == 0  # its own kind's list starts at 0
    assert vram.array.tolist() == [[(1 << 24) + b * 64 + 8, 48, 1] for b in range(4)]
    strided = s.descriptor_list(Granularity.MEMBERS, MemoryKind.DRAM, strided=True)
    assert strided.strided and len(strided) == 3
    assert np.array_equal(strided.expand().array, members.array)


# -- descriptor lists ----------------------------------------------------------------------

def test_descriptor_list_strided_expand_matches_plain() -> None:
    rows = np.array([[1000, 16, 0, 64, 3], [50000, 8, 1, 8, 2], [7, 1, 0, 0, 1]], dtype=np.uint64)
    dl = DescriptorList(rows, "VRAM")
    assert dl.strided and dl.num_spans == 6 and dl.nbytes == 3 * 16 + 2 * 8 + 1
    plain = dl.expand()
    assert not plain.strided and plain.kind is MemoryKind.VRAM
    assert plain.array.tolist() == [[1000, 16, 0], [1064, 16, 0], [1128, 16, 0], [50000, 8, 1], [50008, 8, 1],
                                    [7, 1, 0]]
    assert plain.nbytes == dl.nbytes and plain.expand() is plain
    assert len(DescriptorList([], "DRAM")) == 0
    assert not plain.array.flags.writeable


@pytest.mark.parametrize("bad", [np.zeros((2, 4)), np.zeros(3), [[1.5, 2, 0]], [[-1, 2, 0]], [["a", "b", "c"]]])
def test_descriptor_list_rejects_bad_arrays(bad) -> None:
    with pytest.raises(SpecError):
        DescriptorList(bad)


def test_descriptor_list_round_trip_and_hostile_dicts() -> None:
    dl = DescriptorList(np.array([[1, 2, 3, 4, 5]], dtype=np.uint64), "DRAM")
    back = DescriptorList.from_dict(json.loads(json.dumps(dl.to_dict())))
    assert back.strided and np.array_equal(back.array, dl.array) and back.kind is dl.kind
    for d in ({"kind": "DRAM", "columns": 3.0, "data": [1, 2, 3]}, {"kind": "DRAM", "columns": True, "data": [1]},
              {"kind": "DRAM", "columns": 3, "data": [1, 2]}, {"kind": "DRAM", "columns": 3, "data": [1, 2, -3]},
              {"kind": "DRAM", "columns": 3, "data": [1, 2, True]}, {"kind": "DRAM", "columns": 3, "data": "abc"},
              {"kind": ["x"], "columns": 3, "data": [1, 2, 3]}, {"kind": "DRAM", "columns": 3},
              {"kind": "DRAM", "columns": 3, "data": [1, 2, 1 << 64]}, [1, 2, 3]):
        with pytest.raises(SpecError):
            DescriptorList.from_dict(d)  # type: ignore[arg-type]


# -- wire form -------------------------------------------------------------------------------

def test_spec_round_trips_through_json() -> None:
    s = spec(layout="BLNHC", block_tokens=64, tp_rank=1, tp_size=4)
    back = KVCacheSpec.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and back.to_dict() == s.to_dict()
    for a, b in zip(s.descriptor_list(Granularity.MEMBERS, "DRAM").array,
                    back.descriptor_list(Granularity.MEMBERS, "DRAM").array):
        assert a.tolist() == b.tolist()
    for obj in (s.allocations[1], s.regions[0], s.regions[0].layout, s.regions[0].members[1]):
        assert type(obj).from_dict(json.loads(json.dumps(obj.to_dict()))) == obj


JUNK = [None, True, False, -1, 0, 1 << 70, 1.5, float("inf"), "", "x", [], [1], {}, {"a": 1}, [[[[]]]]]


def test_from_dict_rejects_every_single_field_corruption_with_spec_error() -> None:
    base = spec().to_dict()
    paths = [p for p, _ in leaves(base)]
    for path in paths:
        for junk in JUNK:
            bad = replaced(base, path, junk)
            try:
                KVCacheSpec.from_dict(bad)  # type: ignore[arg-type]
            except SpecError:
                pass
            # Some substitutions are still valid specs (e.g. a different offset); those must
            # build normally. Any other exception type escapes and fails the test.


def test_from_dict_rejects_missing_and_extra_keys() -> None:
    base = spec().to_dict()
    for path, v in leaves(base):
        if isinstance(v, dict):
            for k in list(v):
                bad = copy.deepcopy(base)
                cur = bad
                for p in path:
                    cur = cur[p]
                del cur[k]
                with pytest.raises(SpecError):
                    KVCacheSpec.from_dict(bad)
            extra = replaced(base, path, {**v, "surprise": 1})
            with pytest.raises(SpecError):
                KVCacheSpec.from_dict(extra)  # type: ignore[arg-type]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(path_index=st.integers(0, 10_000), junk=json_values)
def test_from_dict_fuzz_raises_only_spec_error(path_index: int, junk: object) -> None:
    base = spec().to_dict()
    paths = [p for p, _ in leaves(base)]
    bad = replaced(base, paths[path_index % len(paths)], junk)
    try:
        KVCacheSpec.from_dict(bad)  # type: ignore[arg-type]
    except SpecError:
        pass


def test_many_duplicate_member_names_fail_fast() -> None:
    """A hostile peer's 60k members with duplicate names must not cost quadratic time."""
    members = [Member(f"m{i % 30000}", 1).to_dict() for i in range(60000)]
    d = spec().to_dict()
    d["regions"][0]["layout"]["members"] = members
    with pytest.raises(SpecError, match="duplicate"):
        KVCacheSpec.from_dict(d)
