"""Notifications: small active messages that carry the sender's agent name.

A transfer's notification is sent only after its data path reported every byte in place
(the backend's job), so it can never be seen before the data. Standalone ones
(:meth:`Notifications.queue`) never block the sender: the peer may live in the same thread,
so their requests are reaped by later progress calls.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from typing import Any, Callable

from kvxfer import UnsupportedError

from . import _libucp as L
from ._worker import Worker

__all__ = ["MAX_NOTIFICATION", "Notifications"]

#: Notifications ride an eager active message; larger payloads belong in KV memory.
MAX_NOTIFICATION = 64 << 10
_HEADER = struct.Struct("<4sBxH")  # magic, kind, pad, sender-name length; the name follows
_MAGIC = b"KVXN"
_NOTIFY = 1


def check_size(message: bytes) -> None:
    if len(message) > MAX_NOTIFICATION:
        raise UnsupportedError(f"ucx notifications are limited to {MAX_NOTIFICATION} bytes")


class Notifications:
    """Inbox and outbox of one agent; :attr:`w` is set once its worker exists."""

    def __init__(self, agent_name: str) -> None:
        name = agent_name.encode("utf-8", "replace")
        self._header = _HEADER.pack(_MAGIC, _NOTIFY, len(name)) + name
        self.w: Worker | None = None
        self.inbox: dict[str, list[bytes]] = defaultdict(list)
        self._sends: list[tuple[int, tuple[Any, ...], Callable[[], bool], int]] = []

    def on_am(self, header: bytes, data: bytes) -> None:
        """Worker callback: file a well-formed notification under its sender's name."""
        if len(header) < _HEADER.size or len(data) > MAX_NOTIFICATION:
            return
        magic, kind, nlen = _HEADER.unpack_from(header)
        if magic == _MAGIC and kind == _NOTIFY and _HEADER.size + nlen == len(header):
            self.inbox[header[_HEADER.size:].decode("utf-8", errors="replace")].append(data)

    def send(self, ep: int, message: bytes) -> tuple[int | None, tuple[Any, ...]]:
        """Start sending; returns ``(request or None, buffers to keep alive)`` (UcxCallError on failure)."""
        assert self.w is not None
        return self.w.send_am(ep, self._header, bytes(message))

    def queue(self, ep: int, message: bytes, gone: Callable[[], bool]) -> None:
        """Send without waiting; ``gone()`` True means the peer died and the send is dropped."""
        req, bufs = self.send(ep, message)
        if req is not None:
            self._sends.append((req, bufs, gone, ep))

    def reap(self) -> None:
        assert self.w is not None
        keep = []
        for req, bufs, gone, ep in self._sends:
            if self.w.lib.ucp_request_check_status(req) == L.UCS_INPROGRESS and not gone():
                keep.append((req, bufs, gone, ep))
            else:
                self.w.drain([req], 0.0, lambda: False)
        self._sends = keep

    def forget(self, ep: int) -> None:
        """Give back every queued send on ``ep`` now (its worker is about to go)."""
        assert self.w is not None
        self.w.drain([req for req, _, _, e in self._sends if e == ep], 0.0, lambda: False)
        self._sends = [s for s in self._sends if s[3] != ep]

    @property
    def pending(self) -> bool:
        return bool(self._sends)

    def drop_all(self) -> None:
        assert self.w is not None
        self.w.drain([req for req, *_ in self._sends], 0.0, lambda: False)
        self._sends.clear()

    def take(self) -> dict[str, list[bytes]]:
        out, self.inbox = dict(self.inbox), defaultdict(list)
        return out
