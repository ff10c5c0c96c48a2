"""The transfer handle: poll, wait with a deadline, cancel, and stats.

Deadlines and cancellation live here, not in backends, so every transport behaves the same:
``wait`` never blocks longer than its timeout, a timed-out transfer is cancelled (its backend
requests released) before :class:`~kvxfer.errors.TransferTimeoutError` is raised, and a
backend failure is kept and re-raised by every later call. A transfer's own deadline starts
when it was requested, so planning and posting count against it; every timeout must be a
finite, positive number of seconds (:func:`kvxfer.deadlines.check_timeout`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .deadlines import Backoff, Deadline, check_timeout
from .errors import KvxferError, TransferCancelledError, TransferTimeoutError

from .plugin.backend import Backend
from ._stats import Status, TransferStats

_no_telemetry = Backend.telemetry
_no_wait = Backend.wait
_INF = float("inf")
#: The states as module constants: an enum member read through its class costs a call's worth.
_PENDING, _DONE = Status.PENDING, Status.DONE

__all__ = ["Transfer", "TransferStats", "Status", "stall_advice"]


def stall_advice(backend: Backend, peer: str | None) -> str:
    """What a timeout error tells the user to check: the backend's own hint when it has one."""
    try:
        hint = backend.stall_hint(peer)
    except Exception:  # advice must never replace the timeout itself
        hint = None
    return hint or "Check that the peer is alive and progressing."


@dataclass(slots=True)  # slots: one per post, built on the hot path
class _Post:
    handle: Any
    done: bool = False
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    part: int | None = None  # which part of a check run as posts land (kvxfer.integrity.overlap)


class Transfer:
    """One request in flight. Not thread-safe: poll it from the thread that created it."""

    # Slots: one object per small READ instead of two (its dict); ``__dict__`` stays for what
    # callers and subclasses attach, made only when they do.
    __slots__ = ("_backend", "_posts", "_plan", "_stats", "_path_of", "_default_timeout", "_deadline", "_on_done",
                 "_on_finish", "_verify", "_parts", "_started", "_telemetry", "_error", "status", "__dict__",
                 "__weakref__")

    def __init__(self, backend: Backend, posts: list[_Post], stats: TransferStats, *, default_timeout: float,
                 deadline: float | None = None, on_done: Callable[[], None] | None = None,
                 started: float | None = None, on_finish: Callable[["Transfer"], None] | None = None,
                 plan: Any = None, verify: Callable[[], None] | None = None, path_of: Any = None,
                 parts: Any = None):
        self._backend = backend
        self._posts = posts
        self._plan = plan  # what was posted, or how to plan it again (the hot path: kvxfer._hot)
        self._stats = stats
        self._path_of = path_of  # a post whose data path the stats name, asked only when they are read
        t = default_timeout  # the comparison rejects NaN, infinities and negatives without a call
        self._default_timeout = t if type(t) is float and 0.0 < t < _INF else check_timeout(t)
        # The deadline of a plain wait(); the agent passes the one it started before planning.
        # None (the hot path): the timeout counted from the call (``started`` less the stats'
        # ``plan_seconds``), computed only when a wait or an owner's expiry asks.
        self._deadline = deadline
        self._on_done = on_done
        self._on_finish = on_finish
        self._verify = verify  # runs after the data is in, before DONE is reported (kvxfer.integrity)
        self._parts = parts  # a check run part by part as posts land (kvxfer.integrity.overlap), or None
        self._started = started if started is not None else time.perf_counter()
        # the agent's router (kvxfer._routed) passes telemetry on: ask the backend behind it
        self._telemetry = type(getattr(backend, "inner", backend)).telemetry is not _no_telemetry
        self._error: BaseException | None = None
        self.status = Status.PENDING

    @classmethod
    def posted(cls, backend: Backend, posts: list[_Post], stats: TransferStats, default_timeout: float,
               deadline: float | None, started: float, on_finish: Callable[["Transfer"], None] | None,
               on_done: Callable[[], None] | None, plan: Any, telemetry: bool) -> "Transfer":
        """The hot path's constructor (kvxfer._hot): what ``__init__`` sets, given positionally and
        already checked (the agent's timeout was validated when the agent was made; whether the
        backend reports telemetry, when the shape was learnt). ``plan``: ``(function, *args)``,
        called only if someone reads :attr:`plan`; the data path is asked only if someone reads
        :attr:`stats`."""
        t = cls.__new__(cls)
        t._backend, t._posts, t._plan, t._stats, t._path_of = backend, posts, plan, stats, posts[0].handle
        t._default_timeout, t._deadline, t._on_done, t._on_finish = default_timeout, deadline, on_done, on_finish
        t._verify = t._parts = t._error = None
        t._started, t._telemetry, t.status = started, telemetry, _PENDING
        return t

    def __repr__(self) -> str:
        return f"<Transfer {self.status.value} {self._stats.descriptors} descriptors {self._stats.nbytes} bytes>"

    @property
    def stats(self) -> TransferStats:
        """What the transfer cost (see :class:`TransferStats`); its ``path`` is asked of the
        backend the first time someone reads them (the hot path posts without asking)."""
        s = self._stats
        if self._path_of is not None:
            h, self._path_of = self._path_of, None
            try:
                s.path = self._backend.data_path(h)
            except Exception:  # naming the path is best effort; the transfer is what counts
                s.path = None
        return s

    @stats.setter
    def stats(self, value: TransferStats) -> None:
        self._stats, self._path_of = value, None

    def _due(self) -> float:
        """The transfer's own deadline (see ``deadline`` in the constructor)."""
        d = self._deadline
        if d is None:
            since = time.perf_counter() - self._started + self._stats.plan_seconds
            d = self._deadline = Deadline.within(self._default_timeout - since)
        return d

    @property
    def plan(self) -> Any:
        """What was posted (its run count is computed on request), or None. The hot path
        posts without a plan object; it is built here only when someone asks."""
        p = self._plan
        if type(p) is tuple:  # (function, *args): the hot path's (Transfer.posted)
            p = self._plan = p[0](*p[1:])
        elif callable(p):
            p = self._plan = p()
        return p

    # -- state machine --------------------------------------------------------------------
    def done(self) -> bool:
        """Poll once. True when complete; raises the transfer's error if it failed."""
        status = self.status
        if status is not _PENDING:
            if status is _DONE:
                return True
            self._raise()
        backend = self._backend
        try:
            pending = False
            for p in self._posts:
                if not p.done:
                    if backend.poll(p.handle):
                        p.done = True
                        if p.part is not None:  # its bytes are in: check them now, off this thread
                            self._parts.landed(p.part)
                    else:
                        pending = True
        except KvxferError as exc:
            self._fail(exc)
        except Exception as exc:  # a backend leaking a foreign exception is still a failure
            from .errors import BackendError

            err = BackendError(f"backend {self._backend.name!r} failed while polling: {exc!r}")
            err.__cause__ = exc
            self._fail(err)
        if pending:
            return False
        self._stats.seconds = time.perf_counter() - self._started
        if self._telemetry:
            self._collect_telemetry()
        for p in self._posts:  # _release(), inlined: every small READ passes here once
            try:
                backend.release(p.handle)
            except Exception:  # releasing is best effort; the status already says what happened
                pass
            if p.cleanup:
                self._cleanup(p)
        if self._verify is not None:
            try:
                self._verify()
            except KvxferError as exc:
                self.status = Status.FAILED
                self._error = exc
                self._finish()
                raise
        self.status = _DONE
        if self._on_done is not None:
            try:
                self._on_done()
            finally:
                self._finish()
        elif self._on_finish is not None:  # _finish(), inlined
            cb, self._on_finish = self._on_finish, None
            cb(self)
        return True

    def wait(self, timeout: float | None = None) -> "Transfer":
        """Block until done: at most ``timeout`` seconds from now, or, when None, until the
        transfer's deadline (the agent's timeout, counted from the read/write call)."""
        if timeout is None:
            limit, deadline = self._default_timeout, self._due()
        else:
            limit = check_timeout(timeout, "wait timeout")
            deadline = Deadline.within(limit)
        # Spin first (GPU and shm transfers finish in microseconds), then back off so a
        # slow network transfer does not burn a core the peer may need. A backend that
        # needs someone to drive progress gets no sleeps: this loop *is* its progress
        # engine (UCX software RMA ran 25x slower with 1 ms naps between polls).
        # A transfer still pending at the first poll is handed to the backend's own wait once, if
        # it has one (a device-path post: its CUDA event); one done at once (a small DRAM READ)
        # never asks. The store's engine is no Backend and has none.
        block = getattr(type(self._backend), "wait", _no_wait) is not _no_wait
        backoff = None if self._backend.capabilities.needs_progress else Backoff(1e-6, 1e-3, factor=1.0, step=1e-6, spins=64)
        while not self.done():
            if block:
                block = False
                self._block(deadline)
                continue  # poll again: what ended reports, a missed deadline expires below
            if self.expire(time.monotonic(), deadline, limit):
                self._raise()
            if backoff is not None:
                d = backoff.next()
                if d:
                    time.sleep(d)
        return self

    def _block(self, deadline: float) -> None:
        """Block on each post through the backend's own wait (a device-path post: its CUDA event,
        :meth:`~kvxfer.plugin.backend.Backend.wait`) rather than nap between polls; stop at the
        first one it cannot wait on (None) or that missed the deadline (False): the poll loop
        then finishes, or expires, the transfer as for any backend."""
        backend = self._backend
        for p in self._posts:
            if p.done or p.part is not None or self.status is not Status.PENDING:
                continue  # a part's landing is the poll loop's to report (kvxfer.integrity.overlap)
            try:
                ended = backend.wait(p.handle, deadline)
            except KvxferError as exc:
                self._fail(exc)
            except Exception as exc:  # as in done(): a foreign exception is still a typed failure
                from .errors import BackendError

                err = BackendError(f"backend {backend.name!r} failed while waiting: {exc!r}")
                err.__cause__ = exc
                self._fail(err)
            if ended is not True:
                return

    def expire(self, now: float, deadline: float | None = None, limit: float | None = None) -> bool:
        """Past ``deadline`` (default: the transfer's own) and still pending: cancel it, make it
        FAILED with :class:`TransferTimeoutError` and return True. One rule for :meth:`wait`
        and for an :class:`~kvxfer.owner.Owner`'s loop, which polls instead of waiting."""
        if self.status is not Status.PENDING or now < (self._due() if deadline is None else deadline):
            return False
        self.cancel()
        self._error = TransferTimeoutError(
            f"transfer of {self._stats.descriptors} descriptors did not finish within "
            f"{self._default_timeout if limit is None else limit:g} s; "
            f"it was cancelled. {stall_advice(self._backend, self._stats.peer)}")
        self.status = Status.FAILED
        return True

    def cancel(self) -> None:
        """Abort if still pending. A finished transfer stays DONE."""
        if self.status is not Status.PENDING:
            return
        self._release()
        self.status = Status.CANCELLED
        self._error = TransferCancelledError("transfer was cancelled")
        self._finish()

    @property
    def error(self) -> BaseException | None:
        return self._error

    # -- internals ------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        self._release()
        self.status = Status.FAILED
        self._error = exc
        self._finish()
        self._raise()

    def _collect_telemetry(self) -> None:
        out = []
        for p in self._posts:
            try:
                t = self._backend.telemetry(p.handle)
            except Exception:  # telemetry is best effort; the transfer itself succeeded
                t = None
            if t:
                out.append(dict(t))
        self._stats.telemetry = out or None

    def _raise(self) -> None:
        assert self._error is not None
        raise self._error

    def _release(self) -> None:
        for p in self._posts:
            try:
                self._backend.release(p.handle)
            except Exception:  # releasing is best effort; the status already says what happened
                pass
            if p.cleanup:
                self._cleanup(p)
        if self._parts is not None:  # ended early: no check may still read the destination
            self._parts.settle()

    @staticmethod
    def _cleanup(p: _Post) -> None:
        for fn in p.cleanup:
            try:
                fn()
            except Exception:
                pass
        p.cleanup.clear()

    def _finish(self) -> None:
        if self._on_finish is not None:
            cb, self._on_finish = self._on_finish, None
            cb(self)
