"""Discovery of the engine shapes in the README table, the ``dims`` option, and the wire form
of what members now say about their pages (validated, bounded, typed errors)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvxfer import KVCacheSpec, Member, PageFormat, Shard, plan, spec_from_arrays, spec_from_tensors
from kvxfer.errors import MetadataError, SpecError
from kvxfer.metadata import AgentMetadata

torch = pytest.importorskip("torch")
NB, N, H, D, L = 5, 4, 2, 8, 3


def summary(spec: KVCacheSpec) -> list[tuple[str, str, str, int | None]]:
    return [(m.name, m.role, m.page.describe(), m.layer) for m in spec.members]  # type: ignore[union-attr]


def test_vllm_flash_attention() -> None:
    s = spec_from_tensors({f"model.layers.{i}.attn": torch.zeros(2, NB, N, H, D, dtype=torch.bfloat16)
                           for i in range(L)})
    assert s.num_blocks == NB and len(s.regions) == 2 * L and s.layout == "LBNHC" and s.block_tokens == N
    assert summary(s)[:2] == [("model.layers.0.attn.k", "k", "bfloat16[N=4, H=2, D=8]", 0),
                              ("model.layers.0.attn.v", "v", "bfloat16[N=4, H=2, D=8]", 0)]


def test_flash_attention_hnd_strides_give_hnd_pages() -> None:
    x = torch.zeros(2, NB, H, N, D, dtype=torch.float16).permute(0, 1, 3, 2, 4)  # logical NHD, memory HND
    s = spec_from_tensors({"l0": x})
    assert [m.page.axes for m in s.members] == ["HND", "HND"] and s.layout == "LBHNC"  # type: ignore[union-attr]


def test_flashinfer_pages_split_into_k_and_v_members_of_one_row() -> None:
    s = spec_from_tensors({f"l{i}": torch.zeros(NB, 2, N, H, D, dtype=torch.float16) for i in range(L)})
    assert len(s.regions) == L and all(len(r.members) == 2 for r in s.regions)
    page = N * H * D * 2
    assert [(m.name, m.offset, m.role) for m in s.regions[0].members] == [("l0.k", 0, "k"), ("l0.v", page, "v")]
    # Same members as the FlashAttention layout: the two pair, member by member.
    fa = spec_from_tensors({f"l{i}": torch.zeros(2, NB, N, H, D, dtype=torch.float16) for i in range(L)})
    assert plan(s, fa, [0, 1], [2, 3]).descriptors == 2 * 2 * L
    assert plan(s, s, [0, 1], [2, 3]).descriptors == 2 * L  # FlashInfer with itself: whole rows


def test_mla_latent_pages() -> None:
    s = spec_from_tensors({f"l{i}": torch.zeros(NB, 64, 576, dtype=torch.bfloat16) for i in range(L)},
                          replicated=True, tp_rank=1, tp_size=4)
    assert summary(s)[0] == ("l0", "latent", "bfloat16[N=64, D=576]", 0)
    assert s.block_tokens == 64 and all(m.shard is None for m in s.members)


def test_block_outermost_cross_layer_storage_views_and_whole_tensor() -> None:
    st = torch.zeros(NB, L, 2, N, H, D, dtype=torch.bfloat16)
    views = spec_from_tensors({f"l{i}": st[:, i].transpose(0, 1) for i in range(L)})  # FA-shaped views
    assert len(views.allocations) == 1 and len(views.regions) == 1 and views.layout == "BLNHC"
    assert [m.name for m in views.members] == ["l0.k", "l0.v", "l1.k", "l1.v", "l2.k", "l2.v"]
    whole = spec_from_tensors({"kv": st}, dims="BLKNHD")
    assert len(whole.regions) == 1 and [m.name for m in whole.members][:3] == ["kv.0.k", "kv.0.v", "kv.1.k"]
    assert [m.layer for m in whole.members] == [0, 0, 1, 1, 2, 2]
    assert [m.offset for m in whole.members] == [m.offset for m in views.members]


def test_mamba_state_keeps_its_own_suffixes() -> None:
    conv, ssm = torch.zeros(NB, 96, 3), torch.zeros(NB, 4, 16, 8)
    s = spec_from_tensors({"layers.5.mixer": [conv, ssm]}, tp_rank=1, tp_size=2)
    assert summary(s) == [("layers.5.mixer.conv", "state", "float32[D=96, S=3]", 5),
                          ("layers.5.mixer.ssm", "state", "float32[H=4, D=16, S=8]", 5)]
    ssm_shard = s.members[1].shard
    assert ssm_shard is not None and ssm_shard.heads == (4, 8) and ssm_shard.total_heads == 8
    named = spec_from_tensors({"layers.5": {"conv_state": conv, "temporal": ssm}},
                              dims={"layers.5": {"conv_state": "BDS", "temporal": "BHDS"}})
    assert [m.name for m in named.members] == ["layers.5.conv_state", "layers.5.temporal"]
    assert not any(m.name.endswith((".k", ".v")) for m in named.members)


def test_separate_k_and_v_tensors() -> None:
    s = spec_from_tensors({"l0": (torch.zeros(NB, N, H, D), torch.zeros(NB, N, H, D))})
    assert [(m.name, m.role) for m in s.members] == [("l0.k", "k"), ("l0.v", "v")]


def test_dims_option_for_shapes_that_are_ambiguous_or_unknown() -> None:
    amb = torch.zeros(2, 2, N, H, D)  # [2, blocks=2, ...] or [blocks=2, 2, ...]?
    with pytest.raises(SpecError, match="pass dims="):
        spec_from_tensors({"l0": amb})
    assert spec_from_tensors({"l0": amb}, dims="KBNHD").regions[0].offset == 0
    assert len(spec_from_tensors({"l0": amb}, dims="KBNHD").regions) == 2
    assert len(spec_from_tensors({"l0": amb}, dims={"l0": "BKNHD"}).regions) == 1
    with pytest.raises(SpecError, match="cannot tell"):
        spec_from_tensors({"l0": torch.zeros(NB, 3, N, H, D)})
    s = spec_from_tensors({"l0": torch.zeros(NB, 3, N, H, D)}, dims="BXNHD")
    assert s.members[0].page.axes == "XNHD"  # type: ignore[union-attr]
    for bad, msg in (("BNH", "one letter per dimension"), ("BBNHD", "exactly one B"), ("BQNHD", "unknown letters"),
                     ("KXNHD", "exactly one B"), ("BKNHD", "size 3")):
        with pytest.raises(SpecError, match=msg):
            spec_from_tensors({"l0": torch.zeros(NB, 3, N, H, D)}, dims=bad)
    with pytest.raises(SpecError, match="not put K/V there"):
        spec_from_tensors({"l0": torch.zeros(NB, 2, N, H, D)}, dims="BXNHD", kv_dim=1)


def test_heads_held_follow_kv_heads() -> None:
    x = {"l0": torch.zeros(NB, N, 1, D)}
    shard = spec_from_tensors(x, tp_rank=5, tp_size=8, kv_heads=2).members[0].shard
    assert shard is not None and (shard.heads, shard.total_heads) == ((1, 2), 2)
    shard = spec_from_tensors(x, tp_rank=5, tp_size=8).members[0].shard
    assert shard is not None and (shard.heads, shard.total_heads) == ((5, 6), 8)
    with pytest.raises(SpecError, match="does not fit kv_heads=3"):
        spec_from_tensors(x, tp_rank=0, tp_size=2, kv_heads=3)


def test_numpy_dtypes_are_recorded() -> None:
    for dt in ("float16", "int8", "float32", "uint8"):
        s = spec_from_arrays({"l": np.zeros((NB, N, H, D), dt)})
        assert s.members[0].page.dtype == dt and s.members[0].page.itemsize == np.dtype(dt).itemsize  # type: ignore


# -- wire form -----------------------------------------------------------------------------------

def _member_doc() -> dict:
    pg = PageFormat("bfloat16", 2, "NHD", (4, 2, 8))
    return Member("l0.k", pg.nbytes, 0, False, pg, "k", Shard(1, 4, (2, 4), 8), 0).to_dict()


def _spec_doc(member: dict) -> dict:
    return {"layout": "LBNHC", "block_tokens": 4, "tp_rank": 1, "tp_size": 4,
            "allocations": [{"address": 1 << 20, "nbytes": 1 << 16, "kind": "DRAM", "device": 0}],
            "regions": [{"allocation": 0, "offset": 0, "num_blocks": 4,
                         "layout": {"stride": 128, "members": [member]}}]}


def test_member_round_trips_through_json() -> None:
    d = _member_doc()
    assert Member.from_dict(json.loads(json.dumps(d))).to_dict() == d
    spec = KVCacheSpec.from_dict(_spec_doc(d))
    md = AgentMetadata("a", 1, "loopback", b"", spec)
    assert AgentMetadata.decode(md.encode()).spec == spec


@pytest.mark.parametrize("path,value", [
    (("page", "dtype"), "BF16!"), (("page", "dtype"), 7), (("page", "itemsize"), 0), (("page", "itemsize"), 17),
    (("page", "axes"), "NHQ"), (("page", "axes"), "NNH"), (("page", "axes"), ""), (("page", "axes"), "NHDXXXXXX"),
    (("page", "shape"), [4, 2]), (("page", "shape"), [4, 2, -8]), (("page", "shape"), [4, 2, 1 << 40]),
    (("page", "shape"), [4, 2, 16]), (("page", "shape"), "4,2,8"), (("page", "shape"), [4, 2, 8.0]),
    (("page",), None), (("role",), "K V"), (("role",), 3), (("layer",), -1), (("layer",), True),
    (("shard", "tp_rank"), 4), (("shard", "tp_size"), 0), (("shard", "tp_size"), 1 << 20),
    (("shard", "heads"), [2, 5]), (("shard", "heads"), [3, 3]), (("shard", "heads"), [7, 9]),
    (("shard", "heads"), "2-4"), (("shard", "heads"), [2]), (("shard", "total_heads"), None),
    (("shard", "total_heads"), 3), (("shard", "extra"), 1), (("replicated",), True),
])
def test_hostile_member_fields_are_rejected_with_typed_errors(path: tuple[str, ...], value: object) -> None:
    d = _member_doc()
    target = d
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    with pytest.raises(SpecError):
        KVCacheSpec.from_dict(_spec_doc(d))
    bad = AgentMetadata("a", 1, "loopback", b"", None).encode().replace(
        b'"spec":null', json.dumps(_spec_doc(d), separators=(",", ":")).encode())
    with pytest.raises(MetadataError):
        AgentMetadata.decode(bad)
