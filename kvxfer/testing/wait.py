"""The one hang guard of kvxfer's tests: poll a condition until it holds, or fail after a bound.

A test that loops on ``poll()`` by hand either forgets the bound (and hangs CI instead of
failing) or writes it again; the core's tests, the plugins' tests and the tinycopy example
all wait through :func:`wait_until` instead. Its ``timeout`` is a hang guard, never a timed
assertion: it is sized for a loaded machine, far above what a passing run needs.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any, Callable

from ..deadlines import Deadline

__all__ = ["wait_for_server", "wait_until"]


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


def wait_for_server(proc: "subprocess.Popen[bytes]", ready: Callable[[], bool], what: str, timeout: float,
                    log_tail: Callable[[], str], interval: float = 0.05) -> None:
    """Wait for a server child (etcd, a Mooncake master) to be ``ready``: one that exits first is a
    ``RuntimeError``, one not ready within ``timeout`` a ``TimeoutError``, each with its log's tail
    (the caller then kills it). A client started before its server listens can block far longer
    than any test's bound, so fixtures wait here first."""
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; log:\n{log_tail()}")
        return ready()

    try:
        wait_until(up, timeout, what, interval)
    except AssertionError:
        raise TimeoutError(f"{what} was not ready within {timeout}s; log:\n{log_tail()}") from None
