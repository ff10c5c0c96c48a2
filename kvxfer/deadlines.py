"""One rule for every timeout kvxfer accepts: a finite, positive number of seconds.

A NaN deadline compares false with every clock reading, so a loop waiting for it never
ends; an infinite or negative one disables the bound the caller thinks they set. Agents,
transfers and the side channel all check through :func:`check_timeout`, so the rule and its
message are the same everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import select
import time
from typing import Iterator

from .errors import InvalidTimeoutError

__all__ = ["check_timeout", "current_deadline", "deadline_scope", "readable", "writable"]

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("kvxfer_deadline", default=None)


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


def readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` has data (or EOF) within ``timeout`` s. ``poll``, not ``select``: an
    engine process can hold more than 1,024 descriptors, where ``select`` raises."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(p.poll(max(0, int(timeout * 1000))))


def writable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` takes bytes (or has failed) within ``timeout`` s; ``poll``, as :func:`readable`."""
    p = select.poll()
    p.register(fd, select.POLLOUT | select.POLLHUP | select.POLLERR)
    return bool(p.poll(max(0, int(timeout * 1000))))


@contextlib.contextmanager
def deadline_scope(seconds: float) -> Iterator[float]:
    """Bound everything called inside to ``seconds`` from now (or an earlier enclosing bound).

    How a caller's deadline reaches code behind a seam that takes none, such as a backend's
    ``add_remote`` proving metadata (:mod:`kvxfer.prove`): the core sets it, whoever waits
    reads :func:`current_deadline`. Yields the monotonic deadline in force.
    """
    mine = time.monotonic() + check_timeout(seconds, "deadline")
    outer = _DEADLINE.get()
    token = _DEADLINE.set(mine if outer is None else min(outer, mine))
    try:
        yield _DEADLINE.get()  # type: ignore[misc]
    finally:
        _DEADLINE.reset(token)


def current_deadline() -> float | None:
    """The monotonic time by which the current call must return (None: no caller set one)."""
    return _DEADLINE.get()
