"""Offloads of a per-layer host cache through bounce buffers: one worker gathers each group's
pages into rows, the writer hashes the rows there and writes them, one call per file run.

Why (BENCHMARKS.md, "Issue 37: the digest beside its write; per-layer offloads through bounce
buffers"): a per-layer cache has one descriptor per page (160 per row of the benchmark's
cache, block ids shuffled), and the kernel copying scattered 4 KiB pages on the writer's
thread was the offload's bound. A numpy gather on the other core, into a buffer the writer
then hashes and copies from while it is warm, takes the per-layer offload from about 3.0 to
3.7 GB/s on the 2-core VM. The digest is of exactly the bytes written (before, of the slab's
map right after the write). A one-region cache does not come here: its rows are already
runs, and a gather would be one more copy of every byte.

The pages a gather reads are the plan's descriptors, each checked to lie inside the cache's
allocations (the check :class:`~.stage.HostCopies` makes). A gather runs inside the job's
fence (:meth:`~.fileio.Job.io`): once a cancel returned, nothing of the job reads the cache.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import StoreError
from .digest import buffer_row_digests
from .fileio import _SCRATCH, Calls, Job
from .paths import Hook, Mover, descriptors
from .slab import HEADER
from .stage import HostCopies, _inside, _table, buffer_runs, ranges

__all__ = ["Buffers", "offload"]

#: Groups gathered ahead of the writer: one being written, one ready, one being gathered.
DEPTH = 3


class Buffers:
    """A store's bounce buffers, ``DEPTH`` of ``unit`` bytes per request in flight; ``keep``
    sets are kept between requests (first touches of fresh memory cost ~5 ms per set).

    A buffer holds a group's slots as the slab lays them out, so the padding after each row
    stays zero (the bytes the store's own path writes there)."""

    def __init__(self, unit: int, keep: int = 2) -> None:
        self.unit, self._keep = unit, keep
        self._free: list[list[np.ndarray]] = []
        self._lock = threading.Lock()

    def take(self) -> list[np.ndarray]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return [np.zeros(self.unit, dtype=np.uint8) for _ in range(DEPTH)]

    def give(self, bufs: list[np.ndarray]) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(bufs)


def offload(st: Any, job: Job, calls: Calls, todo: list[tuple[int, int, int, int]], mover: Mover,
            cancelled: Callable[[], bool], hook: Hook, source: Sequence[tuple[int, int]],
            uniq: np.ndarray, dig: np.ndarray) -> None:
    """Write ``todo``'s groups in file order from bounce buffers (this thread), while one pool
    task gathers the groups ahead of it, in order; the writer hashes each buffer (warm from
    the gather) right before writing it, so ``dig[i]`` gets ``uniq[i]``'s digest. One
    gatherer, not one task per group: on two cores the writer keeps its own.

    ``source``: the cache's ``(address, nbytes)`` ranges, the only memory a gather reads
    (checked per group). The gatherer is waited for before this returns or
    raises (nothing outlives the job)."""
    buffers: Buffers = st._bounce
    bufs = buffers.take()
    stride, mapped = st.geometry.stride, st._slab.mapped
    src = _Sources(source, int(calls.iov[0, 1]))
    free = threading.Semaphore(DEPTH)  # buffers the writer has finished with
    ready: list[Future[Calls]] = [Future() for _ in todo]
    stop = False

    def gather(k: int, buf: np.ndarray) -> Calls:
        """Group ``k`` into ``buf``; returns its writes."""
        a, b, lo, hi = todo[k]
        at = HEADER + lo * stride
        if (hi - lo + 1) * stride > buf.shape[0]:
            raise StoreError("a group is larger than its bounce buffer")  # the grouping makes this unreachable
        part = Calls(calls.iov, calls.first[a:b], calls.count[a:b], calls.offset[a:b], calls.nbytes[a:b], 0)
        with job.io():  # the fence: a cancel returns only once no gather reads the cache
            src.gather(part, buf, at)
        return buffer_runs(part, np.uint64(buf.ctypes.data), at)

    def gatherer() -> None:
        for k, fut in enumerate(ready):
            free.acquire()
            if stop:
                return
            try:
                fut.set_result(gather(k, bufs[k % DEPTH]))
            except BaseException as exc:
                fut.set_exception(exc)
                return

    task = st._pool.submit(gatherer)
    try:
        for k, fut in enumerate(ready):
            runs = fut.result()
            lo, hi = todo[k][2:]
            i, j = np.searchsorted(uniq, [lo, hi + 1]).tolist()
            dig[i:j] = buffer_row_digests(mapped, bufs[k % DEPTH], lo, uniq[i:j])
            with job.io():  # the fence, as for any call (refused once cancelled)
                mover(True, runs, cancelled, hook)
            free.release()
    finally:
        stop = True
        free.release()  # a gatherer waiting for a buffer wakes, and stops
        wait([task])
        buffers.give(bufs)


class _Sources:
    """The cache's memory as a gather reads it: when its allocations are equally aligned
    modulo ``ln`` (the pages of aligned arrays), one ``[rows, ln]`` table over them all, so a
    group's pages are one ``np.take``; else the checked copies of :class:`~.stage.HostCopies`."""

    def __init__(self, source: Sequence[tuple[int, int]], ln: int) -> None:
        self.memory = list(source)
        self.ranges = ranges(self.memory)  # sorted once: every group's pages are checked against them
        lo = min(a for a, _ in self.memory)
        self.lo, self.ln = lo, ln
        aligned = ln > 0 and all((a - lo) % ln == 0 for a, _ in self.memory)
        rows = max((a + n - lo) // ln for a, n in self.memory) if aligned else 0
        self.table = _table(lo, rows, ln) if aligned else None  # only the planned pages are touched

    def gather(self, part: Calls, buf: np.ndarray, at: int) -> None:
        """``part``'s iovecs into ``buf``, which holds the slab's bytes from offset ``at`` on."""
        local, off = descriptors(part)
        real = local[:, 0] != np.uint64(_SCRATCH.ctypes.data)  # padding bridges: the buffer's zeros
        src, size = local[real, 0].astype(np.int64), local[real, 1].astype(np.int64)
        dst = off[real].astype(np.int64) - at
        if not dst.size:
            return
        _inside(src, size, self.ranges)  # nothing outside the cache is read
        ln = self.ln
        if (self.table is not None and bool((size == ln).all()) and bool(((src - self.lo) % ln == 0).all())
                and int(dst[-1]) - int(dst[0]) == (dst.shape[0] - 1) * ln):  # one run of whole pages in the buffer
            out = buf[int(dst[0]):int(dst[-1]) + ln].reshape(-1, ln)
            np.take(self.table, (src - self.lo) // ln, axis=0, out=out, mode="clip")
            return
        addr = int(buf.ctypes.data)
        HostCopies().copy(addr + dst, src, size, self.memory + [(addr, buf.shape[0])])
