"""Helpers more than one test file needs, written once (fixtures built on them: conftest.py)."""

from __future__ import annotations

import queue

from kvxfer.errors import HandshakeError

__all__ = ["Errors", "has_nixl"]


class Errors:
    """Collects what a side-channel server reports through ``on_error``, with a blocking ``get``."""

    def __init__(self) -> None:
        self.q: queue.Queue[HandshakeError] = queue.Queue()

    def __call__(self, error: HandshakeError) -> None:
        self.q.put(error)

    def get(self) -> HandshakeError:
        return self.q.get(timeout=30)


def has_nixl() -> bool:
    """Whether the nixl package imports here (its tests are skipped, with the reason, if not)."""
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True
