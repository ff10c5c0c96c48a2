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

from ..errors import StoreFullError
from .journal import Record

__all__ = ["Entry", "Index"]

FREE, RESERVED, LIVE = 0, 1, 2


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
        for r in records:  # replay: later records win; a slot claimed twice keeps the later key
            if r.kind == "P":
                self._drop(r.key)
                for k in [k for k, e in self.entries.items() if e.slot == r.slot] if self.state[r.slot] else []:
                    self._drop(k)
                self.entries[r.key] = Entry(r.key, r.slot, r.generation, r.digest)
                self.state[r.slot] = LIVE
                self.generation = max(self.generation, r.generation)
            else:
                self._drop(r.key)

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
        """``n`` free slots (lowest first, so a fresh store writes one contiguous run),
        evicting least recently used unpinned entries as needed; returns (slots, evicted)."""
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
            for k in evicted:
                self._drop(k)
            free = np.flatnonzero(self.state == FREE)
        slots = free[:n].astype(np.int64)
        self.state[slots] = RESERVED
        return slots, evicted

    def unreserve(self, slots: np.ndarray) -> None:
        self.state[slots] = FREE

    def publish(self, keys: Sequence[bytes], slots: np.ndarray, digests: np.ndarray) -> list[Record]:
        """Turn reserved slots into entries; a key already present is replaced (its old slot
        freed once unpinned). Returns the put records to journal."""
        out = []
        for k, s, d in zip(keys, slots.tolist(), digests.tolist()):
            self._drop(k)
            self.generation += 1
            self.entries[k] = Entry(k, s, self.generation, d)
            self.state[s] = LIVE
            out.append(Record("P", k, self.generation, s, d))
        return out
