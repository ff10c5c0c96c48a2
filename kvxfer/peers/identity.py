"""Who a process is: boot id, pid, start time, token and proof page, with one wire encoding.

A pid alone can be reused, so it travels with the process's start time; the boot id tells
hosts (and boots of one host) apart. The token is public: it is the first half of the
SHA-256 of a secret that never leaves this process except through a memory read that ptrace
rules already allow (:mod:`kvxfer.peers.proof`). Equal tokens mean "claims to be this
process"; only the proof makes a claim about another process believable.

A forked child is another process: :func:`on_fork` callbacks run in the child, and the
process page (secret, token, registered spans) is replaced there.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable

from ..errors import MetadataError

__all__ = ["IDENTITY", "Identity", "boot_id", "decode", "encode", "on_fork", "pid_namespace", "stat",
           "start_time"]

#: boot id, pid, start time (clock ticks after boot), token, address of the proof page, PID namespace
IDENTITY = struct.Struct("<16sIQ16sQQ")

_forked: list[Callable[[], None]] = []


def on_fork(callback: Callable[[], None]) -> None:
    """Run ``callback`` in every forked child (the one fork hook of kvxfer's process state)."""
    _forked.append(callback)


def _after_fork_in_child() -> None:
    for cb in list(_forked):
        cb()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_constant: dict[str, object] = {}  # a process's boot and PID namespace never change under it


def boot_id() -> bytes:
    """16 bytes that differ between hosts and between boots of one host (b"" if unknown)."""
    if "boot" not in _constant:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                _constant["boot"] = bytes.fromhex(f.read().strip().replace("-", ""))[:16]
        except (OSError, ValueError):
            return b""
    return _constant["boot"]  # type: ignore[return-value]


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 if unreadable): pids mean the same only within one."""
    if "pidns" not in _constant:
        try:
            _constant["pidns"] = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            return 0
    return _constant["pidns"]  # type: ignore[return-value]


def stat(pid: int) -> tuple[str, int]:
    """``(state, start time)`` from ``/proc/<pid>/stat``; OSError when there is no such process."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    try:
        # the command name may hold spaces and parentheses: fields start after the last ')'
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0].decode(), int(fields[19])  # fields 3 and 22 of proc(5)
    except (ValueError, IndexError) as exc:
        raise OSError(f"unreadable /proc/{pid}/stat") from exc


def start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (-1 if it is gone or unreadable)."""
    try:
        return stat(pid)[1]
    except OSError:
        return -1


@dataclass(frozen=True)
class Identity:
    """What a process tells its peers about itself (see :func:`encode` for the bytes)."""

    boot_id: bytes
    pid: int
    start_time: int
    token: bytes  # public half of the process secret (renewed in a forked child)
    page: int = 0  # where the proof page lives in that process (0: not offered)
    pidns: int = 0  # its PID namespace (inode): the pid means this process only within it

    def same_host(self) -> bool:
        """Whether it claims to run on this host, boot and PID namespace (a claim until proven)."""
        mine = boot_id()
        return bool(mine) and self.boot_id == mine and self.pidns == pid_namespace()


def encode(i: Identity) -> bytes:
    return IDENTITY.pack(i.boot_id.ljust(16, b"\0")[:16], i.pid & 0xFFFFFFFF, i.start_time & (2**64 - 1),
                         i.token.ljust(16, b"\0")[:16], i.page & (2**64 - 1), i.pidns & (2**64 - 1))


def decode(raw: bytes, what: str = "peer identity") -> Identity:
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != IDENTITY.size:
        raise MetadataError(f"{what}: expected {IDENTITY.size} bytes")
    boot, pid, started, token, page, pidns = IDENTITY.unpack(bytes(raw))
    return Identity(boot if boot.strip(b"\0") else b"", int(pid), int(started), token, int(page), int(pidns))
