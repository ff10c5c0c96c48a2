"""Side-channel server: one event-loop thread for every socket, a slot only after authentication.

Why an event loop and not a thread per connection: a thread per accepted socket, holding a
connection slot until its deadline, let 64 clients that connect and say nothing deny the
service to everyone, token or not, and every such thread kept its own allocator arena. Here
a connection that has not proven the token is a socket and a few dozen bytes of state in one
selector; when too many pile up the oldest is dropped, so a legitimate client (which proves
itself within one round trip) is never queued behind them. Only an authenticated client gets
one of ``max_connections`` slots and may send a payload, whose bytes are reserved against
``max_buffered`` before they are read and arrive in bounded chunks.

User callbacks (``on_peer``, a metadata callable) run one at a time in a separate thread,
so a slow callback delays other replies but never the loop that authenticates newcomers.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

from kvxfer.deadlines import check_timeout
from kvxfer.errors import HandshakeError

from . import auth
from .frames import (
    AUTH, CHALLENGE, DEFAULT_MAX_MESSAGE, ERROR, EXCHANGE, FETCH, FLAG_AUTH, HEADER_SIZE, HELLO, NONCE_SIZE,
    READY, REPLY, TAG_SIZE, TYPE_NAMES, HandshakeAuthError, HandshakeProtocolError, HandshakeTimeoutError,
    PeerRejectedError, ServerBusyError, as_bytes, check_size, decode_header, encode_header, error_frame,
    remote_error,
)
from .sockets import (
    AUTH_WAIT, CALLBACK, CHUNK, CLOSING, DATA_WAIT, EXPECT, LINGER, REPLYING, STATE_NAMES, TRIM_AFTER,
    Client, listen, return_free_memory,
)

__all__ = ["MetadataServer", "Metadata"]

log = logging.getLogger("kvxfer.sidechannel")

Metadata = bytes | Callable[[], bytes]

class MetadataServer:
    """Serve our metadata to every client that proves the token, and hand theirs to ``on_peer``.

    It listens as soon as it is constructed (so :attr:`address` is usable at once, with
    ``port=0`` picking a free port). ``token`` is required: the shared secret, or
    ``NO_AUTH`` to opt out explicitly. Each client has ``timeout`` seconds for the whole
    conversation. At most ``max_connections`` authenticated clients are served at once (the
    rest get :class:`ServerBusyError`, retryable); at most ``max_pending`` unauthenticated
    sockets are kept (the oldest is dropped for a newcomer); payloads in progress may
    reserve at most ``max_buffered`` bytes in total (default four ``max_message``).

    ``metadata`` may be a callable, called once per client, for metadata that changes (a new
    generation after re-registration). ``on_peer`` and the callable run in the server's
    callback thread, one call at a time; pass ``queue.put`` to collect peers in a queue. If
    ``on_peer`` raises, the client receives :class:`PeerRejectedError`. Failed handshakes go
    to ``on_error`` (default: a warning on the ``kvxfer.sidechannel`` logger); they never
    stop the server.
    """

    def __init__(self, metadata: Metadata, host: str = "127.0.0.1", port: int = 0, *, token: object = None,
                 on_peer: Callable[[bytes], None] | None = None,
                 on_error: Callable[[HandshakeError], None] | None = None, max_message: int = DEFAULT_MAX_MESSAGE,
                 timeout: float = 10.0, max_connections: int = 64, max_pending: int = 256,
                 max_buffered: int | None = None) -> None:
        self._key = auth.require_key(token)
        self._timeout = check_timeout(timeout)
        if max_message < 0 or max_connections < 1 or max_pending < 1:
            raise ValueError("max_connections and max_pending must be positive, max_message >= 0")
        self._max_message, self._max_connections, self._max_pending = max_message, max_connections, max_pending
        self._max_buffered = 4 * (max_message + TAG_SIZE) if max_buffered is None else max_buffered
        if self._max_buffered < max_message + TAG_SIZE:
            raise ValueError("max_buffered must hold at least one message (max_message + 32 bytes)")
        self._metadata_fn: Callable[[], bytes] | None = None
        self._static: bytes | None = None
        if callable(metadata):
            self._metadata_fn = metadata
        else:
            self._static = check_size(as_bytes(metadata, "metadata"), max_message)
        self._on_peer, self._on_error = on_peer, on_error
        self._listener = listen(host, port)
        name = self._listener.getsockname()
        self._address = (str(name[0]), int(name[1]))
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
        self._jobs: queue.SimpleQueue[tuple[Client, int, bytes] | None] = queue.SimpleQueue()
        self._results: collections.deque[tuple[Client, bytes | HandshakeError]] = collections.deque()
        self._closed = threading.Event()
        self._stopping = False
        self._grace_end = 0.0
        self._grace = 1.0
        port_ = self._address[1]
        self._callbacks = threading.Thread(target=self._callback_loop, name=f"kvxfer-sidechannel-cb:{port_}",
                                           daemon=True)
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-sidechannel:{port_}", daemon=True)
        self._callbacks.start()
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` actually bound; give it to the peers."""
        return self._address

    def close(self, grace: float = 1.0) -> None:
        """Stop accepting; give authenticated conversations ``grace`` seconds, then abort them.

        The grace period matters because ``on_peer`` fires before the reply is sent: a caller
        that closes as soon as it has the peer's metadata must not cut that peer's reply off.
        Idempotent.
        """
        if self._closed.is_set():
            return
        self._grace = max(0.0, float(grace)) if grace == grace else 0.0
        self._closed.set()
        self._wake()
        me = threading.current_thread()  # close() may be called from on_peer or on_error
        if me is not self._thread:
            self._thread.join()
        self._jobs.put(None)
        if me is not self._callbacks:
            self._callbacks.join(timeout=self._grace)

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed.is_set() else "open"
        host, port = self._address
        return f"MetadataServer({host}:{port}, {state}, auth={'on' if self._key else 'off'})"

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
        while self._results:
            c, result = self._results.popleft()
            if c.closed or c.state != CALLBACK:  # timed out meanwhile: it already has its ERROR
                continue
            if isinstance(result, HandshakeError):
                self._fail(c, result)
                continue
            tag = auth.reply_tag(self._key, c.cn, c.sn, result) if self._key else b""
            c.state = REPLYING
            self._send(c, encode_header(REPLY, len(tag) + len(result)) + tag, result)
        if self._closed.is_set() and not self._stopping:
            self._stopping = True
            self._grace_end = time.monotonic() + self._grace
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
            c = Client(sock, f"client {addr[0]}:{addr[1]}", time.monotonic() + self._timeout)
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

    def _handle(self, c: Client, msg_type: int, body: bytes) -> None:
        key = self._key
        if msg_type == HELLO:
            if len(body) != 1 + NONCE_SIZE or body[0] & ~FLAG_AUTH:
                raise HandshakeProtocolError(f"malformed HELLO from {c.peer}")
            if key is not None and not body[0] & FLAG_AUTH:
                raise HandshakeAuthError(f"{c.peer} sent no token but this server requires one; give both "
                                         "sides the same token")
            if key is None and body[0] & FLAG_AUTH:
                raise HandshakeAuthError(f"{c.peer} wants token authentication but this server runs with "
                                         "NO_AUTH; give both sides the same token")
            c.cn, c.sn = body[1:], secrets.token_bytes(NONCE_SIZE)
            proof = auth.server_proof(key, c.cn, c.sn) if key else b""
            c.state = AUTH_WAIT
            self._send(c, encode_header(CHALLENGE, 2 * NONCE_SIZE + len(proof)) + c.cn + c.sn + proof)
        elif msg_type == AUTH:
            if len(body) != NONCE_SIZE + (TAG_SIZE if key else 0):
                raise HandshakeProtocolError(f"malformed AUTH from {c.peer}")
            auth.check_echo(body[:NONCE_SIZE], c.sn, f"AUTH from {c.peer}")
            if key is not None:
                auth.check_tag(body[NONCE_SIZE:], auth.client_proof(key, c.cn, c.sn),
                               f"{c.peer} failed to prove it holds our token: the two sides hold different tokens")
            self._pending.pop(c, None)
            if self._active >= self._max_connections or self._stopping:
                raise ServerBusyError(f"server busy ({self._active} clients in progress), {c.peer} turned "
                                      "away; retry shortly")
            self._active += 1
            c.slot = True
            c.state = DATA_WAIT
            self._send(c, encode_header(READY, 0))

    def _on_data(self, c: Client, msg_type: int, chunks: list[bytes]) -> None:
        """EXCHANGE or FETCH: check the tag, then queue the callback (one copy of the metadata)."""
        key = self._key
        tag_len = TAG_SIZE if key else 0
        size = sum(map(len, chunks))
        if size < tag_len or (msg_type == FETCH and size != tag_len):
            raise HandshakeProtocolError(f"malformed {TYPE_NAMES[msg_type]} from {c.peer}")
        if chunks and len(chunks[0]) < tag_len:  # the tag arrived in pieces
            chunks = [b"".join(chunks)]
        tag = chunks[0][:tag_len] if tag_len else b""
        if tag_len:
            chunks[0] = chunks[0][tag_len:]
        theirs = b"".join(chunks)
        chunks.clear()
        if key is not None:
            auth.check_tag(tag, auth.data_tag(key, msg_type, c.cn, c.sn, theirs),
                           f"{TYPE_NAMES[msg_type]} from {c.peer} fails authentication (altered in flight?)")
        check_size(theirs, self._max_message, f"metadata from {c.peer}")
        c.state = CALLBACK
        self._interest(c)
        self._jobs.put((c, msg_type, theirs))

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
        c.deadline = time.monotonic() + LINGER
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

    # -- callbacks ---------------------------------------------------------------------------
    def _callback_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            c, msg_type, theirs = job
            if c.closed:  # timed out while queued: the client has gone, do not act on its metadata
                continue
            result: bytes | HandshakeError
            try:
                if msg_type == EXCHANGE and self._on_peer is not None:
                    try:
                        self._on_peer(theirs)
                    except Exception as exc:
                        raise PeerRejectedError(f"server's on_peer rejected the metadata from {c.peer}: {exc}") from exc
                result = self._current_metadata()
            except HandshakeError as exc:
                result = exc
            except Exception as exc:
                result = HandshakeError(f"internal error while serving {c.peer}: {exc!r}")
            del job, theirs  # before waiting for the next job: the loop trims freed memory at the end
            self._results.append((c, result))
            self._wake()

    def _current_metadata(self) -> bytes:
        if self._static is not None:
            return self._static
        assert self._metadata_fn is not None
        try:
            value = as_bytes(self._metadata_fn(), "the metadata callable's result")
        except Exception as exc:
            raise PeerRejectedError(f"server could not produce its metadata: {exc!r}") from exc
        return check_size(value, self._max_message)
