"""The watch behind :meth:`Directory.watch` and :meth:`Directory.snapshot`: list, then follow.

One thread per directory keeps a validated copy of the cluster's records. It lists the
cluster prefix, then follows changes from the revision after the listing. When the store
goes away (or cannot replay the changes missed), it lists again once the store is back and
reports the difference as events: a worker that died during the outage is reported
``removed`` then, not never. While the store is away the copy is kept as it was, so peers
already known keep working and :meth:`Directory.snapshot` keeps answering.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..deadlines import Backoff, Deadline
from ..errors import MetadataError
from .entry import DirectoryError, DirectoryUnavailableError, Entry, Event, EventKind, ResyncNeeded

__all__ = ["Watcher", "Subscription"]


class Directory(Protocol):
    """What the watch reads of its :class:`~kvxfer.directory.base.Directory` (a Protocol here,
    so this module needs nothing from the one that imports it)."""

    cluster: str
    prefix: str
    timeout: float
    store: Any

    def entry_from_store(self, key: Any, value: bytes, revision: int = 0) -> Entry: ...

log = logging.getLogger(__name__)

#: Seconds a watch stream may stay silent before it is re-opened (a cut network shows up
#: as silence, not as an error, so this also bounds how long a dead stream goes unnoticed).
IDLE = 2.0


class Subscription:
    """Handle of one :meth:`Directory.watch` callback; :meth:`cancel` stops its calls."""

    def __init__(self, watcher: "Watcher", callback: Callable[[Event], None], role: str | None) -> None:
        self._watcher, self.callback, self.role = watcher, callback, role

    def cancel(self) -> None:
        self._watcher.unsubscribe(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def _kind(prev: Entry | None, new: Entry) -> EventKind | None:
    if prev is None:
        return "added"
    if new.generation > prev.generation:
        return "restarted"
    if new != prev:
        return "updated"
    return None


class Watcher:
    def __init__(self, directory: "Directory") -> None:
        self._dir = directory
        self._cache: dict[str, Entry] = {}
        self._subs: list[Subscription] = []
        self._cache_lock = threading.Lock()
        self._dispatch_lock = threading.RLock()  # callbacks of one subscriber never overlap or reorder
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stop = threading.Event()
        self._synced = threading.Event()
        self.connected = False
        self.last_error: BaseException | None = None
        #: Records skipped because they failed validation (foreign or hostile writers).
        self.rejected = 0
        self.idle = IDLE

    # -- API used by Directory --------------------------------------------------------------
    def start(self, deadline: float | None = None) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"kvxfer-directory-watch-{self._dir.cluster}")
                self._thread.start()
        if deadline is not None and not self._synced.wait(max(0.0, deadline - time.monotonic())):
            raise DirectoryUnavailableError(
                f"the directory's first listing did not complete before the deadline: {self.last_error or 'no answer'}")

    def subscribe(self, callback: Callable[[Event], None], role: str | None) -> Subscription:
        sub = Subscription(self, callback, role)
        with self._dispatch_lock:
            with self._cache_lock:
                self._subs.append(sub)
                current = list(self._cache.values())
            for e in current:  # a late subscriber first hears about everyone already there
                self._deliver(sub, Event("added", e))
        self.start()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._cache_lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def entries(self) -> list[Entry]:
        with self._cache_lock:
            return sorted(self._cache.values(), key=lambda e: (e.role, e.tp_rank, e.pp_rank, e.name))

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self._dir.timeout + self.idle + 1)

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        d, store = self._dir, self._dir.store
        rev: int | None = None
        backoff = Backoff(0.1, 2.0)  # between attempts to reach a lost store
        while not self._stop.is_set():
            try:
                if rev is None:
                    items, revision = store.range(d.prefix, Deadline.within(d.timeout))
                    self._apply_listing(items)
                    rev = revision + 1
                    if not self.connected and self.last_error is not None:
                        log.info("directory %s: watch resynchronised", d.cluster)
                    self.connected, self.last_error = True, None
                    backoff.reset()
                    self._synced.set()
                rev = store.watch(d.prefix, rev, self._on_change, self._stop, self.idle,
                                  Deadline.within(d.timeout))
            except DirectoryError as exc:
                if not isinstance(exc, ResyncNeeded):
                    if self.connected:
                        log.warning("directory %s: watch lost the store: %s", d.cluster, exc)
                    self.connected, self.last_error = False, exc
                    self._stop.wait(backoff.next())
                rev = None
            except Exception as exc:  # never let the thread die: a dead watch would hide departures
                log.exception("directory %s: unexpected error in the watch", d.cluster)
                self.connected, self.last_error, rev = False, exc, None
                self._stop.wait(1.0)
        self.connected = False

    def _decode(self, key: Any, value: bytes, rev: int) -> Entry | None:
        try:
            return self._dir.entry_from_store(key, value, rev)
        except MetadataError as exc:
            self.rejected += 1
            log.warning("directory %s: ignoring an invalid record: %s", self._dir.cluster, exc)
            return None

    def _apply_listing(self, items: list[tuple[Any, bytes, int]]) -> None:
        fresh: dict[str, Entry] = {}
        for key, value, rev in items:
            e = self._decode(key, value, rev)
            if e is not None:
                fresh[e.key] = e
        events: list[Event] = []
        with self._cache_lock:
            for key, old in self._cache.items():
                if key not in fresh:
                    events.append(Event("removed", old, old))
            for key, e in fresh.items():
                prev = self._cache.get(key)
                kind = _kind(prev, e)
                if kind is not None:
                    events.append(Event(kind, e, prev))
            self._cache = fresh
        self._dispatch(events)

    def _on_change(self, kind: str, key: Any, value: bytes | None, rev: int) -> None:
        new = self._decode(key, value, rev) if kind == "put" and value is not None else None
        events: list[Event] = []
        with self._cache_lock:
            skey = key.decode("utf-8", "replace") if isinstance(key, (bytes, bytearray)) else str(key)
            prev = self._cache.get(skey)
            if new is None:  # deleted, or overwritten with something invalid: the worker is gone
                if prev is not None:
                    del self._cache[skey]
                    events.append(Event("removed", prev, prev))
            else:
                self._cache[new.key] = new
                k = _kind(prev, new)
                if k is not None:
                    events.append(Event(k, new, prev))
        self._dispatch(events)

    def _dispatch(self, events: list[Event]) -> None:
        if not events:
            return
        with self._dispatch_lock:
            with self._cache_lock:
                subs = list(self._subs)
            for ev in events:
                for sub in subs:
                    self._deliver(sub, ev)

    @staticmethod
    def _deliver(sub: Subscription, ev: Event) -> None:
        if sub.role is not None and ev.entry.role != sub.role:
            return
        try:
            sub.callback(ev)
        except Exception:
            log.exception("directory watch callback %r failed on %s of %s", sub.callback, ev.kind, ev.entry.name)
