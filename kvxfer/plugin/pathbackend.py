"""The post loop, written once: choose a row, start it, record it, poll it, notify after the data.

A backend made of :class:`~kvxfer.plugin.datapath.DataPath` rows used to write the same loop
around them by hand: take the first row that serves the pair, start it, keep the row and its
handle, poll the row until every byte is in place, only then send the notification (for rows
that do not send it themselves), hand a post with a notification to a
:class:`~kvxfer.progress.Pump` so it leaves even if nobody polls, and cancel through the row.
:class:`PathBackend` is that loop; a subclass lists its rows and says how a notification
reaches a peer. A transport with more to it (a lock around every step, a peer's liveness to check
before each step and once the bytes are in, a notification that is itself a request to poll)
fills the hooks: :attr:`~PathBackend.poll_at_post`, :attr:`~PathBackend.guard`,
:meth:`~PathBackend.admit`, :meth:`~PathBackend.started`, :meth:`~PathBackend.step`,
:meth:`~PathBackend.landed`, :meth:`~PathBackend.delivered` and :meth:`~PathBackend.withdraw`;
each one's default does nothing, and the loop calls a hook only where a subclass overrides it
(looked up on the class), so a backend made of rows alone pays for none. The core's router (:mod:`kvxfer.plugin.routed`) is built on it too: its rows
are the device path and the backend itself.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import KvxferError, TransferCancelledError, TransferTimeoutError
from ..memory import Op
from ..progress import Pump
from .backend import Backend
from .datapath import DataPath, choose

__all__ = ["PathBackend", "Post"]


class Lock(Protocol):
    """What :attr:`PathBackend.guard` holds: a lock (``threading.RLock`` where a step may take it again)."""

    def acquire(self) -> Any: ...

    def release(self) -> None: ...


class Post:
    """One posted transfer: the row that carries it, the row's handle, and what is still owed."""

    __slots__ = ("path", "h", "peer", "notification", "error", "released", "done", "sending", "tag", "pumped",
                 "__weakref__")

    def __init__(self, path: DataPath, h: Any, peer: Any, notification: bytes | None, tag: Any = None) -> None:
        self.path, self.h, self.peer, self.notification = path, h, peer, notification
        self.tag = tag  # what the backend's route() attached (its peer record), for landed()
        self.error: KvxferError | None = None
        self.released = self.done = self.pumped = False
        self.sending: Any = None  # what deliver() returned: a notification still on its way


class PathBackend(Backend):
    """A backend whose ``post``/``poll``/``release``/``data_path`` are the loop over its rows.

    A subclass sets ``self.paths`` (most specific first) and implements :meth:`peer_of` (which
    peer a prepared remote list names) and :meth:`deliver` (hand a notification to that peer;
    called once, after the row reported every byte in place). :meth:`close` must call
    ``super().close()``, which stops the pump.

    Three hooks, neutral by default, let a backend add what its transport needs without
    writing the loop again: :meth:`route` (refuse a stale peer's list, pick a fenced row),
    :meth:`waiting` (drive something while a row is not done) and :meth:`landed` (refuse
    DONE once the bytes are in place, e.g. from a peer that deregistered meanwhile).
    """

    paths: Sequence[DataPath] = ()
    #: Whether post() polls a transfer with a notification once before handing it to the pump
    #: (a row that finishes inside ``start`` then needs no pump thread).
    poll_at_post = True
    #: Held around each step of the loop (post, poll, release): a transport that is not
    #: thread-safe puts its lock here, since the pump polls from its own thread. None: no lock,
    #: and the loop takes none (a small transfer's post, poll and release cost no call for it).
    guard: Lock | None = None
    #: Which posts the pump drives until done. ``None``: those whose notification the loop still
    #: owes and that a first poll did not finish. A number ``n``: every post with a notification
    #: (a row that sends it itself may send it only while polled) and every post of more than
    #: ``n`` descriptors (a row that posts later pieces while polled), without a first poll.
    pump_over: int | None = None
    #: The class of this backend's posts: a wrapper telling its own posts from another's (kvxfer/_routed.py).
    post_type: type[Post] = Post

    def __init__(self, agent_name: str, /, **options: Any) -> None:
        super().__init__(agent_name, **options)
        self._post_lock = threading.Lock()  # the caller and the pump may finish one post together
        self._pump: Pump[Post] = Pump(self.poll, name=f"kvxfer-{self.name}-notify")

    def peer_of(self, remote: Any) -> Any:
        """The peer a prepared remote list belongs to (passed to the row and to :meth:`deliver`):
        its name, or the backend's own record of it."""
        raise NotImplementedError

    def route(self, op: Op, local: Any, remote: Any) -> tuple[DataPath, Any, Any]:
        """Check the pair may still be posted and pick its row: ``(row, peer, tag)``, ``tag`` kept
        on the :class:`Post`. Default: the first row that serves the pair, :meth:`peer_of`, None."""
        return choose(self.paths, local, remote), self.peer_of(remote), None

    def waiting(self, x: Post) -> None:
        """Called by :meth:`poll` while the row is not done (one process's peers may need driving)."""

    def deliver(self, peer: Any, message: bytes) -> Any:
        """Send a transfer's notification, once its bytes are in place. Default: :meth:`notify`.
        A send that is itself a request returns it; the post is done once :meth:`delivered` says so."""
        self.notify(peer, message)

    # -- hooks: each default does nothing -------------------------------------------------------
    def admit(self, local: Any, remote: Any, peer: Any) -> None:
        """Under the guard, before a post starts: refuse a stale list or a dead peer (typed error)."""

    def started(self, x: Post) -> None:
        """Under the guard, once the row started ``x``: record it where the backend tracks posts."""

    def step(self, x: Post) -> None:
        """Under the guard, before each poll of ``x``: drive the transport, raise if its peer is gone."""

    def landed(self, x: Post) -> None:
        """Once the row reported every byte of ``x`` in place, before the notification: raise if
        those bytes cannot be trusted (the peer died meanwhile)."""

    def delivered(self, sending: Any) -> bool:
        """Whether a notification :meth:`deliver` returned has left; raises if its send failed
        (either way it is then settled, and not withdrawn)."""
        return True

    def withdraw(self, sending: Any) -> None:
        """On release, a notification still on its way: settle it (bounded)."""

    # -- the loop -------------------------------------------------------------------------------
    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None, expect: Any = None) -> Post:
        """``expect``: the source's digest of each descriptor, for a row that verifies as it copies
        (the device path's fused kernel); passed on only when given, so other rows never see it."""
        cls, g = self.__class__, self.guard
        if g is not None:
            g.acquire()
        try:
            path, peer, tag = self.route(op, local, remote)
            if cls.admit is not _admit:
                self.admit(local, remote, peer)
            if expect is None:
                h = path.start(op, local, local_idx, remote, remote_idx, peer, notification)
            else:  # an optional keyword of some rows, not of the protocol
                start: Any = path.start
                h = start(op, local, local_idx, remote, remote_idx, peer, notification, expect=expect)
            x = self.post_type(path, h, peer, None if path.sends_notification else notification, tag)
            if cls.started is not _started:
                self.started(x)
        finally:
            if g is not None:
                g.release()
        over = self.pump_over
        if over is None:
            if x.notification is not None and not (self.poll_at_post and self.poll(x)):
                x.pumped = True
                self._pump.add(x)  # still moving: its notification leaves when it is done, polled or not
        elif notification or local_idx.shape[0] > over:
            x.pumped = True
            self._pump.add(x)
        return x

    def poll(self, xfer: Any) -> bool:
        x: Post = xfer
        if x.error is not None or x.done or x.released:
            return _ended(x)
        cls, g = self.__class__, self.guard
        if g is not None:
            g.acquire()
        try:
            if x.error is not None or x.done or x.released:  # the other poller (pump or caller) ended it meanwhile
                return _ended(x)
            try:
                if cls.step is not _step:
                    self.step(x)
                if x.sending is None:  # else the bytes are in and the notification is on its way
                    if not x.path.poll(x.h):
                        if cls.waiting is not _waiting:
                            self.waiting(x)
                        return False
                    if cls.landed is not _landed:
                        self.landed(x)
                    if x.notification is not None:
                        with self._post_lock:
                            note, x.notification = x.notification, None
                        if note is not None:  # after the data: the receiver may read on arrival
                            x.sending = self.deliver(x.peer, note)
                if x.sending is not None:
                    sending, x.sending = x.sending, None  # once delivered() answered, it is settled
                    if not self.delivered(sending):
                        x.sending = sending
                        return False
            except KvxferError as exc:
                x.error = exc
                raise
            x.done = True
        finally:
            if g is not None:
                g.release()
        return True

    def wait(self, xfer: Any, deadline: float) -> bool | None:
        """Block on the row's own ``wait`` where it has one (see :mod:`kvxfer.plugin.datapath`);
        None for a row without one, and for a post whose notification the pump may be polling
        meanwhile (its handle is then polled only, from one side at a time)."""
        x: Post = xfer
        w = getattr(x.path, "wait", None)
        if w is None or x.error is not None or x.released or x.notification is not None:
            return None
        try:
            return bool(w(x.h, deadline))
        except TransferTimeoutError:  # the row gave up at the deadline (and fenced): the core cancels
            return False
        except KvxferError as exc:  # kept: the next poll raises it, as if polling had found it
            x.error = exc
            return True

    def release(self, xfer: Any) -> None:
        x: Post = xfer
        if x.released:
            return
        x.released = True
        if x.pumped:
            self._pump.discard(x)
        g = self.guard
        if g is not None:
            g.acquire()
        try:
            x.path.cancel(x.h)
            sending, x.sending = x.sending, None
            if sending is not None:
                self.withdraw(sending)
        finally:
            if g is not None:
                g.release()

    def data_path(self, xfer: Any) -> str | None:
        return xfer.path.kind(xfer.h)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._pump.stop()


#: The hooks' defaults: the loop skips a hook the class leaves at its default (it does nothing).
_admit, _started, _step = PathBackend.admit, PathBackend.started, PathBackend.step
_waiting, _landed = PathBackend.waiting, PathBackend.landed


def _ended(x: Post) -> bool:
    """What polling an ended post says: its error, done, or cancelled."""
    if x.error is not None:
        raise x.error
    if x.done:
        return True
    raise TransferCancelledError("transfer was released")
