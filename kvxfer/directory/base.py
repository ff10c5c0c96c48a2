"""The directory: publish this worker, find the others, follow their restarts and departures.

A :class:`Directory` is the API; where the records live is a *store* (a handful of methods,
:class:`Store`): :class:`~kvxfer.directory.memory.MemoryStore` inside one process, or
etcd (:class:`~kvxfer.directory.etcd.EtcdDirectory`). Everything with a policy in it (key
layout, validation of what comes back, leases and their renewal, deadlines, the watch cache,
resynchronisation after an outage) is written once, here, so each store stays a thin mapping
of a few primitives.

Liveness: a directory publishes under one lease of ``ttl`` seconds and renews it from a
background thread every ``ttl / 3``. A worker that dies stops renewing, and the store deletes
its records when the lease runs out; a worker that closes its directory revokes the lease,
and its records vanish at once. A worker that restarts publishes again under the same key
with a new generation, which watchers report as ``restarted``.

Deadlines: every call that talks to the store takes ``timeout`` (default: the directory's)
and either returns or raises :class:`DirectoryUnavailableError` by then; none waits longer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..deadlines import Deadline, check_timeout
from ..errors import MetadataError
from ..metadata import AgentMetadata
from .codec import check_token, encode_value
from .entry import (DirectoryError, DirectoryUnavailableError, Entry, Event, LeaseLostError, NotPublishedError,
                    ResyncNeeded)
from .keys import check_role, cluster_prefix, entry_key, rank_prefix, role_prefix
from .watcher import Subscription, Watcher

__all__ = ["Directory", "Store", "LeaseLostError", "ResyncNeeded", "StoredItem", "Subscription"]

log = logging.getLogger(__name__)

#: (key, value, mod_revision) as a store returns it; nothing in it is trusted yet.
StoredItem = tuple[Any, bytes, int]
#: on_change(kind, key, value, revision): kind is "put" or "delete" (value None).
OnChange = Callable[[str, Any, "bytes | None", int], None]


class Store(ABC):
    """The primitives a backing store provides. ``deadline`` is absolute, ``time.monotonic()``.

    Each raises :class:`DirectoryUnavailableError` when the store cannot be reached in time,
    :class:`DirectoryError` when it refuses, and nothing else.
    """

    @abstractmethod
    def grant(self, ttl: int, deadline: float) -> int: ...

    @abstractmethod
    def keepalive(self, lease: int, deadline: float) -> bool:
        """Renew; False when the store no longer knows the lease."""

    @abstractmethod
    def revoke(self, lease: int, deadline: float) -> None: ...

    @abstractmethod
    def put(self, key: str, value: bytes, lease: int, deadline: float) -> None:
        """Write under ``lease``; :class:`LeaseLostError` when the lease is gone."""

    @abstractmethod
    def delete_if(self, key: str, value: bytes, deadline: float) -> None:
        """Delete ``key`` only if it still holds ``value`` (a newer incarnation keeps its record)."""

    @abstractmethod
    def range(self, prefix: str, deadline: float) -> tuple[list[StoredItem], int]:
        """Everything under ``prefix`` held by a lease, and the store's revision at that moment.

        A record written without a lease would never expire (a replayed or forged record
        outliving every worker), so stores leave it out here and report a put of one to
        :meth:`watch` as a delete.
        """

    @abstractmethod
    def watch(self, prefix: str, start_revision: int, on_change: OnChange, stop: threading.Event,
              idle: float, connect_deadline: float) -> int:
        """Report changes from ``start_revision`` on until ``idle`` seconds pass without one
        (or ``stop`` is set); return the revision to resume from. :class:`ResyncNeeded` when
        history from ``start_revision`` is gone."""

    def close(self) -> None:
        """Release connections; the default has none."""


@dataclass
class _Publication:
    key: str
    value: bytes
    entry: Entry


class Directory:
    """Publish agents under ``kvxfer/v1/<cluster>/<role>/tp<T>-pp<P>/<name>`` and find them.

    ``ttl``: seconds a dead worker stays listed (at most; a store may round it up to its own
    minimum). ``timeout``: default deadline of every call. ``token``: sign what we publish and
    accept only entries signed with the same token (see :mod:`kvxfer.directory.codec`).
    """

    def __init__(self, store: Store, cluster: str = "default", *, ttl: float = 10.0, timeout: float = 5.0,
                 token: bytes | str | None = None) -> None:
        self.store = store
        self.cluster = cluster
        self.prefix = cluster_prefix(cluster)
        self.ttl = max(1, math.ceil(check_timeout(ttl, "ttl")))
        self.timeout = check_timeout(timeout)
        self._token = check_token(token)
        self._lock = threading.RLock()  # publications and the lease
        self._lease: int | None = None
        self._published: dict[str, _Publication] = {}
        self._orphans: dict[str, bytes] = {}  # key -> value of records we moved away from
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        #: Last error of the background lease renewal (None while healthy).
        self.publish_error: DirectoryError | None = None
        self._watcher = Watcher(self)

    def __enter__(self) -> "Directory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cluster={self.cluster!r} published={sorted(self._published)}>"

    @property
    def signed(self) -> bool:
        """Whether records are signed with a token: what a reader accepts was written by a holder."""
        return self._token is not None

    def _deadline(self, timeout: float | None) -> float:
        return Deadline.within(self.timeout) if timeout is None else Deadline.after(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise DirectoryError("this directory is closed; create a new one")

    def entry_from_store(self, key: Any, value: bytes, revision: int = 0) -> Entry:
        """Validate one stored record (used by the watch cache too)."""
        return Entry.from_stored(key, value, self.cluster, self._token, revision)

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, agent: Any, role: str, tp_rank: int = 0, pp_rank: int = 0, *,
                timeout: float | None = None) -> Entry:
        """Publish an :class:`~kvxfer.Agent` (or its ``metadata()`` bytes) until :meth:`close`.

        Publish again after the agent re-registers (its generation changes): the record is
        replaced and watchers see ``restarted``. Moving to another role or rank replaces the
        old record too.
        """
        self._check_open()
        metadata = agent.metadata() if hasattr(agent, "metadata") else agent
        if not isinstance(metadata, (bytes, bytearray)):
            raise MetadataError("publish() takes an Agent or its metadata() bytes")
        metadata = bytes(metadata)
        md = AgentMetadata.decode(metadata)
        key = entry_key(self.cluster, role, tp_rank, pp_rank, md.name)
        value = encode_value(key, metadata, self._token)
        entry = self.entry_from_store(key, value)
        deadline = self._deadline(timeout)
        with self._lock:
            if self._lease is None:
                self._lease = self.store.grant(self.ttl, deadline)
            try:
                self.store.put(key, value, self._lease, deadline)
            except LeaseLostError:
                self._republish(deadline)
                self.store.put(key, value, self._lease, deadline)
            old = self._published.get(md.name)
            self._published[md.name] = _Publication(key, value, entry)
            if old is not None and old.key != key:
                self._orphans[old.key] = old.value
            self._delete_orphans(deadline)
        self._start_keeper()
        return entry

    def unpublish(self, name: str, *, timeout: float | None = None) -> None:
        """Remove our record for ``name`` now (a record of a newer incarnation is left alone)."""
        self._check_open()
        deadline = self._deadline(timeout)
        with self._lock:
            pub = self._published.pop(name, None)
            if pub is not None:
                self._orphans[pub.key] = pub.value  # if this delete fails, the renewal thread retries
                self.store.delete_if(pub.key, pub.value, deadline)
                del self._orphans[pub.key]

    def _delete_orphans(self, deadline: float) -> None:
        """Remove our records left under an old role or rank; retried by the renewal thread.

        They share our lease, so they would otherwise live as long as we do.
        """
        for key, value in list(self._orphans.items()):
            try:
                self.store.delete_if(key, value, deadline)
            except DirectoryError as exc:
                log.info("directory %s: old record %s not removed yet: %s", self.cluster, key, exc)
                return
            del self._orphans[key]

    @property
    def published(self) -> list[Entry]:
        with self._lock:
            return [p.entry for p in self._published.values()]

    def _republish(self, deadline: float) -> None:
        """New lease, every record written again (after the store forgot the old lease)."""
        self._lease = self.store.grant(self.ttl, deadline)
        for pub in self._published.values():
            self.store.put(pub.key, pub.value, self._lease, deadline)
        log.info("directory %s: lease renewed after loss, %d record(s) published again", self.cluster,
                 len(self._published))

    def _start_keeper(self) -> None:
        with self._lock:
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name=f"kvxfer-directory-lease-{self.cluster}",
                                                daemon=True)
                self._keeper.start()

    def _keep(self) -> None:
        interval = max(0.2, self.ttl / 3)
        wait = interval
        while not self._stop.wait(wait):
            with self._lock:
                if self._lease is None or not (self._published or self._orphans) or self._closed:
                    continue
                deadline = Deadline.within(min(self.timeout, interval))
                try:
                    if not self.store.keepalive(self._lease, deadline):
                        self._republish(deadline)
                    self._delete_orphans(deadline)
                    if self.publish_error is not None:
                        log.info("directory %s: store reachable again", self.cluster)
                    self.publish_error, wait = None, interval
                except DirectoryError as exc:
                    if self.publish_error is None:
                        log.warning("directory %s: cannot renew the lease: %s", self.cluster, exc)
                    self.publish_error, wait = exc, min(interval, 0.5)

    # -- looking up ---------------------------------------------------------------------------
    def entries(self, role: str | None = None, tp_rank: int | None = None, pp_rank: int | None = None, *,
                timeout: float | None = None) -> list[Entry]:
        """Live entries (asked of the store now), sorted by role, ranks and name.

        Records that fail validation (a foreign or hostile writer) are skipped and logged.
        """
        self._check_open()
        if role is None:
            prefix = self.prefix
        elif tp_rank is not None and pp_rank is not None:
            prefix = rank_prefix(self.cluster, role, tp_rank, pp_rank)
        else:
            prefix = role_prefix(self.cluster, role)
        items, _ = self.store.range(prefix, self._deadline(timeout))
        out = []
        for key, value, rev in items:
            try:
                e = self.entry_from_store(key, value, rev)
            except MetadataError as exc:
                log.warning("directory %s: skipping an invalid record: %s", self.cluster, exc)
                continue
            if e.matches(role, tp_rank, pp_rank):
                out.append(e)
        return sorted(out, key=lambda e: (e.role, e.tp_rank, e.pp_rank, e.name))

    def lookup(self, name: str, *, role: str | None = None, timeout: float | None = None) -> Entry:
        """The live entry of agent ``name`` (the newest generation if several are listed)."""
        if role is not None:
            check_role(role)
        found = [e for e in self.entries(role, timeout=timeout) if e.name == name]
        if not found:
            raise NotPublishedError(f"no live worker named {name!r} in cluster {self.cluster!r}")
        return max(found, key=lambda e: e.generation)

    def find(self, role: str, tp_rank: int | None = None, pp_rank: int | None = None, *,
             timeout: float | None = None) -> list[Entry]:
        """Live workers of ``role`` (at a TP and/or PP rank, when given)."""
        return self.entries(check_role(role), tp_rank, pp_rank, timeout=timeout)

    def wait_for(self, *, name: str | None = None, role: str | None = None, tp_rank: int | None = None,
                 pp_rank: int | None = None, count: int = 1, timeout: float | None = None) -> list[Entry]:
        """Poll until at least ``count`` matching workers are live; raise at the deadline.

        :class:`NotPublishedError` if the store answered but too few are listed,
        :class:`DirectoryUnavailableError` if the store could not be reached at all.
        """
        deadline = self._deadline(timeout)
        pause, last_error = 0.05, None
        while True:
            left = deadline - time.monotonic()
            if left > 0:
                try:
                    found = [e for e in self.entries(role, tp_rank, pp_rank, timeout=left) if e.matches(name=name)]
                    last_error = None
                    if len(found) >= count:
                        return found
                except DirectoryUnavailableError as exc:
                    last_error = exc
            if pause >= deadline - time.monotonic():
                what = f"name={name!r} role={role!r} tp={tp_rank} pp={pp_rank}"
                if last_error is not None:
                    raise DirectoryUnavailableError(f"directory unreachable while waiting for {what}: "
                                                    f"{last_error}") from last_error
                raise NotPublishedError(f"fewer than {count} live worker(s) with {what} in cluster "
                                        f"{self.cluster!r} before the deadline")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    # -- watching -----------------------------------------------------------------------------
    def watch(self, callback: Callable[[Event], None], *, role: str | None = None) -> Subscription:
        """Call ``callback(event)`` for every change (from a background thread).

        The first call starts the watch: it lists the cluster once, then follows changes;
        after an outage it lists again and reports the difference, so no departure is missed.
        Exceptions from the callback are logged and do not stop the watch.
        """
        self._check_open()
        return self._watcher.subscribe(callback, role)

    def snapshot(self, role: str | None = None, tp_rank: int | None = None, pp_rank: int | None = None, *,
                 timeout: float | None = None) -> list[Entry]:
        """Entries as the watch last saw them: no round trip, still served during an outage.

        Starts the watch if needed and waits (up to ``timeout``) for its first listing.
        """
        self._check_open()
        self._watcher.start(self._deadline(timeout))
        return [e for e in self._watcher.entries() if e.matches(role, tp_rank, pp_rank)]

    @property
    def rejected(self) -> int:
        """Records the watch skipped because they failed validation (foreign or hostile writers)."""
        return self._watcher.rejected

    @property
    def watch_connected(self) -> bool:
        """True while the watch follows the store (False before it starts and during outages)."""
        return self._watcher.connected

    # -- lifetime -----------------------------------------------------------------------------
    def close(self, *, revoke: bool = True, timeout: float | None = None) -> None:
        """Stop renewing and watching; with ``revoke`` our records vanish at once. Idempotent.

        ``revoke=False`` leaves them to expire with the lease, as if the process had died.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._watcher.stop()
        if self._keeper is not None:
            self._keeper.join(timeout=self.timeout + 1)
        with self._lock:
            lease, self._lease = self._lease, None
            self._published.clear()
        try:
            if revoke and lease is not None:
                self.store.revoke(lease, self._deadline(timeout))
        except DirectoryError as exc:
            log.warning("directory %s: could not revoke the lease on close (records expire within %ss): %s",
                        self.cluster, self.ttl, exc)
        finally:
            self._watcher.join()
            self.store.close()

    @property
    def closed(self) -> bool:
        return self._closed
