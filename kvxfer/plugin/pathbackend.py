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

from ..errors import KvxferError, TransferCancelledError, TransferTimeoutError
from ..memory import Op
from ..progress import Pump
from .backend import Backend
from .datapath import DataPath, choose

__all__ = ["PathBackend", "Post"]


class Post:
    """One posted transfer: the row that carries it, the row's handle, and what is still owed."""

    __slots__ = ("path", "h", "peer", "notification", "error", "released")

    def __init__(self, path: DataPath, h: Any, peer: str, notification: bytes | None) -> None:
        self.path, self.h, self.peer, self.notification = path, h, peer, notification
        self.error: KvxferError | None = None
        self.released = False


class PathBackend(Backend):
    """A backend whose ``post``/``poll``/``release``/``data_path`` are the loop over its rows.

    A subclass sets ``self.paths`` (most specific first) and implements :meth:`peer_of` (which
    peer a prepared remote list names) and :meth:`deliver` (hand a notification to that peer;
    called once, after the row reported every byte in place). :meth:`close` must call
    ``super().close()``, which stops the pump.
    """

    paths: Sequence[DataPath] = ()

    def __init__(self, agent_name: str, /, **options: Any) -> None:
        super().__init__(agent_name, **options)
        self._post_lock = threading.Lock()  # the caller and the pump may finish one post together
        self._pump: Pump[Post] = Pump(self.poll, name=f"kvxfer-{self.name}-notify")

    def peer_of(self, remote: Any) -> str:
        """The peer a prepared remote list belongs to (passed to the row and to :meth:`deliver`)."""
        raise NotImplementedError

    def deliver(self, peer: str, message: bytes) -> None:
        """Send a transfer's notification, once its bytes are in place. Default: :meth:`notify`."""
        self.notify(peer, message)

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None, expect: Any = None) -> Post:
        """``expect``: the source's digest of each descriptor, for a row that verifies as it copies
        (the device path's fused kernel); passed on only when given, so other rows never see it."""
        path = choose(self.paths, local, remote)
        peer = self.peer_of(remote)
        if expect is None:
            h = path.start(op, local, local_idx, remote, remote_idx, peer, notification)
        else:  # an optional keyword of some rows, not of the protocol
            start: Any = path.start
            h = start(op, local, local_idx, remote, remote_idx, peer, notification, expect=expect)
        x = Post(path, h, peer, None if path.sends_notification else notification)
        if x.notification is not None and not self.poll(x):
            self._pump.add(x)  # still moving: its notification leaves when it is done, polled or not
        return x

    def poll(self, xfer: Any) -> bool:
        x: Post = xfer
        if x.error is not None:
            raise x.error
        if x.released:
            raise TransferCancelledError("transfer was released")
        try:
            if not x.path.poll(x.h):
                return False
        except KvxferError as exc:
            x.error = exc
            raise
        if x.notification is not None:
            with self._post_lock:
                note, x.notification = x.notification, None
            if note is not None:  # after the data: the receiver may read on arrival
                self.deliver(x.peer, note)
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
        self._pump.discard(x)
        x.path.cancel(x.h)

    def data_path(self, xfer: Any) -> str | None:
        return xfer.path.kind(xfer.h)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._pump.stop()
