"""The staged path: a cache's pages through a pinned host stage, double-buffered, to the slab.

For VRAM caches where no backend file path moves device memory (NIXL ``GDS`` needs cuFile to
accept the file: docs/storage.md). Per group of whole rows (at most one cell of
:data:`~.fileio.MAX_CALL` bytes of whole slots):

* offload: one batched copy gathers the group's pages into the stage as the slab lays the
  rows out, then the group's contiguous file runs are written from the stage;
* restore: the runs are read into the stage, then one batched copy scatters the pages.

The same stage serves a host cache split over many regions (per layer) on a backend file
path that does one I/O per descriptor (NIXL POSIX): the pages are gathered into rows with
``memmove`` and each row run is one I/O, instead of one I/O per page.

Two stage buffers serve the worker threads, so one group's device copy overlaps another's
file I/O. The copier is pluggable: :class:`DeviceCopies` (the core's CUDA copier,
:mod:`kvxfer.cuda.copy`, one batch per group into pinned memory) for VRAM, and
:class:`HostCopies` (``memmove``) for host memory, which is how the CPU suite covers every
part of this path but the CUDA calls. Digests stay as for the other paths (the slab's rows,
right after writing, right before reading).
"""

from __future__ import annotations

import ctypes
import queue
from typing import Any, Callable

import numpy as np

from ..errors import StoreError, TransferCancelledError, UnsupportedError
from ..memory import Allocation, MemoryKind
from .fileio import Calls
from .paths import Hook, Mover, descriptors

__all__ = ["HostCopies", "DeviceCopies", "Stage"]


class HostCopies:
    """Copies between host memory and the stage: ``memmove`` per descriptor (the planner merged runs)."""

    name = "host"

    def buffer(self, nbytes: int) -> tuple[int, Any]:
        buf = np.zeros(nbytes, dtype=np.uint8)
        return int(buf.ctypes.data), buf

    def free(self, keep: Any) -> None:
        pass

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
        mm = ctypes.memmove
        for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
            mm(d, s, n)


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

    def mover(self) -> Mover:
        return Mover(self.name, False, self._move)

    def _copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, to_local: bool) -> None:
        if isinstance(self.copies, HostCopies):
            self.copies.copy(dst, src, sizes)
        else:
            self.copies.copy(dst, src, sizes, to_local)

    def _move(self, write: bool, part: Calls, cancelled: Callable[[], bool], hook: Hook) -> None:
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
            # One iovec per contiguous file run of the group: stage bytes -> file, whole.
            runs = np.empty((len(part), 2), dtype=np.uint64)
            runs[:, 0] = np.uint64(addr) + (part.offset.astype(np.uint64) - at)
            runs[:, 1] = part.nbytes.astype(np.uint64)
            one = Calls(runs, np.arange(len(part)), np.ones(len(part), dtype=np.int64), part.offset, part.nbytes,
                        len(part))
            if write:
                self._copy(stage, local[:, 0], local[:, 1], False)
                self.io(True, one, cancelled, issue)
            else:
                self.io(False, one, cancelled, issue)
                self._copy(local[:, 0], stage, local[:, 1], True)
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
