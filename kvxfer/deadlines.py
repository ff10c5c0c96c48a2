"""One rule for every timeout kvxfer accepts: a finite, positive number of seconds.

A NaN deadline compares false with every clock reading, so a loop waiting for it never
ends; an infinite or negative one disables the bound the caller thinks they set. Agents,
transfers and the side channel all check through :func:`check_timeout`, so the rule and its
message are the same everywhere.

Time itself has one home here too: a :class:`Deadline` (a point on the monotonic clock, in the
spirit of httpx's ``Timeout``) and one :class:`Backoff` (how a loop polls), instead of
``time.monotonic() + x`` and nap-doubling loops written by hand in each module
(``tests/test_vocabulary.py`` keeps it so).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import select
import time
from typing import Any, Iterator

from .errors import InvalidTimeoutError

__all__ = ["Backoff", "Deadline", "check_timeout", "current_deadline", "deadline_scope", "readable", "wait_event",
           "writable"]

_DEADLINE: contextvars.ContextVar["Deadline | None"] = contextvars.ContextVar("kvxfer_deadline", default=None)


def check_timeout(timeout: object, what: str = "timeout") -> float:
    """Return ``timeout`` as a float, or raise :class:`InvalidTimeoutError`."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidTimeoutError(f"{what} must be a number of seconds, got {type(timeout).__name__}")
    try:
        t = float(timeout)
    except OverflowError:  # an int too large for a float
        t = math.inf
    if not math.isfinite(t) or t <= 0:
        raise InvalidTimeoutError(f"{what} must be finite and positive (seconds), got {timeout!r}")
    return t


class Deadline(float):
    """A point on the monotonic clock by which something must be done.

    A float (the clock reading), so it compares, subtracts and crosses seams that take a plain
    monotonic deadline unchanged, and costs no Python call to build from one; its methods say
    what every hand-made ``time.monotonic() + x`` loop used to compute by itself. Waits that
    take a timeout in this module (:func:`readable`, :func:`writable`, :func:`wait_event`)
    also take a Deadline, and then wait only for what is :meth:`left`.
    """

    __slots__ = ()

    @classmethod
    def after(cls, seconds: object, what: str = "timeout") -> "Deadline":
        """``seconds`` from now; ``seconds`` is checked by :func:`check_timeout` (typed error)."""
        return cls(time.monotonic() + check_timeout(seconds, what))

    @classmethod
    def within(cls, seconds: float) -> "Deadline":
        """``seconds`` from now, for a value already checked (an agent's timeout): no check here.
        A negative one is a deadline already past (a drain of 0 s, a budget already spent)."""
        return cls(time.monotonic() + seconds)

    @classmethod
    def never(cls) -> "Deadline":
        """No bound: for loops whose bound is optional (``left()`` is then infinite)."""
        return cls(math.inf)

    def left(self) -> float:
        """Seconds until the deadline, never negative."""
        return max(0.0, self - time.monotonic())

    def expired(self, now: float | None = None) -> bool:
        """Whether the deadline has passed (at ``now``, a monotonic reading, when given)."""
        return (time.monotonic() if now is None else now) >= self

    def earliest(self, other: "float | None") -> "Deadline":
        """The earlier of this deadline and ``other`` (None: this one)."""
        return self if other is None or self <= other else Deadline(other)


class Backoff:
    """One polling rhythm: ``spins`` looks without sleeping, then naps growing from ``first``
    (times ``factor``, plus ``step``) up to ``cap``. A loop waiting on something that finishes
    in microseconds should not nap at once; one waiting on a stalled peer should not burn a
    core. :meth:`reset` after progress, :meth:`pause` (never past a deadline) between looks."""

    __slots__ = ("first", "cap", "factor", "step", "spins", "delay", "_n")

    def __init__(self, first: float = 20e-6, cap: float = 1e-3, *, factor: float = 2.0, step: float = 0.0,
                 spins: int = 0) -> None:
        self.first, self.cap, self.factor, self.step, self.spins = first, cap, factor, step, spins
        self.delay, self._n = min(first, cap), 0

    def reset(self) -> None:
        self.delay, self._n = min(self.first, self.cap), 0

    def next(self) -> float:
        """The next nap in seconds (0.0 while spinning), advancing the rhythm."""
        if self._n < self.spins:
            self._n += 1
            return 0.0
        d = self.delay
        self.delay = min(self.cap, d * self.factor + self.step)
        return d

    def pause(self, deadline: float | None = None) -> None:
        """Sleep the next nap, cut at ``deadline``; a spin yields the GIL only (``sleep(0)``)."""
        d = self.next()
        if deadline is not None:
            d = min(d, max(0.0, deadline - time.monotonic()))
        time.sleep(d)


def _seconds(timeout: float) -> float:
    return timeout.left() if isinstance(timeout, Deadline) else timeout


def readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` has data (or EOF) within ``timeout`` s (or by a :class:`Deadline`). ``poll``,
    not ``select``: an engine process can hold more than 1,024 descriptors, where ``select`` raises."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(p.poll(max(0, int(_seconds(timeout) * 1000))))


def writable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` takes bytes (or has failed) within ``timeout`` s; ``poll``, as :func:`readable`."""
    p = select.poll()
    p.register(fd, select.POLLOUT | select.POLLHUP | select.POLLERR)
    return bool(p.poll(max(0, int(_seconds(timeout) * 1000))))


def wait_event(event: Any, deadline: Deadline) -> bool:
    """``event.wait`` (a :class:`threading.Event` or anything with that method) until ``deadline``."""
    return bool(event.wait(deadline.left()))


@contextlib.contextmanager
def deadline_scope(seconds: float) -> Iterator[float]:
    """Bound everything called inside to ``seconds`` from now (or an earlier enclosing bound).

    How a caller's deadline reaches code behind a seam that takes none, such as a backend's
    ``add_remote`` proving metadata (:mod:`kvxfer.prove`): the core sets it, whoever waits
    reads :func:`current_deadline`. Yields the monotonic deadline in force.
    """
    mine = Deadline.after(seconds, "deadline")
    token = _DEADLINE.set(mine.earliest(_DEADLINE.get()))
    try:
        yield _DEADLINE.get()  # type: ignore[misc]
    finally:
        _DEADLINE.reset(token)


def current_deadline() -> "Deadline | None":
    """The monotonic time by which the current call must return (None: no caller set one)."""
    return _DEADLINE.get()
