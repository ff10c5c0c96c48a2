"""The loopback data path: vectorised ``preadv``/``pwritev`` between host memory and the slab.

A plan's descriptors are ``(local address, file offset, length)``. They are sorted by file
offset and cut where the file offset jumps: each contiguous file run is **one** system call
whose iovec array (``struct iovec`` is base + length, two 64-bit words) is a slice of one
``(N, 2) uint64`` numpy array, so no Python code runs per descriptor. The 4 KiB padding after
a row is bridged with an iovec over a scratch page, so consecutive slots stay one call.
Runs longer than ``IOV_MAX`` iovecs are split. Calls go through ctypes, which releases the
GIL, on worker threads; a :class:`Job` is what a :class:`~kvxfer.Transfer` polls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ..deadlines import Deadline
from ..errors import StoreError, StoreFullError, TransferCancelledError
from ..plugin.backend import Backend, Capabilities
from .._stats import Status
from ..transfer import Transfer

__all__ = ["Calls", "build_calls", "groups", "run_calls", "wipe", "Job", "FileEngine", "JobTransfer", "IOV_MAX"]

IOV_MAX = int(os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
_libc = ctypes.CDLL(None, use_errno=True)
_SIG = ([ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64], ctypes.c_ssize_t)
_preadv, _pwritev = _libc.preadv, _libc.pwritev
for _f in (_preadv, _pwritev):
    _f.argtypes, _f.restype = _SIG
_SCRATCH = np.zeros(8192, dtype=np.uint8)
#: Bytes one call moves at most: large requests become several calls the threads share.
MAX_CALL = 8 << 20  # padding bridges point here (writes send zeros)


@dataclass
class Calls:
    """System calls for one request: call ``k`` moves iovecs ``first[k]:first[k]+count[k]``."""

    iov: np.ndarray  # (N, 2) uint64: base, length
    first: np.ndarray
    count: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    descriptors: int  # plan descriptors (bridges not counted)

    def __len__(self) -> int:
        return int(self.first.shape[0])


def build_calls(addr: np.ndarray, off: np.ndarray, length: np.ndarray, *, base: int, stride: int,
                row_len: int, max_call: int | None = None) -> Calls:
    """Group descriptors into contiguous file runs, one call per run (vectorised).

    Runs are also cut on a grid of ``max_call`` bytes of whole slots (a descriptor crossing it
    is cut there first), so one large request is several calls that worker threads share and
    that hold whole rows; ``IOV_MAX`` cuts a call as well (then a row may span two calls).
    """
    max_call = MAX_CALL if max_call is None else max_call
    n = int(addr.shape[0])
    order = np.argsort(off, kind="stable")
    a, o, ln = addr[order].astype(np.uint64), off[order].astype(np.int64), length[order].astype(np.int64)
    unit = max(1, max_call // stride) * stride  # calls are cut on this grid of whole slots
    first, last = (o - base) // unit, (o + ln - 1 - base) // unit
    if n and bool((last > first).any()):  # cut descriptors that cross the grid
        pieces = last - first + 1
        idx = np.repeat(np.arange(n), pieces)
        k = np.arange(idx.shape[0], dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        start = np.where(k == 0, o[idx], base + (first[idx] + k) * unit)
        end = np.minimum(o[idx] + ln[idx], base + (first[idx] + k + 1) * unit)
        a = a[idx] + (start - o[idx]).astype(np.uint64)
        o, ln = start, end - start
    pad = stride - row_len
    if ln.shape[0] > 1 and pad:
        end = o[:-1] + ln[:-1]
        # Bridge exactly the padding between one row's end and the next slot's start.
        gap = np.flatnonzero((o[1:] - end == pad) & ((o[1:] - base) % stride == 0)) + 1
        if gap.size:
            a = np.insert(a, gap, np.uint64(_SCRATCH.ctypes.data))
            o = np.insert(o, gap, o[gap - 1] + ln[gap - 1])
            ln = np.insert(ln, gap, pad)
    m = int(a.shape[0])
    iov = np.empty((m, 2), dtype=np.uint64)
    iov[:, 0], iov[:, 1] = a, ln
    start = np.ones(m, dtype=bool)
    if m > 1:
        start[1:] = o[1:] != o[:-1] + ln[:-1]
        cell = (o - base) // unit  # a new grid cell starts a call: calls hold whole slots
        start[1:] |= cell[1:] != cell[:-1]
    seg = np.cumsum(start) - 1
    pos = np.arange(m) - np.flatnonzero(start)[seg]
    start |= (pos % IOV_MAX) == 0
    first = np.flatnonzero(start)
    count = np.diff(np.append(first, m))
    nbytes = np.add.reduceat(ln, first) if m else ln[:0]
    return Calls(iov, first, count, o[first], nbytes, n)


def groups(c: Calls, base: int, stride: int, unit: int | None = None) -> list[tuple[int, int, int, int]]:
    """Consecutive calls as ``(first call, end call, first slot, last slot)`` such that no
    slot's bytes are in two groups: a group can check or digest its rows on its own, right
    before or after moving them (while they are warm in the CPU caches).

    ``unit``: also keep calls of one ``unit``-byte cell of the file together (a backend's
    file path posts a group at once, whatever its gaps: cells of about ``MAX_CALL``)."""
    if not len(c):
        return []
    lo = (c.offset - base) // stride
    hi = (c.offset + c.nbytes - 1 - base) // stride
    fresh = lo[1:] > hi[:-1]  # a call starting on a fresh slot may start a group
    if unit is not None:
        cell = (c.offset - base) // unit
        fresh &= cell[1:] != cell[:-1]
    cut = np.flatnonzero(fresh) + 1
    a = np.concatenate([[0], cut]).tolist()
    b = np.concatenate([cut, [len(c)]]).tolist()
    return [(i, j, int(lo[i]), int(hi[j - 1])) for i, j in zip(a, b)]


def run_calls(fd: int, write: bool, c: Calls, cancelled: Callable[[], bool],
              hook: Callable[[str], None] | None = None) -> None:
    """Issue every call; a short transfer resumes where it stopped, an error is typed.

    ``hook`` (tests) is called with ``"issue"`` right before each call, after the
    cancellation check (the window :meth:`Job.io` closes), and ``"call"`` after it."""
    fn = _pwritev if write else _preadv
    base = c.iov.ctypes.data
    for k in range(len(c)):
        if cancelled():
            raise TransferCancelledError("store transfer was cancelled")
        first, count, off, want = int(c.first[k]), int(c.count[k]), int(c.offset[k]), int(c.nbytes[k])
        if hook is not None:
            hook("issue")
        got = fn(fd, base + 16 * first, count, off)
        if got != want:
            _finish_short(fn, fd, write, c.iov[first:first + count], off, got)
        if hook is not None:
            hook("call")


def wipe(c: Calls) -> None:
    """Zero the local memory of ``c``'s calls (a restore's rows that failed or were cut short:
    no unchecked byte stays where the caller reads); the padding scratch is left alone."""
    if not len(c):
        return
    lo, hi = int(c.first[0]), int(c.first[-1] + c.count[-1])
    scratch = _SCRATCH.ctypes.data
    for addr, n in c.iov[lo:hi].tolist():
        if addr != scratch:
            ctypes.memset(addr, 0, n)


def _finish_short(fn: Any, fd: int, write: bool, iov: np.ndarray, off: int, got: int) -> None:
    """The rare path: an interrupted or partial call. Loops per call, not per descriptor."""
    rest = iov.copy()
    total = int(rest[:, 1].sum())
    done = 0
    while True:
        if got < 0:
            e = ctypes.get_errno()
            if e == errno.EINTR:
                got = 0
            elif e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StoreFullError(e, f"slab write failed: {os.strerror(e)}")
            else:
                raise StoreError(f"slab {'write' if write else 'read'} failed: {os.strerror(e)}")
        elif got == 0 and not write:
            raise StoreError("the slab ended early (truncated while open?); the rows were not restored")
        done += got
        if done >= total:
            return
        lens = rest[:, 1].astype(np.int64)
        cum = np.cumsum(lens)
        i = int(np.searchsorted(cum, got, side="right"))
        rest = rest[i:].copy()
        into = got - (int(cum[i - 1]) if i else 0)
        rest[0, 0] += np.uint64(into)
        rest[0, 1] -= np.uint64(into)
        got = fn(fd, rest.ctypes.data, rest.shape[0], off + done)


class Job:
    """One store request running on worker threads; polled by a :class:`~kvxfer.Transfer`.

    ``body`` does the work and may raise; ``cleanup`` runs exactly once, on the worker, after
    ``body`` returned or raised (after cancellation too), so reservations and pins are
    released only when no call can still touch the slab.

    The fence: a call that may write the caller's memory runs inside :meth:`io`, and
    :meth:`cancel` returns only once no such call is in flight. A ``preadv`` cannot be
    interrupted, and one already past the cancellation check would otherwise land after the
    transfer reported its end (docs/design.md, section 7); waiting costs at most one call
    (about 8 MiB) per worker thread, where reading into a bounce buffer would cost a copy of
    every restored byte.
    """

    def __init__(self, pool: ThreadPoolExecutor, body: Callable[["Job"], None],
                 cleanup: Callable[["Job", BaseException | None], None], path: str, keep: Any = None) -> None:
        self.cancelled = False
        self.keep = keep  # what owns the memory the calls touch: alive until the job is dropped
        self.path = path
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self._busy = 0  # calls inside io()
        self._cleanup = cleanup
        self._body = body
        self.future: Future[None] = pool.submit(self._run)

    def _run(self) -> None:
        err: BaseException | None = None
        try:
            self._body(self)
        except BaseException as exc:
            err = exc
        self._cleanup(self, err)
        if err is not None:
            raise err

    def poll(self) -> bool:
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            raise exc
        return True

    @contextmanager
    def io(self) -> Iterator[None]:
        """Hold while moving bytes: refused once cancelled, and waited for by :meth:`cancel`."""
        with self.lock:
            if self.cancelled:
                raise TransferCancelledError("store transfer was cancelled")
            self._busy += 1
        try:
            yield
        finally:
            with self.lock:
                self._busy -= 1
                if not self._busy:
                    self._idle.notify_all()

    def cancel(self) -> None:
        """Stop the job; return only when no call of it can still write (the fence)."""
        with self.lock:
            self.cancelled = True
            while self._busy:
                self._idle.wait()


class FileEngine:
    """What :class:`~kvxfer.Transfer` needs of a backend, for store jobs (no transport)."""

    name = "store"
    capabilities = Capabilities(cross_process=False)
    telemetry = Backend.telemetry  # reports nothing per post

    def poll(self, job: Job) -> bool:
        return job.poll()

    def release(self, job: Job) -> None:
        if not job.future.done():
            job.cancel()

    def data_path(self, job: Job) -> str:
        return job.path


ENGINE = FileEngine()


class JobTransfer(Transfer):
    """A store request's :class:`~kvxfer.Transfer`: :meth:`wait` sleeps on the job's future,
    woken once when the job ends, before the core's own wait (deadline, cancel on timeout and
    errors unchanged). The core's polling rhythm (naps growing by a microsecond) woke the
    caller's thread hundreds of times per request, taking the GIL and a core from the
    workers (BENCHMARKS.md, "Issue 37: store offload")."""

    def wait(self, timeout: float | None = None) -> "Transfer":
        if self.status is Status.PENDING and len(self._posts) == 1:
            end = Deadline(self._due()) if timeout is None else Deadline.after(timeout, "wait timeout")
            wait([self._posts[0].handle.future], timeout=end.left())
            if timeout is not None:  # what is left of the caller's timeout, for the core's wait
                timeout = max(end.left(), 1e-6)
        return super().wait(timeout)
