"""Ports for test servers that stay free until the server binds them.

A port picked by binding port 0 comes from the kernel's ephemeral range, the same range it
draws from for every outgoing connection. A vLLM engine binds its side channel only after
loading its model, minutes later on a busy 2-core machine, and by then some client's
``connect()`` may hold that port (CI saw ``Address already in use`` this way). So ports come
from *below* the ephemeral range, where the kernel never assigns one by itself, and each is
reserved with a file under the temporary directory so that two test processes on one machine
do not pick the same one.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
from pathlib import Path

__all__ = ["free_port"]

#: Lowest port handed out: above the registered services most hosts run.
LOW = 20000
_RESERVED = Path(tempfile.gettempdir()) / "kvxfer-ports"
_mine: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    for family, addr in ((socket.AF_INET, host), (socket.AF_INET, "0.0.0.0")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reserve(port: int) -> bool:
    """Claim ``port`` for this process; a claim whose process has exited is taken over."""
    _RESERVED.mkdir(exist_ok=True)
    path = _RESERVED / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
            except (OSError, ValueError):
                owner = 0
            if owner and (owner == os.getpid() or _alive(owner)):
                return False
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _release(port: int) -> None:
    """Give back a claim this process made (and has not handed out)."""
    path = _RESERVED / str(port)
    try:
        if int(path.read_text() or "0") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _reserve_all(ports: range) -> bool:
    """Claim every port of ``ports`` or none: a range only partly claimed gives back its part,
    else those claims would stay with this process, never handed out and never tried again."""
    claimed: list[int] = []
    for q in ports:
        if not _reserve(q):
            for r in claimed:
                _release(r)
            return False
        claimed.append(q)
    return True


def free_port(count: int = 1, host: str = "127.0.0.1") -> int:
    """A port p such that p..p+count-1 are bindable now, outside the ephemeral range, and
    reserved for this process (never handed out twice by it)."""
    high = _ephemeral_low()
    if high - LOW < 1000:  # an unusual range: fall back to what the kernel picks
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    for _ in range(500):
        p = random.randrange(LOW, high - count)
        ports = range(p, p + count)
        if any(q in _mine for q in ports) or not all(_bindable(q, host) for q in ports):
            continue
        if _reserve_all(ports):
            _mine.update(ports)
            return p
    raise RuntimeError(f"no {count} free port(s) between {LOW} and {high}")
