"""The NIXL data path: transfers over lists prepared once with ``prep_xfer_dlist``.

One post is ``make_prepped_xfer`` (int32 indices into the two prepared lists) plus
``transfer``; completion is ``check_xfer_state``. Nothing else runs per transfer.

Large posts are cut into pieces of at most ``piece`` descriptors. NIXL posts every
operation of a request inside ``transfer()`` (with shared memory or TCP it copies there
too), so one huge request would spend seconds in the caller's ``read()``, before the
core's deadline even starts. Only the first piece is posted by :meth:`NixlPath.start`;
each later :meth:`NixlPath.poll` posts one more, so posting runs under the deadline and can
be cancelled. A notification rides on the last piece, which is posted only once all the
others are done: NIXL sends it after that piece's data, so it follows all of the data.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from kvxfer import BackendError, Op, TransferCancelledError, UnsupportedError

from ._bounce import Bounce, Quarantine, expand
from ._nixl import map_error

__all__ = ["Fenced", "NixlPath", "NixlXfer", "as_int32"]

_INT32_MAX = np.iinfo(np.int32).max
_I32 = np.dtype(np.int32)  # numpy's dtypes of its own types are singletons: an identity check


def as_int32(idx: np.ndarray) -> np.ndarray:
    """NIXL takes int32 index arrays (a Python list is far slower); convert only if needed."""
    if idx.dtype == np.int32 and idx.flags.c_contiguous:
        return idx
    if idx.size and (int(idx.max()) > _INT32_MAX or int(idx.min()) < 0):
        raise UnsupportedError("NIXL indexes prepared lists with int32: a list longer than 2**31-1 descriptors "
                               "cannot be addressed; prepare smaller lists")
    return np.ascontiguousarray(idx, dtype=np.int32)


class _Listed(Protocol):
    nixl: Any  # NIXL's prepared-list handle; None once released


class NixlXfer:
    """One post on the NIXL path: pieces not yet posted, and NIXL handles in flight."""

    __slots__ = ("op", "lp", "rp", "li", "ri", "n", "notification", "peer", "next", "live", "released", "bounce")

    def __init__(self, op: Op, lp: _Listed, li: np.ndarray, rp: _Listed, ri: np.ndarray, notification: bytes,
                 peer: str, bounce: Bounce | None = None) -> None:
        self.op, self.lp, self.rp, self.li, self.ri = op, lp, rp, li, ri
        self.bounce = bounce  # a fenced READ lands here and is copied out once DONE (kvxfer_nixl._bounce)
        self.n = li.shape[0]
        self.notification, self.peer = notification, peer
        self.next = 0  # first descriptor not yet posted
        self.live: list[Any] = []  # NIXL handles posted and not yet DONE
        self.released = False


class NixlPath:
    """A :class:`kvxfer.plugin.DataPath` over one NIXL agent; the backend's lock guards every NIXL call."""

    sends_notification = True  # NIXL sends it after the data

    def __init__(self, agent: Any, lock: threading.RLock, piece: int) -> None:
        self._agent = agent
        self._lock = lock
        self._piece = max(1, int(piece))
        self.unreleased: list[Any] = []  # handles NIXL was still aborting; retried by reap()
        self.quarantine = Quarantine()  # fenced READs that ended before their requests did

    @staticmethod
    def serves(local: _Listed, remote: _Listed) -> bool:
        """Both lists were prepared by NIXL (a list of two agents of one process may not be)."""
        return local.nixl is not None and remote.nixl is not None

    def start(self, op: Op, local: _Listed, li: np.ndarray, remote: _Listed, ri: np.ndarray, peer: str,
              notification: bytes | None, fence: bool = False) -> NixlXfer:
        """Post the first piece (the whole transfer when it fits in one). ``fence``: a READ over
        a transport that cannot recall it lands in a :class:`~kvxfer_nixl._bounce.Bounce`."""
        li = li if li.dtype is _I32 and li.flags.c_contiguous else as_int32(li)  # inlined: the hot path
        ri = ri if ri.dtype is _I32 and ri.flags.c_contiguous else as_int32(ri)
        if li.shape != ri.shape:
            raise BackendError(f"index arrays differ in length ({li.shape[0]} vs {ri.shape[0]})")
        if local.nixl is None or remote.nixl is None:
            raise BackendError("NIXL prepared neither or only one of these lists (released, or empty?)")
        bounce = None
        if fence and op is Op.READ:
            rows = getattr(local, "rows", None)
            if rows is None:
                rows = local.rows = expand(local.descs.array)  # type: ignore[attr-defined]
            bounce = Bounce(self._agent, self._lock, rows[li])
            local, li = bounce, np.arange(li.shape[0], dtype=np.int32)
        x = NixlXfer(op, local, li, remote, ri, notification or b"", peer, bounce)
        try:
            with self._lock:
                self._post_next(x)
        except BaseException:
            if bounce is not None:
                self._settle(x)
            raise
        if bounce is not None and not x.live and x.next >= x.n:
            self._deliver(x)  # finished inside transfer()
        return x

    def poll(self, x: NixlXfer) -> bool:
        """True once every piece is DONE; posts the next piece while some remain."""
        if not x.live and x.next >= x.n and not x.released and x.bounce is None:
            return True  # finished inside transfer(): nothing of NIXL's left to look at
        with self._lock:
            if x.released:  # released by another thread: never touch a freed handle
                raise TransferCancelledError("transfer was released")
            for h in x.live[:] if len(x.live) > 1 else x.live:
                try:
                    state = self._agent.check_xfer_state(h)
                except Exception as exc:
                    raise map_error(exc, "transfer failed", x.peer) from exc
                if state == "DONE":
                    x.live.remove(h)
                    self._release(h)
                elif state == "ERR":
                    raise BackendError(f"NIXL reported a failed transfer with {x.peer!r}")
            n = x.n
            if x.next < n and (x.next + self._piece < n or not x.live or not x.notification):
                self._post_next(x)
            finished = x.next >= n and not x.live
            if finished and x.bounce is not None:
                self._deliver(x)
            return finished

    def cancel(self, x: NixlXfer) -> None:
        """Release every handle (NIXL aborts what is pending); never raises."""
        if not x.live and x.next >= x.n and x.lp.__class__ is not Bounce:
            # Every piece posted and done (a small READ, finished inside transfer()): no handle is
            # left and no poll can post another, so there is nothing to take the lock for. Not for
            # a fenced READ (its landing area is Bounce): another thread may be copying it out.
            x.released = True
            return
        with self._lock:
            if x.released:
                return
            x.released = True
            if x.bounce is not None:
                self._settle(x)
                return
            for h in x.live:
                self._release(h)
            x.live.clear()

    def _deliver(self, x: NixlXfer) -> None:
        """Every piece is DONE: copy the landing area to the destination, then free it."""
        b, x.bounce = x.bounce, None
        if b is not None:
            b.deliver()
            b.free()

    def _settle(self, x: NixlXfer) -> None:
        """A fenced READ ends early: free its landing area, or hold it until NIXL is done with it."""
        b, x.bounce = x.bounce, None
        if b is None:
            return
        if x.live:
            self.quarantine.hold(b, x.live)
            x.live = []
            self.quarantine.reap(self._agent)
        else:
            b.free()

    def reap(self) -> None:
        """Retry releasing handles NIXL was still aborting; free landing areas NIXL is done with."""
        if len(self.quarantine):
            with self._lock:
                self.quarantine.reap(self._agent)
        if self.unreleased:
            with self._lock:
                pending, self.unreleased = self.unreleased, []
                for h in pending:
                    self._release(h)

    @staticmethod
    def kind(x: NixlXfer) -> str:
        return "nixl"

    def close(self) -> None:
        """Drop the agent: NIXL destroys it with its last reference."""
        self.unreleased.clear()
        self.quarantine.orphan()
        self._agent = None

    def _post_next(self, x: NixlXfer) -> None:
        n = x.n
        a, b = x.next, min(x.next + self._piece, n)
        last = b == n
        lh, rh = x.lp.nixl, x.rp.nixl
        if lh is None or rh is None:
            raise BackendError(f"a descriptor list of {_what(x, a, b)} was released")
        li, ri = (x.li, x.ri) if a == 0 and last else (x.li[a:b], x.ri[a:b])
        try:
            h = self._agent.make_prepped_xfer(x.op._value_, lh, li, rh, ri, x.notification if last else b"")  # not .value: 2 calls
        except Exception as exc:
            raise map_error(exc, f"creating {_what(x, a, b)}", x.peer) from exc
        try:
            state = self._agent.transfer(h)
        except Exception as exc:
            self._release(h)
            raise map_error(exc, f"posting {_what(x, a, b)}", x.peer) from exc
        if state == "ERR":
            self._release(h)
            raise BackendError(f"NIXL refused to post {_what(x, a, b)} to {x.peer!r}")
        x.next = b
        if state == "DONE":
            try:  # _release(), inlined: a small READ is done here (issue 37 counts its calls)
                self._agent.release_xfer_handle(h)
            except Exception:
                self.unreleased.append(h)
        else:
            x.live.append(h)

    def _release(self, h: Any) -> None:
        try:
            self._agent.release_xfer_handle(h)
        except Exception:
            self.unreleased.append(h)  # NIXL is still aborting it


class Fenced:
    """The fenced row: the same :class:`NixlPath`, whose READs land in a bounce area first
    (:mod:`kvxfer_nixl._bounce`); the backend's ``route()`` picks it for a READ that needs the fence."""

    sends_notification = True

    def __init__(self, path: NixlPath) -> None:
        self._path = path
        self.serves, self.poll, self.cancel, self.kind = path.serves, path.poll, path.cancel, path.kind

    def start(self, op: Op, local: _Listed, li: np.ndarray, remote: _Listed, ri: np.ndarray, peer: str,
              notification: bytes | None) -> NixlXfer:
        return self._path.start(op, local, li, remote, ri, peer, notification, fence=True)


def _what(x: NixlXfer, a: int, b: int) -> str:
    return f"a {x.op.value} of {b - a} descriptors" + (f" (of {x.n})" if x.n != b - a else "")
