"""Heterogeneous peers move the right bytes, or are refused with a message that says why.

Every case moves real bytes through the loopback backend (several prefill agents in one
process) and checks the decode cache against numpy indexing over the logical
``[layer, kv, block, token, head, dim]`` arrays; blocks not named keep the sentinel.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from hetero_caches import agent, assert_gathered, gqa_rank, logical, mla_rank, untouched
from kvxfer.errors import (BlockCountMismatchError, BlockTokensMismatchError, HeadSliceMismatchError,
                           LayoutMismatchError, PageFormatMismatchError)
from kvxfer.pairing import heads_of, may_free, readers, sources

L, B, D = 2, 8, 4
LB = np.array([5, 0, 3])
RB = np.array([2, 7, 4])


def _gqa_case(p_tp: int, d_tp: int, heads: int, order: str = "HND", tokens: int = 4):
    X = logical(L, B, tokens, heads, D)
    pre = [gqa_rank(list(range(L)), B, tokens, heads_of(p, p_tp, heads), D, order, X) for p in range(p_tp)]
    pa = [agent(f"p{p}", pre[p].tensors(), tp_rank=p, tp_size=p_tp, kv_heads=heads) for p in range(p_tp)]
    return X, pre, pa


@pytest.mark.parametrize("p_tp,d_tp,heads", [(2, 4, 8), (4, 2, 8), (8, 16, 8), (16, 2, 8), (1, 2, 4), (4, 1, 4)])
def test_gqa_tp_pairings_gather_the_right_heads(p_tp: int, d_tp: int, heads: int) -> None:
    X, pre, pa = _gqa_case(p_tp, d_tp, heads)
    try:
        for d in sorted({0, d_tp - 1}):
            a, b = heads_of(d, d_tp, heads)
            dec = gqa_rank(list(range(L)), B, 4, (a, b), D, "HND")
            with agent("d", dec.tensors(), tp_rank=d, tp_size=d_tp, kv_heads=heads) as da:
                for p in pa:
                    da.add_source(p.metadata())
                g = da.read_many(LB, {p.name: RB for p in pa}).wait(10)
                read = sorted(g.parts)
                assert read == sorted(f"p{p}" for p, _ in sources(d, d_tp, p_tp, heads))
                assert sorted(g.unread) == sorted(set(p.name for p in pa) - set(read))
                for l in range(L):
                    for kv in (0, 1):
                        got = dec.views[(l, kv)]
                        assert (got[LB] == X[l, kv][RB][:, :, a:b]).all()
                        assert untouched(got, LB)
                # one descriptor per (page, slice, block) before merging
                assert g.stats.descriptors <= len(LB) * 2 * L * max(1, len(read))
    finally:
        for p in pa:
            p.close()


@pytest.mark.parametrize("p_tp,d_tp", [(8, 2), (2, 8)])
def test_mla_reads_whole_rows_from_rank_d_mod_p(p_tp: int, d_tp: int) -> None:
    rng = np.random.default_rng(3)
    X = rng.integers(-30000, 30000, size=(L, B, 4, 16), dtype=np.int16)
    pa = [agent(f"p{p}", mla_rank(L, B, 4, 16, X + p * 0), replicated=True, tp_rank=p, tp_size=p_tp)
          for p in range(p_tp)]
    try:
        for d in range(d_tp):
            views = mla_rank(L, B, 4, 16)
            with agent("d", views, replicated=True, tp_rank=d, tp_size=d_tp) as da:
                for p in pa:
                    da.add_source(p.metadata())
                g = da.read_many(LB, {p.name: RB for p in pa}, notify=b"done").wait(10)
                assert list(g.parts) == [f"p{d % p_tp}"]
                assert g.stats.descriptors <= len(LB) * L  # one per (page, block), merged when adjacent
                for l in range(L):
                    assert (views[f"layer.{l}"][LB] == X[l][RB]).all()
                    assert untouched(views[f"layer.{l}"], LB)
                for p in pa:  # the read rank after its part, the others at once: all may free
                    assert p.notifications().get("d") == [b"done"]
        freed = [p for p in range(p_tp) if may_free(p, p_tp, d_tp)]
        assert freed == list(range(d_tp, p_tp))
        assert readers(0, p_tp, d_tp) == [d for d in range(d_tp) if d % p_tp == 0]
    finally:
        for p in pa:
            p.close()


def test_pp_stages_gather_layer_bands_and_a_missing_layer_is_named() -> None:
    layers, tokens, heads = 4, 4, 4
    X = logical(layers, B, tokens, heads, D)
    st = [gqa_rank([0, 1], B, tokens, (0, heads), D, "NHD", X), gqa_rank([2, 3], B, tokens, (0, heads), D, "NHD", X)]
    pa = [agent(f"s{i}", s.tensors()) for i, s in enumerate(st)]
    dec = gqa_rank(list(range(layers)), B, tokens, (0, heads), D, "NHD")
    try:
        with agent("d", dec.tensors()) as da:
            for p in pa:
                da.add_source(p.metadata())
            with pytest.raises(LayoutMismatchError, match=r"missing: local='layer\.2\.k, layer\.2\.v, layer\.3"):
                da.read("s0", LB, RB)
            assert untouched(dec.views[(0, 0)], np.array([], dtype=int))
            g = da.read_many(LB, {"s0": RB, "s1": RB}).wait(10)
            assert sorted(g.parts) == ["s0", "s1"]
            assert_gathered(dec.views, X, layers, LB, RB)
    finally:
        for p in pa:
            p.close()


def test_small_prefill_blocks_fill_a_decode_block_by_token_offset() -> None:
    heads, small, big = 2, 16, 64
    X = logical(L, 12, small, heads, D)
    pre = gqa_rank(list(range(L)), 12, small, (0, heads), D, "NHD", X)
    dec = gqa_rank(list(range(L)), 4, big, (0, heads), D, "NHD")
    with agent("p", pre.tensors()) as pa, agent("d", dec.tensors()) as da:
        da.add_source(pa.metadata())
        rb = np.array([3, 0, 11, 7, 1, 2])  # 6 prefill blocks: block 2 full, block 0 half
        lb = np.array([2, 0])
        with pytest.raises(BlockCountMismatchError, match="4 per local block"):
            da.read("p", lb, rb[:3])
        t = da.read("p", lb, rb).wait(10)
        assert t.stats.descriptors <= 6 * 2 * L  # one per prefill page; 1 and 2 are adjacent on both sides and merge
        for l in range(L):
            for kv in (0, 1):
                got = dec.views[(l, kv)]
                for j, r in enumerate(rb):
                    tok = (j % 4) * small
                    assert (got[lb[j // 4], tok:tok + small] == X[l, kv][r]).all()
                rest = np.ascontiguousarray(got[0, 2 * small:]).view(np.uint8)
                assert (rest == 0xAA).all(), "tokens past the last prefill block stay untouched"
                assert untouched(got, lb)


# -- refusals -------------------------------------------------------------------------------
def test_head_slice_of_nhd_pages_is_refused_naming_hnd() -> None:
    X, pre, pa = _gqa_case(2, 4, 8, order="NHD")
    dec = gqa_rank(list(range(L)), B, 4, heads_of(0, 4, 8), D, "NHD")
    try:
        with agent("d", dec.tensors(), tp_rank=0, tp_size=4, kv_heads=8) as da:
            with pytest.raises(PageFormatMismatchError, match="one descriptor per token .4 per page.; register HND"):
                da.add_source(pa[0].metadata())
            assert not da.peers
            with pytest.raises(HeadSliceMismatchError):  # add_peer stays strict
                da.add_peer(pa[0].metadata())
    finally:
        for p in pa:
            p.close()


def test_larger_prefill_blocks_and_hnd_token_offsets_are_refused() -> None:
    X = logical(L, 4, 16, 2, D)
    for order, (pt, dt), err, msg in [
            ("NHD", (64, 16), BlockTokensMismatchError, "must cover a whole number of remote blocks"),
            ("HND", (16, 64), BlockTokensMismatchError, r"outermost page axis \(NHD\); this HND page")]:
        pre = gqa_rank([0], 4, pt, (0, 2), D, order, logical(1, 4, pt, 2, D))
        dec = gqa_rank([0], 4, dt, (0, 2), D, order)
        with agent("p", pre.tensors()) as pa, agent("d", dec.tensors()) as da:
            with pytest.raises(err, match=msg):
                da.add_source(pa.metadata())
    del X


def test_partial_source_alone_and_mla_against_gqa_are_refused() -> None:
    X, pre, pa = _gqa_case(4, 2, 8)
    dec = gqa_rank(list(range(L)), B, 4, heads_of(0, 2, 8), D, "HND")
    try:
        with agent("d", dec.tensors(), tp_rank=0, tp_size=2, kv_heads=8) as da:
            da.add_source(pa[0].metadata())
            with pytest.raises(LayoutMismatchError, match=r"(?s)read_many.*layer\.0\.k head 2"):
                da.read("p0", LB, RB)
        with agent("m", mla_rank(L, B, 4, 16), replicated=True) as ma:
            # the MLA pages are ND, the GQA pages HND: nothing pairs
            with pytest.raises(LayoutMismatchError):
                ma.add_source(pa[0].metadata())
    finally:
        for p in pa:
            p.close()


def test_sources_rule() -> None:
    assert sources(3, 4, 2, 8) == [(1, (6, 8))]
    assert sources(1, 2, 4, 8) == [(2, (4, 6)), (3, (6, 8))]
    assert sources(5, 16, 8, 8) == [(2, (2, 3))]
    assert sources(0, 2, 16, 8) == [(0, (0, 1)), (2, (1, 2)), (4, (2, 3)), (6, (3, 4))]
    assert sources(1, 2, 16, 8) == [(9, (4, 5)), (11, (5, 6)), (13, (6, 7)), (15, (7, 8))]
    assert may_free(1, 16, 2, 8) and not may_free(9, 16, 2, 8)


def _page_spec(members: list[tuple[str, kvxfer.MemoryKind, int, int]], tokens: int, blocks: int) -> kvxfer.KVCacheSpec:
    """Per-member regions at fake addresses: ``(name, kind, address, channels)``, ND int16 pages."""
    allocs, regions = [], []
    for i, (name, kind, addr, ch) in enumerate(members):
        pg = kvxfer.PageFormat("int16", 2, "ND", (tokens, ch))
        m = kvxfer.Member(name, pg.nbytes, 0, True, pg, "latent")
        allocs.append(kvxfer.Allocation(addr, pg.nbytes * blocks, kind, 0))
        regions.append(kvxfer.Region(i, 0, blocks, kvxfer.PackedLayout(pg.nbytes, (m,))))
    return kvxfer.KVCacheSpec(tuple(allocs), tuple(regions), layout="LBNHC", block_tokens=tokens)


def test_host_mla_and_device_indexer_against_an_all_device_peer_plan_two_legs() -> None:
    """Host DRAM MLA cache + VRAM indexer locally, all VRAM remotely, 16-token remote blocks."""
    from kvxfer.planner import plan_gather
    from kvxfer.pairing import gather

    dram, vram = kvxfer.MemoryKind.DRAM, kvxfer.MemoryKind.VRAM
    local = _page_spec([("mla.0", dram, 1 << 20, 32), ("idx.0", vram, 1 << 30, 8)], 64, 4)
    remote = _page_spec([("mla.0", vram, 1 << 32, 32), ("idx.0", vram, 1 << 33, 8)], 16, 16)
    g = gather(local, {"p": remote})
    lb, rb = np.array([1, 3]), np.array([9, 2, 5, 0, 14])
    plan = plan_gather(g, local, {"p": remote}, lb, {"p": rb})["p"]
    legs = {(leg.local_kind, leg.remote_kind): leg for leg in plan.legs}
    assert set(legs) == {(dram, vram), (vram, vram)}
    for (lk, _), base_l, base_r, ch in [((dram, vram), 1 << 20, 1 << 32, 32), ((vram, vram), 1 << 30, 1 << 33, 8)]:
        la, ra = plan.explicit(legs[(lk, vram)])
        # independent addresses: remote page j lands at token (j % 4) * 16 of local block lb[j // 4]
        page_l, page_r = 64 * ch * 2, 16 * ch * 2
        want_l = [base_l + lb[j // 4] * page_l + (j % 4) * page_r for j in range(len(rb))]
        want_r = [base_r + r * page_r for r in rb]
        assert la.array[:, 0].tolist() == want_l and ra.array[:, 0].tolist() == want_r
        assert (la.array[:, 1] == page_r).all()
