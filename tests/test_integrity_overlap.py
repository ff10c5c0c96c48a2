"""A verified READ checked while it moves (kvxfer.integrity.overlap): rows hashed as the
backend copies them (``Folded``), or parts hashed on a worker as they land (``Overlapped``).

Each test moves real bytes between two agents of one process: the source holds a seeded
pattern, the destination the 0xAA sentinel; the delivered blocks are compared with numpy
indexing over the logical arrays, and the blocks not read must still hold the sentinel.
For parts, ``PART_BYTES`` is set so a request of a few small blocks is posted in four.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import IntegrityError
from kvxfer.integrity import overlap
from kvxfer.integrity.verified import PairingCheck
from kvxfer.plugin import copies
from kvxfer._harness import faults

from common import has_nixl

pytest.importorskip("xxhash")

NB, L, PAGE = 16, 3, 1024
LB, RB = np.array([9, 2, 14, 5, 0, 11, 7, 3]), np.array([3, 4, 11, 0, 15, 6, 1, 8])
BACKENDS = ["loopback", pytest.param("nixl", marks=[pytest.mark.nixl,
                                                    pytest.mark.skipif(not has_nixl(), reason="nixl not installed")])]


class Pair:
    """A source holding ``X`` (packed rows) and a destination of sentinels, over ``backend``."""

    def __init__(self, backend: str, corruption: faults.Corruption | None = None,
                 fault: faults.Faults | None = None) -> None:
        self.X = np.random.default_rng(5).integers(0, 256, (L, NB, PAGE), dtype=np.uint8)
        self.src = np.ascontiguousarray(self.X.transpose(1, 0, 2).reshape(NB, L * PAGE))
        self.dst = np.full((NB, L * PAGE), 0xAA, np.uint8)
        wrap: dict[str, Any] = {"backend": backend}
        extra: dict[str, Any] = {}
        if corruption is not None:
            wrap, extra = {"backend": "corrupting", "inner": backend}, {"corruption": corruption}
        elif fault is not None:
            wrap, extra = {"backend": "faulty", "inner": backend}, {"faults": fault}
        self.p = kvxfer.Agent("prefill", **wrap)
        self.d = kvxfer.Agent("decode", **wrap, **extra)
        self.p.register({f"layer.{i}": self.src[:, i * PAGE:(i + 1) * PAGE] for i in range(L)})
        self.d.register({f"layer.{i}": self.dst[:, i * PAGE:(i + 1) * PAGE] for i in range(L)})
        self.d.add_peer(self.p.metadata())

    def delivered(self) -> bool:
        got = self.dst.reshape(NB, L, PAGE).transpose(1, 0, 2)
        untouched = np.setdiff1d(np.arange(NB), LB)
        return bool((got[:, LB] == self.X[:, RB]).all()) and bool((self.dst[untouched] == 0xAA).all())

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture
def folded() -> Iterator[Any]:
    made: list[Pair] = []
    faults.install()

    def make(backend: str, corruption: faults.Corruption | None = None, fault: faults.Faults | None = None) -> Pair:
        made.append(Pair(backend, corruption, fault))
        return made[-1]

    try:
        yield make
    finally:
        for p in made:
            p.close()
        faults.uninstall()


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch, folded: Any) -> Any:
    monkeypatch.setattr(overlap, "PART_BYTES", 2 * L * PAGE)  # 8 blocks of 3 KiB: 4 parts
    monkeypatch.setattr(copies, "reports", lambda backend: False)  # parts also where the backend folds
    return folded


def test_a_backend_seen_folding_gets_its_verified_reads_whole(folded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loopback folds row checks into its copies: once seen doing so, no more parts for it."""
    monkeypatch.setattr(overlap, "PART_BYTES", 2 * L * PAGE)
    monkeypatch.setattr(copies, "_REPORTERS", set())
    p = folded("loopback")
    for whole in (False, True):
        p.dst[...] = 0xAA
        t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True))
        assert (t._parts is None) is whole and copies.reports(p.d.backend)
        assert whole or t._parts.parts == 2  # part 0 folded in the copy: the rest went out as one
        t.wait(30)
        assert t.status is kvxfer.Status.DONE and p.delivered()


def test_loopback_hashes_each_row_as_it_copies_it(folded: Any) -> None:
    p = folded("loopback")
    t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True))
    assert isinstance(t._verify, overlap.Folded) and t._verify.seen.all()  # every row hashed in the copy
    t.wait(30)
    assert t.status is kvxfer.Status.DONE and p.delivered()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("parts", [False, True])
def test_a_source_row_unlike_its_digest_fails_typed_with_rows_folded(folded: Any, monkeypatch: pytest.MonkeyPatch,
                                                                     backend: str, parts: bool) -> None:
    """Row digests checked in the copy (loopback), or part by part on the worker (NIXL, parts)."""
    if parts:
        monkeypatch.setattr(overlap, "PART_BYTES", 2 * L * PAGE)  # 8 blocks of 3 KiB: 4 parts
        monkeypatch.setattr(copies, "reports", lambda backend: False)
    p = folded(backend)
    expect = p.p.digest(RB, rows=True)
    p.src[RB[5], 100] ^= 0x10  # the source changed after it was digested: block LB[5] arrives unlike it
    p.X[:, RB[5]] = p.src[RB[5]].reshape(L, PAGE)
    with pytest.raises(IntegrityError) as e:
        p.d.read("prefill", LB, RB, expect=expect).wait(30)
    assert e.value.block == LB[5]
    # Control: the folded checks switched off report DONE over a row unlike the source's digest.
    monkeypatch.setattr(overlap.Folded, "__call__", lambda self: None)
    monkeypatch.setattr(overlap.Folded, "part", lambda self, a, b: lambda: None)
    p.dst[...] = 0xAA
    t = p.d.read("prefill", LB, RB, expect=expect).wait(30)
    assert t.status is kvxfer.Status.DONE and p.delivered()  # delivered what the source holds now


def test_damage_after_the_inner_copy_is_caught_only_the_posted_backend_folds(folded: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper that changes bytes after its inner backend's copy: the inner copy must not fold."""
    c = faults.Corruption("flip", seed=4, page=PAGE)
    p = folded("loopback", c)
    with pytest.raises(IntegrityError):
        p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True)).wait(30)
    # Control: told regardless of which backend copies, the inner loopback hashes before the damage.
    monkeypatch.setattr(copies, "watcher", lambda backend: (copies._WATCH.get() or (None, None))[1])
    p.dst[...] = 0xAA
    t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True)).wait(30)
    assert c.done == 2 and t.status is kvxfer.Status.DONE and not p.delivered()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_verified_read_in_parts_moves_exactly_the_blocks(pair: Any, backend: str) -> None:
    p = pair(backend)
    for rows in (False, True):
        p.dst[...] = 0xAA
        t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=rows))
        # Loopback hashes row digests in its copy: the parts after the first go out as one.
        parts = 2 if (backend, rows) == ("loopback", True) else 4
        assert t._parts is not None and t._parts.parts == parts
        t.wait(30)
        assert t.status is kvxfer.Status.DONE and p.delivered()
        assert sorted({q.part for q in t._posts}) == list(range(parts))  # each part posted, in turn


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_damaged_part_fails_typed_and_is_never_done(pair: Any, backend: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    c = faults.Corruption("flip", seed=3, page=PAGE, every=3)  # the third post: one part of four
    p = pair(backend, c)
    with pytest.raises(IntegrityError) as e:
        p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True)).wait(30)
    assert c.done == 1 and e.value.block in LB[4:6].tolist()  # part 2 holds positions 4 and 5
    # Control: the same damage with the parts' check switched off is reported DONE, bytes wrong.
    monkeypatch.setattr(overlap.Overlapped, "__call__", lambda self: None)
    c.seen = 0
    p.dst[...] = 0xAA
    t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True)).wait(30)
    assert c.done == 2 and t.status is kvxfer.Status.DONE and not p.delivered()


@pytest.mark.parametrize("rows", [False, True])
def test_a_cancelled_read_returns_only_after_its_running_check(pair: Any, monkeypatch: pytest.MonkeyPatch,
                                                               rows: bool) -> None:
    """No worker still reads the destination once cancel() returned (the caller may free it)."""
    started, go, finished = threading.Event(), threading.Event(), []
    cls = overlap.Folded if rows else PairingCheck  # whose part check the worker runs
    real = cls.part

    def slow(self: Any, a: int, b: int) -> Any:
        check = real(self, a, b)

        def run() -> None:
            started.set()
            go.wait(30)
            check()
            finished.append((a, b))
        return run

    monkeypatch.setattr(cls, "part", slow)
    p = pair("loopback")

    def cancel_in_thread(settle: bool) -> list[Any]:
        started.clear()
        go.clear()
        finished.clear()
        t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=rows))  # loopback: every part landed
        assert started.wait(30)  # the first part's check runs on the worker, held
        seen: list[Any] = []
        c = threading.Thread(target=lambda: (t.cancel(), seen.append(list(finished))))
        c.start()
        c.join(0.5 if settle else 30)
        ended_early = not c.is_alive()
        go.set()
        c.join(30)
        assert t.status is kvxfer.Status.CANCELLED
        return [ended_early, seen[0]]

    ended_early, seen = cancel_in_thread(True)
    assert not ended_early and seen == [(0, 2)], seen  # cancel() waited for the running check, dropped the rest
    # Control: without the settle, cancel() returns while the check still reads the destination.
    monkeypatch.setattr(overlap.Overlapped, "settle", lambda self: None)
    ended_early, seen = cancel_in_thread(False)
    assert ended_early and seen == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_parts_go_out_one_after_another_and_none_after_the_end(pair: Any, backend: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """At most WINDOW parts are out before part 0 landed; a read that timed out posts no later
    part, even if part 0's landing is reported after the end."""
    f = faults.Faults(hang_posts=True)  # part 0 never completes
    first = list(range(overlap.WINDOW))
    p = pair(backend, fault=f)

    def timed_out() -> Any:
        p.dst[...] = 0xAA
        f.hang_posts = True
        t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True))
        assert t._parts.parts == 4 and [q.part for q in t._posts] == first  # the first WINDOW parts
        with pytest.raises(kvxfer.TransferTimeoutError):
            t.wait(0.2)
        f.hang_posts = False  # the transport works again: a later post would now move bytes
        t._parts.landed(0)  # part 0's landing, reported late
        return t

    t = timed_out()
    assert t.status is kvxfer.Status.FAILED and [q.part for q in t._posts] == first
    assert (p.dst == 0xAA).all()  # nothing landed after the end
    # Control: an end that does not stop the sequence lets the late landing post the next parts,
    # whose bytes land after the end.
    monkeypatch.setattr(overlap.Overlapped, "settle", lambda self: None)
    t = timed_out()
    late = [q for q in t._posts if q.part >= overlap.WINDOW]
    assert late
    for q in late:  # let them finish (NIXL completes in its progress)
        for _ in range(100_000):
            if p.d.backend.poll(q.handle):
                break
    got = p.dst.reshape(NB, L, PAGE).transpose(1, 0, 2)
    a, b = t._parts._bounds[overlap.WINDOW]
    assert (got[:, LB[a:b]] == p.X[:, RB[a:b]]).all() and (p.dst[LB[:a]] == 0xAA).all()


@pytest.mark.nixl
@pytest.mark.skipif(not has_nixl(), reason="nixl not installed")
@pytest.mark.parametrize("shape", ["rows", "layers"])
def test_parts_cut_from_the_request_plan_move_exactly_their_blocks(pair: Any, monkeypatch: pytest.MonkeyPatch,
                                                                   shape: str) -> None:
    """Each part's posts are cut from the whole request's plan (planned once), whole rows or
    one region per layer; a cut of the wrong positions is caught by the parts' check."""
    from kvxfer import _posting

    p = pair("nixl")
    if shape == "layers":  # re-register both sides as one array per layer
        p.d.close()
        p.p.close()
        src = [np.ascontiguousarray(p.X[i]) for i in range(L)]
        dst = [np.full((NB, PAGE), 0xAA, np.uint8) for _ in range(L)]
        p.p, p.d = kvxfer.Agent("prefill", backend="nixl"), kvxfer.Agent("decode", backend="nixl")
        p.p.register({f"layer.{i}": s for i, s in enumerate(src)})
        p.d.register({f"layer.{i}": s for i, s in enumerate(dst)})
        p.d.add_peer(p.p.metadata())
        got = lambda: np.stack(dst)  # noqa: E731
    else:
        got = lambda: p.dst.reshape(NB, L, PAGE).transpose(1, 0, 2)  # noqa: E731
    planned: list[int] = []
    real_plan = type(p.d)._plan
    monkeypatch.setattr(type(p.d), "_plan", lambda self, *a: planned.append(1) or real_plan(self, *a))
    untouched = np.setdiff1d(np.arange(NB), LB)
    t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True))
    assert t._parts.parts == 4 and len(planned) == 1  # the request planned once, not once per part
    t.wait(30)
    g = got()
    assert t.status is kvxfer.Status.DONE and (g[:, LB] == p.X[:, RB]).all() and (g[:, untouched] == 0xAA).all()
    # Control: a cut one position late leaves each part's first block unmoved; the check fails it.
    real = _posting._slicer

    def late(*a: Any) -> Any:
        cut = real(*a)
        return lambda a, b, out: cut(a + 1, min(b + 1, len(LB)), out)

    monkeypatch.setattr(_posting, "_slicer", late)
    for arr in ([p.dst] if shape == "rows" else dst):
        arr[...] = 0xAA
    with pytest.raises(IntegrityError):
        p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True)).wait(30)
    assert (got()[:, LB[0]] == 0xAA).all()  # position 0 was never posted


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_the_caller_hashed_are_compared_after_done(pair: Any, backend: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts' row hashes compare nothing themselves: one comparison of every row runs after
    DONE (``Folded.__call__``), also over the rows the caller took from the worker. Here the
    worker is held, so the caller hashes every part, and the damaged one is the last."""
    c = faults.Corruption("flip", seed=3, page=PAGE, every=4)  # the fourth post: part [6, 8)
    p = pair(backend, c)
    hold = threading.Event()
    overlap._worker().submit(hold.wait, 30)  # every part's check queues behind this: the caller runs them
    try:
        t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True))
        assert t._parts._bounds == [(0, 2), (2, 4), (4, 6), (6, 8)]
        with pytest.raises(IntegrityError) as e:
            t.wait(30)
        assert c.done == 1 and e.value.block in LB[6:8].tolist()
        # Control: the comparison after DONE switched off, the same damage is reported DONE.
        monkeypatch.setattr(overlap.Folded, "__call__", lambda self: None)
        c.seen = 0
        p.dst[...] = 0xAA
        t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True)).wait(30)
        assert c.done == 2 and t.status is kvxfer.Status.DONE and not p.delivered()
    finally:
        hold.set()


@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged-last-part"])
def test_the_caller_hashes_parts_the_worker_has_not_reached_once_each(pair: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      damaged: bool) -> None:
    """The worker is held busy for the whole READ (its wake-up slower than the caller): the
    caller joins every queued part's rows at DONE. Each row is hashed exactly once, the worker's
    late tasks find nothing left, and a row damaged in the last part still fails typed. The
    intact case is the control of the damaged one (same timing, no error)."""
    if not has_nixl():
        pytest.skip("nixl not installed")  # NIXL folds no row in its copy: every row goes through Rows
    c = faults.Corruption("flip", seed=3, page=PAGE, every=4) if damaged else None  # the fourth post: the last part
    p = pair("nixl", c)
    hashed: list[int] = []
    real = overlap._xxh3()
    monkeypatch.setattr(overlap, "_xxh3", lambda: lambda b: (hashed.append(len(b)), real(b))[1])
    gate = threading.Event()
    overlap._worker().submit(gate.wait, 30)  # the one worker thread, busy until the READ is checked
    try:
        t = p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=True))
        assert t._parts is not None and t._parts.parts == 4
        if damaged:
            with pytest.raises(IntegrityError) as e:
                t.wait(30)
            assert e.value.block in LB[6:8].tolist()  # part 3 holds positions 6 and 7
        else:
            t.wait(30)
            assert t.status is kvxfer.Status.DONE and p.delivered()
    finally:
        gate.set()
    overlap._worker().submit(lambda: None).result(30)  # the queued tasks ran (or were cancelled)
    assert len(hashed) == LB.shape[0] and set(hashed) == {L * PAGE}  # every row once, none twice
