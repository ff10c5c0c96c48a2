"""Helpers more than one test file needs, written once (fixtures built on them: conftest.py)."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

from kvxfer.errors import HandshakeError

__all__ = ["Errors", "has_nixl", "wait_until"]


class Errors:
    """Collects what a side-channel server reports through ``on_error``, with a blocking ``get``."""

    def __init__(self) -> None:
        self.q: queue.Queue[HandshakeError] = queue.Queue()

    def __call__(self, error: HandshakeError) -> None:
        self.q.put(error)

    def get(self) -> HandshakeError:
        return self.q.get(timeout=30)


def wait_until(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something true (returned), or fail after ``timeout``.

    ``interval`` stays coarse because a predicate may ask etcd: the etcd tests always polled
    at 50 ms, and one failed its 30 s wait once when polled at 20 ms on the loaded VM.
    """
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(interval)


def has_nixl() -> bool:
    """Whether the nixl package imports here (its tests are skipped, with the reason, if not)."""
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True
