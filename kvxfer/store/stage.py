"""The staged path: a cache's pages through a pinned host stage, double-buffered, to the slab.

For VRAM caches where no backend file path moves device memory (NIXL ``GDS`` needs cuFile to
accept the file: docs/storage.md). Per group of whole rows (at most one cell of
:data:`~.fileio.MAX_CALL` bytes of whole slots):

* offload: one batched copy gathers the group's pages into the stage as the slab lays the
  rows out, then the group's contiguous file runs are written from the stage;
* restore: the runs are read into the stage, then one batched copy scatters the pages.

The same stage serves a host cache split over many regions (per layer) on a backend file
path that does one I/O per descriptor (NIXL POSIX): the pages are gathered into rows in one
vectorised pass per page size and each row run is one I/O, instead of one I/O per page.

Two stage buffers serve the worker threads, so one group's device copy overlaps another's
file I/O. The copier is pluggable: :class:`DeviceCopies` (the core's CUDA copier,
:mod:`kvxfer.cuda.copy`, one batch per group into pinned memory) for VRAM, and
:class:`HostCopies` (numpy gathers) for host memory, which is how the CPU suite covers every
part of this path but the CUDA calls. Digests stay as for the other paths (the slab's rows,
right after writing, right before reading).
"""

from __future__ import annotations

import ctypes
import queue
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import StoreError, TransferCancelledError, UnsupportedError
from ..memory import Allocation, MemoryKind
from .fileio import Calls
from .paths import Hook, Mover, descriptors

__all__ = ["HostCopies", "DeviceCopies", "Stage", "buffer_runs", "ranges"]


class HostCopies:
    """Copies between host memory and the stage: one numpy gather or scatter per page size.

    Why not a ``memmove`` per descriptor: a per-layer cache has one descriptor per page
    (160 per row of the benchmark's cache), and a Python call per page cost as much as the
    I/O. Every descriptor is first checked to lie inside one of ``memory``'s ranges (the
    local cache's allocations and the stage buffers): nothing outside them is read or written.
    """

    name = "host"

    def buffer(self, nbytes: int) -> tuple[int, Any]:
        buf = np.zeros(nbytes, dtype=np.uint8)
        return int(buf.ctypes.data), buf

    def free(self, keep: Any) -> None:
        pass

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, memory: Sequence[tuple[int, int]]) -> None:
        dst, src, sizes = (np.asarray(x, dtype=np.int64) for x in (dst, src, sizes))
        bounds = ranges(memory)
        _inside(dst, sizes, bounds)
        _inside(src, sizes, bounds)
        for ln in np.unique(sizes).tolist():
            sel = sizes == ln
            d, s = (dst, src) if sel.all() else (dst[sel], src[sel])
            if d.shape[0] > 1 and bool((d[1:] == d[:-1] + ln).all()):  # gather into one run (an offload's stage)
                _gather(s, ln, _table(int(d[0]), d.shape[0], ln))
            elif s.shape[0] > 1 and bool((s[1:] == s[:-1] + ln).all()):  # scatter one run (a restore's stage)
                _scatter(d, ln, _table(int(s[0]), s.shape[0], ln))
            else:
                rows = np.empty((s.shape[0], ln), np.uint8)
                _gather(s, ln, rows)
                _scatter(d, ln, rows)


def buffer_runs(part: Calls, addr: np.uint64, at: int) -> Calls:
    """``part``'s calls as contiguous runs of a buffer at ``addr`` that holds the slab's bytes
    from file offset ``at`` on (a stage, a bounce buffer): one iovec per run, runs that follow
    each other in the file merged into one call."""
    off, n = part.offset.astype(np.int64), part.nbytes.astype(np.int64)
    start = np.ones(off.shape[0], dtype=bool)
    start[1:] = off[1:] != off[:-1] + n[:-1]
    first = np.flatnonzero(start)
    offset = off[first]
    nbytes = np.add.reduceat(n, first)
    iov = np.empty((first.shape[0], 2), dtype=np.uint64)
    iov[:, 0] = addr + (offset - at).astype(np.uint64)
    iov[:, 1] = nbytes.astype(np.uint64)
    k = first.shape[0]
    return Calls(iov, np.arange(k), np.ones(k, dtype=np.int64), offset, nbytes, k)


def ranges(memory: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``memory``'s ``(start, nbytes)`` ranges as sorted start and end arrays, for :func:`_inside`
    (made once where many checks share them)."""
    rs = sorted(memory)
    return np.array([a for a, _ in rs], dtype=np.int64), np.array([a + n for a, n in rs], dtype=np.int64)


def _inside(addr: np.ndarray, sizes: np.ndarray, bounds: tuple[np.ndarray, np.ndarray]) -> None:
    """Every ``[addr, addr + size)`` lies inside one of the ranges :func:`ranges` made."""
    starts, ends = bounds
    i = np.searchsorted(starts, addr, side="right") - 1
    if (i < 0).any() or (addr + sizes > ends[np.maximum(i, 0)]).any():
        raise StoreError("a staged copy leaves the cache's memory")  # the planner's bounds make this unreachable


def _table(address: int, n: int, ln: int) -> np.ndarray:
    """``[n, ln]`` uint8 over the bytes at ``address``: only the rows a caller indexes are touched
    (the descriptors', checked by :func:`_inside`), never the gaps between allocations."""
    return np.frombuffer((ctypes.c_uint8 * (n * ln)).from_address(address), dtype=np.uint8).reshape(n, ln)


def _classes(addr: np.ndarray, ln: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Descriptors grouped by address modulo ``ln`` (one group for pages of aligned arrays):
    per group its positions, a table whose rows start at those addresses, and the row numbers."""
    lo = int(addr.min())
    r = (addr - lo) % ln
    out = []
    for k in np.unique(r).tolist():
        pos = np.flatnonzero(r == k)
        rows = (addr[pos] - lo - k) // ln
        out.append((pos, _table(lo + k, int(rows.max()) + 1, ln), rows))
    return out


def _gather(src: np.ndarray, ln: int, out: np.ndarray) -> None:
    """``out[i] = bytes at src[i]``: one ``np.take`` (one pass, into ``out``) per address class."""
    groups = _classes(src, ln)
    if len(groups) == 1:
        np.take(groups[0][1], groups[0][2], axis=0, out=out, mode="clip")
        return
    for pos, table, rows in groups:
        out[pos] = table[rows]


def _scatter(dst: np.ndarray, ln: int, rows: np.ndarray) -> None:
    """``bytes at dst[i] = rows[i]``: one fancy assignment per address class."""
    for pos, table, at in _classes(dst, ln):
        table[at] = rows if pos.shape[0] == rows.shape[0] else rows[pos]


class DeviceCopies:
    """Copies between one GPU's memory and pinned host stage buffers: one batch per group."""

    def __init__(self, device: int) -> None:
        from ..cuda._driver import cuda, why_not
        from ..cuda.copy import Copier

        c = cuda()
        if c is None:
            raise UnsupportedError(f"a VRAM cache needs CUDA for the store's host stage: {why_not()}")
        self.c, self.device = c, device
        self.copier = Copier(c)
        self.engine = "ce" if c.batch is not None else "sm"
        self.name = f"cuda-{self.engine}"

    def buffer(self, nbytes: int) -> tuple[int, Any]:
        h = ctypes.c_void_p()
        with self.c.on(self.device):
            self.c.check(self.c.rt.cudaHostAlloc(ctypes.byref(h), nbytes, 1), "cudaHostAlloc (the store's stage)")
        return int(h.value or 0), int(h.value or 0)

    def free(self, keep: Any) -> None:
        self.c.rt.cudaFreeHost(ctypes.c_void_p(keep))

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, to_device: bool) -> None:
        from ..cuda._driver import CudaError

        dev = self.device
        try:
            h = self.copier.copy(dst, src, sizes, dev, engine=self.engine, src_device=None if to_device else dev,
                                 dst_device=dev if to_device else None)
        except CudaError:
            if self.engine != "ce":
                raise
            self.engine = "sm"  # the copy engines refused a host location: the copy kernel reaches it (UVA)
            h = self.copier.copy(dst, src, sizes, dev, engine="sm")
        self.copier.synchronize(h)


class Stage:
    """Two stage buffers of ``unit`` bytes and the :class:`~.paths.Mover` that uses them."""

    def __init__(self, copies: Any, unit: int, base: int, stride: int, io: Callable[[bool, Calls, Any, Hook], None],
                 name: str, register: Any = None, buffers: int = 2) -> None:
        """``io(write, runs, cancelled, hook)`` moves stage runs to or from the slab (``pwritev``, or a
        backend's file path, then ``register(allocations)`` -> ``deregister`` handle it first)."""
        self.copies, self.unit, self.base, self.stride, self.io, self.name = copies, unit, base, stride, io, name
        self._free: "queue.Queue[tuple[int, Any]]" = queue.Queue()
        self._all = [copies.buffer(unit) for _ in range(buffers)]
        self._registered = None
        if register is not None:
            try:
                self._registered = register[0]([Allocation(a, unit, MemoryKind.DRAM, 0) for a, _ in self._all])
            except BaseException:
                self.close()
                raise
            self._deregister = register[1]
        for b in self._all:
            self._free.put(b)

    def mover(self, allocations: Sequence[Allocation] = ()) -> Mover:
        """The mover for a cache of ``allocations`` (the only local memory a host copy may touch)."""
        memory = [(a.address, a.nbytes) for a in allocations] + [(a, self.unit) for a, _ in self._all]
        m = Mover(self.name, False, lambda w, p, c, h: self._move(w, p, c, h, memory))
        m.staged = True
        return m

    def _copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, to_local: bool,
              memory: Sequence[tuple[int, int]]) -> None:
        if isinstance(self.copies, HostCopies):
            self.copies.copy(dst, src, sizes, memory)
        else:
            self.copies.copy(dst, src, sizes, to_local)

    def _move(self, write: bool, part: Calls, cancelled: Callable[[], bool], hook: Hook,
              memory: Sequence[tuple[int, int]] = ()) -> None:
        if cancelled():
            raise TransferCancelledError("store transfer was cancelled")
        local, off = descriptors(part)
        lo = (int(part.offset.min()) - self.base) // self.stride
        at = np.uint64(self.base + lo * self.stride)  # the stage holds slots lo.. as the slab does
        if int((off + local[:, 1]).max()) - int(at) > self.unit:
            raise StoreError("a staged group is larger than the stage")  # the grouping makes this unreachable
        addr, keep = self._free.get()
        issue = (lambda stage: hook(stage) if stage == "issue" else None) if hook is not None else None  # noqa: E731
        try:
            stage = np.uint64(addr) + (off - at)
            one = buffer_runs(part, np.uint64(addr), int(at))  # stage bytes <-> file, whole runs
            if write:
                self._copy(stage, local[:, 0], local[:, 1], False, memory)
                self.io(True, one, cancelled, issue)
            else:
                self.io(False, one, cancelled, issue)
                self._copy(local[:, 0], stage, local[:, 1], True, memory)
        finally:
            self._free.put((addr, keep))
        if hook is not None:
            hook("call")  # one I/O per group on this path

    def close(self) -> None:
        if self._registered is not None:
            self._deregister(self._registered)
            self._registered = None
        for _, keep in self._all:
            self.copies.free(keep)
        self._all = []
