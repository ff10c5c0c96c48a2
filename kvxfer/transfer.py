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
from .stats import Status, TransferStats

_no_telemetry = Backend.telemetry

__all__ = ["Transfer", "TransferStats", "Status", "stall_advice"]


def stall_advice(backend: Backend, peer: str | None) -> str:
    """What a timeout error tells the user to check: the backend's own hint when it has one."""
    try:
        hint = backend.stall_hint(peer)
    except Exception:  # advice must never replace the timeout itself
        hint = None
    return hint or "Check that the peer is alive and progressing."


@dataclass
class _Post:
    handle: Any
    done: bool = False
    cleanup: list[Callable[[], None]] = field(default_factory=list)


class Transfer:
    """One request in flight. Not thread-safe: poll it from the thread that created it."""

    def __init__(self, backend: Backend, posts: list[_Post], stats: TransferStats, *, default_timeout: float,
                 deadline: float | None = None, on_done: Callable[[], None] | None = None,
                 started: float | None = None, on_finish: Callable[["Transfer"], None] | None = None,
                 plan: Any = None, verify: Callable[[], None] | None = None):
        self._backend = backend
        self._posts = posts
        self._plan = plan  # what was posted, or how to plan it again (the hot path: kvxfer._hot)
        self.stats = stats
        self._default_timeout = default_timeout if type(default_timeout) is float and deadline is not None \
            else check_timeout(default_timeout)
        # The deadline of a plain wait(); the agent passes the one it started before planning.
        self._deadline = Deadline.within(self._default_timeout) if deadline is None else deadline
        self._on_done = on_done
        self._on_finish = on_finish
        self._verify = verify  # runs after the data is in, before DONE is reported (kvxfer.integrity)
        self._started = started if started is not None else time.perf_counter()
        self._spin = bool(backend.capabilities.needs_progress)
        # the agent's router (kvxfer._routed) passes telemetry on: ask the backend behind it
        self._telemetry = type(getattr(backend, "inner", backend)).telemetry is not _no_telemetry
        self._error: BaseException | None = None
        self.status = Status.PENDING

    def __repr__(self) -> str:
        return f"<Transfer {self.status.value} {self.stats.descriptors} descriptors {self.stats.nbytes} bytes>"

    @property
    def plan(self) -> Any:
        """What was posted (its run count is computed on request), or None. The hot path
        posts without a plan object; it is built here only when someone asks."""
        p = self._plan
        if callable(p):
            p = self._plan = p()
        return p

    # -- state machine --------------------------------------------------------------------
    def done(self) -> bool:
        """Poll once. True when complete; raises the transfer's error if it failed."""
        if self.status is Status.DONE:
            return True
        if self.status is not Status.PENDING:
            self._raise()
        try:
            pending = False
            for p in self._posts:
                if not p.done:
                    p.done = bool(self._backend.poll(p.handle))
                    pending |= not p.done
        except KvxferError as exc:
            self._fail(exc)
        except Exception as exc:  # a backend leaking a foreign exception is still a failure
            from .errors import BackendError

            err = BackendError(f"backend {self._backend.name!r} failed while polling: {exc!r}")
            err.__cause__ = exc
            self._fail(err)
        if pending:
            return False
        self.stats.seconds = time.perf_counter() - self._started
        if self._telemetry:
            self._collect_telemetry()
        self._release()
        if self._verify is not None:
            try:
                self._verify()
            except KvxferError as exc:
                self.status = Status.FAILED
                self._error = exc
                self._finish()
                raise
        self.status = Status.DONE
        try:
            if self._on_done is not None:
                self._on_done()
        finally:
            self._finish()
        return True

    def wait(self, timeout: float | None = None) -> "Transfer":
        """Block until done: at most ``timeout`` seconds from now, or, when None, until the
        transfer's deadline (the agent's timeout, counted from the read/write call)."""
        if timeout is None:
            limit, deadline = self._default_timeout, self._deadline
        else:
            limit = check_timeout(timeout, "wait timeout")
            deadline = Deadline.within(limit)
        # Spin first (GPU and shm transfers finish in microseconds), then back off so a
        # slow network transfer does not burn a core the peer may need. A backend that
        # needs someone to drive progress gets no sleeps: this loop *is* its progress
        # engine (UCX software RMA ran 25x slower with 1 ms naps between polls).
        backoff = None if self._spin else Backoff(1e-6, 1e-3, factor=1.0, step=1e-6, spins=64)
        while not self.done():
            if self.expire(time.monotonic(), deadline, limit):
                self._raise()
            if backoff is not None:
                d = backoff.next()
                if d:
                    time.sleep(d)
        return self

    def expire(self, now: float, deadline: float | None = None, limit: float | None = None) -> bool:
        """Past ``deadline`` (default: the transfer's own) and still pending: cancel it, make it
        FAILED with :class:`TransferTimeoutError` and return True. One rule for :meth:`wait`
        and for an :class:`~kvxfer.owner.Owner`'s loop, which polls instead of waiting."""
        if self.status is not Status.PENDING or now < (self._deadline if deadline is None else deadline):
            return False
        self.cancel()
        self._error = TransferTimeoutError(
            f"transfer of {self.stats.descriptors} descriptors did not finish within "
            f"{self._default_timeout if limit is None else limit:g} s; "
            f"it was cancelled. {stall_advice(self._backend, self.stats.peer)}")
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
        self.stats.telemetry = out or None

    def _raise(self) -> None:
        assert self._error is not None
        raise self._error

    def _release(self) -> None:
        for p in self._posts:
            try:
                self._backend.release(p.handle)
            except Exception:  # releasing is best effort; the status already says what happened
                pass
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
