"""Discovery: numpy arrays, torch tensors and raw pointers become allocations, regions, members.

Where a plan is applied here it is applied with ``ctypes.memmove`` on the real tensors, so
the addresses discovery reports are proven to be the bytes the caller meant.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import numpy as np
import pytest

from kvxfer import HeadSliceMismatchError, Member, MemoryKind, Op, SpecError, TransferPlan, plan, spec_from_arrays, spec_from_pointers, spec_from_tensors

B, L, N, H, C = 6, 4, 4, 2, 8  # blocks, layers, tokens per block, heads, channels


def ptr(x) -> int:
    return int(x.__array_interface__["data"][0]) if isinstance(x, np.ndarray) else int(x.data_ptr())


def memmove_plan(p: TransferPlan) -> None:
    """Move the plan's bytes with memmove: only sound because every descriptor is checked."""
    for leg in p.legs:
        la, ra = p.explicit(leg)
        for spec, arr in ((p.local_spec, la.array), (p.remote_spec, ra.array)):
            for a, n, _ in arr.tolist():
                assert any(x.address <= a and a + n <= x.end for x in spec.allocations)
        for (l_addr, n, _), (r_addr, _, _) in zip(la.array.tolist(), ra.array.tolist()):
            if p.op is Op.READ:
                ctypes.memmove(l_addr, r_addr, n)
            else:
                ctypes.memmove(r_addr, l_addr, n)


# -- numpy --------------------------------------------------------------------------------

def test_numpy_block_outermost_views_are_one_packed_region() -> None:
    storage = np.zeros((B, L, N, H, C), dtype=np.float16)
    views = {f"layer.{i}": storage[:, i] for i in range(L)}
    s = spec_from_arrays(views, replicated=True)
    page = N * H * C * 2
    assert len(s.allocations) == 1 and s.allocations[0].address == ptr(storage)
    assert s.allocations[0].nbytes == storage.nbytes and s.allocations[0].kind is MemoryKind.DRAM
    assert len(s.regions) == 1
    r = s.regions[0]
    assert r.num_blocks == B and r.block_stride == L * page
    assert [(m.name, m.offset, m.size, m.replicated) for m in r.members] == [
        (f"layer.{i}", i * page, page, True) for i in range(L)]
    assert s.layout == "BLNHC" and s.block_tokens == N


def test_numpy_separate_storages_are_one_region_and_allocation_per_layer() -> None:
    arrays = {f"layer.{i}": np.zeros((B, N, H, C), dtype=np.uint8) for i in range(L)}
    s = spec_from_arrays(arrays)
    assert len(s.allocations) == L and len(s.regions) == L
    assert {a.address for a in s.allocations} == {ptr(a) for a in arrays.values()}
    assert all(not r.packed and r.block_stride == N * H * C for r in s.regions)
    assert s.layout.startswith("LB")


def test_numpy_layer_major_storage_is_one_allocation_and_a_region_per_layer() -> None:
    storage = np.zeros((L, B, N, H, C), dtype=np.uint8)
    s = spec_from_arrays({f"layer.{i}": storage[i] for i in range(L)})
    page = N * H * C
    assert len(s.allocations) == 1 and len(s.regions) == L
    assert [r.offset for r in s.regions] == [i * B * page for i in range(L)]
    assert s.layout == "LBNHC"


def test_numpy_rejects_what_it_cannot_describe() -> None:
    storage = np.zeros((B, L, N, H, C), dtype=np.uint8)
    with pytest.raises(SpecError):
        spec_from_arrays({"x": storage[:, 0, :, :, ::2]})  # page not dense
    with pytest.raises(SpecError):
        spec_from_arrays({"x": np.zeros(8, np.uint8)})  # no page dimension
    with pytest.raises(SpecError):
        spec_from_arrays({"x": storage.transpose(1, 0, 2, 3, 4)[0].T})
    with pytest.raises(SpecError):
        spec_from_arrays({"x": [1, 2, 3]})
    with pytest.raises(SpecError):
        spec_from_arrays({})
    with pytest.raises(SpecError):
        spec_from_arrays({"x": storage[:, 0]}, layout="XYZ")
    with pytest.raises(SpecError):
        spec_from_arrays({"x": storage[:, 0]}, kv_dim=1)  # dim 1 has size N, not 2
    with pytest.raises(SpecError):
        spec_from_arrays({"x": (storage[:, 0],)})


def test_replication_options() -> None:
    storage = np.zeros((B, L, N, H, C), dtype=np.uint8)
    views = {f"layer.{i}": storage[:, i] for i in range(L)}
    assert not any(m.replicated for m in spec_from_arrays(views).members)  # head-split by default
    s = spec_from_arrays(views, replicated={"layer.1", "layer.3"})
    assert [m.replicated for m in s.members] == [False, True, False, True]
    # With TP, a replicated page states it is not split by heads: its dims name no heads axis.
    dims = {n: "BNXD" if n.endswith("0") else "BNHD" for n in views}
    s = spec_from_arrays(views, replicated=lambda n: n.endswith("0"), tp_rank=1, tp_size=2, dims=dims)
    assert [m.replicated for m in s.members] == [True, False, False, False]
    assert (s.tp_rank, s.tp_size) == (1, 2)


def test_aliasing_views_from_byte_zero_are_one_allocation_and_move_once() -> None:
    """Several groups view each row from byte 0 (a DeepSeek-style compressor ring)."""
    row = 256
    src = np.arange(B * row, dtype=np.uint32).astype(np.uint8).reshape(B, row)
    dst = np.full((B, row), 0xAA, dtype=np.uint8)

    def views(a: np.ndarray) -> dict[str, np.ndarray]:
        return {"mla": a[:, :192], "ring.0": a[:, :64], "ring.1": a[:, :64], "idx": a[:, 192:224]}

    s_src = spec_from_arrays(views(src), replicated=True)
    s_dst = spec_from_arrays(views(dst), replicated=True)
    assert len(s_src.allocations) == 1 and len(s_src.regions) == 1
    assert [m.offset for m in s_src.members] == [0, 0, 0, 192]
    p = plan(s_dst, s_src, [0, 2], [5, 1], Op.READ)
    assert p.descriptors == 2 and p.nbytes == 2 * 224
    memmove_plan(p)
    assert (dst[0, :224] == src[5, :224]).all() and (dst[2, :224] == src[1, :224]).all()
    assert (dst[:, 224:] == 0xAA).all() and (dst[[1, 3, 4, 5]] == 0xAA).all()
    # Against a peer whose ring is a storage of its own, the ring is a distinct page and
    # moves, but only once for its two aliasing names: 3 descriptors per block.
    per = {k: np.ascontiguousarray(v) for k, v in views(src).items()}
    per["ring.1"] = per["ring.0"]  # the peer's aliases share one storage too
    s_per = spec_from_arrays(per, replicated=True)
    assert len(s_per.allocations) == 3
    p = plan(s_dst, s_per, [0, 2], [5, 1])
    assert p.descriptors == 2 * 3 and p.nbytes == 2 * (192 + 64 + 32)


# -- torch ----------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _bl(order: str, dtype=None) -> tuple[object, dict[str, object]]:
    """Block-outermost storage; views are logical (B, N, H, C) whatever the physical order."""
    dtype = dtype or torch.bfloat16
    if order == "NHC":
        storage = torch.randn(B, L, N, H, C).to(dtype)
        return storage, {f"layer.{i}": storage[:, i] for i in range(L)}
    storage = torch.randn(B, L, H, N, C).to(dtype)
    return storage, {f"layer.{i}": storage[:, i].permute(0, 2, 1, 3) for i in range(L)}


def _lb(order: str) -> tuple[object, dict[str, object]]:
    if order == "NHC":
        storage = torch.randn(L, B, N, H, C).to(torch.bfloat16)
        return storage, {f"layer.{i}": storage[i] for i in range(L)}
    storage = torch.randn(L, B, H, N, C).to(torch.bfloat16)
    return storage, {f"layer.{i}": storage[i].permute(0, 2, 1, 3) for i in range(L)}


@pytest.mark.parametrize("order", ["HNC", "NHC"])
def test_torch_layouts_are_recognised(order: str) -> None:
    storage, views = _bl(order)
    assert all(tuple(v.shape) == (B, N, H, C) for v in views.values())
    s = spec_from_tensors(views, replicated=True)
    page = N * H * C * 2
    assert s.layout == "BL" + order and s.block_tokens == N
    assert len(s.allocations) == 1 and len(s.regions) == 1
    assert s.allocations[0].address == storage.data_ptr()
    assert s.allocations[0].nbytes == storage.untyped_storage().nbytes()
    assert [m.offset for m in s.members] == [i * page for i in range(L)]
    storage, views = _lb(order)
    s = spec_from_tensors(views)
    assert s.layout == "LB" + order and len(s.allocations) == 1 and len(s.regions) == L
    assert [r.offset for r in s.regions] == [i * B * page for i in range(L)]


def test_torch_separate_storages_per_layer() -> None:
    views = {f"layer.{i}": torch.zeros(B, N, H, C, dtype=torch.float16) for i in range(L)}
    s = spec_from_tensors(views)
    assert len(s.allocations) == L and len(s.regions) == L and s.layout == "LBNHC"


def test_torch_kv_as_two_members() -> None:
    page = N * H * C * 2
    storage = torch.zeros(B, L, 2, N, H, C, dtype=torch.float16)
    s = spec_from_tensors({f"layer.{i}": (storage[:, i, 0], storage[:, i, 1]) for i in range(L)})
    assert len(s.allocations) == 1 and len(s.regions) == 1
    assert [(m.name, m.offset) for m in s.members][:3] == [("layer.0.k", 0), ("layer.0.v", page),
                                                          ("layer.1.k", 2 * page)]
    s2 = spec_from_tensors({f"layer.{i}": storage[:, i] for i in range(L)}, kv_dim=1)
    assert [(m.name, m.offset, m.size) for m in s2.members] == [(m.name, m.offset, m.size) for m in s.members]
    # Per-layer storages holding K then V per block: layer-outermost, a 2-member row each.
    per = {f"layer.{i}": torch.zeros(B, 2, N, H, C, dtype=torch.float16) for i in range(L)}
    s3 = spec_from_tensors(per, kv_dim=1)
    assert len(s3.regions) == L and all(len(r.members) == 2 for r in s3.regions)
    assert s3.layout.startswith("LB")
    # vLLM's flash-attention shape (2, B, ...): K and V regions of one storage.
    fa = {f"layer.{i}": torch.zeros(2, B, N, H, C, dtype=torch.float16) for i in range(L)}
    s4 = spec_from_tensors(fa, kv_dim=0)
    assert len(s4.allocations) == L and len(s4.regions) == 2 * L
    assert {r.offset for r in s4.regions} == {0, B * page}


def test_torch_views_of_one_storage_are_one_allocation_even_when_not_packed() -> None:
    storage = torch.zeros(2 * B + 3, N, H, C, dtype=torch.uint8)
    s = spec_from_tensors({"a": storage[:B], "b": storage[B:2 * B]})
    assert len(s.allocations) == 1 and len(s.regions) == 2
    assert [r.offset for r in s.regions] == [0, B * N * H * C]


def test_plan_between_discovered_torch_layouts_moves_the_right_bytes() -> None:
    """A packed decode worker pulls from a layer-outermost prefill worker, by memmove."""
    _, remote_views = _lb("HNC")
    local_storage = torch.full((B, L, H, N, C), 7.0, dtype=torch.bfloat16)
    local_views = {f"layer.{i}": local_storage[:, i].permute(0, 2, 1, 3) for i in range(L)}
    ls = spec_from_tensors(local_views, replicated=True)
    rs = spec_from_tensors(remote_views, replicated=True)
    lb, rb = [4, 0, 2], [1, 5, 3]
    p = plan(ls, rs, lb, rb, Op.READ)
    assert p.descriptors == 3 * L and p.mode == "split"
    memmove_plan(p)
    for name in local_views:
        assert torch.equal(local_views[name][lb], remote_views[name][rb])
        assert (local_views[name][[1, 3, 5]] == 7.0).all()


def test_seed_case_99_views_over_one_block_outermost_storage() -> None:
    """GLM-5.3 hands 99 views over one storage: 1 allocation, 1 region, 1 descriptor per block."""
    layers, blocks, tokens, chans = 99, 12, 4, 16
    src_storage = torch.randn(blocks, layers, tokens, chans).to(torch.bfloat16)
    dst_storage = torch.zeros(blocks, layers, tokens, chans, dtype=torch.bfloat16)

    def views(st: object) -> dict[str, object]:
        return {f"model.layers.{i}.self_attn": st[:, i] for i in range(layers)}  # type: ignore[index]

    src = spec_from_tensors(views(src_storage), replicated=True, tp_rank=0, tp_size=4)
    dst = spec_from_tensors(views(dst_storage), replicated=True, tp_rank=2, tp_size=4)
    assert len(src.allocations) == 1 and len(src.regions) == 1 and len(src.members) == layers
    assert src.layout.startswith("BL")
    lb, rb = [3, 7, 8, 0, 11], [10, 2, 3, 4, 0]
    p = plan(dst, src, lb, rb, Op.READ)
    assert p.descriptors == len(lb) and p.mode == "whole-row"
    assert p.nbytes == len(lb) * layers * tokens * chans * 2
    memmove_plan(p)
    assert torch.equal(dst_storage[lb], src_storage[rb])
    untouched = [b for b in range(blocks) if b not in lb]
    assert (dst_storage[untouched] == 0).all()
    # Consecutive ids merge further when asked: blocks 7,8 <- 2,3 are one run on both sides.
    assert plan(dst, src, lb, rb, coalesce=True).descriptors == len(lb) - 1
    # The same storage as a head-split cache: different ranks hold different heads, refused.
    hs = spec_from_tensors(views(src_storage), replicated=False, tp_rank=1, tp_size=4)
    hd = spec_from_tensors(views(dst_storage), replicated=False, tp_rank=2, tp_size=4)
    with pytest.raises(HeadSliceMismatchError, match="TP rank 2 of 4.*TP rank 1 of 4"):
        plan(hd, hs, lb, rb)


# -- raw pointers -----------------------------------------------------------------------------

def test_from_pointers_block_outermost() -> None:
    s = spec_from_pointers((1 << 20, 10 * 300, 0), num_blocks=10,
                                  members=[("a", 100), ("b", 150)], replicated=True)
    r = s.regions[0]
    assert r.block_stride == 300 and [(m.offset, m.size) for m in r.members] == [(0, 100), (100, 150)]
    assert s.layout == "BLHNC"
    s = spec_from_pointers([(1 << 20, 10 * 300, 0)], num_blocks=10, block_stride=300, kind="VRAM",
                                  members=[Member("a", 100, 8), Member("b", 150, 120)])
    assert [m.offset for m in s.members] == [8, 120] and s.allocations[0].kind is MemoryKind.VRAM
    with pytest.raises(SpecError):  # row too small for the members
        spec_from_pointers((1 << 20, 10 * 200, 0), num_blocks=10, members=[("a", 100), ("b", 150)])
    with pytest.raises(SpecError):
        spec_from_pointers([(1 << 20, 3000, 0), (1 << 24, 3000, 0)], num_blocks=10,
                                  members=[("a", 100)])


def test_from_pointers_layer_outermost() -> None:
    spans = [(1 << 20, 10 * 100, 0), (1 << 24, 10 * 150, 0)]
    s = spec_from_pointers(spans, num_blocks=10, members=[("a", 100), ("b", 150)], layout="LBHNC")
    assert len(s.allocations) == 2 and [r.block_stride for r in s.regions] == [100, 150]
    s = spec_from_pointers((1 << 20, 10 * 250, 0), num_blocks=10, members=[("a", 100), ("b", 150)],
                                  layout="LBNHC")
    assert len(s.allocations) == 1 and [r.offset for r in s.regions] == [0, 1000]
    bl = spec_from_pointers((1 << 28, 10 * 250, 0), num_blocks=10, members=[("a", 100), ("b", 150)],
                            layout="BLNHC")
    assert plan(bl, s, [1, 2], [3, 4]).descriptors == 4
    with pytest.raises(SpecError):
        spec_from_pointers((1 << 20, 10 * 250, 0), num_blocks=10, members=[("a", 100)], layout="XX")


# -- import hygiene -----------------------------------------------------------------------------

def test_import_kvxfer_loads_no_torch_and_no_transport() -> None:
    code = ("import sys, json, kvxfer, numpy as np\n"
            "kvxfer.spec_from_arrays({'x': np.zeros((4, 8), np.uint8)})\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mods = json.loads(out.stdout)
    banned = ("torch", "nixl", "nixl_cu12", "nixl_cu13", "ucxx", "ucp", "libucx", "_ucxx")
    loaded = [m for m in mods if m.split(".")[0] in banned]
    assert loaded == [], loaded
