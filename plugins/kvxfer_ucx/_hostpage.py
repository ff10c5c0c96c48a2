"""Same-host proof: which process a peer is, and which of its memory we may copy.

A peer's metadata may be forged or copied: it can name any pid on this host, including our
own, and advertise any addresses. So the same-host path never trusts the blob's addresses.
Each agent keeps a :class:`RegistrationPage` (a :class:`kvxfer.peers.Page`, the one page
implementation) in its own (unregistered) memory::

    token[16]  secret random bytes; the blob carries only sha256(token)
    seq u64    even when stable; bumped around every change (a seqlock)
    count u64  number of spans that follow (the page's span count; it lists no digests)
    spans      count x (start, end) of everything this agent registered

A peer reads that page from the claimed pid with ``process_vm_readv`` and accepts only if
the token hashes to the blob's digest. Nobody can plant a copy of the page elsewhere without
knowing the token, and the token never leaves the process except through a memory read that
ptrace rules already allowed. The spans in the page were written by the process itself, so
"inside the page's spans" means "inside what that process registered": a forged blob can at
worst point us at memory some kvxfer agent on this host registered for its peers, never at
anything else. The header is re-read before and after every copy: a changed ``seq`` means the
peer deregistered (or re-registered) since we checked, and the transfer fails instead of
moving bytes from or into memory that is no longer registered. The same page bounds a peer
that claims this host on the RMA path too (:func:`prove`, :mod:`kvxfer_ucx._identity`).
"""

from __future__ import annotations

import errno
import socket
import struct
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import numpy as np

from kvxfer import (Allocation, BackendError, IdentityError, KvxferError, MemoryKind, MetadataError,
                    OutOfRegistrationError, PeerDisconnectedError, StalePeerError)
from kvxfer.plugin import SpanIndex, identity as peers
from kvxfer.plugin.ucxabi import Here

from ._blob import Blob, Host
from ._identity import check_reach
from ._samehost import Libc, libc_error, read_remote

__all__ = ["PAGE_SPANS", "PeerPage", "ProcessWatch", "Proof", "RegistrationPage", "host_identity", "prove", "read_page",
           "same_host"]

#: Most spans a page holds: as many allocations as a connection blob may carry.
PAGE_SPANS = 4096
_HEADER = struct.Struct("<16sQQ")  # token, seq, count
_SPAN = 16
TOKEN_BYTES = 16


def host_identity() -> dict[str, Any] | None:
    """``{boot_id, hostname, pidns, pid, start}`` of this process, or None if unreadable.

    Read from :func:`kvxfer.peers.here` (the one process identity). ``boot_id`` changes on
    every boot and differs between hosts (and VMs); the hostname guards against cloned images;
    the PID namespace makes sure ``pid`` means the same process to the peer; ``start`` tells a
    reused pid apart. These are a pre-filter and a liveness signal, not a proof: the page is.
    """
    me = peers.here()
    if not me.boot_id or me.start_time < 0 or not me.pidns:
        return None
    return {"boot_id": str(uuid.UUID(bytes=me.boot_id)), "hostname": socket.gethostname(),
            "pidns": f"pid:[{me.pidns}]", "pid": me.pid, "start": me.start_time}


class ProcessWatch(peers.ProcessWatch):
    """:class:`kvxfer.peers.ProcessWatch` as UCX uses it: never raises, a gone peer reads dead.

    UCX's shared-memory transport notices a dead peer only once a message to it finds the
    peer's queue full, and a killed process that its parent has not reaped yet (a zombie)
    looks alive to it; the watcher sees both.
    """

    def __init__(self, pid: int, start: int, every: float = 0.02) -> None:
        super().__init__(pid, start, every, strict=False)


class RegistrationPage(peers.Page):
    """This agent's page (:class:`kvxfer.peers.Page`): a secret and the spans it registered."""

    def __init__(self) -> None:
        super().__init__(max_spans=PAGE_SPANS)

    def publish(self, spans: Iterable[tuple[int, int]]) -> None:
        """Replace the published spans (``(start, end)`` pairs); readers see all or none."""
        rows = np.array(list(spans), dtype=np.uint64).reshape(-1, 2)
        if len(rows) > PAGE_SPANS:
            raise MetadataError(f"ucx backend: at most {PAGE_SPANS} registered allocations")
        self.set("spans", rows.tolist())


@dataclass
class PeerPage:
    """A verified page of process ``pid``: its token, the ``seq`` we checked, its spans."""

    pid: int
    address: int
    token: bytes
    seq: int
    spans: SpanIndex
    peer: str

    def recheck(self, lib: Libc) -> None:
        """Raise unless the process still holds this token and has not changed its registrations."""
        token, seq, _ = _HEADER.unpack(read_remote(lib, self.pid, self.address, _HEADER.size, self.peer))
        if token != self.token:
            raise PeerDisconnectedError(f"same-host copy: pid {self.pid} is no longer peer {self.peer!r} (the "
                                        "process exited and its pid was reused); add the peer again")
        if seq != self.seq:
            raise StalePeerError(f"same-host copy: peer {self.peer!r} changed its registered memory since its "
                                 "metadata was added; add its fresh metadata")


def _read(pid: int, address: int, nbytes: int, peer: str) -> bytes:
    """``nbytes`` of ``pid`` at ``address``; a proof that ptrace rules forbid is
    :class:`kvxfer.peers.ProofUnavailable`, anything else a typed error."""
    try:
        return peers.read_memory(pid, address, nbytes)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise PeerDisconnectedError(f"peer {peer!r}: process {pid} no longer exists") from None
        if exc.errno == errno.EPERM:
            raise peers.ProofUnavailable(exc.errno, f"ptrace rules forbid reading process {pid}") from None
        raise IdentityError(f"peer {peer!r}: process {pid} has no registration page where its metadata says "
                            f"({exc})") from None


def read_page(lib: Libc, pid: int, address: int, digest: bytes, peer: str) -> PeerPage:
    """Read and verify process ``pid``'s page at ``address``; raise a KvxferError otherwise
    (:class:`kvxfer.peers.ProofUnavailable` where ptrace rules forbid reading it)."""
    for attempt in range(peers.READ_TRIES):  # a descheduled owner is waited for, not refused
        peers.retry_pause(attempt)
        token, seq, count = _HEADER.unpack(_read(pid, address, _HEADER.size, peer))
        if not peers.holds(token, digest):
            raise IdentityError(f"ucx metadata: pid {pid} on this host is not the process that sent peer "
                                f"{peer!r}'s metadata (token mismatch)")
        if count > PAGE_SPANS:
            raise IdentityError(f"ucx metadata: peer {peer!r}'s registration page claims {count} spans")
        if seq % 2:
            continue  # the peer is updating it
        raw = _read(pid, address + _HEADER.size, _SPAN * count, peer) if count else b""
        if _HEADER.unpack(_read(pid, address, _HEADER.size, peer))[1] != seq:
            continue
        rows = np.frombuffer(raw, dtype=np.uint64).reshape(-1, 2)
        try:
            spans = SpanIndex(Allocation(int(s), int(e) - int(s)) for s, e in rows.tolist() if e > s)
        except KvxferError:
            raise IdentityError(f"ucx metadata: peer {peer!r} publishes a malformed registration page") from None
        return PeerPage(pid, address, token, seq, spans, peer)
    raise StalePeerError(f"ucx metadata: peer {peer!r}'s registration page kept changing while we read it")


class Proof(NamedTuple):
    """What :func:`prove` found: the page the copy path uses (None: RMA), the page whose spans
    bound the peer on either path (None: it is not on this host, or ptrace forbids reading it)
    and why the peer got its path."""

    page: PeerPage | None
    bound: PeerPage | None
    why: str


def prove(lib: Libc | None, mine: Host | None, mode: bool | None, peer: str, b: Blob, reach: Here) -> Proof:
    """Which path ``peer`` gets, and the proof that bounds it (module docstring; the reach check
    and its reasons: :mod:`kvxfer_ucx._identity`).

    ``mode`` is the ``same_host_copy`` option: in auto mode (None) a peer that cannot be
    proven to run on this host gets UCX RMA; with True that is an error. A blob that carries
    our own identity, names another local process than its sender, or advertises memory its
    process did not register (now), is refused whatever the mode and the path.
    """
    h = b.host
    if h is not None and mine is not None and h.digest is not None and h.digest == mine.digest:
        raise MetadataError(f"ucx metadata for {peer!r} carries this agent's own same-host identity")
    elsewhere = "peer does not say which host it runs on" if h is None else (
        "no /proc host identity here" if mine is None else same_host(mine, h))
    check_reach(b, not elsewhere, reach, peer)
    if elsewhere:  # the address reaches no process of this host: UCX takes it over the network
        return Proof(None, None, "same_host_copy=False on this agent" if mode is False else elsewhere)
    assert h is not None
    if h.page is None or h.digest is None:
        raise IdentityError(f"ucx metadata of {peer!r} claims this host but offers no registration page to prove it")
    if lib is None:
        if mode:
            raise MetadataError(f"same-host copy unavailable here ({libc_error()})")
        return Proof(None, None, f"registration pages cannot be read here ({libc_error()}), using UCX RMA")
    try:
        page = read_page(lib, h.pid, h.page, h.digest, peer)
    except peers.ProofUnavailable as exc:
        if mode:
            raise BackendError(f"same-host copy: {exc}: Yama ptrace_scope, a container's seccomp/capability "
                               "policy, or a non-dumpable peer. Pass same_host_copy=False to use UCX RMA") from None
        return Proof(None, None, f"{exc}, so its registrations cannot be proven: using UCX RMA")
    rows = np.array([(a, n, 0) for a, n, _ in b.allocations], dtype=np.uint64).reshape(-1, 3)
    try:
        page.spans.check(rows, MemoryKind.DRAM, f"peer {peer!r}")
    except OutOfRegistrationError as exc:
        raise IdentityError(f"ucx metadata advertises memory that process {h.pid} did not register: {exc}") from None
    if mode is False:
        return Proof(None, page, "same_host_copy=False on this agent; RMA bounded by its registration page")
    return Proof(page, page, f"same host, pid {h.pid} proven by its registration page")


def same_host(mine: Host, theirs: Host) -> str:
    """Empty when both identities name this host and PID namespace, else why not."""
    for key, what in (("boot_id", "host (boot_id)"), ("hostname", "hostname"), ("pidns", "PID namespace")):
        if getattr(theirs, key) != getattr(mine, key):
            return f"peer is on another {what}"
    return ""
