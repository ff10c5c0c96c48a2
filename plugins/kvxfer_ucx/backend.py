"""The UCX backend's control plane: connections, liveness, notifications, its rows' hooks.

Bytes move through one of two data paths, rows of :class:`kvxfer.plugin.DataPath`
(:mod:`kvxfer_ucx._paths`), of which :class:`kvxfer.plugin.PathBackend`'s post loop takes
the first that serves the pair:

* :class:`~kvxfer_ucx._paths.CopyPath`: ``process_vm_readv``/``writev`` for peers proven
  to be on this host (:mod:`kvxfer_ucx._hostpage` says how a peer is proven);
* :class:`~kvxfer_ucx._paths.RmaPath`: UCX GET/PUT and a flush, for every other peer.

This module proves a peer for the same-host path at :meth:`UcxBackend.add_remote`, checks descriptors
against registrations at :meth:`~UcxBackend.prepare`, and fills the loop's hooks: a stale or
dead peer is refused before each step (``admit``, ``step``), a finished transfer is verified
against the peer's liveness (same-host: its registration page is unchanged and still its own)
before it counts (``landed``), and only then the notification leaves as an active message
whose request is reaped before the transfer is done (``deliver``, ``delivered``), so that a
notification never overtakes its data. The loop hands a transfer that carries a notification
to its pump, so the notification leaves even if nobody polls.
Transport choice and its security reasoning: ``plugins/kvxfer_ucx/README.md``.

Thread model: every libucp call and every step of a job happens under one lock (the loop's guard).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from kvxfer import (Allocation, BackendClosedError, BackendError, Capabilities, DescriptorList, IdentityError,
                    KvxferError, MemoryKind, MetadataError, Op, OutOfRegistrationError, PeerDisconnectedError,
                    StalePeerError, UnknownPeerError, UnsupportedError)
from kvxfer.plugin import DataPath, Deadline, PathBackend, Post, Pump, SpanIndex
from kvxfer.plugin.prover import named, shared
from kvxfer.plugin.ucxabi import Here, SlotWatch, address as ucxaddr

from . import _libucp as L, _samehost as SH
from ._config import transport_config, warn_if_ptrace_is_narrower
from ._blob import MAX_NAME, Host, encode_blob, parse_blob
from ._hostpage import ProcessWatch, host_identity, prove, same_host
from ._identity import here
from ._lists import Prepared
from ._memory import Registrations
from ._notify import Notifications, check_size
from ._paths import CopyPath, RmaPath
from ._peers import Peer as _Peer
from ._peerworkers import PeerWorkers
from ._worker import UcxCallError, Worker

__all__ = ["UcxBackend"]


#: What the metadata prover's helper runs (:mod:`kvxfer_ucx._helper`, which imports this module),
#: and the route a probe request names as its first byte: RMA (worker address and keys) or
#: same-host copy (worker address only).
PROBE_TARGET = "kvxfer_ucx._helper:make_probe"
ROUTE_RMA, ROUTE_COPY = b"R", b"C"


class UcxBackend(PathBackend):
    """kvxfer transport on raw UCX (libucp through ctypes). DRAM only.

    Options (keyword-only):

    ``same_host_copy``
        ``None`` (auto): peers proven to run on this host get the ``process_vm_readv`` path,
        others UCX RMA; ``True``: a same-host peer that fails the proof is an error; ``False``:
        never. :meth:`peer_path` says which path a peer got and why. Either way, while the
        ``posix`` transport is on, the process declares same-uid processes ptracers
        (``prctl(PR_SET_PTRACER)``): posix already lets them reach its memory.
    ``trusted_network``
        ``False`` (default): UCX uses only same-host transports (``SAME_HOST_TLS``). ``True``
        allows network transports (default ``NETWORK_TLS``); see the README for what that exposes.
    ``tls`` / ``ucx_config``
        ``UCX_TLS`` and extra UCX settings (keys without the ``UCX_`` prefix) for this agent.
    ``copy_chunk``
        most bytes one same-host syscall moves: the granularity of budgets and cancellation.
    ``poll_budget``
        seconds one :meth:`poll` may spend moving bytes before it returns.
    ``cancel_timeout``
        longest :meth:`release` drives still-pending RMA before giving up on it (RMA cannot be
        recalled; a dead peer is never waited on).
    ``prove_metadata`` (default ``"auto"``), ``prove_timeout`` (default 30 s of CPU time)
        load an unauthenticated peer's blob (``token=NO_AUTH``) in a helper process first
        (:mod:`kvxfer_ucx._helper`): a worker address that crashes UCX there never reaches
        this process. ``True`` proves signed blobs too, ``False`` none (docs/design.md,
        section 8).
    """

    name = "ucx"
    poll_at_post = False  # post() only starts: a notification's transfer goes to the pump at once
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.DRAM}), notifications=True, strided_lists=True,
                                merges_runs=False, cheap_prepare=True, max_descriptors=None, needs_progress=True,
                                cross_process=True)

    def __init__(self, agent_name: str, *, same_host_copy: bool | None = None, trusted_network: bool = False,
                 tls: str | None = None, ucx_config: Mapping[str, Any] | None = None,
                 copy_chunk: int = SH.DEFAULT_CHUNK, poll_budget: float = 0.005, cancel_timeout: float = 2.0,
                 prove_metadata: bool | str = "auto", prove_timeout: float = 30.0) -> None:
        super().__init__(agent_name)
        if prove_metadata not in (True, False, "auto"):
            raise BackendError(f"prove_metadata must be True, False or 'auto', got {prove_metadata!r}")
        self._prove_all = prove_metadata is True
        self._prover = shared(PROBE_TARGET, dict(trusted_network=bool(trusted_network), tls=tls,
                                           ucx_config=dict(ucx_config or {}), copy_chunk=int(copy_chunk),
                                           poll_budget=float(poll_budget), cancel_timeout=float(cancel_timeout)),
                              prove_timeout) if prove_metadata else None
        if same_host_copy not in (None, True, False):
            raise BackendError(f"ucx backend: same_host_copy must be None, True or False, got {same_host_copy!r}")
        if not isinstance(agent_name, str) or not 0 < len(agent_name.encode("utf-8", "replace")) <= MAX_NAME:
            raise BackendError(f"ucx backend: agent name must be 1 to {MAX_NAME} bytes")
        if int(copy_chunk) <= 0 or not 0 <= float(poll_budget) < 1 or not 0 <= float(cancel_timeout) < 3600:
            raise BackendError("ucx backend: copy_chunk must be positive, poll_budget and cancel_timeout small")
        self._same_host_copy = same_host_copy
        self._copy_chunk, self._budget, self._cancel_timeout = int(copy_chunk), float(poll_budget), float(cancel_timeout)
        self._trusted = bool(trusted_network)
        self._lock = threading.RLock()
        self.guard = self._lock  # the loop's every step runs under it
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._by_ep: dict[int, _Peer] = {}
        self._notes = Notifications(agent_name)
        config = transport_config(tls, self._trusted, ucx_config)
        self._w = Worker(agent_name, config, self._on_ep_error, self._notes.on_am)
        self._notes.w = self._w
        self._pw = PeerWorkers(self._w)  # same-host RMA peers' own workers
        self._slots = SlotWatch(config, self._w.lib.version)  # a slot a dead writer left in our receive queues
        # Standalone notifications leave only while the worker is progressed: pumped like transfers.
        self._note_pump: Pump[str] = Pump(self._send_queued, name="kvxfer-ucx-notes")
        self._mem = Registrations(self._w)
        self.paths: tuple[DataPath, ...] = (CopyPath(self), RmaPath(self))  # post() takes the first that serves
        self._libc: SH.Libc | None = None
        ident = host_identity()
        self._host = None if ident is None else Host(**ident, page=None, digest=None)
        lib = SH.libc()
        posix = "posix" in {t.strip() for t in config["TLS"].split(",")}
        if lib is not None and (posix or (same_host_copy is not False and self._host is not None)):
            # posix lets any process of this uid that may open /proc/PID/fd reach all of our
            # memory; declaring every process a ptracer makes ptrace (Yama scope 1) allow what
            # the transport allows, no less and no more (docs/design.md, section 8.1).
            SH.allow_same_user_access(lib)  # harmless when it fails (no Yama)
            if posix:
                warn_if_ptrace_is_narrower()
        if self._host is not None:  # the page proves this agent to same-host peers on either path
            self._host = self._host._replace(page=self._mem.page.address, digest=self._mem.page.digest)
        if same_host_copy is not False and lib is not None and self._host is not None:
            self._libc = lib
        self._here: Here | None = None  # this process's UCX, as our own worker address shows it

    # -- callbacks (inside progress, under the lock) --------------------------------------------
    def _on_ep_error(self, ep: int, status: int) -> None:
        peer = self._by_ep.get(ep)
        if peer is not None and peer.failed is None:
            peer.failed = status

    # -- memory ---------------------------------------------------------------------------------
    def register(self, allocations: Sequence[Allocation]) -> int:
        with self._lock:
            self._check_open()
            return self._mem.register(allocations)

    def deregister(self, handle: Any) -> None:
        with self._lock:
            self._mem.deregister(handle)

    # -- peers ----------------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            return encode_blob(self.agent_name, self._w.version, self._w.address, self._mem.advertised(), self._host)

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        """Connect to a peer; on any failure nothing changes (a known peer keeps its connection)."""
        try:
            self._add_remote(peer_name, blob)
        except KvxferError:
            raise
        except Exception as exc:  # the seam's contract: only typed errors leave add_remote
            raise MetadataError(f"ucx metadata for peer rejected: {type(exc).__name__}") from None

    def _proving(self) -> bool:
        """Whether a new blob is loaded in a helper first (``prove_metadata``, and who signed it)."""
        return self._prover is not None and (self._prove_all or not self.peers_authenticated)

    def _add_remote(self, peer_name: str, blob: bytes) -> None:
        b = parse_blob(blob)
        if b.agent != peer_name:
            raise MetadataError(f"ucx metadata names agent {b.agent!r}, expected {peer_name!r}")
        spans = SpanIndex(Allocation(a, n) for a, n, _ in b.allocations)
        with self._lock:
            self._check_open()
            proof = prove(SH.libc(), self._host, self._same_host_copy, peer_name, b, self._reach())
            page = proof.page
        if self._proving():  # every check of ours passed: now UCX sees the bytes, in a helper first
            route = ROUTE_RMA if page is None else ROUTE_COPY  # the helper hands UCX what we will
            self._prover.prove(named(peer_name, route + bytes(blob)), f"UCX metadata of {peer_name!r}")
        with self._lock:
            self._check_open()
            h, watch = b.host, None
            if h is not None and self._host is not None and not same_host(self._host, h):
                watch = ProcessWatch(h.pid, h.start)
            # A same-host RMA peer's replies land in a receive queue of its own (_peerworkers).
            w = self._pw.for_peer(watch) if page is None and watch is not None else self._w
            try:
                ep = w.connect(b.worker)
            except BaseException as exc:
                self._pw.retire(w, watch)
                if isinstance(exc, PeerDisconnectedError):
                    hint = "" if self._trusted else "; peers on other hosts need trusted_network=True on both sides"
                    raise PeerDisconnectedError(f"{exc}{hint}") from None
                raise
            rkeys: list[int] = []
            try:
                if page is None:  # only the RMA path hands remote keys to UCX
                    for _, _, packed in b.allocations:
                        rkeys.append(w.unpack_rkey(ep, packed))
            except BaseException as exc:
                for rk in rkeys:
                    w.destroy_rkey(rk)
                w.close_ep(ep, force=True)
                self._pw.retire(w, watch)
                if isinstance(exc, UcxCallError):
                    raise MetadataError(str(exc)) from None
                raise
            peer = _Peer(peer_name, ep, spans, np.array(rkeys, dtype=np.uint64), page, proof.why, watch, w=w,
                         bound=proof.bound)
            old = self._peers.get(peer_name)
            self._peers[peer_name] = peer
            self._by_ep[ep] = peer
            if old is not None:
                self._drop_peer(old)

    def _reach(self) -> Here:
        """What our own worker address says of this process's UCX (read once; IdentityError if it cannot be)."""
        if self._here is None:
            try:
                self._here = here([self._w.address])
            except ucxaddr.Unreadable as exc:
                raise IdentityError(f"ucx backend: this agent's own worker address cannot be read ({exc}), so which "
                                    "processes a peer's address reaches cannot be told") from None
        return self._here

    def peer_path(self, peer: str) -> tuple[str, str]:
        """``("same-host-copy" | "ucx-rma", reason)`` for a connected peer."""
        with self._lock:
            p = self._peer(peer)
            return p.path, p.reason

    def _drop_peer(self, peer: _Peer) -> None:
        if not peer.closed:
            peer.closed = True
            self._disconnect(peer, force=peer.failed is not None)

    def _disconnect(self, peer: _Peer, force: bool) -> None:
        """Close the endpoint once; forcing it completes whatever is outstanding with an error.
        A worker of the peer's own goes with it, after every request on it was given back:
        a receive queue the peer left blocked (it died mid-write) must not outlive it."""
        if not peer.connected:
            return
        peer.connected = False
        w = peer.w or self._w
        for rk in peer.rkeys.tolist():
            w.destroy_rkey(rk)
        w.close_ep(peer.ep, force=force)
        if self._by_ep.get(peer.ep) is peer:
            del self._by_ep[peer.ep]
        if w is not self._w:
            for x in list(peer.xfers):
                if x.h.job is not None:
                    x.path.abandon(x.h)  # frees every request; nothing is waited on
                if x.sending is not None:
                    w.drain([x.sending[0]], 0.0, lambda: False)
                    x.sending = None
            self._notes.forget(peer.ep)
            self._pw.retire(w, peer.watch, fenced=peer.failed == L.UCS_ERR_CANCELED)  # RmaPath.cancel's fence

    def remove_remote(self, peer: str) -> None:
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is not None:
                self._drop_peer(p)

    def _peer(self, name: str) -> _Peer:
        p = self._peers.get(name)
        if p is None:
            raise UnknownPeerError(f"ucx backend: unknown peer {name!r}; add it with add_remote first")
        return p

    def _raise_if_failed(self, peer: _Peer, force: bool = False) -> None:
        if peer.failed is None and peer.watch is not None and not peer.watch.alive(force):
            peer.failed = L.UCS_ERR_CONNECTION_RESET  # its process exited (or is a zombie)
        if peer.failed is not None:
            why = peer.why or f"disconnected ({self._w.status_string(peer.failed)})"
            raise PeerDisconnectedError(f"ucx peer {peer.name!r} {why}; remove it and add it again once it is back")

    def _fail(self, peer: _Peer, status: int, call: str) -> KvxferError:
        """The error for a failed ucs_status; statuses meaning 'the peer is gone' mark it dead."""
        if status in L.PEER_GONE_STATUSES:
            peer.failed = peer.failed or status
            return PeerDisconnectedError(f"ucx peer {peer.name!r} disconnected during {call}: "
                                         f"{self._w.status_string(status)}")
        return BackendError(f"ucx backend: {call} failed: {self._w.status_string(status)}")

    # -- descriptor lists -----------------------------------------------------------------------
    def prepare(self, peer: str | None, descs: DescriptorList) -> Prepared:
        if descs.kind is not MemoryKind.DRAM:
            raise UnsupportedError(f"ucx backend moves DRAM only, not {descs.kind.value}")
        with self._lock:
            self._check_open()
            if peer is None:
                return Prepared(descs, self._mem.spans, f"agent {self.agent_name!r} (local)", owner=self._mem.epoch)
            p = self._peer(peer)
            return Prepared(descs, p.spans, f"peer {peer!r}", owner=p)

    # -- transfers: the rows' hooks of PathBackend's loop ------------------------------------------
    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Post:
        if (not isinstance(local, Prepared) or not isinstance(remote, Prepared) or isinstance(local.owner, _Peer)
                or not isinstance(remote.owner, _Peer)):
            raise BackendError("ucx backend: post needs a local and a remote list prepared by this backend")
        if notification is not None:
            check_size(notification)
        li, ri = np.asarray(local_idx, dtype=np.int64), np.asarray(remote_idx, dtype=np.int64)
        if li.shape != ri.shape or li.ndim != 1:
            raise BackendError("ucx backend: local and remote index arrays must be 1-D and of equal length")
        return super().post(op, local, li, remote, ri, notification)

    def peer_of(self, remote: Prepared) -> _Peer:
        return remote.owner  # type: ignore[return-value]

    def admit(self, local: Prepared, remote: Prepared, peer: _Peer) -> None:
        self._check_open()
        if local.owner != self._mem.epoch:
            raise OutOfRegistrationError("ucx backend: the local list was prepared over memory deregistered since")
        if peer.closed or self._peers.get(peer.name) is not peer:
            raise StalePeerError(f"ucx backend: peer {peer.name!r} was removed or re-added since this list was "
                                 "prepared; prepare it again")
        self._raise_if_failed(peer)

    def started(self, x: Post) -> None:
        x.peer.xfers.add(x)  # a worker of the peer's own frees what is in flight when it goes

    def step(self, x: Post) -> None:
        self._check_open()
        peer = x.peer
        self._w.progress()
        if peer.connected and peer.w is not None and peer.w is not self._w:
            peer.w.progress()
        self._check_slots()
        self._raise_if_failed(peer)
        if peer.closed:
            raise StalePeerError(f"ucx backend: peer {peer.name!r} was removed or re-added during this transfer")

    def landed(self, x: Post) -> None:
        x.h.job = None  # the row has nothing left to cancel
        self._raise_if_failed(x.peer, force=True)  # alive when every byte had moved

    def deliver(self, peer: _Peer, message: bytes) -> tuple[int, tuple[Any, ...], _Peer] | None:
        """Every byte is in place: the notification leaves as an active message."""
        try:
            am, bufs = self._notes.send(peer.ep, message)
        except UcxCallError as exc:
            raise self._fail(peer, exc.status, "notification send") from None
        return None if am is None else (am, bufs, peer)  # the buffers live until the request is reaped

    def delivered(self, sending: tuple[int, tuple[Any, ...], _Peer]) -> bool:
        st = self._w.reap(sending[0])
        if st is None:
            return False
        if st != L.UCS_OK:
            raise self._fail(sending[2], st, "notification send")
        return True

    def withdraw(self, sending: tuple[int, tuple[Any, ...], _Peer]) -> None:
        if self._closed:
            return
        am, _, peer = sending
        alive = lambda: peer.failed is None and peer.connected and (peer.watch is None or peer.watch.alive())  # noqa: E731
        (peer.w or self._w).drain([am], Deadline.within(self._cancel_timeout), alive)

    # -- notifications --------------------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        check_size(message)
        with self._lock:
            self._check_open()
            p = self._peer(peer)
            self._raise_if_failed(p)
            try:
                self._notes.queue(p.ep, message, lambda: p.failed is not None or p.closed)
            except UcxCallError as exc:
                raise self._fail(p, exc.status, "notification send") from None
            queued = self._notes.pending
        if queued:
            self._note_pump.add("notes")

    def _send_queued(self, _key: str) -> bool:
        """Pump callback: progress until every queued notification has left."""
        with self._lock:
            if self._closed:
                return True
            self._progress_locked()
            return not self._notes.pending

    def drain_notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            if not self._closed:
                self._progress_locked()
            return self._notes.take()

    def progress(self) -> None:
        with self._lock:
            if not self._closed:
                self._progress_locked()

    def _check_slots(self) -> None:
        """Skip a slot a dead writer left in one of this backend's own receive queues."""
        self._slots.check([self._w.fifo, *(p.w.fifo for p in self._peers.values() if p.connected and p.w is not None
                                            and p.w is not self._w), *self._pw.fifos()])

    def _progress_locked(self) -> None:
        for _ in range(64):
            if not self._w.progress():
                break
        for p in self._peers.values():  # RMA peers' own workers: replies, keepalive, errors
            if p.connected and p.w is not None and p.w is not self._w:
                p.w.progress()
        self._pw.progress()
        self._check_slots()
        if self._notes.pending:
            self._notes.reap()

    # -- teardown -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("ucx backend is closed")

    def close(self) -> None:
        super().close()  # the loop's pump, outside the lock: its thread may be waiting for it
        self._note_pump.stop()
        with self._lock:
            if self._closed:
                return
            deadline = Deadline.within(1.0)
            while self._notes.pending and time.monotonic() < deadline:  # let queued notifications leave
                self._w.progress()
                self._notes.reap()
            for p in list(self._peers.values()):
                self._drop_peer(p)
            self._peers.clear()
            self._pw.close()
            self._notes.drop_all()
            self._mem.close()
            self._closed = True
            self._w.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()
