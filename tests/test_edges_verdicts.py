"""One answer to "do these pair?": ``kvxfer plan`` on spec files and agents on real tensors agree.

Each case is a pair of geometries (spec files). The CLI plans them; two loopback agents
register torch tensors shaped as an engine holds that geometry (built here, not by kvxfer)
and one adds the other. Both must accept, or both refuse with the same error class. Where
both accept, a read moves real bytes: the source holds a pattern, the destination the 0xAA
sentinel, and every tensor is compared bytewise with numpy indexing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import KvxferError, LayoutMismatchError
from kvxfer.geometry import resolve
from kvxfer.geometry import Geometry
from test_cli import SPECS, as_json, kvxfer_cmd

torch = pytest.importorskip("torch")
NB = 3
LB, RB = np.array([2, 0]), np.array([0, 1])
DT = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
      "float32": torch.float32}


def _changed(g: Geometry, **member: Any) -> Geometry:
    groups = tuple(dataclasses.replace(grp, members=tuple(dataclasses.replace(m, **member) for m in grp.members))
                   for grp in g.groups)
    return dataclasses.replace(g, groups=groups)


def _layers(g: Geometry) -> Geometry:
    return g.with_layout(False)  # one region per layer: how the tensors below are held


LLAMA = _layers(resolve(str(SPECS / "llama3-70b-tp8.toml")))
GLM5 = _layers(resolve("glm5-mla"))
CASES: list[tuple[str, Geometry, Geometry]] = [
    ("same rank", LLAMA, LLAMA),
    ("bf16 vs fp16", LLAMA, _changed(LLAMA, dtype="float16")),
    ("tp 1/8 vs 2/8", LLAMA, LLAMA.with_parallel((2, 8))),
    ("tp 0/8 vs 0/4", LLAMA.with_parallel((0, 8)), LLAMA.with_parallel((0, 4))),
    ("block tokens", LLAMA, dataclasses.replace(LLAMA, block_tokens=32)),
    ("mla other rank", GLM5.with_parallel((0, 8)), GLM5.with_parallel((3, 8))),
    ("indexer dtype", GLM5, dataclasses.replace(GLM5, groups=(dataclasses.replace(GLM5.groups[0], members=(
        GLM5.groups[0].members[0], dataclasses.replace(GLM5.groups[0].members[1], dtype="bfloat16", shape=(66,)))),))),
    ("mla vs gqa", GLM5, LLAMA),
]


def _engine_tensors(g: Geometry, seed: int | None) -> dict[str, Any]:
    """``{layer: tensor | (k, v) | {name: tensor}}`` as an engine holds ``g``: HND when heads lead."""
    gen = torch.Generator().manual_seed(seed or 0)
    owner = {layer: grp for grp in g.groups for layer in grp.layers}
    hnd = g.layout[2:].startswith("H")

    def one(m: Any) -> Any:
        heads = m.heads_on_rank(g.tp_size)
        width = int(np.prod(m.shape))
        if m.replicated and m.heads == 1:
            st = torch.empty((NB, g.block_tokens, width), dtype=DT[m.dtype])
            view = st
        elif hnd:
            st = torch.empty((NB, heads, g.block_tokens, width), dtype=DT[m.dtype])
            view = st.transpose(1, 2)
        else:
            st = view = torch.empty((NB, g.block_tokens, heads, width), dtype=DT[m.dtype])
        raw = st.view(torch.uint8)
        if seed is None:
            raw.fill_(0xAA)
        else:
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
        return view

    out: dict[str, Any] = {}
    for layer in g.stage_layers:
        ms = owner[layer].members
        names = [m.name for m in ms]
        if names == ["k", "v"]:
            out[f"layer.{layer}"] = (one(ms[0]), one(ms[1]))
        elif names == [""]:
            out[f"layer.{layer}"] = one(ms[0])
        else:
            out[f"layer.{layer}"] = {m.name: one(m) for m in ms}
    return out


def _register(name: str, g: Geometry, seed: int | None) -> tuple[kvxfer.Agent, dict[str, Any]]:
    t = _engine_tensors(g, seed)
    kv_heads = {m.heads for grp in g.groups for m in grp.members if not m.replicated}
    a = kvxfer.Agent(name)
    a.register(t, tp_rank=g.tp_rank, tp_size=g.tp_size, replicated=g.replicated(),
               kv_heads=kv_heads.pop() if len(kv_heads) == 1 else None)
    return a, t


def _cli_verdict(local: Geometry, remote: Geometry, tmp: Path) -> str:
    files = []
    for side, g in (("local", local), ("remote", remote)):
        f = tmp / f"{side}.json"
        f.write_text(json.dumps(g.to_dict()))
        files.append(str(f))
    r = kvxfer_cmd("plan", "--local", files[0], "--remote", files[1], "--tokens", "64", "--json")
    rows = json.loads(r.stdout)
    assert len(rows) == 1
    refused = rows[0]["mode"] == "refused"
    assert r.returncode == (1 if refused else 0), r.stderr[-2000:]  # a refused plan exits 1
    if rows[0]["mode"] == "gather":  # sides of other TP/PP sizes: what read_many runs, not add_peer's pair
        return "gather"
    return "paired" if not refused else str(rows[0].get("error", "refused"))


def _tensors(x: Any) -> list[Any]:
    return list(x.values() if isinstance(x, dict) else x if isinstance(x, tuple) else (x,))


def _raw(t: Any, blocks: np.ndarray) -> np.ndarray:
    """The bytes of ``blocks`` of a logical view, as numpy (numpy has no bfloat16)."""
    return t[torch.from_numpy(blocks)].contiguous().view(torch.uint8).numpy()


def _agent_verdict(local: Geometry, remote: Geometry) -> str:
    a, dst = _register("d", local, None)
    b, src = _register("p", remote, 7)
    try:
        try:
            a.add_peer(b.metadata())
        except LayoutMismatchError as exc:
            assert not a.peers
            return type(exc).__name__
        a.read("p", LB, RB).wait(10)
        rest = np.setdiff1d(np.arange(NB), LB)
        for name in dst:  # bytewise: random bytes include NaNs
            for got, want in zip(_tensors(dst[name]), _tensors(src[name])):
                assert (_raw(got, LB) == _raw(want, RB)).all(), name
                assert (_raw(got, rest) == 0xAA).all(), name
        return "paired"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("case,local,remote", CASES, ids=[c[0] for c in CASES])
def test_cli_and_agents_reach_the_same_verdict(case: str, local: Geometry, remote: Geometry, tmp_path: Path) -> None:
    cli = _cli_verdict(local, remote, tmp_path)
    agents = _agent_verdict(local, remote)
    if cli == "gather":  # the one pair add_peer sees is refused; read_many gathers over the remote's ranks
        assert agents == "HeadSliceMismatchError", f"{case}: kvxfer plan shows a gather, add_peer says {agents}"
        return
    assert cli == agents, f"{case}: kvxfer plan says {cli}, add_peer says {agents}"


def test_control_the_cases_cover_both_verdicts() -> None:
    got = {_agent_verdict(local, remote) for _, local, remote in CASES}
    assert "paired" in got and {"DtypeMismatchError", "HeadSliceMismatchError", "BlockTokensMismatchError"} <= got


def test_spec_file_tp_ranks_are_refused_naming_their_heads() -> None:
    rows = as_json(kvxfer_cmd("plan", "--local", str(SPECS / "llama3-70b-tp8.toml"), "--remote-tp", "2/8",
                              "--tokens", "64", "--json"), code=1)
    assert rows[0]["error"] == "HeadSliceMismatchError"
    assert "heads [1, 2) of 8" in rows[0]["why"] and "heads [2, 3) of 8" in rows[0]["why"], rows[0]["why"]
    assert "heads not described" not in rows[0]["why"]


def test_spec_file_specs_are_described_not_opaque() -> None:
    spec = LLAMA.spec(4)
    for m in spec.members:
        assert not m.page.is_opaque and m.page.dtype == "bfloat16", m
        assert m.shard is not None and m.shard.heads == (1, 2) and m.shard.total_heads == 8, m
    with pytest.raises(KvxferError):
        kvxfer.plan(spec, _changed(LLAMA, dtype="float16").spec(4), [0], [0])
