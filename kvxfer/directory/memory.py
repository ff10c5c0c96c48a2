"""A directory store inside one process: leases, revisions and watches, without a server.

For agents that share a process (tests, single-host tools, the loopback backend) and as the
reference behaviour of a store: it keeps a revision counter and a bounded change history like
etcd, expires leases on time, and can be switched off (:meth:`MemoryStore.down`) to rehearse
an outage.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable
from ..deadlines import Deadline
from .base import Directory, OnChange, Store, StoredItem
from .entry import DirectoryUnavailableError, LeaseLostError, ResyncNeeded

__all__ = ["MemoryStore", "InProcessDirectory"]

_TICK = 0.05  # how often a waiting watch checks for expired leases


class MemoryStore(Store):
    """Records shared by every :class:`InProcessDirectory` built over the same instance."""

    _default: "MemoryStore | None" = None
    _default_lock = threading.Lock()

    def __init__(self, history: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._cond = threading.Condition()
        self._kv: dict[str, tuple[bytes, int, int]] = {}  # key -> (value, lease, mod_revision)
        self._leases: dict[int, tuple[float, float]] = {}  # lease -> (ttl, expiry)
        self._ids = itertools.count(1)
        self._rev = 1
        self._log: list[tuple[int, str, str, bytes | None]] = []  # (revision, kind, key, value)
        self._history = history
        self._compacted = 0  # changes at or below this revision are no longer replayable
        self._clock = clock
        self.available = True

    @classmethod
    def default(cls) -> "MemoryStore":
        """The process-wide store that :class:`InProcessDirectory` uses unless given one."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls()
            return cls._default

    # -- rehearsing outages -----------------------------------------------------------------
    def down(self) -> None:
        """Every call fails with :class:`DirectoryUnavailableError` until :meth:`up`."""
        with self._cond:
            self.available = False
            self._cond.notify_all()

    def up(self, *, wipe: bool = False) -> None:
        """Back again; ``wipe`` forgets every record and lease, like a store that lost its data."""
        with self._cond:
            if wipe:
                for key in list(self._kv):
                    self._change("delete", key, None)
                self._leases.clear()
            self.available = True
            self._cond.notify_all()

    # -- internals (self._cond held) --------------------------------------------------------
    def _check(self) -> None:
        if not self.available:
            raise DirectoryUnavailableError("the in-process directory store is down")
        now = self._clock()
        for lease, (_, expiry) in list(self._leases.items()):
            if expiry <= now:
                self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        self._leases.pop(lease, None)
        for key in [k for k, (_, ls, _) in self._kv.items() if ls == lease]:
            self._change("delete", key, None)

    def _change(self, kind: str, key: str, value: bytes | None, lease: int = 0) -> None:
        self._rev += 1
        if kind == "put":
            assert value is not None
            self._kv[key] = (value, lease, self._rev)
        else:
            self._kv.pop(key, None)
        self._log.append((self._rev, kind, key, value, lease))
        if len(self._log) > self._history:
            drop = len(self._log) - self._history
            self._compacted = self._log[drop - 1][0]
            del self._log[:drop]
        self._cond.notify_all()

    # -- Store ------------------------------------------------------------------------------
    def grant(self, ttl: int, deadline: float) -> int:
        with self._cond:
            self._check()
            lease = next(self._ids)
            self._leases[lease] = (float(ttl), self._clock() + ttl)
            return lease

    def keepalive(self, lease: int, deadline: float) -> bool:
        with self._cond:
            self._check()
            if lease not in self._leases:
                return False
            ttl = self._leases[lease][0]
            self._leases[lease] = (ttl, self._clock() + ttl)
            return True

    def revoke(self, lease: int, deadline: float) -> None:
        with self._cond:
            self._check()
            self._drop_lease(lease)

    def put(self, key: str, value: bytes, lease: int, deadline: float) -> None:
        with self._cond:
            self._check()
            if lease not in self._leases:
                raise LeaseLostError(f"lease {lease} is not known to the store")
            self._change("put", key, bytes(value), lease)

    def delete_if(self, key: str, value: bytes, deadline: float) -> None:
        with self._cond:
            self._check()
            cur = self._kv.get(key)
            if cur is not None and cur[0] == value:
                self._change("delete", key, None)

    def write_raw(self, key: str, value: bytes) -> None:
        """Store any bytes without a lease (for tests: what a foreign or hostile writer can do)."""
        with self._cond:
            self._check()
            self._change("put", key, bytes(value))

    def range(self, prefix: str, deadline: float) -> tuple[list[StoredItem], int]:
        with self._cond:
            self._check()
            items: list[StoredItem] = [(k, v, rev) for k, (v, ls, rev) in sorted(self._kv.items())
                                       if k.startswith(prefix) and ls]  # a leaseless record never expires: unread
            return items, self._rev

    def watch(self, prefix: str, start_revision: int, on_change: OnChange, stop: threading.Event,
              idle: float, connect_deadline: float) -> int:
        rev = start_revision
        quiet_until = Deadline.within(idle)
        while not stop.is_set():
            with self._cond:
                self._check()
                if rev <= self._compacted:
                    raise ResyncNeeded(f"changes from revision {rev} are no longer kept")
                i = bisect.bisect_left(self._log, rev, key=lambda c: c[0])
                changes = [c for c in self._log[i:] if c[2].startswith(prefix)]
                if self._log and i < len(self._log):
                    next_rev = self._log[-1][0] + 1
                else:
                    next_rev = rev
                if not changes:
                    rev = next_rev
                    left = quiet_until - time.monotonic()
                    if left <= 0:
                        return rev
                    self._cond.wait(min(_TICK, left))
                    continue
            for r, kind, key, value, lease in changes:
                if kind == "put" and not lease:  # see Store.range: such a record reads as gone
                    kind, value = "delete", None
                on_change(kind, key, value, r)
            rev = next_rev
            quiet_until = Deadline.within(idle)
        return rev


class InProcessDirectory(Directory):
    """:class:`~kvxfer.directory.Directory` over a :class:`MemoryStore` (the process-wide one by default)."""

    def __init__(self, cluster: str = "default", *, store: MemoryStore | None = None, ttl: float = 10.0,
                 timeout: float = 5.0, token: bytes | str | None = None) -> None:
        super().__init__(store or MemoryStore.default(), cluster, ttl=ttl, timeout=timeout, token=token)
