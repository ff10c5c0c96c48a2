"""Same-host proof: a peer is the process it names, and what it vouches for is its own word.

Metadata is only bytes: anyone who saw a peer's can copy it, name any pid, and move its
addresses. So each process keeps one :class:`Page` in its own, unregistered memory::

    secret[16]   random; identities carry only token = sha256(secret)[:16]
    seq u64      even when stable, bumped around every change (a seqlock)
    n_spans u32, n_digests u32
    spans        n_spans x (start u64, end u64): every span this process registered
    digests      n_digests x 32: SHA-256 of each export (say, CUDA IPC handles) it stands behind

A verifier reads the page of the claimed pid at the claimed address (``process_vm_readv``)
and accepts the claim only if the secret hashes to the token and the pid's start time is the
claimed one. Nobody can plant a copy elsewhere without knowing the secret. What the page
lists was written by that process itself: memory it registered, exports it made. So bounds
checked against a :class:`Proven` page come from the owner, not from whoever forwarded the
metadata.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..errors import BackendError, IdentityError, PeerDisconnectedError
from .identity import Identity, boot_id, on_fork, pid_namespace, start_time

__all__ = ["MAX_DIGESTS", "MAX_SPANS", "READ_TRIES", "Page", "ProofUnavailable", "Proven", "check_this_process", "here",
           "holds", "names_this_process", "process_page", "prove", "read_memory", "retry_pause"]

#: What one page can list: spans registered (by every agent of the process, for the process
#: page) and exports vouched for. The buffer is allocated once per page (~1 MiB).
MAX_SPANS = 1 << 16
MAX_DIGESTS = 256
_HEADER = struct.Struct("<16sQII")
#: Reads of a page caught mid-update before giving up. An owner holds it odd for a few
#: microseconds, but a loaded host can deschedule it right then: after the first few tries
#: each waits a millisecond, so a genuine peer is never refused for being slow (~2 s in all).
READ_TRIES, _QUICK_TRIES = 2000, 8


def retry_pause(attempt: int) -> None:
    """Before re-reading a page caught mid-update: nothing at first, then a millisecond."""
    if attempt >= _QUICK_TRIES:
        time.sleep(0.001)


def token_of(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()[:16]


def holds(secret: bytes, digest: bytes) -> bool:
    """Whether ``secret`` is behind ``digest``: a token (16 bytes) or the whole SHA-256 (32)."""
    return len(digest) in (16, 32) and hashlib.sha256(secret).digest()[:len(digest)] == digest


class Page:
    """A proof page: owners add spans and digests under a key, readers see all or none."""

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self.max_spans = min(int(max_spans), MAX_SPANS)
        self._buf = ctypes.create_string_buffer(_HEADER.size + 16 * self.max_spans + 32 * MAX_DIGESTS)
        self._secret = os.urandom(16)
        self.token = token_of(self._secret)
        self.digest = hashlib.sha256(self._secret).digest()  # for wire formats that carry all of it
        self._seq = 0
        self._entries: dict[object, tuple[np.ndarray, tuple[bytes, ...]]] = {}
        self._lock = threading.Lock()
        _HEADER.pack_into(self._buf, 0, self._secret, 0, 0, 0)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._buf)

    def set(self, key: object, spans: Iterable[tuple[int, int]] = (), digests: Iterable[bytes] = ()) -> None:
        """Publish ``spans`` (``(start, end)``) and ``digests`` under ``key``, replacing its previous ones."""
        rows = np.array(list(spans), dtype=np.uint64).reshape(-1, 2)
        with self._lock:
            old = self._entries.get(key)
            self._entries[key] = (rows, tuple(bytes(d) for d in digests))
            try:
                self._publish()
            except BackendError:  # too much: the page keeps what it listed before
                if old is None:
                    del self._entries[key]
                else:
                    self._entries[key] = old
                raise

    def drop(self, key: object) -> None:
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._publish()

    def _publish(self) -> None:
        rows = np.concatenate([r for r, _ in self._entries.values()] or [np.zeros((0, 2), np.uint64)])
        digests = [d for _, ds in self._entries.values() for d in ds]
        if len(rows) > self.max_spans or len(digests) > MAX_DIGESTS:
            raise BackendError(f"a proof page lists at most {self.max_spans} registered spans and {MAX_DIGESTS} "
                               f"exports; this process registered {len(rows)} and exported {len(digests)}")
        rows = np.ascontiguousarray(rows, dtype=np.uint64)
        self._seq += 1  # odd: a reader retries
        _HEADER.pack_into(self._buf, 0, self._secret, self._seq, 0, 0)
        base = ctypes.addressof(self._buf) + _HEADER.size
        ctypes.memmove(base, rows.ctypes.data, rows.nbytes)
        raw = b"".join(digests)
        ctypes.memmove(base + 16 * len(rows), raw, len(raw))
        _HEADER.pack_into(self._buf, 0, self._secret, self._seq, len(rows), len(digests))
        self._seq += 1
        _HEADER.pack_into(self._buf, 0, self._secret, self._seq, len(rows), len(digests))

    def wipe(self) -> None:
        """Forget the secret (a forked child must not hold its parent's proof)."""
        ctypes.memset(self._buf, 0, ctypes.sizeof(self._buf))
        self._entries.clear()


_state: dict[str, Page | None] = {"page": None}
_state_lock = threading.Lock()


def process_page() -> Page:
    """This process's page (created on first use)."""
    with _state_lock:
        if _state["page"] is None:
            _state["page"] = Page()
        return _state["page"]


def _after_fork() -> None:
    old = _state["page"]
    _state["page"] = None
    if old is not None:
        old.wipe()


on_fork(_after_fork)


_here: dict[str, Identity] = {}


def here() -> Identity:
    """This process, as it presents itself to peers (read from ``/proc`` once per process)."""
    pid = os.getpid()
    page = process_page()
    me = _here.get("me")
    if me is None or me.pid != pid or me.page != page.address or me.token != page.token:
        me = _here["me"] = Identity(boot_id(), pid, start_time(pid), page.token, page.address, pid_namespace())
    return me


def names_this_process(claim: Identity) -> bool:
    """Whether ``claim`` says it is this very process (by pid or by token)."""
    me = here()
    return claim.pid == me.pid or claim.token == me.token


def check_this_process(claim: Identity, what: str) -> None:
    """Raise :class:`~kvxfer.errors.IdentityError` unless ``claim`` is exactly this process
    (same boot, pid, start time, token and page): for peers that must live in this process."""
    if claim != here():
        raise IdentityError(f"{what} names process {claim.pid} with an identity this process does not have")


class ProofUnavailable(OSError):
    """The page could not be read for reasons that say nothing about the peer (ptrace rules)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: dict[str, object] = {}


def read_memory(pid: int, address: int, nbytes: int) -> bytes:
    """``nbytes`` of process ``pid``'s memory at ``address`` (OSError with the errno otherwise)."""
    fn = _libc.get("readv")
    if fn is None:
        lib = ctypes.CDLL(None, use_errno=True)
        fn = lib.process_vm_readv
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.c_ulong]
        _libc["readv"] = fn
    buf = ctypes.create_string_buffer(max(1, nbytes))
    local, remote = _Iovec(ctypes.addressof(buf), nbytes), _Iovec(address, nbytes)
    got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # type: ignore[operator]
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    if got != nbytes:
        raise OSError(errno.EFAULT, f"short read ({got} of {nbytes} bytes)")
    return buf.raw[:nbytes]


@dataclass(frozen=True)
class Proven:
    """A verified page: the identity it proves, its ``seq``, what the process published."""

    identity: Identity
    seq: int
    spans: np.ndarray  # (n, 2) uint64: start, end
    digests: frozenset[bytes]

    def covers(self, address: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Per span: whether ``[address, address + nbytes)`` lies inside one published span."""
        a, n = np.asarray(address, np.uint64), np.asarray(nbytes, np.uint64)
        if not len(self.spans):
            return np.zeros(a.shape, bool)
        order = np.argsort(self.spans[:, 0], kind="stable")
        start, end = self.spans[order, 0], self.spans[order, 1]
        # the published span with the greatest start <= address; overlapping spans are merged first
        run_end = np.maximum.accumulate(end)
        i = np.searchsorted(start, a, side="right") - 1
        ok = i >= 0
        j = np.where(ok, i, 0)
        return ok & (a + n >= a) & (a + n <= run_end[j])


def prove(claim: Identity, what: str, *, pid: int | None = None) -> Proven:
    """Verify that process ``claim.pid`` holds the secret behind ``claim.token``.

    Raises :class:`~kvxfer.errors.IdentityError` when it does not (a forgery or a copy), or
    its start time differs (the pid was reused); :class:`~kvxfer.errors.PeerDisconnectedError`
    when no such process exists; :class:`ProofUnavailable` when ptrace rules forbid reading it.
    ``pid`` overrides where the page is read (the fake CUDA layer's processes live in one).
    """
    target = claim.pid if pid is None else pid
    if not claim.page:
        raise IdentityError(f"{what}: names process {claim.pid} but offers no proof page")
    if pid is None and start_time(target) != claim.start_time:
        raise IdentityError(f"{what}: process {claim.pid} is not the one named (gone, or its start time differs)")
    for attempt in range(READ_TRIES):
        retry_pause(attempt)
        head = _read(target, claim, 0, _HEADER.size, what)
        secret, seq, n_spans, n_digests = _HEADER.unpack(head)
        if not holds(secret, claim.token):
            raise IdentityError(f"{what}: process {claim.pid} on this host is not the one that sent it (its "
                                "proof page does not hold the secret behind the token)")
        if n_spans > MAX_SPANS or n_digests > MAX_DIGESTS:
            raise IdentityError(f"{what}: process {claim.pid} publishes a malformed proof page")
        if seq % 2:
            continue
        body = _read(target, claim, _HEADER.size, 16 * n_spans + 32 * n_digests, what)
        if _HEADER.unpack(_read(target, claim, 0, _HEADER.size, what))[1] != seq:
            continue
        spans = np.frombuffer(body, np.uint64, 2 * n_spans).reshape(-1, 2).copy()
        digests = frozenset(body[16 * n_spans + 32 * k: 16 * n_spans + 32 * (k + 1)] for k in range(n_digests))
        return Proven(claim, seq, spans, digests)
    raise IdentityError(f"{what}: process {claim.pid}'s proof page kept changing while it was read")


def _read(pid: int, claim: Identity, offset: int, nbytes: int, what: str) -> bytes:
    if nbytes == 0:
        return b""
    try:
        return read_memory(pid, claim.page + offset, nbytes)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise PeerDisconnectedError(f"{what}: process {claim.pid} no longer exists") from None
        if exc.errno == errno.EPERM:
            raise ProofUnavailable(exc.errno, f"{what}: ptrace rules forbid reading process {claim.pid}") from None
        raise IdentityError(f"{what}: process {claim.pid} has no proof page where it says ({exc})") from None
