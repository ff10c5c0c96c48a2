"""Spec files: the documented examples, random geometries, typed errors, and real bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer.errors import SpecError, SpecFileError
from kvxfer.geometry import PRESETS
from kvxfer.geometry import DTYPES, Geometry, load, loads
from kvxfer.testing.buffers import SENTINEL, allocate

SPECS = Path(__file__).resolve().parent.parent / "docs" / "specs"


def test_documented_examples_load() -> None:
    glm = load(SPECS / "glm5-mla.toml")
    assert (glm.num_layers, glm.block_tokens, glm.tp_rank, glm.tp_size) == (78, 64, 3, 8)
    assert glm.members[:2] == (("layer.0.kv", 64 * 576 * 2, True), ("layer.0.indexer", 64 * 132, True))
    llama = load(SPECS / "llama3-70b-tp8.toml")
    assert llama.layout == "LBHNC" and len(llama.members) == 160
    assert llama.members[0] == ("layer.0.k", 16 * 1 * 128 * 2, False)  # one of 8 heads on this rank
    hybrid = load(SPECS / "qwen-hybrid.json")
    assert list(hybrid.stage_layers) == list(range(24))
    names = [n for n, _, _ in hybrid.members]
    assert names[:4] == ["layer.0.conv", "layer.0.ssm", "layer.1.conv", "layer.1.ssm"]
    assert ("layer.3.k", 64 * 2 * 256 * 2, False) in hybrid.members
    assert dict((n, s) for n, s, _ in hybrid.members)["layer.0.ssm"] == 32 * 128 * 128 * 2  # per block, not per token


def test_toml_and_json_forms_agree() -> None:
    g = load(SPECS / "glm5-mla.toml")
    again = loads(json.dumps(g.to_dict()), fmt="json")
    assert again == g and again.members == g.members


def test_presets_round_trip_and_build_specs() -> None:
    for name, g in PRESETS.items():
        assert Geometry.from_dict(json.loads(json.dumps(g.to_dict()))) == g, name
        for packed in (True, False):
            spec = g.spec(3, packed=packed)
            assert [(m.name, m.size, m.replicated) for m in spec.members] == list(g.members)
            assert spec.row_bytes == g.row and spec.num_blocks == 3


# -- random geometries ------------------------------------------------------------------


@st.composite
def geometries(draw: Any) -> dict[str, Any]:
    layers = draw(st.integers(1, 10))
    ngroups = draw(st.integers(1, min(3, layers)))
    owner = draw(st.lists(st.integers(0, ngroups - 1), min_size=layers, max_size=layers))
    owner[:ngroups] = list(range(ngroups))  # every group gets a layer
    tp = draw(st.sampled_from([1, 2, 4]))
    groups = []
    for gi in range(ngroups):
        members = []
        for mi in range(draw(st.integers(1, 3))):
            m: dict[str, Any] = {"name": f"m{mi}", "dtype": draw(st.sampled_from(sorted(DTYPES))),
                                 "heads": draw(st.sampled_from([1, 2, 4, 8])),
                                 "per_token": draw(st.booleans()), "replicated": draw(st.booleans())}
            if draw(st.booleans()):
                m["head_dim"] = draw(st.integers(1, 16))
            else:
                m["shape"] = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
            members.append(m)
        groups.append({"layers": [i for i in range(layers) if owner[i] == gi], "members": members})
    pp = draw(st.integers(1, layers))
    return {"name": "random", "layers": layers, "block_tokens": draw(st.integers(1, 8)),
            "layout": draw(st.sampled_from(["BLHNC", "LBHNC", "BLNHC", "LBNHC"])),
            "parallel": {"tp_size": tp, "tp_rank": draw(st.integers(0, tp - 1)), "pp_size": pp,
                         "pp_rank": draw(st.integers(0, pp - 1))},
            "groups": groups}


def _expected_members(d: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """Members computed straight from the document, independently of the parser."""
    par = d["parallel"]
    layers = np.array_split(np.arange(d["layers"]), par["pp_size"])[par["pp_rank"]].tolist()
    out = []
    for layer in layers:
        g = next(g for g in d["groups"] if layer in g["layers"])
        for m in g["members"]:
            heads = m["heads"] if m["replicated"] else max(1, m["heads"] // par["tp_size"])
            elems = m["head_dim"] if "head_dim" in m else math.prod(m["shape"])
            size = (d["block_tokens"] if m["per_token"] else 1) * heads * elems * DTYPES[m["dtype"]]
            out.append((f"layer.{layer}.{m['name']}", size, m["replicated"]))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries())
def test_random_geometry_builds_the_spec_it_describes(d: dict[str, Any]) -> None:
    g = loads(json.dumps(d), fmt="json")
    want = _expected_members(d)
    assert list(g.members) == want
    spec = g.spec(5)
    assert [(m.name, m.size, m.replicated) for m in spec.members] == want
    assert (spec.layout, spec.tp_rank, spec.tp_size, spec.block_tokens) == (
        d["layout"], d["parallel"]["tp_rank"], d["parallel"]["tp_size"], d["block_tokens"])
    assert len(spec.regions) == (1 if d["layout"].startswith("BL") else len(want))
    assert Geometry.from_dict(g.to_dict()) == g


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries(), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_random_geometry_moves_exact_bytes(d: dict[str, Any], src_packed: bool, dst_packed: bool, seed: int) -> None:
    """Real buffers from a spec file, one loopback read, checked member by member with numpy."""
    g = loads(json.dumps(d), fmt="json")
    nb = 6
    src = allocate(g, nb, packed=src_packed, pad=3)
    dst = allocate(g, nb, packed=dst_packed, pad=5)
    src.fill_blocks(seed)
    before = {n: np.array(v, copy=True) for n, v in dst.views.items()}
    src_blocks, dst_blocks = [4, 0, 5], [1, 2, 0]
    with kvxfer.Agent("src", backend="loopback") as a, kvxfer.Agent("dst", backend="loopback") as b:
        src.register(a)
        dst.register(b)
        b.read(b.add_peer(a.metadata()), dst_blocks, src_blocks).wait(10)
    for name, view in dst.views.items():  # the logical (blocks, page) array of each member
        want = before[name].copy()
        want[dst_blocks] = src.views[name][src_blocks]
        np.testing.assert_array_equal(view, want, err_msg=name)
    if dst.packed:
        assert (dst.storages[0][:, g.row:] == SENTINEL).all()  # row padding untouched
    assert dst.verify(dst_blocks, src_blocks, seed) is None
    if len(set(src_blocks)) > 1:
        assert dst.verify(dst_blocks, src_blocks[::-1], seed) is not None  # the check can fail


# -- typed errors -----------------------------------------------------------------------

BASE = {"layers": 4, "block_tokens": 16, "groups": [{"layers": "all", "members": [
    {"name": "k", "dtype": "bfloat16", "heads": 2, "head_dim": 8}]}]}


def _with(path: str, value: Any) -> dict[str, Any]:
    d = json.loads(json.dumps(BASE))
    *keys, last = path.split(".")
    node: Any = d
    for k in keys:
        node = node[int(k)] if k.isdigit() else node[k]
    if value is _DELETE:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return d


_DELETE = object()


@pytest.mark.parametrize("path,value,needle", [
    ("layer", 4, "unknown key(s) 'layer'"),
    ("layers", _DELETE, "missing key(s) 'layers'"),
    ("layers", True, "layers: expected an integer"),
    ("block_tokens", 0, "block_tokens: expected an integer"),
    ("layout", "XYZ", "unknown 'XYZ'"),
    ("parallel", {"tp_size": 3}, "2 heads do not split over tp_size 3"),
    ("parallel", {"tp_size": 2, "tp_rank": 2}, "tp_rank"),
    ("parallel", {"pp_size": 5}, "pp_size 5 is larger"),
    ("parallel", {"dp_size": 2}, "parallel: unknown key(s) 'dp_size'"),
    ("groups", [], "groups: expected a non-empty list"),
    ("groups.0.layers", "0-2", "layers 3 belong to no group"),
    ("groups.0.layers", "2-1", "outside layers"),
    ("groups.0.layers", "0-9", "outside layers"),
    ("groups.0.layers", "a-b", "cannot read 'a-b'"),
    ("groups.0.layers", [0, 1, 1, 2, 3], "listed twice"),
    ("groups.0.members.0.dtype", "bf61", "groups[0].members[0].dtype: unknown dtype 'bf61'"),
    ("groups.0.members.0.shape", [2, 2], "exactly one of head_dim or shape"),
    ("groups.0.members.0.head_dim", -1, "head_dim: expected an integer"),
    ("groups.0.members.0.name", "a.b", "use letters"),
    ("groups.0.members.0.replicated", "yes", "expected true or false"),
    ("groups.0.members", [{"name": "k", "dtype": "bf16", "head_dim": 1}] * 2, "duplicate member names"),
])
def test_spec_file_errors_name_the_key(path: str, value: Any, needle: str) -> None:
    with pytest.raises(SpecFileError, match=None) as info:
        loads(json.dumps(_with(path, value)), source="model.json", fmt="json")
    assert isinstance(info.value, SpecError)  # the error a bad spec on the wire raises
    assert str(info.value).startswith("model.json: ") and needle in str(info.value), str(info.value)


def test_overlapping_and_rest_groups() -> None:
    d = {"layers": 4, "block_tokens": 1, "groups": [
        {"layers": "0-2", "members": [{"dtype": "uint8", "head_dim": 1}]},
        {"layers": "2-3", "members": [{"dtype": "uint8", "head_dim": 1}]}]}
    with pytest.raises(SpecFileError, match=r"groups\[1\]: layer 2 is already in groups\[0\]"):
        loads(json.dumps(d), fmt="json")
    d["groups"][1]["layers"] = "rest"
    assert [n for n, _, _ in loads(json.dumps(d), fmt="json").members] == ["layer.0", "layer.1", "layer.2", "layer.3"]
    d["groups"][0]["layers"] = "rest"
    with pytest.raises(SpecFileError, match="only one group"):
        loads(json.dumps(d), fmt="json")


@pytest.mark.parametrize("text,fmt,needle", [
    ("layers = [", "toml", "not valid TOML"),
    ("{", "json", "not valid JSON"),
    ("[1, 2]", "json", "expected a table"),
    (b"\xff\xfe", "toml", "not UTF-8"),
])
def test_unreadable_files(text: Any, fmt: str, needle: str) -> None:
    with pytest.raises(SpecFileError, match=needle):
        loads(text, fmt=fmt)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecFileError, match="cannot read"):
        load(tmp_path / "nope.toml")
