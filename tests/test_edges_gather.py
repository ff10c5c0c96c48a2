"""read_many at the edges: its lists die with their peers, and its stats say where time went.

Real bytes move through the loopback backend (several prefill agents in one process); the
decode cache is checked against numpy indexing over the logical arrays, and blocks not named
keep the sentinel.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import numpy as np
import pytest

import kvxfer
from hetero_caches import agent, assert_gathered, gqa_rank, logical, untouched
from kvxfer.pairing import heads_of

LB = np.array([5, 0, 3])
RB = np.array([2, 7, 4])


def _kept(a: kvxfer.Agent) -> int:
    """Prepared lists the agent holds: agent-wide plus per peer."""
    return len(a._local_prepared) + sum(len(p.prepared) for p in a.peers.values())


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _prefill(layers: int, blocks: int, heads: int, tp: int, X: np.ndarray) -> list[kvxfer.Agent]:
    ranks = [gqa_rank(list(range(layers)), blocks, 1, heads_of(p, tp, heads), 2, "HND", X) for p in range(tp)]
    return [agent(f"p{p}", ranks[p].tensors(), tp_rank=p, tp_size=tp, kv_heads=heads) for p in range(tp)]


def _restart_rounds(layers: int, blocks: int, rounds: int) -> tuple[list[int], list[int], int]:
    """A TP1 decode gathers from 4 TP4 prefill ranks, which restart ``rounds`` times."""
    heads, tp = 4, 4
    X = logical(layers, blocks, 1, heads, 2)
    dec = gqa_rank(list(range(layers)), blocks, 1, (0, heads), 2, "HND")
    kept, rss, listed = [], [], 0
    with agent("d", dec.tensors(), tp_rank=0, tp_size=1, kv_heads=heads) as da:
        for r in range(rounds):
            pa = _prefill(layers, blocks, heads, tp, X)
            try:
                for p in pa:
                    da.add_source(p.metadata())  # a new generation: the old peer is dropped
                for l in range(layers):  # the sentinel again, so each round proves its own bytes
                    for kv in (0, 1):
                        dec.views[(l, kv)].view(np.uint8)[...] = 0xAA
                g = da.read_many(LB, {p.name: RB for p in pa}).wait(10)
                assert sorted(g.parts) == [f"p{p}" for p in range(tp)]
                for l in range(layers):
                    for kv in (0, 1):
                        got = dec.views[(l, kv)]
                        assert (got[LB] == X[l, kv][RB]).all()
                        assert untouched(got, LB)
                listed = listed or (sum(h.descs.nbytes for p in da.peers.values() for h in p.prepared.values())
                            + sum(h.descs.nbytes for h in da._local_prepared.values()))
            finally:
                for p in pa:
                    p.close()
            gc.collect()
            kept.append(_kept(da))
            rss.append(_rss())
    return kept, rss, listed


def test_gather_lists_are_released_with_their_peers_across_restarts() -> None:
    kept, _, _ = _restart_rounds(layers=2, blocks=8, rounds=4)
    assert kept[0] > 0, "control: the gather prepared lists, so a leak would show"
    assert kept == [kept[0]] * 4, f"prepared lists kept per restart: {kept}"


def test_gather_restarts_keep_rss_flat() -> None:
    kept, rss, listed = _restart_rounds(layers=32, blocks=4096, rounds=5)
    # Control: one round's lists are large enough that keeping them would show in RSS.
    assert listed > 8 << 20, listed
    growth = rss[-1] - rss[1]  # after the first round has warmed allocators and caches
    assert growth < listed, f"RSS grew {growth} bytes over {len(rss) - 2} restarts (one round's lists: {listed})"
    assert kept == [kept[0]] * 5, f"prepared lists kept per restart: {kept}"


def test_removing_a_gather_peer_releases_both_sides_of_its_lists() -> None:
    heads, tp = 4, 4
    X = logical(2, 8, 1, heads, 2)
    dec = gqa_rank([0, 1], 8, 1, (0, heads), 2, "HND")
    pa = _prefill(2, 8, heads, tp, X)
    try:
        with agent("d", dec.tensors(), kv_heads=heads) as da:
            released: list[Any] = []
            real = da.backend.release_prepared
            da.backend.release_prepared = lambda h: (released.append(h), real(h))  # type: ignore[method-assign]
            for p in pa:
                da.add_source(p.metadata())
            da.read_many(LB, {p.name: RB for p in pa}).wait(10)
            held = {id(h) for h in da.peers["p0"].prepared.values()}
            assert any(h.owner is da.backend for h in da.peers["p0"].prepared.values()), \
                "the local side of p0's gather lists belongs to p0"
            da.remove_peer("p0")
            assert held <= {id(h) for h in released}
            assert not da._local_prepared, "no gather list is kept agent-wide"
    finally:
        for p in pa:
            p.close()


# -- stats ----------------------------------------------------------------------------------
class _Clock:
    """perf_counter that jumps ``step`` seconds at every backend post, so posting is visible."""

    def __init__(self, step: float) -> None:
        self.step, self.offset, self.real = step, 0.0, time.perf_counter

    def __call__(self) -> float:
        return self.real() + self.offset


def _steps(seconds: float, step: float = 1000.0) -> int:
    """Whole steps of :class:`_Clock` in a duration (the real time in it is far below one step)."""
    return int(seconds // step)


def test_each_parts_plan_seconds_excludes_the_other_parts_posts(monkeypatch: pytest.MonkeyPatch) -> None:
    heads, tp, step = 8, 4, 1000.0
    X = logical(2, 8, 4, heads, 4)
    ranks = [gqa_rank([0, 1], 8, 4, heads_of(p, tp, heads), 4, "HND", X) for p in range(tp)]
    pa = [agent(f"p{p}", ranks[p].tensors(), tp_rank=p, tp_size=tp, kv_heads=heads) for p in range(tp)]
    dec = gqa_rank([0, 1], 8, 4, (0, heads), 4, "HND")
    try:
        with agent("d", dec.tensors(), kv_heads=heads) as da:
            for p in pa:
                da.add_source(p.metadata())
            clock = _Clock(step)
            real_post = da.backend.post

            def slow_post(*a: Any) -> Any:
                clock.offset += step  # every post "takes" step seconds
                return real_post(*a)

            da.backend.post = slow_post  # type: ignore[method-assign]
            monkeypatch.setattr(time, "perf_counter", clock)
            g = da.read_many(LB, {p.name: RB for p in pa}).wait(10)
            monkeypatch.undo()
            parts = [t.stats for t in g.parts.values()]
            assert len(parts) == tp
            st = g.stats
            assert st.wall_seconds is not None
            # Counted in steps of the fake clock (one per post), not in real time.
            planned, posted = [_steps(s.plan_seconds) for s in parts], [_steps(s.post_seconds) for s in parts]
            assert all(n >= s.posts for n, s in zip(posted, parts)), posted  # control: posting is seen
            assert planned == [0] * tp, planned  # no part is charged another part's posts
            assert _steps(st.plan_seconds) == 0 and _steps(st.post_seconds) >= sum(s.posts for s in parts), st
            assert _steps(st.wall_seconds) >= _steps(st.post_seconds + st.plan_seconds), st
            assert st.seconds is not None and st.nbytes == sum(s.nbytes for s in parts)
            assert_gathered(dec.views, X, 2, LB, RB)
    finally:
        for p in pa:
            p.close()
