"""Socket plumbing for the side-channel server: per-client state, the listener, freeing memory.

Kept apart from :mod:`.loop` and :mod:`.server` so that they read as the event loop and the
protocol, and this module as the state and mechanics they share.
"""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import Callable

from kvxfer.errors import HandshakeError

from .frames import AUTH, EXCHANGE, FETCH, HELLO

__all__ = ["Client", "listen", "return_free_memory", "CHUNK", "LINGER", "TRIM_AFTER", "HELLO_WAIT", "AUTH_WAIT",
           "DATA_WAIT", "CALLBACK", "REPLYING", "CLOSING", "EXPECT", "STATE_NAMES"]

CHUNK = 256 * 1024  # largest single recv into a payload
LINGER = 0.2  # seconds to drain a client after our ERROR frame, so no reset destroys it
DRAIN_LIMIT = 1 << 20
# Connection states. Reading states expect one frame type (or ERROR).
HELLO_WAIT, AUTH_WAIT, DATA_WAIT, CALLBACK, REPLYING, CLOSING = range(6)
EXPECT = {HELLO_WAIT: (HELLO,), AUTH_WAIT: (AUTH,), DATA_WAIT: (EXCHANGE, FETCH)}
STATE_NAMES = {HELLO_WAIT: "waiting for HELLO", AUTH_WAIT: "waiting for AUTH", DATA_WAIT: "waiting for the metadata",
               CALLBACK: "running on_peer", REPLYING: "sending the reply", CLOSING: "closing"}


class Client:
    """Per-connection state: at most one frame header and one payload in progress."""

    __slots__ = ("sock", "peer", "deadline", "state", "head", "msg_type", "length", "chunks", "got",
                 "out", "cn", "sn", "slot", "reserved", "drain_left", "events", "closed", "shut")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.state = HELLO_WAIT
        self.head = b""
        self.msg_type = self.length = self.got = 0
        self.chunks: list[bytes] = []
        self.out: collections.deque[memoryview] = collections.deque()
        self.cn = self.sn = b""
        self.slot = self.closed = self.shut = False
        self.reserved = 0
        self.drain_left = DRAIN_LIMIT
        self.events = 0


TRIM_AFTER = 4 << 20  # payload bytes received between two trims
_malloc_trim: Callable[[int], int] | None | bool = False


def return_free_memory() -> None:
    """Hand freed payload memory back to the OS (glibc only; a no-op elsewhere).

    glibc raises its mmap threshold after the first large buffer is freed, so later
    multi-megabyte payloads come from heaps it keeps: a burst of them would stay resident
    for the life of the process. ``malloc_trim`` gives those pages back.
    """
    global _malloc_trim
    if _malloc_trim is False:
        _malloc_trim = None
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            pass
    if _malloc_trim:
        _malloc_trim(0)  # type: ignore[operator]


def listen(host: str, port: int) -> socket.socket:
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise HandshakeError(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        if os.name != "nt":  # on Windows SO_REUSEADDR would let others steal the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise HandshakeError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock
