"""kvxfer.Owner: submission from many threads, cross-thread cancel, close in flight, back-pressure,
fairness, refresh, asyncio. Every transfer moves real bytes (loopback) and is checked against
numpy indexing of the caches (``expected_after``). Where a transfer must stay in flight, the
backend's ``poll`` is held behind a gate (the bytes already moved; only completion waits), as
a slow transport would; each safety case has its control beside it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

import numpy as np
import pytest

from kvxfer import Agent, Owner, Status
from kvxfer.errors import (AgentClosedError, BackPressureError, KvxferError, PeerDisconnectedError,
                           TransferCancelledError, TransferTimeoutError)
from kvxfer.testing import expected_after, make_cache

pytestmark = pytest.mark.timeout(120)
GEOM = {"num_layers": 3, "page": 256}


def _pair(name: str = "prefill", seed: int = 11, dst_blocks: int = 64) -> tuple[Agent, Agent, Any, Any]:
    src = make_cache("packed", num_blocks=32, pad=16, seed=seed, **GEOM)
    dst = make_cache("layers", num_blocks=dst_blocks, **GEOM)
    a = Agent(name, backend="loopback", timeout=60.0)
    b = Agent("decode", backend="loopback", timeout=60.0)
    a.register(src.views, replicated=True)
    b.register(dst.views, replicated=True)
    return a, b, src, dst


class _Gate:
    """Holds the backend's completion (not its copy) until opened; records who released what."""

    def __init__(self, agent: Agent) -> None:
        self.open = threading.Event()
        self.release_threads: list[str] = []
        poll, release = agent.backend.poll, agent.backend.release
        agent.backend.poll = lambda x: self.open.is_set() and poll(x)  # type: ignore[method-assign]

        def rel(x: Any) -> None:
            self.release_threads.append(threading.current_thread().name)
            release(x)

        agent.backend.release = rel  # type: ignore[method-assign]


@pytest.fixture
def pair() -> Iterator[tuple[Agent, Owner, Any, Any]]:
    a, b, src, dst = _pair()
    owner = Owner(b, max_pending_per_peer=8, max_pending=12)
    owner.add_peer(a.metadata()).result()
    try:
        yield a, owner, src, dst
    finally:
        owner.close()
        a.close()


def test_many_threads_submit_and_every_byte_is_right(pair: tuple[Agent, Owner, Any, Any]) -> None:
    a, owner, src, dst = pair
    before, src_pages = dst.layer_pages(), src.layer_pages()
    rng = np.random.default_rng(3)
    jobs = {t: [(4 * t + i, int(rng.integers(0, 32))) for i in range(4)] for t in range(8)}  # dst ids disjoint
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for d, s in jobs[t]:
                while True:
                    try:
                        h = owner.read("prefill", [d], [s])
                        break
                    except BackPressureError:  # 8 threads against a bound of 8: wait a turn
                        threading.Event().wait(0.001)
                assert h.wait().status is Status.DONE
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    pairs = [p for t in jobs for p in jobs[t]]
    want = expected_after(before, src_pages, [d for d, _ in pairs], [s for _, s in pairs])
    np.testing.assert_array_equal(dst.layer_pages(), want)
    assert owner.pending == 0


def test_cancel_from_another_thread_runs_on_the_owner(pair: tuple[Agent, Owner, Any, Any]) -> None:
    a, owner, src, dst = pair
    gate = _Gate(owner.agent)
    t = owner.read("prefill", [1, 2], [3, 4]).wait_posted()
    assert t.status is Status.PENDING
    th = threading.Thread(target=t.cancel, name="canceller")
    th.start()
    th.join()
    assert t.status is Status.CANCELLED and isinstance(t.error, TransferCancelledError)
    with pytest.raises(TransferCancelledError):
        t.wait(1)
    assert gate.release_threads and all(n.startswith("kvxfer-owner") for n in gate.release_threads)
    # Control: the same transfer, not cancelled, ends DONE with its bytes once the gate opens.
    before, src_pages = dst.layer_pages(), src.layer_pages()
    u = owner.read("prefill", [5, 6], [7, 8])
    gate.open.set()
    assert u.wait().status is Status.DONE
    np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src_pages, [5, 6], [7, 8]))


def test_back_pressure_is_typed_and_per_peer(pair: tuple[Agent, Owner, Any, Any]) -> None:
    a, owner, src, dst = pair
    gate = _Gate(owner.agent)
    held = [owner.read("prefill", [i], [i]) for i in range(8)]
    with pytest.raises(BackPressureError) as e:
        owner.read("prefill", [9], [9])
    assert e.value.peer == "prefill" and e.value.limit == 8
    # Another peer has its own bound, up to the owner's total (12).
    a2, _, src2, _ = _pair("prefill2", seed=5)
    try:
        owner.add_peer(a2.metadata()).result()
        more = [owner.read("prefill2", [20 + i], [i]) for i in range(4)]
        with pytest.raises(BackPressureError) as e:
            owner.read("prefill2", [30], [0])
        assert e.value.peer is None and e.value.limit == 12
        gate.open.set()
        for h in held + more:
            h.wait()
        assert owner.pending == 0
        owner.read("prefill", [9], [9]).wait()  # admitted again once the others finished
    finally:
        a2.close()


def test_close_with_transfers_in_flight_ends_each_done_or_typed() -> None:
    a, b, src, dst = _pair()
    owner = Owner(b)
    stop = threading.Event()
    owner.add_peer(a.metadata()).result()
    owner.route("stuck", lambda: (stop.wait(30), a.metadata())[1])  # a fetch that does not answer
    gate = _Gate(b)
    flying = [owner.read("prefill", [i], [i]).wait_posted() for i in range(4)]
    queued = [owner.read("stuck", [10 + i], [i]) for i in range(3)]
    owner.close()
    stop.set()
    for h in flying + queued:
        assert h.status in (Status.DONE, Status.CANCELLED, Status.FAILED)
        with pytest.raises(KvxferError):
            h.wait(1)
    assert all(h.status is Status.CANCELLED for h in flying)
    assert all(isinstance(h.error, AgentClosedError) for h in queued)
    assert b.closed
    with pytest.raises(AgentClosedError):
        owner.read("prefill", [0], [0])
    assert gate.release_threads
    a.close()


def test_close_with_drain_lets_transfers_finish() -> None:
    """Control for the case above: given time, the same in-flight transfers end DONE, bytes right."""
    a, b, src, dst = _pair()
    owner = Owner(b)
    owner.add_peer(a.metadata()).result()
    gate = _Gate(b)
    before, src_pages = dst.layer_pages(), src.layer_pages()
    flying = [owner.read("prefill", [i], [i + 1]).wait_posted() for i in range(4)]
    threading.Timer(0.2, gate.open.set).start()
    owner.close(drain=60)
    assert all(h.status is Status.DONE for h in flying)
    np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src_pages, [0, 1, 2, 3], [1, 2, 3, 4]))
    a.close()


def _fairness(inline_fetch: bool) -> tuple[bool, Status, Any]:
    """A READ from a peer whose metadata fetch hangs, then one from a healthy peer: returns
    whether the healthy READ finished while the other's fetch still hung."""
    a, b, src, dst = _pair()
    owner = Owner(b)
    if inline_fetch:  # the mutant: a blocking fetch inside the shared loop
        def inline(route: Any) -> None:
            route.fetching = True
            md = route.fetch()
            owner._fetched(route, route.generation, md, None)

        owner._handshake = inline  # type: ignore[method-assign]
    released, returned = threading.Event(), threading.Event()

    def fetch() -> bytes:  # a stopped prefill: answers only once the test lets it
        released.wait(60)
        returned.set()
        return b""

    try:
        owner.add_peer(a.metadata()).result()
        owner.route("stopped-prefill", fetch)
        slow = owner.read("stopped-prefill", [20], [0], timeout=1.0)
        before, src_pages = dst.layer_pages(), src.layer_pages()
        fast = owner.read("prefill", [1, 2], [5, 6])
        if inline_fetch:
            fast._event.wait(2.0)  # the mutant's loop sits in the fetch: stop waiting, let it go
        else:
            fast._event.wait()
        fast_first = fast._event.is_set() and not returned.is_set()
        if not inline_fetch:
            slow._event.wait()  # ends at its own deadline while its fetch still hangs
        released.set()
        fast.wait()
        np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src_pages, [1, 2], [5, 6]))
        slow._event.wait()
        return fast_first, fast.status, slow
    finally:
        released.set()
        owner.close()
        a.close()


def test_a_stopped_peer_does_not_delay_another() -> None:
    fast_first, status, slow = _fairness(inline_fetch=False)
    assert status is Status.DONE and fast_first
    assert isinstance(slow.error, TransferTimeoutError)  # its own deadline, while its fetch still hung


def test_fairness_control_a_fetch_in_the_loop_stalls_everyone() -> None:
    fast_first, status, _ = _fairness(inline_fetch=True)
    assert status is Status.DONE and not fast_first  # it could finish only once the fetch returned


def test_route_fetches_once_and_again_after_a_restart() -> None:
    a, b, src, dst = _pair()
    fetches: list[int] = []
    current = {"agent": a}

    def fetch() -> bytes:
        fetches.append(1)
        return current["agent"].metadata()

    with Owner(b) as owner:
        owner.route("p0", fetch, expect="prefill")
        for i in range(3):
            owner.read("p0", [i], [i]).wait()
        assert len(fetches) == 1
        a.close()  # prefill restarts: new memory, new generation, same name
        src2 = make_cache("packed", num_blocks=32, pad=16, seed=77, **GEOM)
        a2 = Agent("prefill", backend="loopback", timeout=60.0)
        a2.register(src2.views, replicated=True)
        current["agent"] = a2
        with pytest.raises(PeerDisconnectedError):
            owner.read("p0", [4], [4]).wait()
        before = dst.layer_pages()
        owner.read("p0", [5, 6], [8, 9]).wait()
        assert len(fetches) == 2
        np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src2.layer_pages(), [5, 6], [8, 9]))
        a2.close()


def test_await_and_done_callbacks(pair: tuple[Agent, Owner, Any, Any]) -> None:
    a, owner, src, dst = pair
    before, src_pages = dst.layer_pages(), src.layer_pages()
    seen: list[tuple[str, Status]] = []
    t = owner.read("prefill", [3, 4], [1, 0])
    t.add_done_callback(lambda h: seen.append((threading.current_thread().name, h.status)))

    async def main() -> Any:
        return await owner.read("prefill", [7], [9])

    u = asyncio.run(main())
    t.wait()
    assert u.status is Status.DONE
    assert seen and seen[0][1] is Status.DONE
    np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src_pages, [3, 4, 7], [1, 0, 9]))
    assert t.done() and u.done()


def test_call_errors_come_back_and_a_wait_on_the_owner_thread_is_refused(pair: tuple[Agent, Owner, Any, Any]) -> None:
    a, owner, src, dst = pair
    before, src_pages = dst.layer_pages(), src.layer_pages()
    with pytest.raises(KeyError):
        owner.call(lambda agent: {}["missing"]).result()
    seen: list[BaseException] = []
    inner: list[Any] = []

    def on_done(h: Any) -> None:  # runs on the owner's thread: it may submit, never wait
        u = owner.read("prefill", [11], [12])
        inner.append(u)
        try:
            u.wait()
        except RuntimeError as exc:
            seen.append(exc)

    gate = _Gate(owner.agent)  # t stays in flight until its callback is in place
    t = owner.read("prefill", [10], [13]).wait_posted()
    t.add_done_callback(on_done)
    gate.open.set()
    t.wait()
    assert seen and "owner's own thread" in str(seen[0])
    assert inner[0].wait().status is Status.DONE  # submitted from the callback, done all the same
    want = expected_after(before, src_pages, [10, 11], [13, 12])
    np.testing.assert_array_equal(dst.layer_pages(), want)


def _burst_run(control: bool) -> tuple[int, Any, Any, Any]:
    """Six one-block READs submitted at once to a ready peer, ``burst=2``: returns how often the
    loop went to sleep with a ready peer's transfers still queued, and the caches."""
    a, b, src, dst = _pair("prefill", seed=5)
    owner = Owner(b, burst=2)
    backlog_sleeps = 0
    idle_wait = owner._idle_wait

    def watched(delay: float) -> float:  # the loop calls this only on its way to sleep
        nonlocal backlog_sleeps
        backlog_sleeps += any(r.queue and r.ready for r in owner._routes.values())
        return idle_wait(delay)

    owner._idle_wait = watched  # type: ignore[method-assign]
    if control:
        owner._backlogged = lambda: False  # type: ignore[method-assign]
    before, src_pages = dst.layer_pages(), src.layer_pages()
    try:
        owner.add_peer(a.metadata()).result()
        handles = [owner.read("prefill", [10 + i], [i]) for i in range(6)]
        assert all(h.wait().status is Status.DONE for h in handles)
    finally:
        owner.close()
        a.close()
    return backlog_sleeps, before, src_pages, dst


@pytest.mark.parametrize("control", [False, True], ids=["fixed", "control-naps-with-a-backlog"])
def test_the_loop_does_not_nap_while_a_ready_peer_has_transfers_queued(control: bool) -> None:
    """``burst`` bounds one round per peer (fairness), not the request: once a round's posts
    complete at once, the next round starts at once. The loop used to nap up to 1 s per round
    (20 one-block READs took 9 s at burst 2). The control restores the old sleep rule."""
    sleeps, before, src_pages, dst = _burst_run(control)
    want = expected_after(before, src_pages, [10 + i for i in range(6)], list(range(6)))
    np.testing.assert_array_equal(dst.layer_pages(), want)
    assert (sleeps > 0) if control else (sleeps == 0)
