"""A read-only view of a store's index, for a process that must not open the store.

One :class:`~kvxfer.Store` holds a slab at a time (its ``flock``), but another process may
need to know what it holds: vLLM's scheduler decides which prompt prefixes to load while a
worker process owns the store. The view replays the index journal (the same crash-consistent
records an opening store replays) without locking or writing anything, reading only what was
appended since its last look. It is a hint: an entry it shows may be evicted or found damaged before a
restore, which the restore reports as a miss. docs/storage.md has the journal format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import AbstractSet as Set, Any, Sequence

import numpy as np

from ..errors import StoreError
from .journal import _header, replay

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
    """The keys a store's journal holds, as of the last look at the file."""

    def __init__(self, handle: ViewHandle) -> None:
        self.handle = handle
        self._ino: int | None = None
        self._at = 0  # bytes of the file replayed so far (a valid prefix)
        self._tail = b""  # its last bytes: a new file (a compaction) that reuses the inode differs here
        self._slot_of: dict[bytes, int] = {}
        self._key_in: dict[int, bytes] = {}

    def keys(self) -> Set[bytes]:
        """Live keys. An append (the file grew) is replayed from where the last look ended; a
        compaction (a new file renamed over it) or anything else is replayed whole. Absent or
        foreign: no keys."""
        h = self.handle
        try:
            with open(h.index_path, "rb") as f:
                st = os.fstat(f.fileno())
                back = len(self._tail)
                if st.st_ino == self._ino and st.st_size >= self._at:
                    f.seek(self._at - back)
                    data = f.read()
                    if data[:back] != self._tail:
                        data = b""
                else:
                    data = b""
                if not data:  # not an append to what was replayed: replay the whole file
                    self._ino, self._at, self._tail, back = st.st_ino, 0, b"", 0
                    self._slot_of, self._key_in = {}, {}
                    f.seek(0)
                    data = f.read()
                data = data[back:]
                if not data:
                    return self._slot_of.keys()
            head = b"" if self._at == 0 else _header(h.fingerprint, h.slots)  # replay wants its header first
            records, used = replay(head + data, h.fingerprint, h.slots)
        except (OSError, StoreError):
            self._ino, self._at, self._tail, self._slot_of, self._key_in = None, 0, b"", {}, {}
            return self._slot_of.keys()
        self._at += used - len(head)
        self._tail = (self._tail + data[:used - len(head)])[-32:]
        for r in records:  # later records win, and a slot claimed twice keeps the later key (index.py)
            old = self._slot_of.pop(r.key, None)
            if old is not None:
                self._key_in.pop(old, None)
            if r.kind == "P":
                self._slot_of.pop(self._key_in.pop(r.slot, b""), None)
                self._slot_of[r.key], self._key_in[r.slot] = r.slot, r.key
        return self._slot_of.keys()

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        have = self.keys()
        return np.fromiter((k in have for k in keys), dtype=bool, count=len(keys))

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the journal holds."""
        hit = self.lookup(keys)
        return int(hit.shape[0] if hit.all() else np.argmin(hit))
