"""No documented path leads to wrong heads: the quick start, the refusal hint, ``replicated``.

GQA ranks hold different KV heads; a user following the README or an error's advice must
never get two ranks paired. Bytes move through the loopback backend and are checked against
numpy indexing over the logical arrays (the destination starts as the 0xAA sentinel).
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

import kvxfer
from hetero_caches import gqa_rank, logical, mla_rank, untouched
from kvxfer.errors import HeadSliceMismatchError, SpecError
from kvxfer.pairing import heads_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
L, B, T, H, D = 2, 8, 4, 8, 4
LB, RB = np.array([5, 0, 3]), np.array([2, 7, 4])


def _quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n.*?```python\n(.*?)```", text, re.S)
    assert block, "README has a Quick start section with a python block"
    return block.group(1)


def _register_call(code: str) -> str:
    m = re.search(r"\.register\((.*?)\)\s*(?:#[^\n]*)?\n(?!\s+\w+=)", code, re.S)
    assert m, code
    return re.sub(r"#[^\n]*", "", m.group(1))


def test_readme_quick_start_registers_gqa_safely() -> None:
    call = _register_call(_quick_start())
    assert "replicated=True" not in call, call
    assert "tp_rank=" in call and "tp_size=" in call, call


def test_control_register_call_parser_sees_replicated() -> None:
    assert "replicated=True" in _register_call("a.register(kv_caches, replicated=True)   # x\nnext()\n")


def _ranks(opts: dict[str, object]) -> tuple[np.ndarray, list[kvxfer.Agent], list]:
    X = logical(L, B, T, H, D)
    tp = 2
    ranks = [gqa_rank(list(range(L)), B, T, heads_of(r, tp, H), D, "HND", X) for r in range(tp)]
    agents = []
    for r in range(tp):
        a = kvxfer.Agent(f"r{r}")
        a.register(ranks[r].tensors(), tp_rank=r, tp_size=tp, **opts)
        agents.append(a)
    return X, agents, ranks


def test_quick_start_form_refuses_other_ranks_heads_with_gqa_advice() -> None:
    X, (a0, a1), _ = _ranks({"kv_heads": H})
    dec = gqa_rank(list(range(L)), B, T, heads_of(0, 2, H), D, "HND")
    try:
        with kvxfer.Agent("d") as d:
            d.register(dec.tensors(), tp_rank=0, tp_size=2, kv_heads=H)
            with pytest.raises(HeadSliceMismatchError) as err:
                d.add_peer(a1.metadata())
            msg = str(err.value)
            assert "tp_rank=" in msg and "kv_heads=" in msg, msg
            assert re.search(r"replicated=True is only for pages byte-identical on every TP rank", msg), msg
            assert "MLA" in msg and "indexer" in msg, msg
            # Control: the same form pairs the rank holding the same heads and moves the right ones.
            d.add_peer(a0.metadata())
            d.read("r0", LB, RB).wait(10)
            for l in range(L):
                for kv in (0, 1):
                    assert (dec.views[(l, kv)][LB] == X[l, kv][RB][:, :, 0:H // 2]).all()
                    assert untouched(dec.views[(l, kv)], LB)
    finally:
        a0.close()
        a1.close()


def test_replicated_true_on_a_gqa_share_is_refused_when_kv_heads_is_known() -> None:
    rank = gqa_rank(list(range(L)), B, T, heads_of(1, 2, H), D, "HND")
    with kvxfer.Agent("a") as a:
        with pytest.raises(SpecError, match=r"layer\.0\.k: replicated=True, but its page holds 4 of .*kv_heads=8"):
            a.register(rank.tensors(), replicated=True, tp_rank=1, tp_size=2, kv_heads=H)
        assert a.spec is None


def _wrong_heads_read(opts: dict[str, object], ranks_opts: list[dict[str, object]]) -> np.ndarray:
    """Decode rank 0 (registered with ``opts``) reads rank 1's blocks; returns the heads that landed."""
    X = logical(L, B, T, H, D)
    r1 = gqa_rank(list(range(L)), B, T, heads_of(1, 2, H), D, "HND", X)
    dec = gqa_rank(list(range(L)), B, T, heads_of(0, 2, H), D, "HND")
    with kvxfer.Agent("r1") as a1, kvxfer.Agent("d") as d:
        a1.register(r1.tensors(), tp_size=2, **ranks_opts[0])
        d.register(dec.tensors(), tp_size=2, **opts)
        d.add_peer(a1.metadata())  # accepted only because a registration claimed what is false
        d.read("r1", LB, RB).wait(10)
        assert untouched(dec.views[(0, 0)], LB)
        return dec.views[(0, 0)][LB]


def test_replicated_true_on_a_gqa_share_is_refused_without_kv_heads() -> None:
    with pytest.raises(SpecError, match=r"layer\.0\.k: replicated=True with tp_size=2, .*nothing says it holds every"):
        _ranks({"replicated": True})


def test_control_without_kv_heads_replicated_gqa_pairs_wrong_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the refusal matters: with the check off, kvxfer believes replicated=True and rank 0 gets rank 1's heads."""
    import kvxfer.geometry._discover as discover
    monkeypatch.setattr(discover, "replicated_heads", lambda *a: None)
    got = _wrong_heads_read({"replicated": True, "tp_rank": 0}, [{"replicated": True, "tp_rank": 1}])
    X = logical(L, B, T, H, D)
    assert (got == X[0, 0][RB][:, :, H // 2:]).all()  # rank 1's heads 4..8 in rank 0's blocks


def test_tp_size_without_tp_rank_is_refused() -> None:
    rank = gqa_rank(list(range(L)), B, T, heads_of(1, 2, H), D, "HND")
    with kvxfer.Agent("a") as a:
        with pytest.raises(SpecError, match=r"tp_size=2 needs tp_rank="):
            a.register(rank.tensors(), tp_size=2, kv_heads=H)
        assert a.spec is None
        with pytest.raises(SpecError, match=r"tp_rank must be an integer from 0 to 1"):
            a.register(rank.tensors(), tp_size=2, tp_rank=2, kv_heads=H)
        assert a.register(rank.tensors(), tp_size=2, tp_rank=1, kv_heads=H).members[0].shard.heads == (4, 8)


def test_control_tp_rank_defaulting_to_zero_pairs_wrong_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old default: rank 1 registered without tp_rank claims rank 0's heads, and rank 0 reads them."""
    import kvxfer.geometry._discover as discover
    real = discover.check_tp
    monkeypatch.setattr(discover, "check_tp", lambda r, s: real(0 if r is None else r, s))
    got = _wrong_heads_read({"tp_rank": 0, "kv_heads": H}, [{"kv_heads": H}])
    X = logical(L, B, T, H, D)
    assert (got == X[0, 0][RB][:, :, H // 2:]).all()


def test_control_replicated_true_is_accepted_where_it_is_true() -> None:
    full = gqa_rank(list(range(L)), B, T, (0, H), D, "HND")  # every head on this rank (TP 1, or MQA-like)
    with kvxfer.Agent("a") as a:
        a.register(full.tensors(), replicated=True, kv_heads=H)
    rng = np.random.default_rng(5)
    X = rng.integers(-30000, 30000, size=(L, B, T, 16), dtype=np.int16)
    with kvxfer.Agent("p") as p, kvxfer.Agent("d") as d:  # MLA latent pages: identical on every rank
        p.register(mla_rank(L, B, T, 16, X), replicated=True, tp_rank=1, tp_size=2, kv_heads=H)
        views = mla_rank(L, B, T, 16)
        d.register(views, replicated=True, tp_rank=0, tp_size=2, kv_heads=H)
        d.add_peer(p.metadata())
        d.read("p", LB, RB).wait(10)
        for l in range(L):
            assert (views[f"layer.{l}"][LB] == X[l][RB]).all()
            assert untouched(views[f"layer.{l}"], LB)


def test_hidden_heads_pair_only_the_same_tp_rank() -> None:
    """Heads flattened into the channel axis ([blocks, tokens, heads*dim]) cannot be named: such
    pages pair only with the same TP rank and size (docs/geometry.md), never another rank's."""
    rng = np.random.default_rng(9)
    src = [rng.integers(0, 255, size=(B, T, H // 2 * D), dtype=np.uint8) for _ in range(2)]
    dst = np.full((B, T, H // 2 * D), 0xAA, np.uint8)
    with kvxfer.Agent("r0") as r0, kvxfer.Agent("r1") as r1, kvxfer.Agent("d") as d:
        r0.register({"l0": src[0]}, tp_rank=0, tp_size=2)
        r1.register({"l0": src[1]}, tp_rank=1, tp_size=2)
        d.register({"l0": dst}, tp_rank=0, tp_size=2)
        with pytest.raises(HeadSliceMismatchError):
            d.add_peer(r1.metadata())
        d.add_peer(r0.metadata())  # control: the same rank pairs and moves its own bytes
        d.read("r0", LB, RB).wait(10)
        assert (dst[LB] == src[0][RB]).all() and untouched(dst, LB)
