"""A metadata directory: workers publish their agent metadata, find each other, follow changes.

Next to the side channel (two workers swap metadata directly), a directory serves a fleet:
every worker publishes under ``kvxfer/v1/<cluster>/<role>/tp<T>-pp<P>/<name>`` with a lease,
so a worker that dies disappears within the lease's TTL; a watch reports arrivals, restarts
(a new generation) and departures; lookups go by name or by role and rank. Two stores:

* :class:`InProcessDirectory` - agents of one process (tests, single-host tools);
* :class:`EtcdDirectory` - etcd, for workers on many hosts (``pip install 'kvxfer[etcd]'``).

Typical use on a decode worker::

    from kvxfer.directory import EtcdDirectory, PeerTracker
    d = EtcdDirectory("http://10.0.0.5:2379", cluster="llama-70b")
    d.publish(agent, role="decode", tp_rank=0)
    prefills = PeerTracker(agent, d, role="prefill", tp_rank=0)
    ...
    prefills.sync()                 # in the agent's thread: add, refresh, drop peers
    agent.read(name, local, remote).wait()

The key layout is in :mod:`kvxfer.directory.keys`, the value format in
:mod:`kvxfer.directory.codec`, the choices behind it in docs/directory.md. Importing this
package imports no etcd client; :class:`EtcdDirectory` loads ``etcd3gw`` when created.
"""

from __future__ import annotations

from typing import Any

from .base import Directory, Store, Subscription
from .entry import (DirectoryError, DirectoryUnavailableError, Entry, Event, LeaseLostError, NotPublishedError,
                    ResyncNeeded)
from .keys import entry_key, parse_key
from .memory import InProcessDirectory, MemoryStore
from .tracker import PeerTracker, SyncResult

__all__ = ["Directory", "Store", "Subscription", "Entry", "Event", "DirectoryError", "DirectoryUnavailableError",
           "NotPublishedError", "LeaseLostError", "ResyncNeeded", "entry_key", "parse_key", "InProcessDirectory",
           "MemoryStore", "PeerTracker", "SyncResult", "EtcdDirectory", "EtcdStore", "open_directory"]


def __getattr__(name: str) -> Any:
    if name in ("EtcdDirectory", "EtcdStore"):
        from . import etcd

        return getattr(etcd, name)
    raise AttributeError(name)


def open_directory(url: str, cluster: str = "default", **options: Any) -> Directory:
    """A directory from a URL: ``memory://`` (this process) or ``http(s)://host:port`` (etcd)."""
    if url.startswith("memory:"):
        return InProcessDirectory(cluster, **options)
    if url.startswith(("etcd://", "etcds://")):
        url = ("https://" if url.startswith("etcds://") else "http://") + url.split("://", 1)[1]
    from .etcd import EtcdDirectory

    return EtcdDirectory(url, cluster, **options)
