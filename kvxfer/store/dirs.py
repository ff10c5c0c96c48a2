"""The store's directory: checked once, then every name in it resolved against its descriptor.

A store restores whatever its files say, digests included: whoever can write its directory
can put rows under its keys (a slab and journal of their own) or plant a symlink where the
store creates a file, so that creating a store truncates a file the store's user owns. So a
store trusts only what it made:

* the directory must be owned by this process's uid and writable by nobody else
  (:class:`~kvxfer.errors.StorePermissionError`, saying why and what to do);
* every file is opened relative to the directory's descriptor (``openat``), never following a
  symlink (``O_NOFOLLOW``), and ``fstat``-ed: a regular file of this uid, or refused;
* a file is created under a fresh, unpredictable temporary name with ``O_EXCL`` and renamed
  into place, so nothing planted at a name can be followed or truncated.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from typing import Callable

from ..errors import StoreBusyError, StoreError, StoreFullError, StorePermissionError

__all__ = ["StoreDir", "typed", "run_all"]

_NEW = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def _check(st: os.stat_result, what: str, where: str) -> None:
    """Refuse what this uid does not own, or what others may write (the one trust rule)."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise StorePermissionError(
            f"{what} {where} belongs to uid {st.st_uid}, not to this process's uid {uid}: its owner could put "
            "rows under your keys. Give the store a directory of your own (a path that does not exist yet is "
            "created 0700)")
    if st.st_mode & 0o022:
        raise StorePermissionError(
            f"{what} {where} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): they could "
            f"replace the slab or its journal. Run chmod go-w on it, or give the store a directory of your own")


def typed(exc: OSError, what: str) -> StoreError:
    """A file system error as the store's: :class:`StoreFullError` when it is about space."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StoreFullError(exc.errno, f"{what}: {os.strerror(exc.errno)}; free space (nothing was changed)")
    return StoreError(f"{what}: {exc.strerror or exc}")


class StoreDir:
    """An open, checked store directory (``fd``) and the file operations relative to it."""

    def __init__(self, path: object) -> None:
        try:
            p = os.fspath(path)  # type: ignore[call-overload]
        except TypeError:
            raise StoreError(f"the store path must be a str or os.PathLike, got {type(path).__name__}") from None
        if not isinstance(p, str) or not p or "\0" in p or len(p) > 4096:
            raise StoreError(f"the store path must be a non-empty directory path without NUL, got {p!r:.80}")
        self.path = p
        try:
            os.makedirs(p, mode=0o700, exist_ok=True)
            self.fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileExistsError, NotADirectoryError):
            raise StoreError(f"the store path {p} is not a directory; give the store a directory") from None
        except OSError as exc:
            raise StoreError(f"cannot open the store directory {p}: {exc.strerror}") from None
        try:
            _check(os.fstat(self.fd), "the store directory", p)
        except BaseException:
            os.close(self.fd)
            raise

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self, name: str, flags: int) -> int:
        """Open ``name`` (``flags`` may add ``O_CREAT``): never through a symlink, and only a
        regular file of this uid that others cannot write."""
        try:
            fd = os.open(name, flags | _OPEN, 0o600, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StorePermissionError(f"{self.join(name)} is a symlink; the store follows none: remove it") \
                    from None
            if isinstance(exc, FileNotFoundError):
                raise
            raise typed(exc, f"cannot open {self.join(name)}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StorePermissionError(f"{self.join(name)} is not a regular file; move it away")
            _check(st, "the file", self.join(name))
            return fd
        except BaseException:
            os.close(fd)
            raise

    def create(self, name: str) -> tuple[int, str]:
        """A new empty file to be renamed to ``name`` by :meth:`publish`: its descriptor and
        its temporary name (fresh, random, created exclusively)."""
        for _ in range(8):
            tmp = f"{name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
            try:
                return os.open(tmp, _NEW, 0o600, dir_fd=self.fd), tmp
            except FileExistsError:
                continue
            except OSError as exc:  # a full directory or inode table, a read-only file system
                raise typed(exc, f"cannot create {self.join(name)}") from None
        raise StoreError(f"cannot create a temporary file for {self.join(name)}")  # 8 collisions of 48 random bits

    def publish(self, tmp: str, name: str) -> None:
        """Rename ``tmp`` over ``name`` and make the rename durable."""
        try:
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.fsync(self.fd)
        except OSError as exc:
            raise typed(exc, f"cannot publish {self.join(name)}") from None

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def sweep(self, prefix: str) -> None:
        """Remove temporaries of ``prefix`` a killed process left (call holding the slab's lock:
        only its holder creates them)."""
        for name in os.listdir(self.fd):
            if name.startswith(prefix) and ".tmp-" in name:
                self.unlink(name)

    def lock(self, name: str, busy: str) -> int:
        """Hold an exclusive ``flock`` on ``name`` (created if absent), or raise
        :class:`~kvxfer.errors.StoreBusyError` with ``busy``. A holder may remove the file
        (:meth:`unlock`), so a lock taken on a file no longer at ``name`` is retried."""
        for _ in range(64):
            fd = self.open(name, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StoreBusyError(busy) from None
            try:
                here = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                here = False
            if here:
                return fd
            os.close(fd)
        raise StoreBusyError(busy)

    def unlock(self, fd: int, name: str, remove: bool) -> None:
        """Release a :meth:`lock`; ``remove``: delete the lock file first (still holding it)."""
        try:
            if remove:
                self.unlink(name)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def run_all(*steps: Callable[[], None]) -> None:
    """Run every step, then raise the first error (so one failure leaks nothing else)."""
    err: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:
            err = err or exc
    if err is not None:
        raise err
