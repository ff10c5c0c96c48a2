"""The one hang guard of kvxfer's tests: poll a condition until it holds, or fail after a bound.

A test that loops on ``poll()`` by hand either forgets the bound (and hangs CI instead of
failing) or writes it again; the core's tests, the plugins' tests and the tinycopy example
all wait through :func:`wait_until` instead. Its ``timeout`` is a hang guard, never a timed
assertion: it is sized for a loaded machine, far above what a passing run needs.
"""

from __future__ import annotations

import time
from typing import Any, Callable
from ..deadlines import Deadline

__all__ = ["wait_until"]


def wait_until(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something true (returned), or fail after ``timeout``.

    ``interval`` stays coarse by default because a predicate may ask etcd: the etcd tests
    always polled at 50 ms, and one failed its 30 s wait once when polled at 20 ms on the
    loaded VM. A predicate that drives a transfer (``poll``) passes ``interval=0``: it only
    yields the processor between polls.
    """
    deadline = Deadline.within(timeout)
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(interval)
