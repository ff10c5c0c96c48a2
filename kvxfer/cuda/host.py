"""Who and where a process is: boot id, pid, start time, a per-process token; peer liveness.

The device path may only be used between processes of one running kernel (CUDA IPC handles
mean nothing elsewhere), so each side advertises the kernel's boot id. A pid alone can be
reused, so it travels with the process's start time; the peer opens a pidfd on it, which
stays tied to that very process and becomes readable when it exits: a dead peer is noticed
in a microsecond, without signals or timeouts.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ..deadlines import readable

__all__ = ["Identity", "PeerProcess", "boot_id", "here", "pidfd_getfd", "start_time"]

_token = {"value": os.urandom(16)}


def _after_fork_in_child() -> None:
    # A forked child shares no mappings or exporters with its parent.
    _token["value"] = os.urandom(16)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def boot_id() -> bytes:
    """16 bytes that differ between hosts and between boots of one host (b"" if unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16]
    except (OSError, ValueError):
        return b""


def start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (-1 if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # the command name may hold spaces and parentheses: fields start after the last ')'
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


@dataclass(frozen=True)
class Identity:
    """What a process tells its peers about itself."""

    boot_id: bytes
    pid: int
    start_time: int
    token: bytes  # random per process (renewed in a forked child)


def here() -> Identity:
    pid = os.getpid()
    return Identity(boot_id(), pid, start_time(pid), _token["value"])


class PeerProcess:
    """A pidfd on a peer process: ``alive()`` is one non-blocking poll.

    Raises ``OSError`` when the pid is gone, or now names another process (start time differs).
    """

    def __init__(self, pid: int, started: int) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)
        if start_time(pid) != started:
            os.close(self.fd)
            raise OSError(f"process {pid} is not the one that sent the metadata (start time differs)")

    def alive(self) -> bool:
        if self.fd < 0:
            return False
        return not readable(self.fd, 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
