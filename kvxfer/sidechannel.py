"""TCP side channel that lets two workers swap agent metadata before any KV block moves.

Prefill and decode each hold an opaque metadata blob (DESIGN.md §2: agent name, generation,
backend connection blob, KV cache spec). Before either side can post a transfer it needs the
other's blob: decode needs prefill's to READ, prefill needs decode's to WRITE. One side runs a
:class:`MetadataServer`; the other calls :func:`exchange` (send ours, get theirs) or
:func:`fetch` (get theirs only). The server hands what clients sent to ``on_peer``.

Why stdlib sockets and blocking threads, not asyncio or pyzmq:

* No new dependency for a handful of messages per peer pair. pyzmq is a compiled wheel every
  connector would carry, and its REQ socket wedges after a lost reply unless it is recreated;
  plain TCP with a 12-byte header gives exact control over deadlines and size limits.
* Connectors call from engine threads and want a plain blocking call. asyncio would need a
  loop of its own in a thread, and clashes with an engine loop that is already running.
* One connection per peer pair, two round trips, a few KB to a few MB: a thread per
  connection (at most ``max_connections``) is cheap, and with a deadline on each connection a
  slow or hostile client only ever holds its own thread.

Wire format: each message is a 12-byte big-endian header ``magic(4) version(1) type(1)
reserved(2) length(4)`` and ``length`` payload bytes. The header is validated (magic, version,
known type, reserved == 0, length within the bound for that type) *before* the payload is read,
so a hostile length costs 12 bytes, not an allocation. Payloads are raw bytes and fixed-size
fields; nothing is pickled.

Conversation (client C, server S)::

    C -> S  HELLO           flags(1) client_nonce(32)       flags bit 0: C holds a token
    S -> C  CHALLENGE       server_nonce(32) [server_tag(32)]
    C -> S  EXCHANGE|FETCH  [client_tag(32)] metadata       FETCH carries no metadata
    S -> C  REPLY           [reply_tag(32)] metadata
    either  ERROR           code(1) utf-8 text              then the sender hangs up

With a shared token each tag is HMAC-SHA256(token, label, version, both nonces[, metadata]),
with fresh random nonces from both sides: the token never crosses the wire, a recorded
conversation cannot be replayed, the server proves itself before the client sends its metadata
and the client before the server sends its own, and the metadata cannot be altered in flight.
It is not encrypted: whoever can read the network can read the metadata, backend connection
blob included; keep the channel on a private network or in a tunnel where that matters. A
token on one side only, or two different tokens, gives :class:`HandshakeAuthError` on both
sides: whichever side detects it sends an ERROR frame to the other.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import ClassVar

from kvxfer.errors import HandshakeError

__all__ = [
    "MetadataServer", "exchange", "fetch", "encode_header", "decode_header",
    "DEFAULT_MAX_MESSAGE", "HandshakeError", "HandshakeTimeoutError", "HandshakeProtocolError",
    "MessageTooLargeError", "HandshakeAuthError", "PeerRejectedError", "ServerBusyError",
]

log = logging.getLogger(__name__)

MAGIC = b"KVXH"
VERSION = 1
HEADER = struct.Struct("!4sBBHI")
HEADER_SIZE = HEADER.size  # 12
NONCE_SIZE = 32
TAG_SIZE = 32  # HMAC-SHA256
DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024  # metadata is a few KB to a few MB
MAX_ERROR_TEXT = 1024

HELLO, CHALLENGE, EXCHANGE, FETCH, REPLY, ERROR = 1, 2, 3, 4, 5, 6  # message types
_TYPE_NAMES = {HELLO: "HELLO", CHALLENGE: "CHALLENGE", EXCHANGE: "EXCHANGE", FETCH: "FETCH",
               REPLY: "REPLY", ERROR: "ERROR"}
# Payload bounds of the fixed-size types; EXCHANGE and REPLY are bounded by max_message.
_FIXED_MAX = {HELLO: 1 + NONCE_SIZE, CHALLENGE: NONCE_SIZE + TAG_SIZE, FETCH: TAG_SIZE,
              ERROR: 1 + MAX_ERROR_TEXT}
_FLAG_AUTH = 0x01

Metadata = bytes | Callable[[], bytes]


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """The peer did not connect, send or read within the deadline."""
    code: ClassVar[int] = 1


class HandshakeProtocolError(HandshakeError):
    """The peer sent bytes that are not this protocol (bad magic, version, type or length)."""
    code: ClassVar[int] = 2


class MessageTooLargeError(HandshakeError):
    """A message exceeds ``max_message``; raise the limit on the side that rejected it."""
    code: ClassVar[int] = 3


class HandshakeAuthError(HandshakeError):
    """Token missing on one side, or the two sides hold different tokens."""
    code: ClassVar[int] = 4


class PeerRejectedError(HandshakeError):
    """The server's ``on_peer`` refused our metadata, or it could not produce its own."""
    code: ClassVar[int] = 5


class ServerBusyError(HandshakeError):
    """The server already serves ``max_connections`` clients; retry shortly."""
    code: ClassVar[int] = 6


_ERRORS_BY_CODE: dict[int, type[HandshakeError]] = {
    cls.code: cls
    for cls in (HandshakeTimeoutError, HandshakeProtocolError, MessageTooLargeError,
                HandshakeAuthError, PeerRejectedError, ServerBusyError)
}


# --------------------------------------------------------------------------- framing


def encode_header(msg_type: int, length: int) -> bytes:
    """Pack a frame header. Kept public so tests and other tools speak the same bytes."""
    return HEADER.pack(MAGIC, VERSION, msg_type, 0, length)


def decode_header(data: bytes, max_message: int = DEFAULT_MAX_MESSAGE) -> tuple[int, int]:
    """Validate a 12-byte header and return ``(type, length)``; raise on anything unexpected.

    Oversized lengths are rejected here, so the caller never allocates a hostile length.
    """
    if len(data) != HEADER_SIZE:
        raise HandshakeProtocolError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, msg_type, reserved, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise HandshakeProtocolError(
            f"bad magic {magic!r} (expected {MAGIC!r}): the peer is not a kvxfer metadata "
            "endpoint, or the port is wrong")
    if version != VERSION:
        raise HandshakeProtocolError(
            f"peer speaks handshake protocol version {version}, this kvxfer speaks {VERSION}; "
            "run the same kvxfer version on both sides")
    if msg_type not in _TYPE_NAMES:
        raise HandshakeProtocolError(f"unknown message type {msg_type}")
    if reserved != 0:
        raise HandshakeProtocolError(f"reserved header field is {reserved}, expected 0")
    if msg_type in _FIXED_MAX and length > _FIXED_MAX[msg_type]:
        raise HandshakeProtocolError(
            f"{_TYPE_NAMES[msg_type]} of {length} bytes is longer than that message allows")
    if msg_type not in _FIXED_MAX and length > TAG_SIZE + max_message:
        raise MessageTooLargeError(
            f"{_TYPE_NAMES[msg_type]} of {length} bytes exceeds max_message={max_message} "
            "(+32 for the tag); raise max_message on the receiving side if the metadata is "
            "legitimately this large")
    return msg_type, length


class _Conn:
    """One socket plus the absolute deadline every send and recv on it must meet."""

    def __init__(self, sock: socket.socket, deadline: float, peer: str, max_message: int):
        self.sock, self.deadline, self.peer, self.max_message = sock, deadline, peer, max_message

    def _remaining(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise HandshakeTimeoutError(f"deadline passed while {what} ({self.peer})")
        return left

    def recv_exact(self, n: int, what: str) -> bytes:
        # Chunks, not a buffer of the announced size: memory follows what the peer really sent.
        chunks: list[bytes] = []
        got = 0
        while got < n:
            self.sock.settimeout(self._remaining(what))
            try:
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except TimeoutError:
                raise HandshakeTimeoutError(
                    f"timed out while {what} ({self.peer}): got {got} of {n} bytes") from None
            except OSError as exc:
                raise HandshakeError(
                    f"connection to {self.peer} failed while {what}: {exc}") from exc
            if not chunk:
                raise HandshakeProtocolError(
                    f"{self.peer} closed the connection while {what} ({got} of {n} bytes)")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv_frame(self, expected: tuple[int, ...]) -> tuple[int, bytes]:
        """Read one frame; an ERROR frame from the peer is raised as the matching error."""
        names = "/".join(_TYPE_NAMES[t] for t in expected)
        header = self.recv_exact(HEADER_SIZE, f"reading the {names} header")
        try:
            msg_type, length = decode_header(header, self.max_message)
        except HandshakeError as exc:
            raise type(exc)(f"from {self.peer}: {exc}") from None
        if msg_type == ERROR:
            payload = self.recv_exact(length, "reading an ERROR message")
            raise _remote_error(payload, self.peer)
        if msg_type not in expected:
            raise HandshakeProtocolError(
                f"{self.peer} sent {_TYPE_NAMES[msg_type]} where {names} was expected")
        return msg_type, self.recv_exact(length, f"reading the {_TYPE_NAMES[msg_type]} payload")

    def send_frame(self, msg_type: int, *parts: bytes) -> None:
        length = sum(len(p) for p in parts)
        self.sock.settimeout(self._remaining(f"sending {_TYPE_NAMES[msg_type]}"))
        try:
            self.sock.sendall(b"".join((encode_header(msg_type, length), *parts)))
        except TimeoutError:
            raise HandshakeTimeoutError(
                f"timed out sending {_TYPE_NAMES[msg_type]} to {self.peer}") from None
        except OSError as exc:
            # The peer may have rejected us and closed; its ERROR frame says why, so prefer it.
            remote = self.peer_error()
            if remote is not None:
                raise remote from exc
            raise HandshakeError(
                f"connection to {self.peer} lost while sending {_TYPE_NAMES[msg_type]}: {exc}"
            ) from exc

    def peer_error(self) -> HandshakeError | None:
        """After a failed send, read the ERROR frame the peer may have left before closing."""
        try:
            header = self.recv_exact(HEADER_SIZE, "reading why the peer closed")
            msg_type, length = decode_header(header, self.max_message)
            if msg_type != ERROR:
                return None
            return _remote_error(self.recv_exact(length, "reading an ERROR message"), self.peer)
        except HandshakeError:
            return None

    def send_error(self, error: HandshakeError) -> None:
        """Best effort: tell the peer why we hang up, without waiting on a peer that won't read."""
        code = getattr(error, "code", 0)
        text = str(error).encode("utf-8", "replace")[:MAX_ERROR_TEXT]
        try:  # non-blocking: a ~1 KB frame fits the socket buffer, or the peer isn't reading
            self.sock.setblocking(False)
            self.sock.send(encode_header(ERROR, 1 + len(text)) + bytes([code]) + text)
        except OSError:
            pass

    def hang_up(self, linger: float = 0.2, limit: int = 1 << 20) -> None:
        """Close gently after an error: FIN, then discard what the peer still sends (bounded).

        Closing with unread bytes queued makes the kernel send a reset, which can destroy the
        ERROR frame before the peer reads it; a short, bounded drain avoids that.
        """
        end = time.monotonic() + linger
        try:
            self.sock.shutdown(socket.SHUT_WR)
            while limit > 0 and (left := end - time.monotonic()) > 0:
                self.sock.settimeout(left)
                chunk = self.sock.recv(min(limit, 1 << 16))
                if not chunk:
                    break
                limit -= len(chunk)
        except OSError:
            pass


def _remote_error(payload: bytes, peer: str) -> HandshakeError:
    """Turn a peer's ERROR frame into our exception; its text is untrusted, so sanitize it."""
    code = payload[0] if payload else 0
    text = payload[1:].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    cls = _ERRORS_BY_CODE.get(code, HandshakeError)
    return cls(f"{peer} refused the handshake: {text}")


def _key(token: str | bytes | None) -> bytes | None:
    if token is None:
        return None
    key = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not key:
        raise ValueError("an empty token authenticates nothing; pass None to disable auth")
    return key


def _tag(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC over a domain label and the transcript; parts are fixed-size except the last."""
    mac = hmac.new(key, label + bytes([VERSION]), hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def _as_bytes(metadata: object, what: str) -> bytes:
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(metadata).__name__}")
    return bytes(metadata)


def _check_size(data: bytes, limit: int, what: str = "our metadata") -> bytes:
    if len(data) > limit:
        raise MessageTooLargeError(
            f"{what} is {len(data)} bytes, over max_message={limit}; raise max_message on "
            "both sides")
    return data


# --------------------------------------------------------------------------- server


class MetadataServer:
    """Serve our metadata to every client that asks, and hand theirs to ``on_peer``.

    It listens as soon as it is constructed (so :attr:`address` is usable at once, with
    ``port=0`` picking a free port) and accepts in a daemon thread. Each client gets its own
    thread and its own ``timeout`` for the whole conversation, so a client that stalls or sends
    garbage is dropped without delaying anyone else; at most ``max_connections`` are served at
    once and the rest are told to retry (:class:`ServerBusyError`).

    ``metadata`` may be a callable, called once per client, for metadata that changes (a new
    generation after re-registration). ``on_peer`` runs in the connection's thread, possibly
    concurrently for several clients; pass ``queue.put`` to collect peers in a queue. If it
    raises, the client receives :class:`PeerRejectedError`. Failed handshakes are reported to
    ``on_error`` (default: a warning on the ``kvxfer.sidechannel`` logger); they never stop the
    server.
    """

    def __init__(
        self,
        metadata: Metadata,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | bytes | None = None,
        on_peer: Callable[[bytes], None] | None = None,
        on_error: Callable[[HandshakeError], None] | None = None,
        max_message: int = DEFAULT_MAX_MESSAGE,
        timeout: float = 10.0,
        max_connections: int = 64,
    ) -> None:
        if timeout <= 0 or max_message < 0 or max_connections < 1:
            raise ValueError("timeout and max_connections must be positive, max_message >= 0")
        self._metadata_fn: Callable[[], bytes] | None = None
        self._static: bytes | None = None
        if callable(metadata):
            self._metadata_fn = metadata
        else:
            self._static = _check_size(_as_bytes(metadata, "metadata"), max_message)
        self._key = _key(token)
        self._on_peer, self._on_error = on_peer, on_error
        self._max_message, self._timeout = max_message, timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._closed = threading.Event()
        try:
            family, _, _, _, addr = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            self._sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise HandshakeError(f"cannot listen on {host}:{port}: {exc}") from exc
        try:
            if os.name != "nt":  # on Windows SO_REUSEADDR would let others steal the port
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(addr)
            self._sock.listen(128)
        except OSError as exc:
            self._sock.close()
            raise HandshakeError(f"cannot listen on {host}:{port}: {exc}") from exc
        name = self._sock.getsockname()
        self._address = (str(name[0]), int(name[1]))
        self._sock.setblocking(False)
        # A socketpair wakes the accept loop on close(), portably and without polling.
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"kvxfer-handshake:{self.address[1]}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` actually bound; give it to the peers."""
        return self._address

    def close(self, grace: float = 1.0) -> None:
        """Stop accepting; give conversations in progress ``grace`` seconds, then abort them.

        The grace period matters because ``on_peer`` fires before the reply is sent: a caller
        that closes as soon as it has the peer's metadata must not cut that peer's reply off.
        Idempotent.
        """
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._wake_w.send(b"\0")
        self._thread.join()
        with self._lock:
            self._lock.wait_for(lambda: not self._conns, timeout=grace)
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for obj in (self._selector, self._sock, self._wake_r, self._wake_w):
            obj.close()

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed.is_set() else "open"
        host, port = self._address
        return f"MetadataServer({host}:{port}, {state}, auth={'on' if self._key else 'off'})"

    def _accept_loop(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    return
                try:
                    conn, addr = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:  # e.g. out of file descriptors: back off, keep serving
                    log.warning("metadata server failed to accept: %s", exc)
                    time.sleep(0.05)
                    continue
                self._start(conn, f"client {addr[0]}:{addr[1]}")

    def _start(self, conn: socket.socket, peer: str) -> None:
        """Hand the connection to a thread of its own, or turn it away if none may start."""
        if self._slots.acquire(blocking=False):
            with self._lock:
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn, peer),
                                 name=f"kvxfer-handshake {peer}", daemon=True).start()
                return
            except RuntimeError:  # the process cannot start more threads
                with self._lock:
                    self._conns.discard(conn)
                self._slots.release()
        err = ServerBusyError(f"server busy, {peer} turned away; retry shortly")
        _Conn(conn, 0.0, peer, 0).send_error(err)
        conn.close()
        self._report(err)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        c = _Conn(conn, time.monotonic() + self._timeout, peer, self._max_message)
        try:
            self._converse(c)
        except HandshakeError as exc:
            c.send_error(exc)
            c.hang_up()
            self._report(exc)
        except Exception as exc:  # a bug here must not kill the server silently
            err = HandshakeError(f"internal error while serving {peer}: {exc!r}")
            c.send_error(err)
            c.hang_up()
            self._report(err)
        finally:
            conn.close()
            self._slots.release()
            with self._lock:
                self._conns.discard(conn)
                self._lock.notify_all()

    def _converse(self, c: _Conn) -> None:
        _, hello = c.recv_frame((HELLO,))
        if len(hello) != 1 + NONCE_SIZE or hello[0] & ~_FLAG_AUTH:
            raise HandshakeProtocolError(f"malformed HELLO from {c.peer}")
        client_nonce, key = hello[1:], self._key
        if key is not None and not hello[0] & _FLAG_AUTH:
            raise HandshakeAuthError(
                f"{c.peer} sent no token but this server requires one; give both sides the "
                "same token")
        if key is None and hello[0] & _FLAG_AUTH:
            raise HandshakeAuthError(
                f"{c.peer} wants token authentication but this server has no token; give "
                "both sides the same token")
        server_nonce = secrets.token_bytes(NONCE_SIZE)
        proof = _tag(key, b"kvxfer-server", client_nonce, server_nonce) if key else b""
        c.send_frame(CHALLENGE, server_nonce, proof)

        msg_type, body = c.recv_frame((EXCHANGE, FETCH))
        tag_len = TAG_SIZE if key else 0
        if len(body) < tag_len or (msg_type == FETCH and len(body) != tag_len):
            raise HandshakeProtocolError(f"malformed {_TYPE_NAMES[msg_type]} from {c.peer}")
        tag, theirs = body[:tag_len], body[tag_len:]
        if key is not None and not hmac.compare_digest(
                tag, _tag(key, b"kvxfer-client", bytes([msg_type]), client_nonce,
                          server_nonce, theirs)):
            raise HandshakeAuthError(
                f"{c.peer} failed to prove it holds our token: the two sides hold different "
                "tokens")
        _check_size(theirs, self._max_message, f"metadata from {c.peer}")
        if msg_type == EXCHANGE and self._on_peer is not None:
            try:
                self._on_peer(theirs)
            except Exception as exc:
                raise PeerRejectedError(
                    f"server's on_peer rejected the metadata from {c.peer}: {exc}") from exc
        ours = self._current_metadata()
        reply_tag = _tag(key, b"kvxfer-reply", client_nonce, server_nonce, ours) if key else b""
        c.send_frame(REPLY, reply_tag, ours)

    def _current_metadata(self) -> bytes:
        if self._static is not None:
            return self._static
        assert self._metadata_fn is not None
        try:
            value = _as_bytes(self._metadata_fn(), "the metadata callable's result")
        except Exception as exc:
            raise PeerRejectedError(f"server could not produce its metadata: {exc!r}") from exc
        return _check_size(value, self._max_message)

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


# --------------------------------------------------------------------------- client


def exchange(
    host: str,
    port: int,
    metadata: bytes,
    *,
    token: str | bytes | None = None,
    timeout: float = 5.0,
    max_message: int = DEFAULT_MAX_MESSAGE,
) -> bytes:
    """Send our metadata to the server at ``host:port`` and return the server's.

    ``timeout`` bounds the whole call, connect included. Every failure is a
    :class:`~kvxfer.errors.HandshakeError` (a subclass saying which kind).
    """
    return _request(host, port, EXCHANGE, _as_bytes(metadata, "metadata"), token, timeout,
                    max_message)


def fetch(
    host: str,
    port: int,
    *,
    token: str | bytes | None = None,
    timeout: float = 5.0,
    max_message: int = DEFAULT_MAX_MESSAGE,
) -> bytes:
    """Return the server's metadata without sending ours (a READ-only decode side needs no more)."""
    return _request(host, port, FETCH, b"", token, timeout, max_message)


def _request(host: str, port: int, msg_type: int, ours: bytes, token: str | bytes | None,
             timeout: float, max_message: int) -> bytes:
    key = _key(token)
    _check_size(ours, max_message)
    deadline = time.monotonic() + timeout
    peer = f"server {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=max(timeout, 1e-3))
    except TimeoutError:
        raise HandshakeTimeoutError(f"could not connect to {peer} within {timeout}s") from None
    except OSError as exc:
        raise HandshakeError(
            f"could not connect to {peer}: {exc}; is its MetadataServer running?") from exc
    with sock:
        c = _Conn(sock, deadline, peer, max_message)
        try:
            return _client_converse(c, msg_type, ours, key)
        except HandshakeError as exc:
            c.send_error(exc)  # so the server's log says why we hung up
            raise


def _client_converse(c: _Conn, msg_type: int, ours: bytes, key: bytes | None) -> bytes:
    client_nonce = secrets.token_bytes(NONCE_SIZE)
    c.send_frame(HELLO, bytes([_FLAG_AUTH if key else 0]), client_nonce)
    _, challenge = c.recv_frame((CHALLENGE,))
    if len(challenge) != NONCE_SIZE + (TAG_SIZE if key else 0):
        raise HandshakeProtocolError(f"malformed CHALLENGE from {c.peer}")
    server_nonce, proof = challenge[:NONCE_SIZE], challenge[NONCE_SIZE:]
    if key is not None and not hmac.compare_digest(
            proof, _tag(key, b"kvxfer-server", client_nonce, server_nonce)):
        raise HandshakeAuthError(
            f"{c.peer} failed to prove it holds our token: the two sides hold different tokens")
    tag = (_tag(key, b"kvxfer-client", bytes([msg_type]), client_nonce, server_nonce, ours)
           if key else b"")
    c.send_frame(msg_type, tag, ours)

    _, reply = c.recv_frame((REPLY,))
    tag_len = TAG_SIZE if key else 0
    if len(reply) < tag_len:
        raise HandshakeProtocolError(f"malformed REPLY from {c.peer}")
    tag, theirs = reply[:tag_len], reply[tag_len:]
    if key is not None and not hmac.compare_digest(
            tag, _tag(key, b"kvxfer-reply", client_nonce, server_nonce, theirs)):
        raise HandshakeAuthError(f"REPLY from {c.peer} fails authentication (altered in flight?)")
    return _check_size(theirs, c.max_message, f"metadata from {c.peer}")
