"""The seam on Mooncake Transfer Engine: registrations, the blob, bounded lists, batch posts.

A post runs as :mod:`._posts` says: submitted at once as one-span async batches, polled
without blocking, runs copied out as their batches finish; a post with a notification as
chunked synchronous batch calls on a worker thread (they release the GIL). The fence
(``kvxfer/plugin/backend.py``): a call fails at its first stalled span while the spans queued
behind it stay queued inside Mooncake and land when a stopped peer resumes, and no call of
this Python API waits for or drops them. So a READ lands in a private arena and is copied to
its destination only from calls that returned 0 (:mod:`._bounce`). A WRITE is sent from a
snapshot of its source in an arena: its destination is the peer's memory, which nothing here
can recall, so its queued spans may still reach the peer after the end, but they carry the
bytes it was asked to move (the plugin README says what a caller does about it). ``release``
of a running post holds its arena and returns at once, so every wait ends within the caller's
deadline; ``progress_timeout`` bounds only how long a stopped peer keeps a worker thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np

from kvxfer import (Allocation, Backend, BackendClosedError, BackendError, Capabilities, DescriptorList, KvxferError,
                    MemoryKind, Op, PeerDisconnectedError, StalePeerError, UnknownPeerError, UnsupportedError)
from kvxfer.plugin import SpanIndex, check_timeout, current_deadline

from . import _blob, _identity, _notify, _posts
from ._bounce import Arenas, gather, scatter
from ._engine import start_engine, stop_engine
from ._posts import Post

__all__ = ["MooncakeBackend"]

_log = logging.getLogger("kvxfer.mooncake")

PATH = "mooncake-tcp"


class _Peer:
    """One ``add_remote``: a new object each time, so lists prepared before it go stale."""

    __slots__ = ("session", "index", "regions", "ready")

    def __init__(self, blob: _blob.Blob) -> None:
        self.session = blob.session
        self.regions = blob.regions
        self.index = SpanIndex(Allocation(a, n) for a, n in blob.regions)
        # Mooncake has its connection: a quick post's submit, in the caller's thread, cannot
        # then wait on a handshake (which holds the engine's lock for up to 60 s).
        self.ready = False


class Listed:
    """A prepared list: expanded ``(address, nbytes, device)`` rows, and whose memory."""

    __slots__ = ("rows", "peer", "epoch")

    def __init__(self, rows: np.ndarray, peer: str | None, epoch: _Peer | None) -> None:
        self.rows, self.peer, self.epoch = rows, peer, epoch


class MooncakeBackend(Backend):
    name = "mooncake"
    # TCP only in this wheel: host memory. Notifications: Mooncake's own, attached to the batch
    # (:mod:`._notify`). Cancel: a batch call cannot be stopped once running. Fence: READs land
    # in an arena (above).
    # Lists are prepared once and indexed per transfer (cheap_prepare=False): a fresh list per
    # transfer cost a one-block READ about 150 us of checks; runs that touch on the peer are
    # merged here (:class:`._posts.Runs`), so the core's coalescing is not needed.
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.DRAM}), ops=frozenset({Op.READ, Op.WRITE}),
                                notifications=True, cross_process=True, fence=True, cheap_prepare=False)
    #: READs land in a private arena copied out once DONE (the fence); WRITEs are sent from a
    #: snapshot of their source in one. False only in the tests' controls, which show the late
    #: landing (READs) and the release that waits for a stopped peer (WRITEs) without them.
    fence_reads = True
    snapshot_writes = True

    def __init__(self, agent_name: str, *, trusted_network: bool = False, host: str = "127.0.0.1",
                 progress_timeout: float = 5.0, workers: int = 2) -> None:
        super().__init__(agent_name)
        if trusted_network is not True:
            raise BackendError(
                "mooncake backend: Mooncake's TCP listeners bind every interface and authenticate nobody, so "
                "anyone who reaches the port can read and write the registered memory. Pass trusted_network=True "
                "only where everyone who can reach this host is trusted; see plugins/kvxfer_mooncake/README.md")
        self.progress_timeout = check_timeout(progress_timeout, "mooncake progress_timeout")
        if not isinstance(workers, int) or not 1 <= workers <= 64:
            raise BackendError(f"mooncake workers must be an int in 1..64, got {workers!r}")
        self.host = host
        self._engine, self.session = start_engine(host, self.progress_timeout)
        from mooncake.engine import TransferNotify, TransferOpcode  # loaded now, after start_engine set its env

        self._note_cls, self._ops = TransferNotify, {Op.READ: TransferOpcode.Read, Op.WRITE: TransferOpcode.Write}
        self._arenas = Arenas(self._engine)
        self._regs: dict[int, tuple[tuple[int, int], ...]] = {}
        self._local = SpanIndex()
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count(1)
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix=f"kvxfer-mooncake-{agent_name}")
        self._notes = cf.ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-mooncake-notify-{agent_name}")
        self._lock = threading.Lock()
        self._live: set[Post] = set()  # quick posts whose batches may be on the wire
        self._closed = False
        # One byte of our own that add_remote's first contact reads into (never advertised).
        self._scratch = np.zeros(64, np.uint8)
        if self._engine.register_memory(self._scratch.ctypes.data, self._scratch.nbytes) != 0:
            raise BackendError("mooncake register_memory of the handshake scratch byte failed")
        _identity.serving(self.session, self)

    # memory
    def register(self, allocations: Sequence[Allocation]) -> int:
        done: list[tuple[int, int]] = []
        for a in allocations:
            if a.kind is not MemoryKind.DRAM:
                self._unregister(done)
                raise UnsupportedError("mooncake (TCP) moves host memory only")
            rc = self._engine.register_memory(a.address, a.nbytes)
            if rc != 0:
                self._unregister(done)
                raise BackendError(f"mooncake register_memory({a.address:#x}, {a.nbytes}) returned {rc}")
            done.append((a.address, a.nbytes))
        handle = next(self._ids)
        try:
            _identity.publish(self, handle, tuple(done))  # what a same-host receiver proves our blob against
        except BackendError:
            self._unregister(done)
            raise
        with self._lock:
            self._regs[handle] = tuple(done)
            self._reindex()
        return handle

    def deregister(self, handle: Any) -> None:
        with self._lock:
            regions = self._regs.pop(handle, ())
            self._reindex()
        _identity.forget(self, handle)
        self._unregister(regions)

    def _unregister(self, regions: Sequence[tuple[int, int]]) -> None:
        for addr, _ in regions:
            self._engine.unregister_memory(addr)

    def owns(self, regions: Sequence[tuple[int, int]]) -> bool:
        """Whether every ``(address, nbytes)`` lies inside what this backend registered."""
        rows = np.array([(a, n, 0) for a, n in regions], dtype=np.uint64).reshape(-1, 3)
        try:
            self._local.check(rows, MemoryKind.DRAM, self.agent_name)
        except KvxferError:
            return False
        return True

    def _reindex(self) -> None:
        self._local = SpanIndex(Allocation(a, n) for regs in self._regs.values() for a, n in regs)

    # peers
    def local_metadata(self) -> bytes:
        with self._lock:
            return _blob.encode(self.session, [r for regs in self._regs.values() for r in regs])

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        b = _blob.decode(blob, peer_name)  # typed MetadataError; nothing kept on failure
        _identity.check(b, b.identity, peer_name, self.host)  # typed IdentityError; nothing kept on failure
        peer = _Peer(b)
        with self._lock:
            self._peers[peer_name] = peer
        if b.regions:
            self._first_contact(b, peer)

    def _first_contact(self, b: _blob.Blob, peer: _Peer) -> None:
        """Handshake now, inside add_peer's deadline, not in the first transfer.

        Mooncake's handshake with a peer that accepts but never answers takes 60 s whatever
        its settings; the progress timeout bounds only an established session. So the
        handshake is done here (a one-byte read into our scratch byte) and waited for at most
        the progress timeout or the caller's deadline; if it is still pending it finishes in
        the background and can only write the scratch byte.
        """
        bound = self.progress_timeout
        deadline = current_deadline()
        if deadline is not None:
            bound = max(0.0, min(bound, deadline - time.monotonic()))
        f = self._pool.submit(self._engine.batch_transfer_sync_read, b.session, [self._scratch.ctypes.data],
                              [b.regions[0][0]], [1])
        cf.wait([f], timeout=bound)
        peer.ready = f.done() and not f.cancelled() and f.exception() is None and f.result() == 0

    def remove_remote(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)

    # lists
    def prepare(self, peer: str | None, descs: DescriptorList) -> Listed:
        if descs.kind is not MemoryKind.DRAM:
            raise UnsupportedError("mooncake (TCP) moves host memory only")
        rows = descs.expand().array
        if peer is None:
            self._local.check(rows, MemoryKind.DRAM, f"{self.agent_name} (local)")
            return Listed(rows, None, None)
        epoch = self._peers.get(peer)
        if epoch is None:
            raise UnknownPeerError(peer)
        epoch.index.check(rows, MemoryKind.DRAM, f"peer {peer!r}")  # bounded by what its blob registered
        return Listed(rows, peer, epoch)

    # transfers
    def post(self, op: Op, local: Listed, local_idx: np.ndarray, remote: Listed, remote_idx: np.ndarray,
             notification: bytes | None) -> Post:
        if self._closed:
            raise BackendClosedError(f"mooncake backend of {self.agent_name!r} is closed")
        note = None
        if notification is not None:
            _notify.check_size(notification)
            note = self._note_cls(self.agent_name, _notify.encode(notification))
        if remote.peer is None or local.peer is not None:
            raise BackendError("post needs a local list and a peer's list")
        epoch = self._peers.get(remote.peer)
        if epoch is None:
            raise UnknownPeerError(remote.peer)
        if epoch is not remote.epoch:
            raise StalePeerError(f"{remote.peer!r} was re-added since this list was prepared")
        la, ra = local.rows[np.asarray(local_idx)], remote.rows[np.asarray(remote_idx)]
        if la.shape[0] != ra.shape[0] or not np.array_equal(la[:, 1], ra[:, 1]):
            raise BackendError("mooncake post: local and remote spans differ in count or length")
        n = la.shape[0]
        if n == 0:
            if note is not None:
                self.notify(remote.peer, notification)  # type: ignore[arg-type]
            return Post(op, epoch.session, 0)
        nbytes = int(la[:, 1].sum()) if n > 8 else sum(la[:, 1].tolist())
        code = self._ops[op]
        fenced = self.fence_reads if op is Op.READ else self.snapshot_writes
        if not fenced:  # the tests' controls only: straight into the destination, one call
            x = Post(op, epoch.session, nbytes, peer=epoch)
            x.bounds = [0, n]
            x.future = self._pool.submit(_posts.run_chunks, self._engine, x, la[:, 0].tolist(), ra[:, 0].tolist(),
                                         la[:, 1].tolist(), code, note)
            return x
        runs = _posts.Runs(la, ra)
        arena = self._arenas.take(nbytes)
        x = Post(op, epoch.session, nbytes, arena, runs.local, epoch)
        x.offsets = runs.offsets
        try:
            if op is Op.WRITE:
                gather(arena, runs.local)
            staged = _posts.staged(arena, runs)
            if note is None and epoch.ready and len(runs.lengths) <= _posts.QUICK_SPANS:
                x.spans = runs.starts
                self._live.add(x)
                _posts.submit_quick(self._engine, x, staged, runs.remote, runs.lengths, code)
                return x
            x.bounds = _posts.chunk_bounds(runs.lengths)
            x.spans = [runs.starts[r] for r in x.bounds]
            x.future = self._pool.submit(_posts.run_chunks, self._engine, x, staged, runs.remote, runs.lengths, code,
                                         note)
        except BaseException:
            self._live.discard(x)
            if x.batches:
                self._arenas.hold(arena)  # some were submitted: Mooncake may still write there
            else:
                self._arenas.give(arena)
            raise
        return x

    def poll(self, xfer: Post) -> bool:
        if xfer.batches is not None:
            return self._poll_quick(xfer)
        f = xfer.future
        if f is None:
            return True
        finished = f.done()  # read first: every result was appended before the future finished
        res, b = xfer.results, xfer.bounds
        while xfer.copied < len(res):
            k = xfer.copied
            if res[k] != 0:
                self._settle(xfer, deliver=False)
                self._failed(xfer, res[k])
            if xfer.arena is not None and xfer.op is Op.READ:
                lo, hi = xfer.spans[k], xfer.spans[k + 1]
                scatter(xfer.arena, xfer.rows[lo:hi], xfer.offsets[lo])  # type: ignore[index]
            xfer.copied += 1
        if xfer.copied == len(b) - 1:
            xfer.peer.ready = True
            self._settle(xfer, deliver=True)
            return True
        if not finished:
            return False
        self._settle(xfer, deliver=False)
        try:
            f.result()
        except cf.CancelledError:
            raise BackendError("mooncake post was cancelled") from None
        except Exception as exc:  # the binding raised: typed here, the call has returned
            raise BackendError(f"mooncake {xfer.op.value} failed: {exc!r}") from None
        raise BackendError(f"mooncake {xfer.op.value} stopped after {xfer.copied} of {len(b) - 1} chunks")

    def _poll_quick(self, xfer: Post) -> bool:
        if xfer.stop:
            raise BackendError("mooncake post was released")
        rc = _posts.poll_quick(self._engine, xfer)  # advances xfer.copied past the batches done
        if rc is not None and rc != 0:
            self._live.discard(xfer)
            self._settle(xfer, deliver=False)
            self._failed(xfer, rc)
        k, m = xfer.out, xfer.copied
        if m > k and xfer.op is Op.READ:  # those batches returned done: their runs go out now
            lo, hi = xfer.spans[k], xfer.spans[m]
            scatter(xfer.arena, xfer.rows[lo:hi], xfer.offsets[lo])  # type: ignore[arg-type,index]
        xfer.out = m
        if rc is None:
            return False
        self._live.discard(xfer)
        self._settle(xfer, deliver=True)
        return True

    def _failed(self, xfer: Post, rc: int) -> None:
        raise PeerDisconnectedError(
            f"mooncake {xfer.op.value} with {xfer.session} returned {rc}: the peer died, stopped answering for "
            f"{self.progress_timeout:g} s, or no longer registers that memory")

    def _settle(self, xfer: Post, deliver: bool) -> None:
        """The transfer ended: its arena goes back if every call returned 0, else it is held:
        spans Mooncake queued behind a failure may still land in it."""
        arena, xfer.arena = xfer.arena, None
        if arena is None:
            return
        if deliver:
            self._arenas.give(arena)
        else:
            self._arenas.hold(arena)

    def release(self, xfer: Post) -> None:
        """Cancel. A chunked post stops at its next chunk boundary; one not started is dropped.
        Whatever may still be on the wire keeps its arena held and this returns at once, within
        the caller's deadline whatever the peer does: nothing of a READ can reach its
        destination any more, and a WRITE's late spans carry only its snapshot."""
        xfer.stop = True
        if xfer.batches is not None:
            self._live.discard(xfer)
            self._settle(xfer, deliver=False)
            return
        f = xfer.future
        if f is None:
            return
        if f.cancel():
            self._settle(xfer, deliver=True)  # never handed to Mooncake
            return
        if xfer.arena is not None:
            self._settle(xfer, deliver=False)
            return
        cf.wait([f])  # the tests' controls only: bounded by Mooncake's progress timeout

    def data_path(self, xfer: Post) -> str | None:
        return PATH

    def telemetry(self, xfer: Post) -> dict[str, Any]:
        return {"path": PATH, "bytes": xfer.nbytes}

    # notifications
    def notify(self, peer: str, message: bytes) -> None:
        """A standalone notification rides a one-byte READ of the peer's first region into our
        scratch byte (Mooncake sends notifications only with a batch, and refuses an empty
        one). One thread sends them, in order, so the caller never waits on the peer."""
        if self._closed:
            raise BackendClosedError(f"mooncake backend of {self.agent_name!r} is closed")
        _notify.check_size(message)
        epoch = self._peers.get(peer)
        if epoch is None:
            raise UnknownPeerError(peer)
        if not epoch.regions:
            raise UnsupportedError(f"mooncake notifications ride a transfer: peer {peer!r} registered no memory")
        note = self._note_cls(self.agent_name, _notify.encode(message))
        self._notes.submit(self._engine.batch_transfer_sync, epoch.session, [self._scratch.ctypes.data],
                           [epoch.regions[0][0]], [1], self._ops[Op.READ], note)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        if self._closed:
            return {}
        try:
            notes = self._engine.get_notifies()
        except Exception as exc:  # noqa: BLE001 - a sender's bytes the binding could not convert
            _log.warning("mooncake: notifications lost, the binding failed to read them: %r", exc)
            return {}
        return _notify.decode(notes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)  # every running call returns before memory goes
        self._notes.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            handles = list(self._regs)
            regs, self._regs = list(self._regs.values()), {}
            self._peers.clear()
            self._reindex()
        for h in handles:
            _identity.forget(self, h)
        for x in list(self._live):  # never polled to the end nor released: Mooncake may still write
            self._settle(x, deliver=False)
        self._live.clear()
        for regions in regs:
            self._unregister(regions)
        self._unregister([(self._scratch.ctypes.data, 0)])
        held: list[Any] = [*self._arenas.close(), self._scratch]  # the first contact's byte too
        engine, self._engine = [self._engine], None
        threading.Thread(target=stop_engine, args=(engine, held), name="kvxfer-mooncake-close", daemon=True).start()
