"""The caller's turn: while an :class:`~kvxfer.owner.Owner`'s loop sleeps, the caller does its step.

Handing a small READ to the owner's thread and back costs two thread wake-ups, each longer
than the transfer itself on a loaded machine (issue 37: +37 to +120 us over the caller's
path). When the loop has nothing to do, nobody is served by that hand-off, so the submitting
thread posts the request itself and the waiting thread polls it, both under the owner's
engine lock (which the loop holds whenever it is awake). The rules that keep the owner's
promises (``docs/design.md``, "Threads"):

* **the caller never waits behind anyone**: the lock is only ever tried, never waited for; a
  busy loop or another caller holding it sends the request the usual way (the inbox);
* **fairness**: a caller posts only while the loop sleeps, nothing is in the inbox and its
  route has nothing queued, so it overtakes nobody; a waiter stops polling as soon as the
  loop wakes or work arrives, and the loop polls what is in flight from then on;
* **bounded work on the caller**: only a request of a shape posted before (the agent's hot
  path, :mod:`kvxfer._hot`) to a peer already added: no planning, no metadata, no connection
  set-up; anything else is queued for the loop;
* **done callbacks stay on the owner's thread**: a waiter never finishes a handle that has
  callbacks, it wakes the loop for it; the handle is finished outside the lock;
* **close and cancel stay the loop's**: both go through the inbox, which stops every caller's
  turn; once the loop has ended, the engine lock stays held and no caller takes a turn.
"""

from __future__ import annotations

import time
from typing import Any

from .deadlines import Backoff
from .errors import KvxferError

__all__ = ["post", "drive", "poll_one", "queue_late"]


def post(owner: Any, t: Any, route: Any) -> bool:
    """Post ``t`` on the calling thread; False when it must go through the inbox instead."""
    engine = owner._engine
    if not engine.acquire(False):
        return False
    try:
        agent = owner.agent
        if not owner._sleeping or owner._inbox or route.queue or not route.ready or t.expect is not None:
            return False
        hot = agent._hot.get((route.peer, t.op))
        if hot is None:
            return False
        try:
            inner = hot.post(agent, t.local_blocks, t.remote_blocks, t.notify, t.deadline)
        except BaseException as exc:  # refused while posting: typed, as the loop would end it
            owner._end(t, exc)
            owner._maybe_refresh(route, exc)
            return True
        if inner is None:  # not of the shape after all: the loop plans it
            return False
        t._inner = inner
        owner._inflight[t] = None
        t._mark_posted()
        return True
    finally:
        engine.release()


def queue_late(owner: Any, t: Any, route: Any) -> None:
    """Queue ``t`` after its turn was refused; if the owner closed meanwhile, the loop may be
    gone: nothing went out, so it fails as if submitted after the close."""
    with owner._lock:
        if owner._closing:
            owner._held -= 1
            route.held -= 1
            owner._forget_idle(route)
            owner._check_open()
        owner._inbox.append(("transfer", t))


def drive(owner: Any, t: Any, until: float | None, once: bool = False) -> None:
    """Poll ``t`` on the calling thread while the loop sleeps, until it ends, ``until`` (None:
    its deadline, where polling expires it) passes, or the loop must take over."""
    engine = owner._engine
    spins, backoff = 0, None  # as Transfer.wait: spin first, then nap (never for a progress-driven backend)
    while not t._ended:
        if not owner._sleeping or owner._inbox or t._callbacks or t._inner is None:
            break
        if engine.acquire(False):
            ended, error = False, None
            try:
                if owner._sleeping and not owner._inbox and not t._ended:
                    ended, error = poll_one(t, time.monotonic())
                    if ended:
                        t._ended = True  # claimed: neither the loop nor a cancel ends it again
                        owner._inflight.pop(t, None)
                        if error is not None:
                            owner._maybe_refresh(owner._routes.get(t.route), error)
            finally:
                engine.release()
            if ended:  # finished outside the lock: a callback added meanwhile cannot block the loop
                owner._settle(t, error)
                return
        if once or (until is not None and time.monotonic() >= until):
            break
        spins += 1
        if spins > 64 and not owner._progress_driven:
            if backoff is None:
                backoff = Backoff(1e-6, 1e-3, factor=1.0, step=1e-6)
            time.sleep(backoff.next())
    if not t._ended and not once:
        owner._kick()  # the loop polls what is in flight from here on


def poll_one(t: Any, now: float) -> tuple[bool, BaseException | None]:
    """One look at a posted transfer, the loop's rule: (ended, its error or None)."""
    inner = t._inner
    try:
        if inner.done():
            return True, None
    except KvxferError as exc:
        return True, exc
    if inner.expire(now):
        return True, inner.error
    return False, None
