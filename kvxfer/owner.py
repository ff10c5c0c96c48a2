"""The owner: one thread that owns an :class:`~kvxfer.agent.Agent`, so callers never wait.

An engine's model thread must not spend a step on a metadata round trip, a transport's
connection set-up or a poll loop. With ``Owner(agent)``, one thread does everything the
agent does: metadata fetch and refresh (on short-lived per-peer threads, never in the shared
loop), ``add_peer``, planning, posting, progress, completion and notifications. Callers
submit from any thread and get an :class:`~kvxfer.owned.OwnedTransfer` at once.

Rules the loop keeps:

* **bounded admission**: at most ``max_pending`` transfers held (queued or in flight) in
  all and ``max_pending_per_peer`` for one peer; past either, submission raises
  :class:`~kvxfer.errors.BackPressureError` and queues nothing;
* **fairness**: each peer has its own queue, posted round-robin, ``burst`` at a time; the
  only blocking call for a peer, its metadata fetch, runs on a thread of its own, so a
  stopped peer holds only its own queue (and, by its own bound, only its share of the total);
* **deadlines stay the agent's**: a transfer's deadline starts at submission; queued time,
  planning, posting and flight count against it (:meth:`kvxfer.transfer.Transfer.expire`);
* **refresh on failure**: a peer reached through :meth:`Owner.route` is fetched once, and
  again only after a transfer from it failed in a way a restart explains.

The thread model is in ``docs/design.md`` ("Threads").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, TypeVar

from . import _args, _direct, _drain, _handshake
from .agent import Agent
from .deadlines import Backoff, Deadline, check_timeout
from .errors import (
    AgentClosedError,
    BackPressureError,
    InvalidArgumentError,
    TransferCancelledError,
    UnknownPeerError,
)
from .memory import Op
from .owned import OwnedFuture, OwnedTransfer
from ._routes import REFRESH_ON, PeerRoute
from .transfer import Status

__all__ = ["Owner"]

log = logging.getLogger("kvxfer.owner")
T = TypeVar("T")

#: After posting or completing, the loop polls what is in flight without sleeping (only yielding
#: the GIL between polls) for this long: a small transfer is seen done microseconds after it is.
#: Then it naps between polls, from _MIN_NAP doubling to 1 ms, so a stalled peer costs no core.
_SPIN_S = 2e-3
_MIN_NAP = 20e-6


class Owner:
    """Owns ``agent`` on a thread of its own; see the module docstring.

    ``close_agent``: :meth:`close` closes the agent too. ``add_peer_timeout`` bounds each
    ``add_peer`` the loop runs for a fetched route (proving unsigned metadata included).
    """

    def __init__(self, agent: Agent, *, max_pending: int = 4096, max_pending_per_peer: int = 512, burst: int = 8,
                 add_peer_timeout: float | None = None, close_agent: bool = True, name: str | None = None) -> None:
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                   for n in (max_pending, max_pending_per_peer, burst)):
            raise InvalidArgumentError("max_pending, max_pending_per_peer and burst must be integers of at least 1")
        if not isinstance(agent, Agent):
            raise InvalidArgumentError(f"Owner owns a kvxfer.Agent, got {type(agent).__name__}")
        self.agent = agent
        self.max_pending, self.max_pending_per_peer, self.burst = max_pending, max_pending_per_peer, burst
        self.add_peer_timeout = None if add_peer_timeout is None else check_timeout(add_peer_timeout)
        self._close_agent = close_agent
        self._lock = threading.Lock()  # admission counts, routes, closing: never held while waiting
        # The loop sleeps on a lock used as a binary semaphore: a submitter releases it only
        # when the loop said it sleeps, so a busy loop costs submitters no wake-up call, and a
        # sleeping one is woken by one futex, not a Condition's lock per waiter.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._sleeping = False
        # Whoever touches the agent holds this: the loop whenever it is awake, else a caller
        # taking its turn (kvxfer._direct), who only ever tries it. Held for good once closed.
        self._engine = threading.Lock()
        self._engine.acquire()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._routes: dict[str, PeerRoute] = {}
        self._held = 0
        self._closing = False
        self._drain_until = 0.0
        self._inflight: dict[OwnedTransfer, None] = {}  # the loop's only
        caps = agent.backend.capabilities
        self._max_sleep = 50e-6 if caps.needs_progress else 1e-3
        self._progress_driven = caps.needs_progress
        self._thread = threading.Thread(target=self._run, name=name or f"kvxfer-owner:{agent.name}", daemon=True)
        self._thread.start()
        self._ident = self._thread.ident  # read once: Thread.ident is a property

    def __enter__(self) -> "Owner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submitting (any thread) -----------------------------------------------------------
    def read(self, peer: str, local_blocks: Any, remote_blocks: Any, notify: bytes | None = None, *,
             timeout: float | None = None, expect: Any = None) -> OwnedTransfer:
        """Queue a READ of ``peer``'s ``remote_blocks`` into ``local_blocks``; returns at once.

        ``peer`` is a route's key or a peer's name. The block ids are read when the transfer
        is posted: do not change them after submitting. ``timeout`` (default: the agent's)
        counts from now. ``expect``: the source's digests, verified as :meth:`Agent.read` does.
        """
        return self._submit(Op.READ, peer, local_blocks, remote_blocks, notify, timeout, expect)

    def write(self, peer: str, local_blocks: Any, remote_blocks: Any, notify: bytes | None = None, *,
              timeout: float | None = None) -> OwnedTransfer:
        """Queue a WRITE of our ``local_blocks`` into ``peer``'s ``remote_blocks``."""
        return self._submit(Op.WRITE, peer, local_blocks, remote_blocks, notify, timeout)

    def _submit(self, op: Op, key: str, local: Any, remote: Any, notify: bytes | None,
                timeout: float | None, expect: Any = None) -> OwnedTransfer:
        msg = notify if notify is None else _args.notify_bytes(notify)
        if type(key) is not str:
            _args.peer_key(key)
        limit = self.agent.timeout if timeout is None else _args.timeout_or(self.agent.timeout, timeout)
        t = OwnedTransfer(self, op, key, local, remote, msg, Deadline.within(limit), limit)
        t.expect = expect
        with self._lock:
            if self._closing:
                self._check_open()
            route = self._routes.get(key)
            if route is None:  # a peer added directly: its name is its route
                route = self._routes[key] = PeerRoute(key, peer=key)
            if self._held >= self.max_pending:
                raise BackPressureError(f"the owner of {self.agent.name!r} holds {self._held} transfers, its limit; "
                                        "retry later or fail the request", pending=self._held,
                                        limit=self.max_pending)
            if route.held >= self.max_pending_per_peer:
                raise BackPressureError(f"peer {key!r} has {route.held} transfers held, its limit of "
                                        f"{self.max_pending_per_peer}; it may be slow or stopped",
                                        pending=route.held, limit=self.max_pending_per_peer, peer=key)
            self._held += 1
            route.held += 1
            direct = self._sleeping and not self._inbox and not route.queue and route.peer is not None \
                and not route.fetching  # the caller's turn (kvxfer._direct), checked again there
            if not direct:
                self._inbox.append(("transfer", t))
        if direct and not _direct.post(self, t, route):  # the loop was busy after all: queue it
            _direct.queue_late(self, t, route)
        elif direct:
            return t
        if self._sleeping:
            self._kick()
        return t

    def route(self, key: str, fetch: Callable[[], bytes], *, expect: str | None = None) -> None:
        """Name a peer that the owner reaches by itself: ``fetch()`` returns its metadata.

        ``fetch`` runs on a thread of its own (it may block for its own timeout), at the
        first transfer and again after a failure a restart explains. ``expect``: the agent
        name the metadata must carry (a different one fails the route's transfers).
        """
        if not isinstance(key, str) or not callable(fetch) or not isinstance(expect, (str, type(None))):
            raise InvalidArgumentError("route(key: str, fetch: a callable returning metadata bytes, expect: str | None)")
        with self._lock:
            self._check_open()
            r = self._routes.get(key)
            if r is None:
                self._routes[key] = PeerRoute(key, fetch=fetch, expect=expect)
            else:
                r.fetch, r.expect = fetch, expect

    def connect(self, key: str) -> OwnedFuture[str]:
        """Fetch and add the route's peer now (if not already); the future holds its name."""
        _args.peer_key(key)  # checked here: on the loop, an unhashable key would end it
        return self._enqueue("connect", key)

    def refresh(self, key: str) -> None:
        """Fetch the route's metadata again before its next transfer (a restart was seen)."""
        _args.peer_key(key)
        self._enqueue("refresh", key)

    def add_peer(self, metadata: bytes, *, timeout: float | None = None) -> OwnedFuture[str]:
        """:meth:`Agent.add_peer` on the owner's thread; the peer's name is also its route."""
        return self._enqueue("call", lambda a: self._added(a.add_peer(metadata, timeout=timeout)))

    def call(self, fn: Callable[[Agent], T]) -> OwnedFuture[T]:
        """Run ``fn(agent)`` on the owner's thread: the way to use any other agent method."""
        return self._enqueue("call", fn)

    def notify(self, peer: str, message: bytes) -> OwnedFuture[None]:
        _args.peer_key(peer)
        msg = _args.message_bytes(message)
        return self._enqueue("call", lambda a: a.notify(self._peer_name(peer), msg))

    def notifications(self, timeout: float | None = None) -> dict[str, list[bytes]]:
        """:meth:`Agent.notifications`, drained on the owner's thread (waits for it)."""
        return self.call(lambda a: a.notifications()).result(timeout)

    def _enqueue(self, kind: str, arg: Any) -> OwnedFuture[Any]:
        fut: OwnedFuture[Any] = OwnedFuture(self)
        if threading.current_thread() is self._thread:  # from a callback: run in place
            self._apply((kind, arg, fut))
            return fut
        with self._lock:
            self._check_open()
            self._inbox.append((kind, arg, fut))
            self._kick()
        return fut

    def _cancel(self, t: OwnedTransfer) -> None:
        if threading.current_thread() is self._thread:
            self._cancel_now(t)
            return
        with self._lock:
            self._inbox.append(("cancel", t))
            self._kick()
        while not t._event.wait(0.5):
            if not self._thread.is_alive():
                break

    def _kick(self) -> None:
        """Wake the loop (a no-op when a wake is already pending)."""
        try:
            self._wake.release()
        except RuntimeError:  # already released: the loop will see it
            pass

    def _check_open(self) -> None:
        if self._closing:
            raise AgentClosedError(f"the owner of agent {self.agent.name!r} is closed")

    def _check_not_loop(self, what: str) -> None:
        if threading.get_ident() == self._ident:
            raise RuntimeError(f"{what}() on the owner's own thread would wait for itself; use add_done_callback")

    @property
    def pending(self) -> int:
        """Transfers held now (queued or in flight)."""
        with self._lock:
            return self._held

    # -- closing ---------------------------------------------------------------------------
    def close(self, drain: float = 0.0) -> None:
        """Stop: transfers not yet posted fail with :class:`AgentClosedError`; those in flight
        get ``drain`` seconds to finish, then are cancelled (:class:`TransferCancelledError`).
        Every one ends DONE or with a typed error. Then the agent is closed. Idempotent."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._drain_until = Deadline.within(max(0.0, drain))
            self._kick()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def closed(self) -> bool:
        return self._closing and not self._thread.is_alive()

    # -- the loop (the owner's thread only) --------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # a bug here must not leave callers waiting forever
            log.exception("kvxfer: the owner's loop of %r failed", self.agent.name)
            with self._lock:
                self._closing = True
        finally:
            self._shutdown()

    def _loop(self) -> None:
        naps, busy_since = Backoff(_MIN_NAP, self._max_sleep), time.monotonic()
        while True:
            spinning = bool(self._inflight) and time.monotonic() - busy_since < _SPIN_S
            if not self._inbox and not self._closing and not spinning and not self._backlogged():
                self._sleeping = True  # then look again: a submitter that missed the flag appended first
                if not self._inbox and not self._closing:
                    wait = self._idle_wait(naps.delay)
                    self._engine.release()  # callers may take their turn (kvxfer._direct) meanwhile
                    try:
                        self._wake.acquire(timeout=wait)
                    finally:
                        self._sleeping = False
                        self._engine.acquire()
                self._sleeping = False
            closing = self._closing  # read before draining: all that came before closing is applied
            had_ops = bool(self._inbox)
            self._apply_all(self._inbox)
            if closing:
                return
            moved = self._post_ready()
            now = time.monotonic()
            moved |= self._poll(now)
            self._expire_queued(now)
            if moved or had_ops:
                busy_since = now
                naps.reset()
            elif spinning:
                time.sleep(0)  # yields the GIL: a model thread never waits a switch interval for us
            else:
                naps.next()  # the next wait (for the queue, or between polls) is twice as long

    def _backlogged(self) -> bool:
        """A ready peer still has transfers queued (``burst`` ended the last round): no nap.

        Without this check the loop slept up to a second per ``burst`` once what it had posted
        completed at once, with the rest of a request's transfers queued behind them."""
        return any(r.queue and r.ready for r in self._routes.values())

    def _idle_wait(self, delay: float) -> float:
        if self._inflight:
            return delay
        waits = [t.deadline for r in self._routes.values() for t in r.queue]
        return max(1e-4, min(1.0, min(waits) - time.monotonic())) if waits else 1.0

    def _apply_all(self, ops: deque[tuple[Any, ...]]) -> None:
        """Apply and drop each op: none stays referenced while the loop waits (a fetched
        peer's metadata can be hundreds of MB). Submitters append to the same deque meanwhile
        (``deque`` appends and pops are atomic): what they add now is applied now."""
        while True:
            try:
                op = ops.popleft()
            except IndexError:
                return
            self._apply(op)

    def _apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "transfer":
            t: OwnedTransfer = op[1]
            route = self._routes[t.route]
            route.queue.append(t)
            if route.peer is None and not route.fetching:
                self._handshake(route)
        elif kind == "cancel":
            self._cancel_now(op[1])
        elif kind == "call":
            fut: OwnedFuture[Any] = op[2]
            try:
                fut._finish(Status.DONE, op[1](self.agent))
            except BaseException as exc:  # the caller's own function: handed back, not raised here
                fut._finish(Status.FAILED, None, exc)
        elif kind in ("connect", "refresh"):
            route = self._routes.get(op[1])
            fut = op[2]
            if route is None:
                fut._finish(Status.FAILED, None, UnknownPeerError(f"no route {op[1]!r}; name it with route() first"))
                return
            if kind == "refresh" and route.fetch is not None:
                route.peer = None
            if route.ready:
                fut._finish(Status.DONE, route.peer)
                return
            if kind == "connect":
                route.waiters.append(fut)
            else:
                fut._finish(Status.DONE, None)
            if not route.fetching and route.fetch is not None:
                self._handshake(route)
        elif kind == "fetched":
            self._fetched(*op[1:])

    def _added(self, name: str) -> str:
        with self._lock:
            r = self._routes.get(name)
            if r is None:
                self._routes[name] = PeerRoute(name, peer=name)
            elif r.fetch is None:
                r.peer = name
        return name

    def _peer_name(self, key: str) -> str:
        r = self._routes.get(key)
        return r.peer if r is not None and r.peer is not None else key

    # -- handshakes (kvxfer._handshake) --------------------------------------------------------
    def _handshake(self, route: PeerRoute) -> None:
        _handshake.start(self, route)

    def _fetched(self, route: PeerRoute, gen: int, md: bytes | None, err: BaseException | None) -> None:
        _handshake.fetched(self, route, gen, md, err)

    # -- posting and polling -------------------------------------------------------------------
    def _post_ready(self) -> bool:
        """Post up to ``burst`` queued transfers of each ready peer; True when any was."""
        moved = False
        for route in list(self._routes.values()):
            n = 0
            while route.queue and route.ready and n < self.burst:
                t = route.queue.popleft()
                n += 1
                moved = True
                try:
                    t._inner = self.agent._transfer(t.op, route.peer, t.local_blocks, t.remote_blocks, t.notify,
                                                    deadline=t.deadline, expect=t.expect)
                except BaseException as exc:
                    self._end(t, exc)
                    self._maybe_refresh(route, exc)
                    continue
                self._inflight[t] = None
                t._mark_posted()
        return moved

    def _poll(self, now: float) -> bool:
        moved = False
        for t in list(self._inflight):
            ended, error = _direct.poll_one(t, now)
            if ended:
                self._end(t, error)
                if error is not None:
                    self._maybe_refresh(self._routes.get(t.route), error)
                moved = True
        return moved

    def _expire_queued(self, now: float) -> None:
        _drain.expire_queued(self, now)

    def _maybe_refresh(self, route: PeerRoute | None, exc: BaseException | None) -> None:
        if route is not None and route.fetch is not None and isinstance(exc, REFRESH_ON) and not route.fetching:
            route.peer = None
            if route.queue:
                self._handshake(route)

    def _cancel_now(self, t: OwnedTransfer) -> None:
        if t._ended:
            return
        if t._inner is None:
            route = self._routes.get(t.route)
            if route is not None and t in route.queue:
                route.queue.remove(t)
            else:  # still in the inbox: drop it there
                with self._lock:
                    try:
                        self._inbox.remove(("transfer", t))
                    except ValueError:
                        pass
        else:
            t._inner.cancel()
            if t._inner.status is Status.DONE:
                self._end(t)
                return
        self._end(t, TransferCancelledError("transfer was cancelled"))

    def _end(self, t: OwnedTransfer, error: BaseException | None = None) -> None:
        """Finish ``t`` once (under the engine lock): give back its admission, run its callbacks."""
        if t._ended:
            return
        t._ended = True
        self._inflight.pop(t, None)
        self._settle(t, error)

    def _settle(self, t: OwnedTransfer, error: BaseException | None) -> None:
        """``t`` was claimed (``_ended``) by whoever ends it: admission back, then its callbacks."""
        with self._lock:
            self._held -= 1
            route = self._routes[t.route]
            route.held -= 1
            self._forget_idle(route)
        if error is None:
            t._done()
        else:
            t._fail(error)

    def _forget_idle(self, route: PeerRoute) -> None:
        """Under the lock: drop a route named only by submissions once it holds nothing.

        The next submission builds the same route again, so 20,000 unknown names leave
        nothing behind; routes named by :meth:`route` (how to fetch a peer) are kept, and so
        is a peer's own while the agent knows it (bounded by its peers; not rebuilt per READ).
        """
        if route.fetch is None and not route.held and not route.queue and not route.waiters \
                and route.peer not in self.agent._peers:
            self._routes.pop(route.key, None)

    def _shutdown(self) -> None:
        """Everything held ends DONE or typed; then the agent closes (see :meth:`close`)."""
        _drain.shutdown(self)
