"""Host copies a backend makes itself, reported to the core while it posts (verified READs).

A backend that copies host bytes with its own ``memmove`` (loopback) can tell the core after
each copy; the core then hashes the destination row while it is still in the cache, instead
of reading it back from memory after DONE (:class:`kvxfer.integrity.overlap.Folded`; issue 37
measured copy then hash at +36 %, hashing each row right after its copy at +5 %). Only the
backend the core posted to is told: one wrapped by another (a test's fault injector, which
may change bytes after the inner copy) is not, so such a change is still caught after DONE.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator

__all__ = ["reports", "watcher", "watching"]

Watch = Callable[[int, int], None]
_WATCH: ContextVar[tuple[object, Watch] | None] = ContextVar("kvxfer_copies", default=None)
_REPORTERS: set[type] = set()  # backend classes seen reporting their copies to a watcher


def watcher(backend: object) -> Watch | None:
    """What ``backend`` calls after each host copy it makes inside the current post, with the
    destination address and byte count; None when nobody watches (then it calls nothing)."""
    w = _WATCH.get()
    if w is not None and w[0] is backend:
        _REPORTERS.add(type(backend))
        return w[1]
    return None


def reports(backend: object) -> bool:
    """Whether ``backend``'s class was seen reporting its copies: the core then folds the check
    into them rather than posting a verified READ in parts (which only adds posts there)."""
    return type(backend) in _REPORTERS


@contextlib.contextmanager
def watching(backend: object, fn: Watch) -> Iterator[None]:
    """The core's side: ``fn`` hears ``backend``'s copies for the duration of the block."""
    token = _WATCH.set((backend, fn))
    try:
        yield
    finally:
        _WATCH.reset(token)
