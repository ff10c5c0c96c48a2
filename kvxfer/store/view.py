"""A read-only view of a store's index, for a process that must not open the store.

One :class:`~kvxfer.Store` holds a slab at a time (its ``flock``), but another process may
need to know what it holds: vLLM's scheduler decides which prompt prefixes to load while a
worker process owns the store. The view replays the index journal (the same crash-consistent
records an opening store replays) without locking or writing anything, and again only when
the file changed. It is a hint: an entry it shows may be evicted or found damaged before a
restore, which the restore reports as a miss. docs/storage.md has the journal format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import StoreError
from .journal import replay

__all__ = ["IndexView", "ViewHandle"]


@dataclass(frozen=True)
class ViewHandle:
    """What a view needs to find and check one store's journal (plain values: it crosses processes)."""

    index_path: str
    fingerprint: str
    slots: int

    @classmethod
    def of(cls, store: Any) -> "ViewHandle":
        """The handle of an open :class:`~kvxfer.Store`."""
        return cls(store._slab.index_path, store.geometry.fingerprint, int(store.slots))


class IndexView:
    """The keys a store's journal holds, as of the last time the file changed."""

    def __init__(self, handle: ViewHandle) -> None:
        self.handle = handle
        self._stamp: tuple[int, int, int] | None = None
        self._keys: frozenset[bytes] = frozenset()

    def keys(self) -> frozenset[bytes]:
        """Live keys; re-read when the journal's inode, size or mtime changed (a compaction
        renames a new file over it, an append grows it). Absent or foreign: no keys."""
        h = self.handle
        try:
            st = os.stat(h.index_path)
        except OSError:
            self._stamp, self._keys = None, frozenset()
            return self._keys
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            try:
                with open(h.index_path, "rb") as f:
                    data = f.read()
                records, _ = replay(data, h.fingerprint, h.slots)
            except (OSError, StoreError):
                records = []
            slot_of: dict[bytes, int] = {}
            key_in: dict[int, bytes] = {}
            for r in records:  # later records win, and a slot claimed twice keeps the later key (index.py)
                old = slot_of.pop(r.key, None)
                if old is not None:
                    key_in.pop(old, None)
                if r.kind == "P":
                    slot_of.pop(key_in.pop(r.slot, b""), None)
                    slot_of[r.key], key_in[r.slot] = r.slot, r.key
            self._stamp, self._keys = stamp, frozenset(slot_of)
        return self._keys

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        have = self.keys()
        return np.fromiter((k in have for k in keys), dtype=bool, count=len(keys))

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the journal holds."""
        hit = self.lookup(keys)
        return int(hit.shape[0] if hit.all() else np.argmin(hit))
