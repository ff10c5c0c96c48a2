"""The same-host data path: ``process_vm_readv`` / ``process_vm_writev`` on libc through ctypes.

Why it exists: between two processes of one host, UCX's only single-copy transport for host
memory is CMA, and UCX aborts the *surviving* process when a CMA peer dies in the middle of a
copy. The kernel call underneath is harmless by itself: when the peer is gone it returns
``ESRCH``. Calling it ourselves gives the same single copy with a typed error instead.

This module only moves bytes (:class:`CopyJob`: one transfer as arrays of ``struct iovec``
built with numpy, in batches of at most ``IOV_MAX`` iovecs and ``chunk`` bytes per syscall,
resumable after a partial transfer, errno mapped to kvxfer's errors). Which process a peer
is, and which of its memory we may touch, is :mod:`kvxfer_ucx._hostpage`'s business; the
backend decides when this path is used.

Security note: :func:`allow_same_user_access` calls ``prctl(PR_SET_PTRACER,
PR_SET_PTRACER_ANY)``. Under Yama ``ptrace_scope=1`` that lets *any process of the same
user* read and write this process's memory, which is what a peer needs to copy from us.
Without Yama the call fails harmlessly. The backend makes it whenever the ``posix`` transport
is on too, since that transport lets the same processes reach this memory anyway
(docs/design.md, section 8.1).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time

import numpy as np

from kvxfer import BackendError, KvxferError, PeerDisconnectedError, TransferCancelledError

__all__ = [
    "DEFAULT_CHUNK",
    "IOV_MAX",
    "CopyJob",
    "Libc",
    "allow_same_user_access",
    "libc",
    "libc_error",
    "map_errno",
    "read_remote",
]

#: Linux's ``UIO_MAXIOV``: the most iovecs one ``process_vm_*v`` call accepts (more gives EINVAL).
IOV_MAX = 1024
#: Bytes per syscall. Bounds how long one call blocks, which bounds how late a cancellation
#: or a time budget can be honoured.
DEFAULT_CHUNK = 8 << 20
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_EPERM_HINT = ("ptrace permissions forbid cross-process memory access to peer {peer!r} (pid {pid}): Yama "
               "ptrace_scope, a container's seccomp/capability policy, or a non-dumpable peer. Pass "
               "same_host_copy=False to fall back to UCX RMA")


class Libc:
    """The three libc calls the fast path needs, typed once.

    ``ctypes.CDLL`` releases the GIL around foreign calls, so a long copy does not stall
    the process's other Python threads.
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.readv = lib.process_vm_readv  # AttributeError on libcs without it: caller handles
        self.writev = lib.process_vm_writev
        for fn in (self.readv, self.writev):
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
            fn.restype = ctypes.c_ssize_t
        self.prctl = lib.prctl
        self.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self.prctl.restype = ctypes.c_int


_LIBC: Libc | None = None
_LIBC_ERROR: str | None = None


def libc() -> Libc | None:
    """The shared :class:`Libc`, or None where the syscalls do not exist (not Linux)."""
    global _LIBC, _LIBC_ERROR
    if _LIBC is None and _LIBC_ERROR is None:
        try:
            _LIBC = Libc()
        except (OSError, AttributeError) as exc:
            _LIBC_ERROR = f"process_vm_readv is not available: {exc}"
    return _LIBC


def libc_error() -> str | None:
    return _LIBC_ERROR


def allow_same_user_access(lib: Libc) -> bool:
    """``prctl(PR_SET_PTRACER, ANY)``: let same-user peers read/write us under Yama scope 1.

    Returns whether the call succeeded; failure is normal without Yama and changes nothing.
    """
    return lib.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0


def map_errno(err: int, op: str, peer: str, pid: int) -> KvxferError:
    """errno of a failed ``process_vm_*v`` as a kvxfer error."""
    if err == errno.ESRCH:
        return PeerDisconnectedError(f"same-host copy: peer {peer!r} (pid {pid}) no longer exists; remove it and "
                                     "add it again once it is back")
    if err == errno.EPERM:
        return BackendError("same-host copy: " + _EPERM_HINT.format(peer=peer, pid=pid))
    if err == errno.EFAULT:
        return BackendError(f"same-host copy ({op}) from/to peer {peer!r} (pid {pid}) hit an unmapped address: the "
                            "peer freed or remapped memory it still advertises as registered")
    return BackendError(f"same-host copy ({op}) with peer {peer!r} (pid {pid}) failed: "
                        f"{errno.errorcode.get(err, err)} ({os.strerror(err)})")


class CopyJob:
    """One transfer on the fast path: ``local[i] <-> remote[i]`` for equal-length pairs.

    Descriptors longer than ``chunk`` are split into ``chunk``-sized pieces up front (numpy,
    no per-descriptor Python), so one syscall never moves more than ``chunk`` bytes plus at
    most ``IOV_MAX`` pieces. Progress is a byte count over the concatenated pieces; a partial
    return (the kernel may stop early, even inside an iovec) simply resumes from there.

    Not thread-safe: the backend steps a job under its lock.
    """

    def __init__(self, lib: Libc, pid: int, write: bool, local: np.ndarray, remote: np.ndarray,
                 nbytes: np.ndarray, *, peer: str = "?", chunk: int = DEFAULT_CHUNK) -> None:
        self.pid, self.write, self.peer = int(pid), bool(write), peer
        self._fn = lib.writev if write else lib.readv
        chunk = max(1, int(chunk))
        la = np.asarray(local, dtype=np.uint64)
        ra = np.asarray(remote, dtype=np.uint64)
        n = np.asarray(nbytes, dtype=np.uint64)
        counts = ((n + np.uint64(chunk - 1)) // np.uint64(chunk)).astype(np.int64)
        if len(n) and (counts > 1).any():
            first = np.cumsum(counts) - counts
            owner = np.repeat(np.arange(len(n)), counts)
            off = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)).astype(np.uint64)
            off *= np.uint64(chunk)
            la, ra = la[owner] + off, ra[owner] + off
            n = np.minimum(np.uint64(chunk), n[owner] - off)
        # struct iovec {void *iov_base; size_t iov_len;} is two uint64 on every 64-bit Linux ABI.
        self.liov = np.empty((len(n), 2), dtype=np.uint64)
        self.riov = np.empty((len(n), 2), dtype=np.uint64)
        self.liov[:, 0], self.liov[:, 1] = la, n
        self.riov[:, 0], self.riov[:, 1] = ra, n
        self.cum = np.cumsum(n.astype(np.int64))
        self.total = int(self.cum[-1]) if len(n) else 0
        self.chunk = chunk
        self.done_bytes = 0
        self._k = 0  # first piece not completely moved
        self.syscalls = 0
        self.partials = 0  # syscalls that moved less than asked (resumed)
        self.error: KvxferError | None = None
        self.cancelled = False

    @property
    def finished(self) -> bool:
        return self.done_bytes >= self.total

    def _call(self, liov: int, lcnt: int, riov: int, rcnt: int) -> int:
        """One raw syscall; returns bytes moved or ``-errno``. Tests replace it to force partials."""
        r = self._fn(self.pid, liov, lcnt, riov, rcnt, 0)
        return r if r >= 0 else -ctypes.get_errno()

    def step(self, deadline: float | None = None) -> bool:
        """Copy until finished, or until ``deadline`` (monotonic) passed after at least one syscall.

        ``deadline=None`` does exactly one syscall. Returns :attr:`finished`. Raises the mapped
        error (and remembers it) on failure; bytes already moved stay moved.
        """
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise TransferCancelledError("same-host copy was cancelled")
        cum, k_max = self.cum, len(self.cum)
        while not self.finished:
            k, done = self._k, self.done_bytes
            start = int(cum[k]) - int(self.liov[k, 1])
            j = int(np.searchsorted(cum, done + self.chunk, side="right"))
            j = max(k + 1, min(j, k + IOV_MAX, k_max))
            off = done - start
            if off:  # resume inside piece k: adjust a private copy of the first iovec
                liov, riov = self.liov[k:j].copy(), self.riov[k:j].copy()
                liov[0] += np.array([off, -off], dtype=np.int64).astype(np.uint64)
                riov[0] += np.array([off, -off], dtype=np.int64).astype(np.uint64)
                lp, rp = liov.ctypes.data, riov.ctypes.data
            else:
                lp, rp = self.liov.ctypes.data + 16 * k, self.riov.ctypes.data + 16 * k
            want = int(cum[j - 1]) - done
            got = self._call(lp, j - k, rp, j - k)
            self.syscalls += 1
            if got < 0 or (got == 0 and want > 0):
                err = -got if got < 0 else errno.EFAULT
                self.error = map_errno(err, "write" if self.write else "read", self.peer, self.pid)
                raise self.error
            if got > want:
                self.error = BackendError(f"same-host copy: kernel reported {got} bytes for a {want}-byte batch")
                raise self.error
            if got < want:
                self.partials += 1
            self.done_bytes = done + got
            self._k = int(np.searchsorted(cum, self.done_bytes, side="right"))
            if deadline is None or time.monotonic() >= deadline:
                break
        return self.finished

    def cancel(self) -> None:
        """Stop: no syscall runs between steps, so nothing moves after this returns."""
        self.cancelled = True


def read_remote(lib: Libc, pid: int, address: int, nbytes: int, peer: str) -> bytes:
    """``nbytes`` of process ``pid``'s memory at ``address`` (small reads: proofs, headers)."""
    buf = ctypes.create_string_buffer(max(1, nbytes))
    job = CopyJob(lib, pid, False, np.array([ctypes.addressof(buf)], np.uint64), np.array([address], np.uint64),
                  np.array([nbytes], np.uint64), peer=peer)
    while not job.step(None):
        pass
    return buf.raw[:nbytes]
