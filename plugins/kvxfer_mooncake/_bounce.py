"""The fence for READs: Mooncake lands them in a private area, copied out only once DONE.

Mooncake's TCP transport cannot recall what it has queued: a batch call fails at its first
stalled span, and the spans still queued behind the peer's lanes land once a stopped peer
resumes (RELIABILITY.md, "Mooncake: the kit's stopped-peer case"). No call of its Python API
waits for or drops them. So a READ's spans land in an :class:`Arena` (DRAM this engine
registered for itself, never advertised) and are copied to the caller's destination only
after the call returned 0, in the caller's thread, before the end is reported. A READ that
failed, timed out or was cancelled while running never copies; its arena is *held*, still
registered, until the engine is gone, because nothing says when Mooncake is done with it.
The caller's memory is then never written after the end, and ``release`` need not wait.

A WRITE is sent from an arena too, filled from its source (:func:`gather`) at the post. Its
destination is the peer's, which nothing here can recall; but a span Mooncake sends after the
end then carries the bytes the WRITE was asked to move, not what the source holds by then,
never reads memory the caller has since deregistered, and ``release`` need not wait for it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from kvxfer import BackendError

__all__ = ["Arena", "Arenas", "gather", "scatter"]

#: Arenas are sized in whole powers of two from this, so a few serve transfers of any size.
_MIN_ARENA = 1 << 20
#: Idle arenas kept for reuse; more are given back to Mooncake and freed.
_IDLE_KEPT = 4
#: Bytes held for READs that ended before Mooncake let go of them; past this, READs are refused
#: (typed) rather than let a peer that keeps stalling grow this process without bound.
HELD_LIMIT = 1 << 30


class Arena:
    """One registered landing area: ``buffer`` (uint8) at ``base``."""

    __slots__ = ("buffer", "base", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.empty(nbytes, np.uint8)
        self.base = int(self.buffer.ctypes.data)
        self.nbytes = nbytes


class Arenas:
    """The engine's landing areas: idle ones reused, held ones kept until the engine is gone.

    ``take`` runs on every post, a one-block READ's included, so it is a lookup: a running
    count of the held bytes and a short list of idle arenas, smallest first."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._idle: list[Arena] = []  # sorted by size
        self.held: list[Arena] = []
        self._held_bytes = 0

    def take(self, nbytes: int) -> Arena:
        """An idle arena of at least ``nbytes``, or a new one registered now."""
        with self._lock:
            if self._held_bytes > HELD_LIMIT:
                raise BackendError(
                    f"mooncake: {len(self.held)} READs ended while Mooncake still had spans of them queued "
                    f"(a peer that stalls); their landing areas exceed {HELD_LIMIT >> 20} MiB. Close this agent "
                    "and start another to give them back")
            for i, a in enumerate(self._idle):
                if a.nbytes >= nbytes:
                    return self._idle.pop(i)
        a = Arena(max(_MIN_ARENA, 1 << (max(nbytes, 1) - 1).bit_length()))
        rc = self._engine.register_memory(a.base, a.nbytes)
        if rc != 0:
            raise BackendError(f"mooncake register_memory of a {a.nbytes}-byte READ landing area returned {rc}")
        return a

    def give(self, a: Arena) -> None:
        """Back to the idle list: only once no call can write into it (its call returned)."""
        with self._lock:
            self._idle.append(a)
            self._idle.sort(key=lambda x: x.nbytes)
            if len(self._idle) <= _IDLE_KEPT:
                return
            a = self._idle.pop(0)
            engine = self._engine
        if engine is not None:  # None: closed, the engine unregisters everything as it stops
            engine.unregister_memory(a.base)

    def hold(self, a: Arena) -> None:
        """Its READ ended while Mooncake may still write into it: never reused."""
        with self._lock:
            self.held.append(a)
            self._held_bytes += a.nbytes

    def close(self) -> list[Arena]:
        """Unregister the idle arenas; return the held ones, to be dropped after the engine.

        It lets go of the engine too: kept here, the engine would outlive the backend's close
        while the held arenas were freed, and a span still queued for one would land in freed
        memory (the suite died of SIGABRT and SIGSEGV that way: RELIABILITY.md, "Mooncake: a
        held landing area freed before its engine")."""
        with self._lock:
            idle, self._idle = self._idle, []
            held, self.held, self._held_bytes = self.held, [], 0
            engine, self._engine = self._engine, None
        for a in idle:
            engine.unregister_memory(a.base)
        return held


def _view(lo: int, units: int, unit: int) -> np.ndarray:
    """``units`` items of ``unit`` bytes at address ``lo``, without touching them."""
    class _Mem:
        __array_interface__ = {"data": (lo, False), "shape": (units,), "typestr": f"|V{unit}", "version": 3}

    return np.asarray(_Mem())


def _groups(arena: Arena, rows: np.ndarray, offset: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, Any]]:
    """The rows and the arena (packed in row order from ``offset``) as items of one void dtype per group, with
    each group's item indexes: ``(memory, arena, memory index, arena index)``.

    The unit is the largest size dividing every length and every address offset in a group (a
    KV page, typically), so numpy copies each item with one ``memcpy`` and the index stays
    small. Rows are grouped by their address modulo the lengths' common divisor: one group per
    allocation alignment (a per-layer cache has a few), never one per row.
    """
    addr = rows[:, 0].astype(np.int64)
    lens = rows[:, 1].astype(np.int64)
    keep = lens > 0
    addr, lens = addr[keep], lens[keep]
    if not len(lens):
        return []
    offs = np.cumsum(lens) - lens + offset  # where each row sits in the arena (multiples of the lengths' divisor)
    step = int(np.gcd.reduce(lens))
    res = addr % step
    out = []
    for r in np.unique(res).tolist():
        sel = res == r
        a, n, o = addr[sel], lens[sel], offs[sel]
        lo = int(a.min())
        unit = int(np.gcd.reduce(np.concatenate([n, a - lo, o, [step]])))
        counts = n // unit
        total = int(counts.sum())
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        k = np.arange(total, dtype=np.int64) - starts
        mem = _view(lo, int(((a - lo + n) // unit).max()), unit)
        pi = np.repeat(o // unit, counts) + k
        first = int(pi[0])
        if int(pi[-1]) - first + 1 == total:  # one group: the arena's part is one slice, not an index
            packed = _view(arena.base + first * unit, total, unit)
            pi = slice(None)  # type: ignore[assignment]
        else:
            packed = _view(arena.base, arena.nbytes // unit, unit)
        out.append((mem, packed, np.repeat((a - lo) // unit, counts) + k, pi))
    return out


#: Up to this many rows are copied one ``memmove`` each: a one-block READ's copy is then about a
#: microsecond, not the tens of the vectorised grouping.
FEW_ROWS = 8


def _few(rows: np.ndarray) -> list[tuple[int, int]] | None:
    if len(rows) > FEW_ROWS:
        return None
    return [(int(a), int(n)) for a, n in rows[:, :2].tolist()]


def scatter(arena: Arena, rows: np.ndarray, offset: int = 0) -> None:
    """Copy the arena (from ``offset``) out to ``rows`` (``N x 2+``: address, nbytes): one
    ``memmove`` per row for a few rows, else one fancy assignment per group, no loop per row.
    The rows were bounded by this agent's registrations in ``prepare``; only their bytes are
    written."""
    few = _few(rows)
    if few is not None:
        at = arena.base + offset
        for addr, n in few:
            ctypes.memmove(addr, at, n)
            at += n
        return
    for mem, packed, mi, pi in _groups(arena, rows, offset):
        mem[mi] = packed[pi]


def gather(arena: Arena, rows: np.ndarray) -> None:
    """Copy ``rows`` into the arena, packed in row order: a WRITE's snapshot."""
    few = _few(rows)
    if few is not None:
        at = arena.base
        for addr, n in few:
            ctypes.memmove(at, addr, n)
            at += n
        return
    for mem, packed, mi, pi in _groups(arena, rows, 0):
        packed[pi] = mem[mi]
