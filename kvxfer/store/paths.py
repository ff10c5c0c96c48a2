"""The store's data paths: which one moves a request's calls, and the backend file path runner.

The core plans and groups a request once (:mod:`.fileio`); a path only moves a group of
whole rows. Two kinds exist:

* ``preadv``/``pwritev`` (:func:`~.fileio.run_calls`): the store's own, for a
  :class:`~kvxfer.KVCacheSpec` or an agent whose backend has no file path (loopback);
* a backend's :class:`kvxfer.plugin.files.FilePath` (NIXL ``POSIX``), when the agent's
  backend offers one for the cache's memory kind: the slab is registered with it once per
  store, and each group is one post of the group's descriptors, polled to its end on the
  worker thread (a cancelled request lets a post in flight finish: no I/O outlives its job,
  and the cancel returns only after it: :meth:`~.fileio.Job.io`).

:class:`Mover` is what :meth:`kvxfer.Store._run` calls per group, whichever path it is.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import numpy as np

from ..errors import KvxferError, StoreError, TransferCancelledError
from ..memory import MemoryKind, Op
from .fileio import Calls, run_calls

__all__ = ["Mover", "Files", "descriptors"]

Hook = Callable[[str], None] | None  # tests: "issue" before a post or call, "call" after


def descriptors(part: Calls) -> tuple[np.ndarray, np.ndarray]:
    """The iovecs of ``part``'s calls as ``(address, nbytes, device 0)`` rows and the file
    offset of each (the calls' runs are contiguous in the file), vectorised."""
    count, first = part.count.astype(np.int64), part.first.astype(np.int64)
    idx = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
    iov = part.iov[idx]
    ln = iov[:, 1].astype(np.int64)
    start = np.cumsum(ln) - ln  # bytes before each iovec in the part
    call_start = np.repeat(start[np.cumsum(part.count) - part.count], part.count)
    off = np.repeat(part.offset.astype(np.int64), part.count) + (start - call_start)
    local = np.zeros((iov.shape[0], 3), dtype=np.uint64)
    local[:, :2] = iov
    return local, off.astype(np.uint64)


class Mover:
    """Moves one group of calls: ``mover(write, part, cancelled, hook)``; ``name`` is the path.

    ``bridges``: it can bridge row padding (scratch iovecs); ``per_run``: it does one I/O per
    contiguous file run (a system call, or a staged run), not one per descriptor. ``staged``:
    rows pass through the stage (:mod:`.stage`), which checks them in the slab, not in the cache."""

    staged = False

    def __init__(self, name: str, bridges: bool, run: Callable[[bool, Calls, Callable[[], bool], Hook], None],
                 per_run: bool = True) -> None:
        self.name, self.bridges, self._run, self.per_run = name, bridges, run, per_run

    def __call__(self, write: bool, part: Calls, cancelled: Callable[[], bool], hook: Hook) -> None:
        self._run(write, part, cancelled, hook)

    def label(self, write: bool) -> str:
        return ("pwritev" if write else "preadv") if self.name == "posix" else self.name


def posix_mover(fd: int) -> Mover:
    """The store's own path; padding between rows is bridged so runs of slots stay one call."""
    return Mover("posix", True, lambda write, part, cancelled, hook: run_calls(fd, write, part, cancelled, hook))


class Files:
    """The slab's registrations with backends' file paths: once per (store, path)."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self._fd, self._nbytes = fd, nbytes
        self._held: dict[int, tuple[weakref.ReferenceType[Any], Any]] = {}

    def mover(self, fp: Any, kind: MemoryKind) -> Mover | None:
        """A :class:`Mover` over ``fp`` for memory of ``kind``, or None when it cannot move it."""
        if fp is None or kind not in fp.memory_kinds:
            return None
        hit = self._held.get(id(fp))
        if hit is None or hit[0]() is not fp:
            try:
                handle = fp.register_file(self._fd, self._nbytes)
            except KvxferError as exc:
                raise StoreError(f"the {fp.name} file path could not register the slab: {exc}") from exc
            hit = (weakref.ref(fp), handle)
            self._held[id(fp)] = hit
        return Mover(fp.name, False, self.io(fp, kind), per_run=False)

    def io(self, fp: Any, kind: MemoryKind) -> Callable[[bool, Calls, Callable[[], bool], Hook], None]:
        """Move ``part``'s iovecs through ``fp`` as one post, polled to its end (call :meth:`mover` first)."""
        handle = self._held[id(fp)][1]

        def run(write: bool, part: Calls, cancelled: Callable[[], bool], hook: Hook = None) -> None:
            if cancelled():
                raise TransferCancelledError("store transfer was cancelled")
            if hook is not None:
                hook("issue")
            local, off = descriptors(part)
            try:
                x = fp.post(Op.WRITE if write else Op.READ, handle, local, off, kind)
            except KvxferError as exc:
                raise StoreError(f"the {fp.name} file path refused a store {'write' if write else 'read'}: "
                                 f"{exc}") from exc
            try:
                _wait(fp, x, write)
            finally:
                fp.release(x)
            if hook is not None:
                hook("call")

        return run

    def close(self) -> None:
        for ref, handle in self._held.values():
            fp = ref()
            if fp is not None:
                try:
                    fp.deregister_file(handle)
                except KvxferError:
                    pass  # the backend closed first: its registrations went with it
        self._held.clear()


def _wait(fp: Any, x: Any, write: bool) -> None:
    """Poll a post to its end (never abandoned half-way: the slab's rows must be settled)."""
    pause = 0.0
    while True:
        try:
            if fp.poll(x):
                return
        except KvxferError as exc:
            raise StoreError(f"a store {'write' if write else 'read'} on the {fp.name} path failed: {exc}") from exc
        if pause:
            time.sleep(pause)
        pause = min(1e-3, pause * 2 if pause else 2e-5)
