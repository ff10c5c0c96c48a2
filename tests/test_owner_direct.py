"""The caller's turn (kvxfer/_direct.py): while an Owner's loop sleeps, a submitter posts a small
READ itself and a waiter polls it. What must still hold: the right bytes, a cancel in flight,
a stopped peer holding nobody else, two submitters each served in order, a close racing a
submit. Every transfer moves real bytes (loopback, runs not merged so the agent's hot path
serves them) checked against numpy indexing (``expected_after``); a transfer that must stay
in flight has its completion held (its bytes already moved), as a slow transport would. Each
safety case has its control: the same steps with the rule undone show the bad outcome.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from kvxfer import Agent, Owner, Status, _direct
from kvxfer.errors import AgentClosedError, KvxferError, TransferCancelledError, TransferTimeoutError
from kvxfer.testing import expected_after, make_cache

pytestmark = pytest.mark.timeout(120)
GEOM = {"num_layers": 2, "page": 128}


class _Hold:
    """Holds completion of the transfers posted while ``on`` is set; records who posted/released."""

    def __init__(self, agent: Agent) -> None:
        self.on, self.polls = False, 0
        self.held: set[int] = set()
        self.posters: list[str] = []
        self.releasers: list[str] = []
        be = agent.backend
        post, poll, release = be.post, be.poll, be.release

        def _post(*a: Any) -> Any:
            x = post(*a)
            self.posters.append(threading.current_thread().name)
            if self.on:
                self.held.add(id(x))
            return x

        def _release(x: Any) -> None:
            self.releasers.append(threading.current_thread().name)
            release(x)

        be.post = _post  # type: ignore[method-assign]
        def _poll(x: Any) -> bool:
            if id(x) in self.held:
                self.polls += 1
                return False
            return bool(poll(x))

        be.poll = _poll  # type: ignore[method-assign]
        be.release = _release  # type: ignore[method-assign]


def _peer(name: str, seed: int) -> tuple[Agent, Any]:
    src = make_cache("packed", num_blocks=32, seed=seed, **GEOM)
    a = Agent(name, backend="loopback", timeout=60.0)
    a.register(src.views, replicated=True)
    return a, src


@pytest.fixture
def two() -> Iterator[tuple[Owner, dict[str, Any], Any, _Hold]]:
    """An owner over a decode agent (runs not merged: the hot path) and two prefill peers."""
    dst = make_cache("packed", num_blocks=64, **GEOM)
    b = Agent("decode", backend="loopback", timeout=60.0, coalesce=False)
    b.register(dst.views, replicated=True)
    peers = {"p1": _peer("p1", 3), "p2": _peer("p2", 5)}
    owner = Owner(b)
    for a, _ in peers.values():
        owner.add_peer(a.metadata()).result(10)
    hold = _Hold(b)
    try:
        for p in peers:  # the first READ of a shape plans on the loop; later ones take the hot path
            owner.read(p, [63], [0]).wait(10)
        yield owner, {p: src for p, (_, src) in peers.items()}, dst, hold
    finally:
        owner.close()
        for a, _ in peers.values():
            a.close()


def _check(dst: Any, before: np.ndarray, src: Any, d: list[int], s: list[int]) -> None:
    np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src.layer_pages(), d, s))


def _reads(owner: Owner, hold: _Hold, dst: Any, src: Any, n: int = 6) -> list[str]:
    before = dst.layer_pages()
    start = len(hold.posters)
    for i in range(n):
        assert owner.read("p1", [i], [2 * i + 1]).wait(10).status is Status.DONE
    _check(dst, before, src["p1"], list(range(n)), [2 * i + 1 for i in range(n)])
    return hold.posters[start:]


def test_small_reads_are_posted_by_the_caller_with_the_right_bytes(two: Any) -> None:
    owner, src, dst, hold = two
    posters = _reads(owner, hold, dst, src)
    me = threading.current_thread().name
    assert posters == [me] * 6 and owner.pending == 0


def test_control_without_the_callers_turn_the_owner_posts(two: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, src, dst, hold = two
    monkeypatch.setattr(_direct, "post", lambda *a: False)
    posters = _reads(owner, hold, dst, src)
    assert all(p.startswith("kvxfer-owner") for p in posters) and owner.pending == 0


def test_cancel_in_flight_while_a_waiter_polls(two: Any) -> None:
    owner, src, dst, hold = two
    hold.on = True
    t = owner.read("p1", [5], [9])
    hold.on = False
    assert t.posted and hold.posters[-1] == threading.current_thread().name  # the caller's turn
    out: list[BaseException] = []

    def waiter() -> None:
        try:
            t.wait(30)
        except BaseException as exc:
            out.append(exc)

    w = threading.Thread(target=waiter, name="waiter")
    w.start()
    released = len(hold.releasers)
    t.cancel()
    w.join(30)
    assert t.status is Status.CANCELLED and len(out) == 1 and isinstance(out[0], TransferCancelledError)
    assert hold.releasers[released:] and all(n.startswith("kvxfer-owner") for n in hold.releasers[released:])
    hold.held.clear()  # the transport "completes" now: a cancelled handle stays cancelled
    assert t.status is Status.CANCELLED and owner.pending == 0
    # Control: the same transfer, not cancelled, ends DONE (the waiter's own polls) with its bytes.
    before = dst.layer_pages()
    hold.on = True
    u = owner.read("p1", [6], [10])
    hold.on = False
    w = threading.Thread(target=lambda: out.append(u.wait(30)), name="waiter2")  # type: ignore[func-returns-value]
    w.start()
    hold.held.clear()
    w.join(30)
    assert u.status is Status.DONE and owner.pending == 0
    _check(dst, before, src["p1"], [6], [10])


def _hog(owner: Any, t: Any, until: float | None, once: bool = False) -> None:
    """The mutant: "a lock around the agent": a waiter holds the engine while its transfer is out."""
    if once:
        return
    with owner._engine:
        while not t._ended:
            ended, err = _direct.poll_one(t, time.monotonic())
            if ended:
                t._ended = True
                owner._inflight.pop(t, None)
                owner._settle(t, err)
                return


def _stopped(two: Any, monkeypatch: pytest.MonkeyPatch, mutant: Callable[..., None] | None) -> tuple[bool, Any]:
    owner, src, dst, hold = two
    if mutant is not None:
        monkeypatch.setattr(_direct, "drive", mutant)
    hold.on = True
    stuck = owner.read("p2", [40], [1], timeout=1.0)  # p2 stopped: its READ never completes
    hold.on = False
    waiter = threading.Thread(target=lambda: pytest.raises(TransferTimeoutError, stuck.wait), name="stuck-waiter")
    waiter.start()
    polls = hold.polls
    while not stuck._ended and hold.polls < polls + 20:
        threading.Event().wait(0.001)  # until the waiter polls it (the mutant: holding the engine)
    before = dst.layer_pages()
    fast = owner.read("p1", [7, 8], [3, 4])
    for _ in range(1500):  # done() looks without waiting; a wait that timed out would cancel it
        if fast.done():
            break
        threading.Event().wait(0.001)
    fast_first = fast._event.is_set() and not stuck._ended
    waiter.join(30)
    assert fast.wait(30).status is Status.DONE
    _check(dst, before, src["p1"], [7, 8], [3, 4])
    return fast_first, stuck


def test_a_stopped_peer_a_waiter_polls_holds_nobody_else(two: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fast_first, stuck = _stopped(two, monkeypatch, None)
    assert fast_first  # p1's READ finished while p2's waiter still polled
    assert isinstance(stuck.error, TransferTimeoutError)  # p2's ended at its own deadline


def test_control_a_waiter_holding_the_engine_stalls_everyone(two: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fast_first, stuck = _stopped(two, monkeypatch, _hog)
    assert not fast_first and isinstance(stuck.error, TransferTimeoutError)


def test_two_submitters_each_served_in_order(two: Any) -> None:
    owner, src, dst, hold = two
    before = dst.layer_pages()
    jobs = {"p1": [(i, (5 * i) % 32) for i in range(0, 24)], "p2": [(24 + i, (3 * i) % 32) for i in range(24)]}
    posted: list[int] = []  # the local list's index of each post, in posting order
    be = owner.agent.backend
    post = be.post

    def record(op: Any, lp: Any, li: Any, rp: Any, ri: Any, n: Any) -> Any:
        x = post(op, lp, li, rp, ri, n)
        posted.append(int(np.asarray(li).reshape(-1)[0]))
        return x

    be.post = record  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def submitter(peer: str) -> None:
        try:
            hs = [owner.read(peer, [d], [s]) for d, s in jobs[peer][:12]]  # a burst, then one by one
            for d, s in jobs[peer][12:]:
                hs.append(owner.read(peer, [d], [s]))
                hs[-1].wait(30)
            for h in hs:
                assert h.wait(30).status is Status.DONE
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(p,)) for p in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors and owner.pending == 0
    # Each peer's READs were posted in the order they were submitted (their ids ascend).
    base = min(posted)  # the index of block 0
    mine = {p: [i - base for i in posted if i - base in {d for d, _ in js}] for p, js in jobs.items()}
    assert len(posted) == 48 and all(mine[p] == [d for d, _ in js] for p, js in jobs.items())
    want = before
    for p, js in jobs.items():
        want = expected_after(want, src[p].layer_pages(), [d for d, _ in js], [s for _, s in js])
    np.testing.assert_array_equal(dst.layer_pages(), want)


def _close_racing(two: Any, monkeypatch: pytest.MonkeyPatch, control: bool) -> tuple[Any, Any]:
    """A submitter is about to take its turn when another thread closes the owner: the turn is
    refused (the loop has ended), and the submission must not be queued where nobody looks."""
    owner, src, dst, hold = two
    real = _direct.post

    def racing(o: Any, t: Any, route: Any) -> bool:
        threading.Thread(target=o.close, name="closer").start()
        o._thread.join(30)  # the loop has ended: the engine stays held
        return real(o, t, route)

    monkeypatch.setattr(_direct, "post", racing)
    if control:  # the mutant: the late queueing without its check for a close
        def late(o: Owner, t: Any, route: Any) -> None:
            with o._lock:
                o._inbox.append(("transfer", t))

        monkeypatch.setattr(_direct, "queue_late", late)
    try:
        h = owner.read("p1", [9], [9])
    except AgentClosedError as exc:
        return exc, None
    return None, h


def test_a_close_racing_a_submit_ends_it_typed(two: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, src, dst, hold = two
    before = dst.layer_pages()
    raised, h = _close_racing(two, monkeypatch, control=False)
    assert isinstance(raised, AgentClosedError) and h is None and owner.pending == 0
    np.testing.assert_array_equal(dst.layer_pages(), before)  # nothing was posted
    with pytest.raises(AgentClosedError):
        owner.read("p1", [9], [9])


def test_control_a_late_queue_without_the_check_leaves_a_handle_pending(two: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    owner, src, dst, hold = two
    raised, h = _close_racing(two, monkeypatch, control=True)
    assert raised is None and h is not None
    with pytest.raises(KvxferError):
        h.wait(0.3)
    assert h.status is Status.PENDING and owner.pending == 1  # queued where no loop will ever look


def _callback_thread(two: Any, monkeypatch: pytest.MonkeyPatch, mutant: Callable[..., None] | None) -> str:
    owner, src, dst, hold = two
    if mutant is not None:
        monkeypatch.setattr(_direct, "drive", mutant)
    before = dst.layer_pages()
    hold.on = True
    t = owner.read("p1", [11], [12])  # posted by this thread (the caller's turn), held in flight
    hold.on = False
    seen: list[str] = []
    t.add_done_callback(lambda h: seen.append(threading.current_thread().name))
    hold.held.clear()
    assert t.wait(30).status is Status.DONE
    _check(dst, before, src["p1"], [11], [12])
    return seen[0]


def test_done_callbacks_of_a_callers_post_run_on_the_owner(two: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _callback_thread(two, monkeypatch, None).startswith("kvxfer-owner")


def test_control_a_waiter_that_finishes_it_runs_the_callback_itself(two: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert _callback_thread(two, monkeypatch, _hog) == threading.current_thread().name
