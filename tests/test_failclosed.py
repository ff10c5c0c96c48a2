"""The fail-closed cases: each pairing a byte copy would get wrong is refused, with its message.

Transfers run on the loopback backend between two agents; expected destinations come from
numpy indexing over logical arrays (:mod:`kvxfer._harness.engines`), never from the planner.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvxfer import Agent, KVCacheSpec, Member, PageFormat, Shard, plan, spec_from_arrays, spec_from_pointers
from kvxfer.errors import (BlockTokensMismatchError, DtypeMismatchError, DuplicateBlockIdError, HeadSliceMismatchError,
                           LayoutMismatchError, PageFormatMismatchError, SpecError)
from kvxfer._harness.engines import EngineCache, build

B, N, H, D = 6, 4, 8, 4


def gqa(style: str = "flash", order: str = "NHD", tp: int = 1, rank: int = 0, **kw: object) -> EngineCache:
    base = dict(style=style, order=order, dtype="float16", layers=2, blocks=B, block_tokens=N, kv_heads=H,
                head_dim=D, tp_size=tp, tp_rank=rank)
    return EngineCache(**{**base, **kw})  # type: ignore[arg-type]


def pair_agents(dec: EngineCache, pre: EngineCache, seed: int = 7):
    src, dst = build(pre, seed=seed), build(dec)
    p, d = Agent("prefill"), Agent("decode")
    p.register(src.views, **pre.register_options())
    d.register(dst.views, **dec.register_options())
    return p, d, src, dst


def refusal(dec: EngineCache, pre: EngineCache, error: type[LayoutMismatchError]) -> LayoutMismatchError:
    """add_peer refuses, no peer is kept, no byte moves; returns the error for its message."""
    p, d, src, dst = pair_agents(dec, pre)
    before = [r.tobytes() for r in dst.raw()]
    try:
        with pytest.raises(error) as info:
            d.add_peer(p.metadata())
        assert not d.peers
        assert [r.tobytes() for r in dst.raw()] == before
        return info.value
    finally:
        d.close()
        p.close()


# -- the cases ------------------------------------------------------------------------------

def test_vllm_flash_attention_shape_is_k_and_v_not_two_blocks() -> None:
    """[2, blocks, ...] is K/V outermost: block 0 -> block 1 copies K to K and V to V."""
    dec, pre = gqa("flash"), gqa("flash")
    p, d, src, dst = pair_agents(dec, pre)
    with p, d:
        assert d.spec is not None and d.spec.num_blocks == B
        assert sorted(m.name for m in d.spec.members) == ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"]
        assert {m.role for m in d.spec.members} == {"k", "v"}
        before, s = dst.logical(), src.logical()
        d.read(d.add_peer(p.metadata()), [1], [0]).wait(5)
    want = before.copy()
    want[1] = s[0]
    np.testing.assert_array_equal(dst.logical().view(np.uint8), want.view(np.uint8))


def test_other_tp_size_and_rank_is_refused_naming_both_slices() -> None:
    err = refusal(gqa(tp=2, rank=0), gqa(tp=4, rank=2), HeadSliceMismatchError)
    assert "heads [0, 4) of 8 (TP rank 0 of 2)" in str(err) and "heads [4, 6) of 8 (TP rank 2 of 4)" in str(err)
    assert "members[layers.0.k, layers.0.v, layers.1.k, layers.1.v].heads" in str(err)


def test_other_rank_same_size_is_refused() -> None:
    err = refusal(gqa(tp=2, rank=1), gqa(tp=2, rank=0), HeadSliceMismatchError)
    assert "local='heads [4, 8) of 8 (TP rank 1 of 2)'" in str(err)
    assert "remote='heads [0, 4) of 8 (TP rank 0 of 2)'" in str(err)


def test_ranks_holding_the_same_heads_pair_across_tp_sizes() -> None:
    """2 KV heads over TP4: ranks 0 and 1 both hold head 0, which TP2 rank 0 holds too."""
    dec, pre = gqa(tp=4, rank=1, kv_heads=2), gqa("cross", tp=2, rank=0, kv_heads=2)
    p, d, src, dst = pair_agents(dec, pre)
    with p, d:
        before, s = dst.logical(), src.logical()
        d.read(d.add_peer(p.metadata()), [2, 0], [5, 5]).wait(5)
    want = before.copy()
    want[[2, 0]] = s[[5, 5]]
    np.testing.assert_array_equal(dst.logical().view(np.uint8), want.view(np.uint8))


def test_hnd_against_nhd_is_refused_naming_the_order() -> None:
    err = refusal(gqa(order="HND"), gqa("cross", order="NHD"), PageFormatMismatchError)
    assert "order: local='HND' remote='NHD'" in str(err)


def test_nhd_and_hnd_with_one_head_hold_the_same_bytes_and_move() -> None:
    dec, pre = gqa(order="HND", tp=8, rank=3), gqa("flashinfer", order="NHD", tp=8, rank=3)
    p, d, src, dst = pair_agents(dec, pre)
    with p, d:
        before, s = dst.logical(), src.logical()
        d.read(d.add_peer(p.metadata()), [4], [1]).wait(5)
    want = before.copy()
    want[4] = s[1]
    np.testing.assert_array_equal(dst.logical().view(np.uint8), want.view(np.uint8))


def test_element_type_mismatch_is_refused_naming_both_dtypes() -> None:
    err = refusal(gqa(dtype="float16"), gqa(dtype="int16"), DtypeMismatchError)
    assert "dtype: local='float16' remote='int16'" in str(err)


def test_bf16_into_fp16_torch_is_refused() -> None:
    torch = pytest.importorskip("torch")
    kv = {f"layers.{i}": torch.zeros(2, B, N, H, D, dtype=torch.bfloat16) for i in range(2)}
    kv16 = {f"layers.{i}": torch.zeros(2, B, N, H, D, dtype=torch.float16) for i in range(2)}
    with Agent("prefill") as p, Agent("decode") as d:
        p.register(kv)
        d.register(kv16)
        with pytest.raises(DtypeMismatchError, match="dtype: local='float16' remote='bfloat16'"):
            d.add_peer(p.metadata())


def test_block_tokens_mismatch_is_refused() -> None:
    err = refusal(gqa(block_tokens=4), gqa(block_tokens=2, blocks=12), BlockTokensMismatchError)
    assert "block_tokens: local=4 remote=2" in str(err)
    assert "tokens: local=4 remote=2" in str(err)


def test_missing_member_and_opaque_size_refusals() -> None:
    a = spec_from_pointers((1 << 20, 8 * 96, 0), num_blocks=8, members=[("a", 32), ("b", 64)])
    b = spec_from_pointers((1 << 24, 8 * 96, 0), num_blocks=8, members=[("a", 40), ("c", 56)])
    with pytest.raises(LayoutMismatchError) as info:
        plan(a, b, [0], [0])
    assert type(info.value) is LayoutMismatchError
    assert ("members", "b", "c") in info.value.diff and ("members[a].size", 32, 40) in info.value.diff


def test_described_against_opaque_page_is_refused() -> None:
    arr = np.zeros((8, N, H, D), np.float16)
    described = spec_from_arrays({"layer.0": arr})
    opaque = spec_from_pointers((1 << 24, 8 * arr[0].nbytes, 0), num_blocks=8, members=[("layer.0", arr[0].nbytes)],
                                layout="LBNHC", block_tokens=N)
    with pytest.raises(PageFormatMismatchError, match=r"page: local='float16\[N=4, H=8, D=4\]' "
                                                      r"remote='bytes\[X=256\]'"):
        plan(described, opaque, [0], [0])


def test_opaque_pages_with_other_layout_labels_are_refused() -> None:
    a = spec_from_pointers((1 << 20, 8 * 64, 0), num_blocks=8, members=[("a", 64)], layout="BLHNC")
    b = spec_from_pointers((1 << 24, 8 * 64, 0), num_blocks=8, members=[("a", 64)], layout="LBNHC")
    with pytest.raises(PageFormatMismatchError, match="layout: local='BLHNC' remote='LBNHC'"):
        plan(a, b, [0], [0])
    c = spec_from_pointers((1 << 28, 8 * 64, 0), num_blocks=8, members=[("a", 64)], layout="LBHNC")
    assert plan(a, c, [0], [0]).descriptors == 1  # block- or layer-outermost is the planner's job


def test_role_and_described_shape_refusals() -> None:
    page = PageFormat("bfloat16", 2, "ND", (4, 8))

    def one(role: str, pg: PageFormat) -> KVCacheSpec:
        return KVCacheSpec((spec_from_pointers((1 << 20, 4096, 0), num_blocks=8, members=[("x", 64)]).allocations),
                           (spec_from_pointers((1 << 20, 4096, 0), num_blocks=8, members=[
                               Member("x", pg.nbytes, 0, True, pg, role)]).regions))
    with pytest.raises(PageFormatMismatchError, match="role: local='latent' remote='k'"):
        plan(one("latent", page), one("k", page), [0], [0])
    with pytest.raises(PageFormatMismatchError, match=r"shape: local='bfloat16\[N=4, D=8\]' "
                                                      r"remote='bfloat16\[N=4, D=16\]'"):
        plan(one("", page), one("", PageFormat("bfloat16", 2, "ND", (4, 16))), [0], [0])


def test_many_refusals_are_grouped_and_bounded() -> None:
    arr = {f"layer.{i}": np.zeros((4, N, H, D), np.float16) for i in range(40)}
    other = {f"layer.{i}": np.zeros((4, N, H, D), np.int16) for i in range(40)}
    with pytest.raises(DtypeMismatchError) as info:
        plan(spec_from_arrays(arr), spec_from_arrays(other), [0], [0])
    assert len(info.value.diff) == 1
    assert "members[layer.0, layer.1, layer.2, layer.3 (+36 more)].dtype" in str(info.value)


def test_check_reports_the_pairing_and_refusals() -> None:
    p, d, _, _ = pair_agents(gqa(), gqa("cross"))
    with p, d:
        peer = d.add_peer(p.metadata())
        assert d.check(peer).mode == "split"
    p, d, _, _ = pair_agents(gqa(), gqa())
    with p, d:
        d.deregister()
        peer = d.add_peer(p.metadata())  # nothing registered here yet: nothing to check
        d.register(build(gqa(dtype="int16")).views, **gqa().register_options())
        with pytest.raises(DtypeMismatchError):
            d.check(peer)
        with pytest.raises(DtypeMismatchError):
            d.read(peer, [0], [0])


# -- request sanity ---------------------------------------------------------------------------

def test_duplicate_destination_ids_are_refused_sources_may_repeat() -> None:
    a = spec_from_pointers((1 << 20, 8 * 64, 0), num_blocks=8, members=[("a", 64)])
    b = spec_from_pointers((1 << 24, 8 * 64, 0), num_blocks=8, members=[("a", 64)])
    with pytest.raises(DuplicateBlockIdError, match="local block id 0 is a destination more than once"):
        plan(a, b, [0, 0], [1, 2], "READ")
    with pytest.raises(DuplicateBlockIdError, match="remote block id 3"):
        plan(a, b, [1, 2], [3, 3], "WRITE")
    assert plan(a, b, [1, 2], [3, 3], "READ").descriptors == 2
    big = spec_from_pointers((1 << 30, 1 << 30, 0), num_blocks=1 << 20, members=[("a", 1024)])
    big2 = spec_from_pointers((1 << 32, 1 << 30, 0), num_blocks=1 << 20, members=[("a", 1024)])
    ids = np.arange(0, 1 << 20, 4096)
    plan(big, big2, ids, ids)
    dup = ids.copy()
    dup[-1] = dup[7]
    with pytest.raises(DuplicateBlockIdError, match=f"local block id {dup[7]}"):
        plan(big, big2, dup, ids)


# -- descriptors ------------------------------------------------------------------------------

def test_split_plans_merge_consecutive_blocks_per_member() -> None:
    """Per-layer K and V on both sides (4 members), 8 consecutive blocks: 4 descriptors."""
    p, d, src, dst = pair_agents(gqa(blocks=16), gqa(blocks=16))
    with p, d:
        peer = d.add_peer(p.metadata())
        assert d.spec is not None and p.spec is not None
        q = plan(d.spec, p.spec, np.arange(4, 12), np.arange(8))
        assert q.descriptors == 32 and q.runs == 4  # merge-capable backends merge them
        assert plan(d.spec, p.spec, np.arange(4, 12), np.arange(8), coalesce=True).descriptors == 4
        before, s = dst.logical(), src.logical()
        t = d.read(peer, np.arange(4, 12), np.arange(8)).wait(5)
        assert t.stats.descriptors == 4  # loopback takes coalesced plans
    want = before.copy()
    want[4:12] = s[0:8]
    np.testing.assert_array_equal(dst.logical().view(np.uint8), want.view(np.uint8))


def test_whole_rows_of_packed_caches_still_merge() -> None:
    p, d, _, _ = pair_agents(gqa("cross", blocks=16), gqa("cross", blocks=16))
    with p, d:
        assert d.spec is not None and p.spec is not None
        assert plan(d.spec, p.spec, np.arange(8), np.arange(8, 16), coalesce=True).descriptors == 1


# -- lifetimes --------------------------------------------------------------------------------

def test_peer_restarts_leave_no_growth() -> None:
    """100 restarts of the prefill worker: caches, peers and live specs stay flat."""
    dst = build(gqa())
    d = Agent("decode")
    d.register(dst.views, **gqa().register_options())
    src = build(gqa("cross"), seed=1)
    sizes = []
    try:
        for i in range(100):
            with Agent("prefill") as p:
                p.register(src.views, **gqa("cross").register_options())
                peer = d.add_peer(p.metadata())  # a new generation replaces the old peer
                d.read(peer, [i % B], [(i + 1) % B]).wait(5)
                assert d.plan(peer, [0], [0]).mode == "split"
            if i in (9, 99):
                gc.collect()
                assert d.spec is not None
                specs = sum(isinstance(o, KVCacheSpec) for o in gc.get_objects())
                sizes.append((len(d.spec._cache), len(d.peers), specs, len(d.backend._peers)))
    finally:
        d.close()
    assert sizes[0] == sizes[1], sizes


def test_dropping_a_peer_releases_its_pairing() -> None:
    import weakref

    p, d, _, _ = pair_agents(gqa(), gqa("cross"))
    with p, d:
        peer = d.add_peer(p.metadata())
        d.read(peer, [0], [1]).wait(5)
        ref = weakref.ref(d.peers[peer].pairing)  # type: ignore[arg-type]
        remote_spec = weakref.ref(d.peers[peer].spec)  # type: ignore[arg-type]
        d.remove_peer(peer)
        gc.collect()
        assert ref() is None and remote_spec() is None


_TEMPORARIES = """
import ctypes, gc, numpy as np, kvxfer
# 1 MiB storages: freed, they go back to the system (unmapped), so a stale pointer faults.
def fresh(fill):
    return {f"layer.{i}": np.full((16, 65536), fill, np.uint8) for i in range(4)}
a = kvxfer.Agent("prefill", backend=BACKEND)
b = kvxfer.Agent("decode", backend=BACKEND)
a.register(fresh(7))  # temporaries: nothing but the agent refers to them
b.register(fresh(0xAA))
gc.collect()
junk = [np.full((16, 65536), 1, np.uint8) for _ in range(16)]  # may land where freed storages were
peer = b.add_peer(a.metadata())
for _ in range(5):
    b.read(peer, list(range(16)), list(range(16))).wait(60)
for alloc in b.spec.allocations:  # read through the registered addresses themselves
    assert set(ctypes.string_at(alloc.address, alloc.nbytes)) == {7}, "destination lacks the source bytes"
assert all((j == 1).all() for j in junk), "a transfer wrote into memory it does not own"
b.close(); a.close()
print("ok")
"""


def run_temporaries(backend: str) -> None:
    code = "BACKEND = %r\n" % backend + textwrap.dedent(_TEMPORARIES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stderr[-2000:])


def test_registering_temporaries_does_not_crash_loopback() -> None:
    run_temporaries("loopback")


def test_agent_holds_what_it_registered_until_deregister() -> None:
    import weakref

    arrays = {f"layer.{i}": np.zeros((4, 64), np.uint8) for i in range(2)}
    refs = [weakref.ref(a) for a in arrays.values()]
    with Agent("x") as a:
        a.register(arrays)
        del arrays
        gc.collect()
        assert all(r() is not None for r in refs)
        a.deregister()
        gc.collect()
        assert all(r() is None for r in refs)


# -- registration strictness -------------------------------------------------------------------

def test_object_and_read_only_arrays_are_refused() -> None:
    with pytest.raises(SpecError, match="Python objects"):
        spec_from_arrays({"x": np.zeros((4, 8), dtype=object)})
    ro = np.zeros((4, 8), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(SpecError, match="read-only"):
        spec_from_arrays({"x": ro})
    with Agent("x") as a, pytest.raises(SpecError, match="read-only"):
        a.register({"x": ro})


def test_shard_is_checked_against_the_page() -> None:
    pg = PageFormat("float16", 2, "NHD", (4, 2, 8))
    Member("x", pg.nbytes, 0, False, pg, "k", Shard(1, 4, (2, 4), 8))
    with pytest.raises(SpecError, match="holds 3 heads but the page has H=2"):
        Member("x", pg.nbytes, 0, False, pg, "k", Shard(1, 4, (2, 5), 8))
    with pytest.raises(SpecError, match="replicated member"):
        Member("x", pg.nbytes, 0, True, pg, "k", Shard(1, 4, (2, 4), 8))
    with pytest.raises(SpecError, match="is 128 bytes, the member is 64"):
        Member("x", 64, 0, False, pg)


def test_replicated_pages_with_other_head_counts_are_refused() -> None:
    a = spec_from_arrays({"l0": np.zeros((4, N, 4, D), np.float16)}, replicated=True)
    b = spec_from_arrays({"l0": np.zeros((4, N, 2, D), np.float16)}, replicated=True)
    with pytest.raises(HeadSliceMismatchError, match="l0].heads: local='4 heads' remote='2 heads'"):
        plan(a, b, [0], [0])
