"""Lookups in the cluster tier from a process that holds no cache: a scheduler's view.

A scheduler answers "how much of this prompt is stored?" before any block is allocated, and
it owns no KV cache to register: :class:`MooncakeLookup` is a Mooncake Store client that lends
no segment, registers no buffer and moves no row, only asks the master which objects exist.
The layout fingerprint that namespaces the objects comes from the worker that owns the cache
(:attr:`MooncakeTier.geometry <kvxfer.tiers.MooncakeTier>`), so both name the same objects.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from ..deadlines import Deadline, check_timeout
from ..errors import InvalidArgumentError
from ..store.store import _keys
from . import _client
from .objects import object_name

__all__ = ["MooncakeLookup", "exist"]

_FINGERPRINT = re.compile(r"[0-9a-f]{1,64}")


def exist(client: _client.Client, keys: Sequence[bytes], names: list[str], deadline: float) -> np.ndarray:
    """A bool per key: its object is in the cluster now. A negative code (the master gone) is
    a typed error naming those keys."""
    if not names:
        return np.zeros(0, dtype=bool)
    got = np.asarray(client.call(lambda: client.store.batch_is_exist(names), deadline, "lookup"), dtype=np.int64)
    bad = got < 0
    if bad.any():
        raise _client.typed(int(got[bad][0]), "lookup", [k for k, b in zip(keys, bad.tolist()) if b])
    return got == 1


def check_namespace(namespace: Any) -> str:
    if not isinstance(namespace, str) or not 0 < len(namespace) <= 64 or "/" in namespace:
        raise InvalidArgumentError(f"namespace must be 1 to 64 characters without '/', got {namespace!r:.80}")
    return namespace


class MooncakeLookup:
    """Which of a layout's objects the cluster holds (``lookup``/``prefix``, as a tier's).

    ``fingerprint``: the layout's (a worker's ``MooncakeTier.geometry.fingerprint``);
    ``namespace``: the tier's. ``timeout``: the deadline of creation and of each lookup.
    """

    def __init__(self, master: str, fingerprint: str, *, namespace: str = "kvxfer", hostname: str = "127.0.0.1",
                 protocol: str = "tcp", metadata: str = "P2PHANDSHAKE", timeout: float = 5.0) -> None:
        if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
            raise InvalidArgumentError(f"a layout fingerprint is 1 to 64 hex digits, got {fingerprint!r:.80}")
        self.fingerprint, self.namespace = fingerprint, check_namespace(namespace)
        self.timeout = check_timeout(timeout, "MooncakeLookup timeout")
        self._client = _client.Client(master, hostname, 0, 0, protocol, "", metadata, Deadline.within(self.timeout))

    def __repr__(self) -> str:
        return f"<MooncakeLookup {self._client.master} {self.fingerprint}>"

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> np.ndarray:
        ks = _keys(keys)
        names = [object_name(self.namespace, self.fingerprint, k) for k in ks]
        return exist(self._client, ks, names, Deadline.within(self.timeout if timeout is None else
                                                             check_timeout(timeout)))

    def prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        hit = self.lookup(keys, timeout=timeout)
        return int(hit.shape[0] if hit.all() else np.argmin(hit))

    def close(self) -> None:
        self._client.close()
