"""The side-channel server's connections: one event-loop thread for every socket, a slot only after authentication.

Why an event loop and not a thread per connection: a thread per accepted socket, holding a
connection slot until its deadline, let 64 clients that connect and say nothing deny the
service to everyone, token or not, and every such thread kept its own allocator arena. Here
a connection that has not proven the token is a socket and a few dozen bytes of state in one
selector; when too many pile up the oldest is dropped, so a legitimate client (which proves
itself within one round trip) is never queued behind them. Only an authenticated client gets
one of ``max_connections`` slots and may send a payload, whose bytes are reserved against
``max_buffered`` before they are read and arrive in bounded chunks.

:class:`ConnectionLoop` owns the sockets, framing, deadlines, bounds and slots. What the
frames mean belongs to :class:`~.server.MetadataServer`, through three hooks: ``_handle`` (a
complete control frame), ``_on_data`` (a complete EXCHANGE or FETCH payload) and
``_deliver`` (replies that became ready while the loop slept).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from kvxfer.errors import HandshakeError

from ..deadlines import Deadline
from .frames import (
    ERROR, EXCHANGE, FETCH, HEADER_SIZE, TYPE_NAMES, HandshakeProtocolError, HandshakeTimeoutError, ServerBusyError, decode_header,
    error_frame, remote_error,
)
from .sockets import (
    CHUNK, CLOSING, DATA_WAIT, EXPECT, LINGER, REPLYING, STATE_NAMES, TRIM_AFTER, Client, return_free_memory,
)

__all__ = ["ConnectionLoop"]

log = logging.getLogger("kvxfer.sidechannel")


class ConnectionLoop:
    """Accepts, reads frames, writes replies, enforces deadlines and bounds; one thread.

    Subclasses start ``self._thread`` once their own state is ready, and implement the hooks.
    """

    def __init__(self, listener: socket.socket, *, timeout: float, max_message: int, max_connections: int,
                 max_pending: int, max_buffered: int,
                 on_error: Callable[[HandshakeError], None] | None) -> None:
        self._listener, self._timeout, self._on_error = listener, timeout, on_error
        self._max_message, self._max_connections, self._max_pending = max_message, max_connections, max_pending
        self._max_buffered = max_buffered
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pending: collections.OrderedDict[Client, None] = collections.OrderedDict()  # not yet authenticated
        self._conns: set[Client] = set()
        self._timers: list[tuple[float, int, Client]] = []
        self._seq = itertools.count()
        self._active = self._buffered = self._received = 0
        self._scratch = memoryview(bytearray(1 << 16))  # where drained bytes go
        self._closed = threading.Event()
        self._stopping = False
        self._grace_end = 0.0
        self._grace = 1.0
        port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-sidechannel:{port}", daemon=True)

    # -- hooks -------------------------------------------------------------------------------
    def _handle(self, c: Client, msg_type: int, body: bytes) -> None:
        """A complete control frame (not ERROR, not a payload) arrived from ``c``."""
        raise NotImplementedError

    def _on_data(self, c: Client, msg_type: int, chunks: list[bytes]) -> None:
        """A complete EXCHANGE or FETCH payload arrived from ``c``, in the chunks it was read in."""
        raise NotImplementedError

    def _deliver(self) -> None:
        """The loop was woken: send whatever replies became ready."""
        raise NotImplementedError

    # -- event loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                now = time.monotonic()
                wait = 1.0 if not self._timers else min(1.0, max(0.0, self._timers[0][0] - now))
                if self._stopping:
                    wait = min(wait, max(0.0, self._grace_end - now))
                events = self._sel.select(wait)
                for key, mask in events:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._on_wake()
                    else:
                        self._on_event(key.data, mask)
                self._expire(time.monotonic())
                if self._received >= TRIM_AFTER or (self._received and not events):  # payloads freed
                    self._received = 0
                    return_free_memory()
                if len(self._timers) > 4 * len(self._conns) + 256:  # forget entries of closed clients
                    self._timers = [t for t in self._timers if not t[2].closed and t[0] == t[2].deadline]
                    heapq.heapify(self._timers)
                if self._stopping and (not self._conns or time.monotonic() >= self._grace_end):
                    return
        except Exception:  # a bug here must not leave clients hanging without a word in the log
            log.exception("metadata server loop failed; the server is closed")
        finally:
            for c in list(self._conns):
                self._drop(c)
            for obj in (self._sel, self._listener, self._wake_r, self._wake_w):
                obj.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # buffer full (a wake is already pending) or already closed
            pass

    def _on_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        self._deliver()
        if self._closed.is_set() and not self._stopping:
            self._stopping = True
            self._grace_end = Deadline.within(self._grace)
            self._sel.unregister(self._listener)
            self._listener.close()
            for c in list(self._pending):  # nothing promised to these yet
                self._drop(c)

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, so established clients keep being served
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: make room from the unauthenticated
                log.warning("metadata server failed to accept: %s", exc)
                if self._pending:
                    self._evict()
                else:
                    time.sleep(0.05)  # nothing to free: back off instead of spinning on the listener
                return
            if len(self._pending) >= self._max_pending:
                self._evict()
            sock.setblocking(False)
            c = Client(sock, f"client {addr[0]}:{addr[1]}", Deadline.within(self._timeout))
            self._conns.add(c)
            self._pending[c] = None
            self._interest(c)
            self._arm(c)

    def _evict(self) -> None:
        oldest = next(iter(self._pending))
        err = ServerBusyError(f"{oldest.peer} dropped: more than {self._max_pending} unauthenticated "
                              "connections; the oldest goes first")
        self._report(err)
        try:
            oldest.sock.send(error_frame(err))
        except OSError:
            pass
        self._drop(oldest)

    def _on_event(self, c: Client, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ and not c.closed:
                if c.state == CLOSING:
                    self._drain(c)
                else:
                    self._read(c)
            if mask & selectors.EVENT_WRITE and not c.closed:
                self._flush(c)
        except HandshakeError as exc:
            self._fail(c, exc)
        except Exception as exc:  # a bug here must not kill the loop for everyone else
            self._fail(c, HandshakeError(f"internal error while serving {c.peer}: {exc!r}"))

    def _recv(self, c: Client, n: int, what: str) -> bytes | None:
        try:
            data = c.sock.recv(n)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise HandshakeError(f"connection to {c.peer} failed while {what}: {exc}") from exc
        if not data:
            raise HandshakeProtocolError(f"{c.peer} closed the connection while {what}")
        return data

    def _read(self, c: Client) -> None:
        """Read as much of the current frame as is there, and act on each complete frame."""
        while c.state in EXPECT and not c.closed:
            if len(c.head) < HEADER_SIZE:
                data = self._recv(c, HEADER_SIZE - len(c.head), f"reading a header ({STATE_NAMES[c.state]})")
                if data is None:
                    return
                c.head += data
                if len(c.head) < HEADER_SIZE:
                    continue
                c.msg_type, c.length = decode_header(c.head, self._max_message)
                if c.msg_type != ERROR and c.msg_type not in EXPECT[c.state]:
                    raise HandshakeProtocolError(
                        f"{c.peer} sent {TYPE_NAMES[c.msg_type]} while {STATE_NAMES[c.state]}")
                if c.length > 0 and c.state == DATA_WAIT:
                    if self._buffered + c.length > self._max_buffered:
                        raise ServerBusyError(f"{c.peer}: the server is buffering {self._buffered} bytes of other "
                                              f"clients' metadata (max_buffered={self._max_buffered}); retry shortly")
                    self._buffered += c.length
                    c.reserved += c.length
            if c.got < c.length:
                data = self._recv(c, min(c.length - c.got, CHUNK), f"reading the {TYPE_NAMES[c.msg_type]} payload")
                if data is None:
                    return
                c.chunks.append(data)
                c.got += len(data)
                self._received += len(data)
                if c.got < c.length:
                    continue
            msg_type, chunks = c.msg_type, c.chunks
            c.head, c.chunks, c.got, c.length = b"", [], 0, 0
            if msg_type in (EXCHANGE, FETCH):
                self._on_data(c, msg_type, chunks)
                continue
            payload = b"".join(chunks)
            if msg_type == ERROR:
                raise remote_error(payload, c.peer)
            self._handle(c, msg_type, payload)

    def _take_slot(self, c: Client) -> None:
        """``c`` proved the token: it leaves the unauthenticated queue for one of the slots."""
        self._pending.pop(c, None)
        if self._active >= self._max_connections or self._stopping:
            raise ServerBusyError(f"server busy ({self._active} clients in progress), {c.peer} turned "
                                  "away; retry shortly")
        self._active += 1
        c.slot = True

    # -- output, errors, closing ------------------------------------------------------------
    def _send(self, c: Client, *parts: bytes) -> None:
        c.out.extend(memoryview(p) for p in parts if p)
        self._flush(c)

    def _flush(self, c: Client) -> None:
        while c.out:
            try:
                n = c.sock.send(c.out[0])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(c)
                return
            if n < len(c.out[0]):
                c.out[0] = c.out[0][n:]
                break
            c.out.popleft()
        if not c.out:
            if c.state == REPLYING:  # the conversation is complete
                self._drop(c)
                return
            if c.state == CLOSING and not c.shut:
                c.shut = True
                try:
                    c.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    self._drop(c)
                    return
        self._interest(c)

    def _fail(self, c: Client, error: HandshakeError) -> None:
        """Report, send an ERROR frame, then hang up gently (FIN, then a short bounded drain).

        Closing with unread bytes queued makes the kernel send a reset, which can destroy the
        ERROR frame before the peer reads it; the drain avoids that.
        """
        if c.closed:
            return
        self._report(error)
        if c.state == CLOSING:
            self._drop(c)
            return
        c.state = CLOSING
        c.out.clear()
        c.deadline = Deadline.within(LINGER)
        self._arm(c)
        self._send(c, error_frame(error))

    def _drain(self, c: Client) -> None:
        try:
            n = c.sock.recv_into(self._scratch[:min(c.drain_left, len(self._scratch))])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        c.drain_left -= n
        if not n or c.drain_left <= 0:
            self._drop(c)

    def _drop(self, c: Client) -> None:
        if c.closed:
            return
        c.closed = True
        if c.events:
            self._sel.unregister(c.sock)
        c.sock.close()
        c.out.clear()
        c.chunks = []
        self._pending.pop(c, None)
        self._conns.discard(c)
        if c.slot:
            self._active -= 1
        self._buffered -= c.reserved
        self._received += c.reserved  # its payload is garbage now: due for the next trim

    def _interest(self, c: Client) -> None:
        if c.closed:
            return
        events = selectors.EVENT_WRITE if c.out else 0
        if c.state in EXPECT or c.state == CLOSING:
            events |= selectors.EVENT_READ
        if events == c.events:
            return
        if not c.events:
            self._sel.register(c.sock, events, c)
        elif not events:
            self._sel.unregister(c.sock)
        else:
            self._sel.modify(c.sock, events, c)
        c.events = events

    def _arm(self, c: Client) -> None:
        heapq.heappush(self._timers, (c.deadline, next(self._seq), c))

    def _expire(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            deadline, _, c = heapq.heappop(self._timers)
            if c.closed or deadline != c.deadline:
                continue
            if c.state == CLOSING:
                self._drop(c)
            else:
                self._fail(c, HandshakeTimeoutError(f"deadline passed while {STATE_NAMES[c.state]} ({c.peer})"))

    def _report(self, error: HandshakeError) -> None:
        if self._closed.is_set():
            return  # aborted by close(): not the peer's fault, not worth a warning
        if self._on_error is None:
            log.warning("metadata handshake failed: %s", error)
            return
        try:
            self._on_error(error)
        except Exception:
            log.exception("on_error callback raised")
