"""The UCX backend's two data paths as rows of :class:`kvxfer.plugin.DataPath`.

:class:`CopyPath` (``process_vm_readv``/``writev``, :mod:`kvxfer_ucx._samehost`) serves peers
proven to be on this host; :class:`RmaPath` (UCX GET/PUT and a flush, :mod:`kvxfer_ucx._rma`)
every other peer. Both resolve the paired descriptors the same way and neither sends the
notification: the backend sends it once ``poll`` reported every byte in place, after the
peer's liveness was checked once more, and clears the handle's job (nothing is left to cancel).
Each path drives its job under the backend's lock (the backend holds it around every call
here) with the backend's budget and timeouts.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from kvxfer import BackendError, KvxferError, Op, PeerDisconnectedError
from kvxfer.plugin import Deadline, merge_runs

from . import _libucp as L, _samehost as SH
from ._lists import Prepared
from ._peers import COPY, RMA, Peer
from ._rma import RmaJob
from ._worker import Worker

__all__ = ["CopyPath", "PathHost", "PathJob", "RmaPath", "guarded"]


class PathHost(Protocol):
    """What the paths use of the backend holding them (its options, worker and peer handling)."""

    _libc: SH.Libc | None
    _copy_chunk: int
    _budget: float
    _cancel_timeout: float
    _closed: bool
    _w: Worker

    def _fail(self, peer: Peer, status: int, call: str) -> KvxferError: ...

    def _disconnect(self, peer: Peer, force: bool) -> None: ...


def _pairs(local: Prepared, li: np.ndarray, remote: Prepared, ri: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(local addresses, remote addresses, lengths, remote allocation slots)`` of the pairs."""
    la, ln, _ = local.resolve(li)
    ra, rn, slot = remote.resolve(ri)
    if not np.array_equal(ln, rn):
        i = int(np.flatnonzero(ln != rn)[0])
        raise BackendError(f"ucx backend: pair {i} moves {int(ln[i])} local bytes but {int(rn[i])} remote bytes")
    return la, ra, ln, slot


def guarded(peer: Peer, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a same-host step; a vanished peer process is as final as UCX's error callback."""
    try:
        return fn(*args)
    except PeerDisconnectedError:
        peer.failed = peer.failed or L.UCS_ERR_CONNECTION_RESET
        raise


class PathJob:
    """A path's handle: the job moving the bytes (None once they are in place, or cancelled) and
    the peer it moves them with."""

    __slots__ = ("job", "peer")

    def __init__(self, job: Any, peer: Peer) -> None:
        self.job, self.peer = job, peer


class _Row:
    """What both rows share: the backend they serve, and that the backend sends notifications."""

    sends_notification = False

    def __init__(self, backend: PathHost) -> None:
        self._b = backend


class CopyPath(_Row):
    """Same-host single copy; the peer's registration page is rechecked before and after."""

    @staticmethod
    def serves(local: Prepared, remote: Prepared) -> bool:
        return remote.owner.page is not None  # type: ignore[union-attr]

    def start(self, op: Op, local: Prepared, li: np.ndarray, remote: Prepared, ri: np.ndarray, peer: Any,
              notification: bytes | None) -> PathJob:
        p: Peer = remote.owner  # type: ignore[assignment]
        la, ra, ln, _ = _pairs(local, li, remote, ri)
        assert p.page is not None and self._b._libc is not None
        guarded(p, p.page.recheck, self._b._libc)
        la, ra, ln = merge_runs(la, ra, ln)  # fewer iovecs; both sides were checked already
        return PathJob(SH.CopyJob(self._b._libc, p.page.pid, op is Op.WRITE, la, ra, ln, peer=p.name,
                                  chunk=self._b._copy_chunk), p)

    def poll(self, h: PathJob) -> bool:
        p = h.peer
        if not guarded(p, h.job.step, Deadline.within(self._b._budget)):
            return False
        assert p.page is not None and self._b._libc is not None
        guarded(p, p.page.recheck, self._b._libc)  # still the peer, still registered
        return True

    @staticmethod
    def cancel(h: PathJob) -> None:
        job, h.job = h.job, None
        if job is not None:
            job.cancel()  # between steps: no syscall is running, nothing moves any more

    abandon = cancel

    @staticmethod
    def kind(h: Any) -> str:
        return COPY


def _still_registered(p: Peer) -> None:
    """A same-host RMA peer's page, read again: still its process, registrations unchanged
    (:mod:`kvxfer_ucx._identity`). No page (a peer elsewhere): nothing to read."""
    lib = SH.libc()
    if p.bound is not None and lib is not None:
        guarded(p, p.bound.recheck, lib)


class RmaPath(_Row):
    """UCX GET/PUT; cancelling settles what is in flight, or closes the connection. A peer on
    this host is held to its registration page before the first byte and before DONE."""

    @staticmethod
    def serves(local: Prepared, remote: Prepared) -> bool:
        return remote.owner.page is None  # type: ignore[union-attr]

    def start(self, op: Op, local: Prepared, li: np.ndarray, remote: Prepared, ri: np.ndarray, peer: Any,
              notification: bytes | None) -> PathJob:
        p: Peer = remote.owner  # type: ignore[assignment]
        la, ra, ln, slot = _pairs(local, li, remote, ri)
        _still_registered(p)
        b = self._b
        return PathJob(RmaJob(p.w or b._w, p.ep, op is Op.READ, la, ra, ln, p.rkeys[slot],
                              lambda st, call: b._fail(p, st, call)), p)

    def poll(self, h: PathJob) -> bool:
        if not h.job.step(Deadline.within(self._b._budget)):
            return False
        _still_registered(h.peer)
        return True

    def cancel(self, h: PathJob) -> None:
        """RMA cannot be recalled: drive it until it settles (bounded by ``cancel_timeout``).
        A live peer that neither finished nor failed in time has its endpoint forced closed,
        which completes its requests, so that nothing writes into our memory after we return."""
        b, peer = self._b, h.peer
        job, h.job = h.job, None
        if job is None or b._closed:
            return
        alive = lambda: peer.failed is None and peer.connected and (peer.watch is None or peer.watch.alive())  # noqa: E731
        if not job.cancel(Deadline.within(b._cancel_timeout), alive) and alive():
            peer.failed = L.UCS_ERR_CANCELED
            peer.why = (f"did not settle a cancelled transfer within cancel_timeout={b._cancel_timeout:g} s, "
                        "so its connection was closed (nothing can arrive late)")
            b._disconnect(peer, force=True)

    @staticmethod
    def abandon(h: PathJob) -> None:
        """Free every request without waiting (the worker they live on is going away)."""
        h.job.cancel(0.0, lambda: False)

    @staticmethod
    def kind(h: Any) -> str:
        return RMA
