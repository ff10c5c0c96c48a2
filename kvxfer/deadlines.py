"""One rule for every timeout kvxfer accepts: a finite, positive number of seconds.

A NaN deadline compares false with every clock reading, so a loop waiting for it never
ends; an infinite or negative one disables the bound the caller thinks they set. Agents,
transfers and the side channel all check through :func:`check_timeout`, so the rule and its
message are the same everywhere.
"""

from __future__ import annotations

import math
import select

from .errors import InvalidTimeoutError

__all__ = ["check_timeout", "readable"]


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
