"""The post loop, written once: choose a row, start it, record it, poll it, notify after the data.

A backend made of :class:`~kvxfer.plugin.datapath.DataPath` rows used to write the same loop
around them by hand: take the first row that serves the pair, start it, keep the row and its
handle, poll the row until every byte is in place, only then send the notification (for rows
that do not send it themselves), hand a post with a notification to a
:class:`~kvxfer.progress.Pump` so it leaves even if nobody polls, and cancel through the row.
:class:`PathBackend` is that loop; a subclass lists its rows and says how a notification
reaches a peer. The core's router (:mod:`kvxfer.plugin.routed`) is built on it too: its rows
are the device path and the backend itself.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..errors import KvxferError, TransferCancelledError
from ..memory import Op
from ..progress import Pump
from .backend import Backend
from .datapath import DataPath, choose

__all__ = ["PathBackend", "Post"]


class Post:
    """One posted transfer: the row that carries it, the row's handle, and what is still owed."""

    __slots__ = ("path", "h", "peer", "notification", "error", "released", "tag", "done", "pumped")

    def __init__(self, path: DataPath, h: Any, peer: str, notification: bytes | None, tag: Any = None) -> None:
        self.path = path
        self.h = h
        self.peer = peer
        self.notification = notification
        self.tag = tag  # what the backend's route() attached (its peer record), for landed()
        self.error: KvxferError | None = None
        self.released = self.done = self.pumped = False


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

    def peer_of(self, remote: Any) -> str:
        """The peer a prepared remote list belongs to (passed to the row and to :meth:`deliver`)."""
        raise NotImplementedError

    def route(self, op: Op, local: Any, remote: Any) -> tuple[DataPath, str, Any]:
        """Check the pair may still be posted and pick its row: ``(row, peer, tag)``, ``tag`` kept
        on the :class:`Post`. Default: the first row that serves the pair, :meth:`peer_of`, None."""
        return choose(self.paths, local, remote), self.peer_of(remote), None

    def waiting(self, x: Post) -> None:
        """Called by :meth:`poll` while the row is not done (one process's peers may need driving)."""

    def landed(self, x: Post) -> None:
        """Called once the row reports every byte in place, before the notification; raise to fail."""

    def deliver(self, peer: str, message: bytes) -> None:
        """Send a transfer's notification, once its bytes are in place. Default: :meth:`notify`."""
        self.notify(peer, message)

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Post:
        path, peer, tag = self.route(op, local, remote)
        x = self.post_type(path, path.start(op, local, local_idx, remote, remote_idx, peer, notification), peer,
                           None if path.sends_notification else notification, tag)
        over = self.pump_over
        if over is None:
            if x.notification is not None and not self.poll(x):
                x.pumped = True
                self._pump.add(x)  # still moving: its notification leaves when it is done, polled or not
        elif notification or local_idx.shape[0] > over:
            x.pumped = True
            self._pump.add(x)
        return x

    def poll(self, xfer: Any) -> bool:
        x: Post = xfer
        if x.done:
            return True
        if x.error is not None:
            raise x.error
        if x.released:
            raise TransferCancelledError("transfer was released")
        try:
            if not x.path.poll(x.h):
                self.waiting(x)
                return False
            self.landed(x)
        except KvxferError as exc:
            x.error = exc
            raise
        if x.notification is not None:
            with self._post_lock:
                note, x.notification = x.notification, None
            if note is not None:  # after the data: the receiver may read on arrival
                self.deliver(x.peer, note)
        x.done = True
        return True

    def release(self, xfer: Any) -> None:
        x: Post = xfer
        if x.released:
            return
        x.released = True
        if x.pumped:
            self._pump.discard(x)
        x.path.cancel(x.h)

    def data_path(self, xfer: Any) -> str | None:
        return xfer.path.kind(xfer.h)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._pump.stop()
