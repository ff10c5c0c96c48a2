"""The live backends of this process, keyed by instance id: the one registry a backend keeps.

A backend whose peer lives in this very process can skip its transport (a memmove, a device
copy without IPC handles) by finding the peer's object here from the instance id in the
peer's blob. A blob is bytes from the network, though, and instance ids travel in blobs, so
an id alone proves nothing: :meth:`Live.find` answers only when the blob also carries the
token the caller expects of this process (``identity.here().token``, or a capability's), so
a blob forged elsewhere with a copied id is never resolved to a live object. There is no
lookup by id alone. Values are weak (a dropped backend leaves by itself), access is locked
(backends are closed from any thread), and a forked child starts empty: it shares no live
backend with its parent.
"""

from __future__ import annotations

import hmac
import threading
import weakref
from typing import Generic, Hashable, TypeVar

from ..peers.identity import on_fork

__all__ = ["Live"]

T = TypeVar("T")


class Live(Generic[T]):
    """One kind of backend's live instances, by id (``live[id] = backend`` on open,
    ``live.pop(id)`` on close)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: "weakref.WeakValueDictionary[Hashable, T]" = weakref.WeakValueDictionary()
        on_fork(self._forget_all)

    def __setitem__(self, key: Hashable, backend: T) -> None:
        with self._lock:
            self._by_id[key] = backend

    def pop(self, key: Hashable, default: T | None = None) -> T | None:
        with self._lock:
            return self._by_id.pop(key, default)

    def find(self, key: Hashable, claimed: bytes, expected: bytes) -> T | None:
        """The live backend ``key`` names, if the blob that named it carries ``claimed`` equal
        to ``expected``, the token of this process; None otherwise (also for an empty token)."""
        if not expected or not hmac.compare_digest(bytes(claimed), bytes(expected)):
            return None
        with self._lock:
            return self._by_id.get(key)

    def values(self) -> list[T]:
        """A snapshot of this process's own live backends (to close them, or pump their notices)."""
        with self._lock:
            return list(self._by_id.values())

    def items(self) -> list[tuple[Hashable, T]]:
        with self._lock:
            return list(self._by_id.items())

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` names a live backend here: a yes/no that hands out no object (a blob
        naming one of ours must then prove it came from this process)."""
        with self._lock:
            return key in self._by_id

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def _forget_all(self) -> None:
        # in the child, right after fork: the lock may have been held by a parent's thread
        self._lock = threading.Lock()
        self._by_id = weakref.WeakValueDictionary()
