"""The Mooncake Store client, reached without ever waiting longer than the caller allows.

The client library is imported here, when a tier is created, never by ``import kvxfer``. Its
``setup()`` blocks for about 90 s when no master answers, and a call during a master outage
blocks for seconds: so the master's port is probed first (a refused or silent port is a
typed error at once), and every client call runs on a worker thread that the caller waits
for only until its deadline (a call still blocked then is left to finish on its own; its
result is ignored). Return codes become typed errors in :func:`typed`.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Callable, TypeVar

from ..errors import (InvalidArgumentError, MissingDependencyError, StoreCorruptError, StoreError, StoreFullError,
                      StoreMissError, StoreUnavailableError, TransferTimeoutError)

__all__ = ["INSTALL", "Client", "parse_master", "probe", "typed", "MISSING", "LEASED", "UNREACHABLE", "GONE", "SIZE"]

INSTALL = "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1   (and: apt-get install -y libibverbs1)"

# Mooncake Store's error codes met in practice (docs/storage.md, the cluster tier).
MISSING = -704  # no such object (never written, evicted, lost with a master restart)
LEASED = -706  # a read's lease still holds the object: it cannot be removed yet
LEASE_EXPIRED = -707  # a read's lease ended before its transfer did (the lease is shorter than the read)
GONE = -800  # the client holding the object's segment is gone (until its TTL expires)
NO_SPACE = -200  # no segment can take the object
UNREACHABLE = -900  # the master does not answer
SIZE = -600  # the object's size is not the buffer's (not an object of ours)

T = TypeVar("T")


def parse_master(master: str) -> tuple[str, int]:
    """``host:port`` of a master, checked."""
    if not isinstance(master, str) or len(master) > 261 or master.count(":") != 1:  # a DNS name and a port
        raise InvalidArgumentError(f"master must be 'host:port', got {master!r:.80}")
    host, _, port = master.partition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"master must be 'host:port' with a port in 1..65535, got {master!r:.80}")
    return host, int(port)


def probe(host: str, port: int, deadline: float) -> None:
    """Connect to the master's RPC port once, within the deadline: a typed error, not a 90 s
    ``setup()``, when nothing listens there."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeoutError(f"no time left to reach the Mooncake master at {host}:{port}")
    try:
        socket.create_connection((host, port), timeout=left).close()
    except OSError as exc:
        raise StoreUnavailableError(f"the Mooncake master at {host}:{port} does not answer ({exc}); start one "
                                    "(docs/storage.md, 'The cluster tier') or fix the address") from None


def typed(code: int, what: str, keys: list[bytes]) -> StoreError:
    """The typed error for a Mooncake return code (negative) about ``keys``."""
    if code == MISSING:
        return StoreMissError(f"{what}: {len(keys)} object(s) not in the cluster store (never written, evicted, "
                              "or lost with a master restart)", keys)
    if code == GONE:
        return StoreUnavailableError(f"{what}: the client holding {len(keys)} object(s) is gone", keys)
    if code == LEASE_EXPIRED:
        return StoreUnavailableError(f"{what}: the read's lease of {len(keys)} object(s) ended before the transfer "
                                     "did (the master's default_kv_lease_ttl is shorter than this read)", keys)
    if code == UNREACHABLE:
        return StoreUnavailableError(f"{what}: the Mooncake master does not answer", keys)
    if code == SIZE:
        return StoreCorruptError(f"{what}: {len(keys)} object(s) of another size than a row of this layout "
                                 "(not ours): recompute those blocks", keys)
    if code == NO_SPACE:
        return StoreFullError(f"{what}: no segment of the cluster store can take {len(keys)} object(s) "
                              "(mount more segments, or offload less)")
    return StoreUnavailableError(f"{what}: Mooncake Store returned {code} for {len(keys)} object(s)", keys)


class Client:
    """One Mooncake Store client; each call bounded by a deadline (:meth:`call`)."""

    def __init__(self, master: str, hostname: str, segment: int, local_buffer: int, protocol: str, device: str,
                 metadata: str, deadline: float) -> None:
        host, port = parse_master(master)
        probe(host, port, deadline)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise MissingDependencyError(f"the cluster tier needs Mooncake Store: {INSTALL} ({exc})") from None
        self.store: Any = MooncakeDistributedStore()
        self.master = master
        # Calls still running (one left behind by its deadline included): the client is closed
        # only once none is, since closing it under a running call frees what the call uses.
        self._busy, self._closing, self._state = 0, False, threading.Lock()
        rc = self.call(lambda: self.store.setup(hostname, metadata, segment, local_buffer, protocol, device, master),
                       deadline, "connecting to the Mooncake master")
        if rc != 0:
            raise StoreUnavailableError(f"Mooncake Store setup() returned {rc} (master {master}, this host "
                                        f"{hostname}, protocol {protocol})")

    def call(self, fn: Callable[[], T], deadline: float, what: str) -> T:
        """``fn()`` on a daemon thread (one left blocked must not hold the interpreter's exit),
        waited for until ``deadline`` (monotonic)."""
        fut: "Future[T]" = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
            finally:
                with self._state:
                    self._busy -= 1
                    last = self._closing and self._busy == 0
                if last:
                    self._close()

        with self._state:
            if self._closing:
                raise StoreError("the Mooncake client is closed")
            self._busy += 1

        threading.Thread(target=run, name="kvxfer-mooncake-call", daemon=True).start()
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise TransferTimeoutError(f"{what}: the Mooncake client did not return by the deadline (master "
                                       f"{self.master}); the call is left to finish on its own") from None

    def close(self) -> None:
        """Leave the cluster now, or when the last call still running returns."""
        with self._state:
            if self._closing:
                return
            self._closing = True
            if self._busy:
                return
        self._close()

    def _close(self) -> None:
        try:
            self.store.close()
        except Exception:  # closing a client whose master is gone must not hide the caller's error
            pass
