"""Ports for test servers that stay free until the server binds them.

A port picked by binding port 0 comes from the kernel's ephemeral range, the same range it
draws from for every outgoing connection. A vLLM engine binds its side channel only after
loading its model, minutes later on a busy 2-core machine, and by then some client's
``connect()`` may hold that port (CI saw ``Address already in use`` this way). So ports come
from *below* the ephemeral range, where the kernel never assigns one by itself, and each is
reserved with a file under the temporary directory so that two test processes on one machine
do not pick the same one.

The claims live in a directory of this user's own (``kvxfer-ports-<uid>``, mode 0700), checked
before use: another user's, or one others may write, is refused, since whoever can write
there decides which ports this process believes taken. A claim is read without following a
link or waiting on a FIFO, and at most a few bytes of it: a planted symlink to ``/dev/zero``
or a FIFO is not a claim, and is replaced.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import stat
import tempfile
from pathlib import Path

from ..errors import KvxferError

__all__ = ["free_port"]

#: Lowest port handed out: above the registered services most hosts run.
LOW = 20000
_RESERVED: Path | None = None  # where claims go; None: kvxfer-ports-<uid> under the temporary directory
#: Most bytes of a claim read: a pid.
_CLAIM_BYTES = 32
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


def _where() -> Path:
    """The claims directory's path, for the uid this process has now."""
    return _RESERVED if _RESERVED is not None else Path(tempfile.gettempdir()) / f"kvxfer-ports-{os.getuid()}"


def _directory() -> Path:
    """The claims directory, made 0700 if absent; refused unless it is this user's and private."""
    where = _where()
    try:
        os.mkdir(where, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(where)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise KvxferError(f"port claims directory {where} is not a private directory of uid {os.getuid()} "
                          f"(uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): another user could decide which "
                          "ports this process believes taken. Remove it, or point TMPDIR elsewhere")
    return where


def _claimant(path: Path) -> int | None:
    """The pid in a claim file; None when ``path`` is not one (a link, a FIFO, any non-regular
    file, or bytes that are not a pid). Never follows a link, never waits, reads a few bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return 0
        return None  # ELOOP: a symlink; anything else we cannot read is no claim either
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _CLAIM_BYTES)
    finally:
        os.close(fd)
    try:
        pid = int(raw or b"0")
    except ValueError:
        return None
    return pid if 0 <= pid < 1 << 31 else None  # os.kill is never asked about a group or a huge number


def _reserve(port: int) -> bool:
    """Claim ``port`` for this process; a claim whose process has exited is taken over."""
    path = _directory() / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            owner = _claimant(path) or 0
            if owner and (owner == os.getpid() or _alive(owner)):
                return False
            try:
                path.unlink(missing_ok=True)  # a dead claimant's, or no claim at all
            except OSError:  # a directory, say: not ours to clear, so not this port
                return False
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _release(port: int) -> None:
    """Give back a claim this process made (and has not handed out)."""
    path = _where() / str(port)
    if _claimant(path) == os.getpid():
        path.unlink(missing_ok=True)


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
