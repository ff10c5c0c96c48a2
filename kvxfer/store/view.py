"""A read-only view of a store's index, for a process that must not open the store.

One :class:`~kvxfer.Store` holds a slab at a time (its ``flock``), but another process may
need to know what it holds: vLLM's scheduler decides which prompt prefixes to load while a
worker process owns the store. The view replays the index journal (the same crash-consistent
records an opening store replays) without locking or writing anything, reading only what was
appended since its last look, a chunk at a time. It is a hint: an entry it shows may be
evicted or found damaged before a restore, which the restore reports as a miss. docs/storage.md has the journal format.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import AbstractSet as Set, Any, Sequence

import numpy as np

from ..errors import StoreError
from . import journal
from .journal import Reader, Record

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
        compaction (a new file renamed over it) or anything else is replayed whole, a chunk at
        a time. Absent, foreign or not a regular file: no keys."""
        h = self.handle
        try:
            fd = os.open(h.index_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return self._reset()
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._reset()
            back = len(self._tail)
            if st.st_ino != self._ino or st.st_size < self._at or \
                    os.pread(fd, back, self._at - back) != self._tail:  # not an append to what was replayed
                self._reset()
                self._ino = st.st_ino
            r = Reader(h.fingerprint, h.slots, headed=self._at > 0)
            r.tail = self._tail
            at = self._at
            while not r.ended:
                data = os.pread(fd, journal.CHUNK, at)
                if not data:
                    break
                at += len(data)
                self._apply(r.feed(data))
            self._at += r.at
            self._tail = r.tail
        except (OSError, StoreError):
            return self._reset()
        finally:
            os.close(fd)
        return self._slot_of.keys()

    def _reset(self) -> Set[bytes]:
        self._ino, self._at, self._tail, self._slot_of, self._key_in = None, 0, b"", {}, {}
        return self._slot_of.keys()

    def _apply(self, records: list[Record]) -> None:
        for r in records:  # later records win, and a slot claimed twice keeps the later key (index.py)
            old = self._slot_of.pop(r.key, None)
            if old is not None:
                self._key_in.pop(old, None)
            if r.kind == "P":
                self._slot_of.pop(self._key_in.pop(r.slot, b""), None)
                self._slot_of[r.key], self._key_in[r.slot] = r.slot, r.key

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        have = self.keys()
        return np.fromiter((k in have for k in keys), dtype=bool, count=len(keys))

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the journal holds."""
        hit = self.lookup(keys)
        return int(hit.shape[0] if hit.all() else np.argmin(hit))
