"""The in-memory index: key -> entry (slot, generation, digest), LRU order, pins, free slots.

Not thread-safe on its own: the store calls it under its lock. Slots are in one of three
states: free, reserved (a write in flight, not yet published) or live (an entry's). Eviction
takes the least recently used entries that no restore pins; a dropped entry that is pinned
keeps its slot until the last restore using it ends, so no write can land under a read.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..errors import InvalidArgumentError, StoreError, StoreFullError
from ..planner import MAX_BLOCK_IDS
from .journal import MAX_KEY, Record

__all__ = ["Entry", "Index", "check_keys"]

FREE, RESERVED, LIVE = 0, 1, 2


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Keys as a list of bounded bytes, or a typed error (a caller's input: nothing assumed)."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Iterable) or \
            getattr(keys, "ndim", 1) == 0:  # a 0-d array claims to be iterable and sized, and is neither
        raise InvalidArgumentError(f"keys must be a sequence of bytes objects, one per block, got {type(keys).__name__}")
    if hasattr(keys, "__len__") and len(keys) > MAX_BLOCK_IDS:  # counted before walking (a lazy range)
        raise InvalidArgumentError(f"{len(keys)} keys in one call; at most {MAX_BLOCK_IDS}")
    try:
        out = [bytes(k) if isinstance(k, (bytes, bytearray, memoryview)) else k for k in keys]
    except TypeError:  # an iterable that cannot be iterated (a 0-d array)
        raise InvalidArgumentError(f"keys must be a sequence of bytes objects, got {type(keys).__name__}") from None
    for k in out:
        if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY:
            raise StoreError(f"a key must be 1 to {MAX_KEY} bytes (opaque, e.g. a prefix hash), got {k!r:.60}")
    return out


@dataclass(eq=False)
class Entry:
    key: bytes
    slot: int
    generation: int
    digest: int
    pins: int = 0
    dead: bool = False  # dropped from the index; the slot is freed when pins reach 0


class Index:
    def __init__(self, slots: int, records: Iterable[Record] = ()) -> None:
        self.slots = slots
        self.state = np.zeros(slots, dtype=np.uint8)
        self.entries: "collections.OrderedDict[bytes, Entry]" = collections.OrderedDict()
        self.generation = 0
        owner: dict[int, bytes] = {}  # slot -> key while replaying (a crafted journal stays linear)
        for r in records:  # replay: later records win; a slot claimed twice keeps the later key
            old = self._drop(r.key)
            if old is not None and owner.get(old.slot) == r.key:
                del owner[old.slot]
            if r.kind == "P":
                k = owner.pop(r.slot, None)
                if k is not None:
                    self._drop(k)
                self.entries[r.key] = Entry(r.key, r.slot, r.generation, r.digest)
                owner[r.slot] = r.key
                self.state[r.slot] = LIVE
                self.generation = max(self.generation, r.generation)

    def __len__(self) -> int:
        return len(self.entries)

    def live(self) -> list[Record]:
        """Entries as put records, least recently used first (what compaction writes)."""
        return [Record("P", e.key, e.generation, e.slot, e.digest) for e in self.entries.values()]

    def _drop(self, key: bytes) -> Entry | None:
        e = self.entries.pop(key, None)
        if e is not None:
            e.dead = True
            if e.pins == 0:
                self.state[e.slot] = FREE
        return e

    def drop(self, keys: Iterable[bytes]) -> list[bytes]:
        """Remove entries; returns the keys that were present (the caller journals them)."""
        return [k for k in keys if self._drop(k) is not None]

    def lookup(self, keys: Sequence[bytes], touch: bool = False) -> list[Entry | None]:
        out = [self.entries.get(k) for k in keys]
        if touch:
            for k, e in zip(keys, out):
                if e is not None:
                    self.entries.move_to_end(k)
        return out

    def pin(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            e.pins += 1

    def unpin(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            e.pins -= 1
            if e.pins == 0 and e.dead:
                self.state[e.slot] = FREE

    def reserve(self, n: int) -> tuple[np.ndarray, list[bytes]]:
        """``n`` free slots (lowest first, so a fresh store writes one contiguous run) and the
        least recently used unpinned entries to evict for them; changes nothing: the caller
        journals the evictions, then :meth:`commit` s (a journal that cannot take them evicts
        nothing)."""
        free = np.flatnonzero(self.state == FREE)
        evicted: list[bytes] = []
        if free.shape[0] < n:
            need = n - free.shape[0]
            for k, e in self.entries.items():
                if len(evicted) == need:
                    break
                if e.pins == 0:
                    evicted.append(k)
            if len(evicted) < need:
                raise StoreFullError(f"no room for {n} rows: {free.shape[0]} slots free and only "
                                     f"{len(evicted)} entries evictable (the rest are pinned by restores or "
                                     "reserved by writes in flight); raise capacity or restore fewer at once")
            free = np.sort(np.concatenate([free, np.array([self.entries[k].slot for k in evicted], dtype=np.int64)]))
        return free[:n].astype(np.int64), evicted

    def commit(self, slots: np.ndarray, evicted: Sequence[bytes]) -> None:
        """Evict and reserve what :meth:`reserve` chose (under the same hold of the lock)."""
        for k in evicted:
            self._drop(k)
        self.state[slots] = RESERVED

    def unreserve(self, slots: np.ndarray) -> None:
        self.state[slots] = FREE

    def put(self, keys: Sequence[bytes], slots: np.ndarray, digests: np.ndarray) -> None:
        """Turn reserved slots into entries, generations ``generation + 1`` on in key order
        (what :func:`~.journal.encode_puts` journaled first); a key already present is replaced
        (its old slot freed once unpinned). An old entry's slot is never one of ``slots``
        (reserved slots were free or evicted), so they all turn live at once."""
        g = self.generation
        for i, k, s, d in zip(range(g + 1, g + 1 + len(keys)), keys, slots.tolist(), digests.tolist()):
            self._drop(k)
            self.entries[k] = Entry(k, s, i, d)
        self.generation = g + len(keys)
        self.state[slots] = LIVE
