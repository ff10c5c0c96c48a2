"""The NIXL backend's notifications: sending, receiving, progress, and deregistration notices.

A mixin of :class:`kvxfer_nixl.backend.NixlBackend` (the control plane), kept apart so each
file stays small; it uses the backend's NIXL agent, lock and peers. Three things happen
here besides moving messages:

* NIXL sends a notification only while someone progresses its worker, so after sending one
  the notify thread (:class:`kvxfer.progress.Pump`) keeps progressing for a while;
* agents of one process progress each other while they wait, because nobody else would;
* an agent with registered memory progresses its own worker from a sleeping thread
  (``background_progress``) once its metadata left, so a peer that only serves reads needs
  no calls from its owner;
* a backend that deregisters memory tells its peers (a control notice, never delivered to
  the user), and a backend that receives one marks the sender stale.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from kvxfer import KvxferError, UnknownPeerError
from kvxfer.plugin import Deadline, Pump

from ._nixl import map_error
from ._records import Flush, Remote, instances, notice, parse_notice

__all__ = ["Notifications"]

#: How long the notify thread keeps progressing NIXL after a notification was sent: it
#: leaves the worker only when someone progresses it, and the caller may have gone back to work.
NOTIF_FLUSH_S = 2.0
#: Longest nap of the background progress thread: an idle agent wakes this often (BENCHMARKS.md,
#: "A passive peer"), and a reader's connection or software RMA waits at most this long per step.
BACKGROUND_SLEEP_S = 1e-3
#: Why a transfer that timed out may not have moved, appended to the core's timeout error.
STALL_HINT = ("A NIXL peer serves reads and writes only while its worker progresses: its agent does that "
              "by itself while it has memory registered (option background_progress, on by default), but "
              "one created with background_progress=False must call Agent.progress() or notifications() "
              "every few milliseconds. If the peer does, check that it is alive and reachable "
              "(kvxfer doctor; options: docs/backends.md).")


class Notifications:
    """Notification handling for :class:`~kvxfer_nixl.backend.NixlBackend`."""

    agent_name: str
    _agent: Any
    _lock: threading.RLock
    _remotes: dict[str, Remote]
    _inbox: dict[str, list[bytes]]
    _collected: float
    _closed: bool
    _notify_thread: bool
    _progress_thread: bool
    _flush: Flush
    _pump: Pump[Any]
    _keeper: Pump[Any] | None
    _exported: bool
    _registrations: list[Any]
    _id: bytes
    _reg_epoch: int

    if TYPE_CHECKING:  # the backend's, used here
        def _check_open(self) -> None: ...
        def progress(self) -> None: ...
        def poll(self, xfer: Any) -> bool: ...

    def notify(self, peer: str, message: bytes) -> None:
        self._check_open()
        rem = self._remotes.get(peer)
        if rem is None:
            raise UnknownPeerError(f"NIXL backend of {self.agent_name!r} has no peer {peer!r}")
        self._send_notif(rem, bytes(message))
        self._flush_soon()

    def drain_notifications(self) -> dict[str, list[bytes]]:
        self._check_open()
        self.progress()
        with self._lock:
            out, self._inbox = self._inbox, {}
        return out

    def _pumped(self, h: Any) -> bool:
        """What the notify thread polls: transfers, and the flush after a standalone notification."""
        if h is self._flush:
            with contextlib.suppress(KvxferError):
                self._collect(blocking=False)
            return time.monotonic() >= self._flush.until
        return self.poll(h)

    def _announce_deregistration(self) -> None:
        """Tell peers that memory they may hold keys for is gone, so they stop using it.

        Peers in this process are marked at once; others receive a control notification
        (only those this backend has added) and mark us when they next look at
        notifications, which they also do whenever one of their transfers to us completes.
        """
        for other in list(instances.values()):
            for rem in list(other._remotes.values()):
                if rem.local is not None and rem.local() is self:
                    rem.stale = self._stale_reason(rem.name)
        msg = notice(self._id, self._reg_epoch)
        for rem in list(self._remotes.values()):
            with self._lock:
                try:
                    self._agent.send_notif(rem.nixl, msg)
                except Exception:
                    pass  # a peer we cannot reach cannot read from us either

    @staticmethod
    def _stale_reason(peer: str) -> str:
        return (f"peer {peer!r} deregistered memory that lists prepared for it cover; "
                "add it again from its fresh metadata")


    def _flush_soon(self) -> None:
        if self._notify_thread:
            self._flush.until = Deadline.within(NOTIF_FLUSH_S)
            self._pump.add(self._flush)


    def _send_notif(self, rem: Remote, message: bytes) -> None:
        with self._lock:
            try:
                self._agent.send_notif(rem.nixl, message)
            except Exception as exc:
                raise map_error(exc, "sending a notification", rem.name) from exc

    def _collect(self, blocking: bool = True) -> None:
        """Move NIXL's new notifications into the inbox, acting on control notices."""
        if not self._lock.acquire(blocking=blocking):
            return
        try:
            if self._closed:
                return
            self._collected = time.monotonic()
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:
                raise map_error(exc, "reading notifications") from exc
            for k, v in new.items():
                key = k.decode("utf-8", "replace") if isinstance(k, (bytes, bytearray)) else str(k)
                msgs = [bytes(m) for m in v]
                msgs = [m for m in msgs if not self._notice(key, m)]
                if msgs:
                    self._inbox.setdefault(key, []).extend(msgs)
        finally:
            self._lock.release()

    def _notice(self, sender: str, msg: bytes) -> bool:
        """True if ``msg`` is a deregistration notice (acted upon if it concerns a known peer)."""
        parsed = parse_notice(msg)
        if parsed is None:
            return False
        rem = self._remotes.get(sender)
        if rem is not None and rem.blob.instance == parsed[0] and parsed[1] > rem.blob.reg_epoch:
            rem.stale = self._stale_reason(sender)
        return True

    def _keep_progressing(self) -> None:
        """Start the background progress thread (idempotent) once registered memory may be
        read: memory is registered *and* our metadata left (:meth:`local_metadata`). No peer
        can connect before it has our metadata, so an agent that only does file I/O (the
        store's ``nixl-posix`` path) or that was never advertised has nothing to progress,
        and a thread waking every millisecond would take the CPU and GIL from its process's
        work (BENCHMARKS.md, "Issue 37: store offload, this session")."""
        if self._keeper is not None and self._exported and self._registrations:
            self._keeper.add(self._keeper)

    def _kept(self, _: Any) -> bool:
        """One background progress step; never blocks the owner (a held lock means it progresses)."""
        if self._closed:
            return True
        with contextlib.suppress(KvxferError):
            self._collect(blocking=False)
        return False

    def stall_hint(self, peer: str | None) -> str | None:
        return STALL_HINT

    def waiting(self, x: Any = None) -> None:
        """Progress peers of this process while a transfer waits (PathBackend's hook) and in
        ``progress()``: nobody else drives them when the thread is off.

        Never blocks: a peer busy in another thread is progressing anyway.
        """
        if self._progress_thread:
            return
        for rem in tuple(self._remotes.values()):
            other = rem.local() if rem.local is not None else None
            if other is not None and not other._closed:
                try:
                    other._collect(blocking=False)
                except KvxferError:
                    pass

