"""Is a peer process still the one that sent its metadata, and still running?

One watcher for every backend: a pidfd where the kernel has them (it stays tied to that very
process and becomes readable when it exits, zombie included: a dead peer is noticed without
signals, timeouts or polling ``/proc``), else ``/proc/<pid>/stat`` read at most every
``every`` seconds. The pid and start time come from the peer's identity: a lie can only make
that peer's own connection look dead, never another's alive.
"""

from __future__ import annotations

import ctypes
import os
import time

from ..deadlines import readable
from .identity import stat

__all__ = ["ProcessWatch", "pidfd_getfd"]


class ProcessWatch:
    """Watch process ``pid`` that started at ``start``; ``alive()`` is cheap enough for every poll.

    With ``strict`` it raises ``OSError`` when the pid is gone or now names another process
    (start time differs); without, such a watch just reads as dead. ``fd`` is the pidfd (-1 on
    the ``/proc`` fallback, or once closed).
    """

    def __init__(self, pid: int, start: int, every: float = 0.02, *, strict: bool = True) -> None:
        self.pid, self.start, self.every = int(pid), int(start), every
        self.fd = -1
        self._next = 0.0
        self._alive = True
        try:
            self.fd = os.pidfd_open(self.pid)
        except AttributeError:
            pass  # no pidfd in this Python or kernel: /proc below
        except OSError:
            if strict:
                raise OSError(f"process {pid} does not exist") from None
        if self._state() is not True:
            self.close()
            if strict:
                raise OSError(f"process {pid} is not the one that sent the metadata (gone, or its start time "
                              "differs)")

    def _state(self) -> bool:
        try:
            state, started = stat(self.pid)
        except OSError:
            return False
        return state not in ("Z", "X", "x") and started == self.start

    def alive(self, force: bool = False) -> bool:
        """At most one look per ``every`` seconds unless ``force`` (``every=0``: every call)."""
        if not self._alive:
            return False
        if self.every > 0 and not force:
            now = time.monotonic()
            if now < self._next:
                return True
            self._next = now + self.every
        self._alive = not readable(self.fd, 0) if self.fd >= 0 else self._state()
        return self._alive

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._alive = False

    def __del__(self) -> None:  # owners that just drop a watch must not leak its pidfd
        try:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        except (AttributeError, OSError):
            pass


_SYS_PIDFD_GETFD = 438  # the same number on x86-64 and aarch64


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """Duplicate file descriptor ``fd`` of the process behind ``pidfd`` into this one.

    This is how a VMM allocation's shareable handle (a file descriptor) reaches the peer
    without a Unix socket; it needs ptrace rights over the exporter (same user, Yama allowing).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    out = libc.syscall(_SYS_PIDFD_GETFD, ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
    if out < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
    return int(out)
