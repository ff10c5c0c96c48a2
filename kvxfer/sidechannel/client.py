"""Side-channel client: :func:`exchange` and :func:`fetch`, plain blocking calls.

Connectors call from engine threads and want one blocking call with one deadline, so the
client is a straight-line conversation over a blocking socket (see :mod:`.auth` for the
messages); the server is the side that must juggle many clients.
"""

from __future__ import annotations

import secrets
import socket
import time

from kvxfer.deadlines import Deadline, check_timeout
from kvxfer.errors import HandshakeError

from . import auth
from .frames import (
    AUTH, CHALLENGE, DEFAULT_MAX_MESSAGE, ERROR, EXCHANGE, FETCH, FLAG_AUTH, HEADER_SIZE, HELLO,
    NONCE_SIZE, READY, REPLY, TAG_SIZE, TYPE_NAMES, HandshakeProtocolError, HandshakeTimeoutError,
    as_bytes, check_size, decode_header, encode_header, error_frame, remote_error,
)

__all__ = ["exchange", "fetch"]


def exchange(host: str, port: int, metadata: bytes, *, token: object = None, timeout: float = 5.0,
             max_message: int = DEFAULT_MAX_MESSAGE) -> bytes:
    """Send our metadata to the server at ``host:port`` and return the server's.

    ``token`` is the shared secret (``NO_AUTH`` to opt out); ``timeout`` bounds the whole
    call, connect included. Every failure is a :class:`~kvxfer.errors.HandshakeError`.
    """
    return _request(host, port, EXCHANGE, as_bytes(metadata, "metadata"), token, timeout, max_message)


def fetch(host: str, port: int, *, token: object = None, timeout: float = 5.0,
          max_message: int = DEFAULT_MAX_MESSAGE) -> bytes:
    """Return the server's metadata without sending ours (a READ-only decode side needs no more)."""
    return _request(host, port, FETCH, b"", token, timeout, max_message)


class _Conn:
    """One blocking socket plus the absolute deadline every send and recv on it must meet."""

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
                raise HandshakeTimeoutError(f"timed out while {what} ({self.peer}): got {got} of {n} bytes") from None
            except OSError as exc:
                raise HandshakeError(f"connection to {self.peer} failed while {what}: {exc}") from exc
            if not chunk:
                raise HandshakeProtocolError(f"{self.peer} closed the connection while {what} ({got} of {n} bytes)")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv_frame(self, expected: int) -> bytes:
        """Read one frame of the expected type; an ERROR frame is raised as the matching error."""
        name = TYPE_NAMES[expected]
        header = self.recv_exact(HEADER_SIZE, f"reading the {name} header")
        try:
            msg_type, length = decode_header(header, self.max_message)
        except HandshakeError as exc:
            raise type(exc)(f"from {self.peer}: {exc}") from None
        if msg_type == ERROR:
            raise remote_error(self.recv_exact(length, "reading an ERROR message"), self.peer)
        if msg_type != expected:
            raise HandshakeProtocolError(f"{self.peer} sent {TYPE_NAMES[msg_type]} where {name} was expected")
        return self.recv_exact(length, f"reading the {name} payload")

    def send_frame(self, msg_type: int, *parts: bytes) -> None:
        length = sum(len(p) for p in parts)
        self.sock.settimeout(self._remaining(f"sending {TYPE_NAMES[msg_type]}"))
        try:
            self.sock.sendall(b"".join((encode_header(msg_type, length), *parts)))
        except TimeoutError:
            raise HandshakeTimeoutError(f"timed out sending {TYPE_NAMES[msg_type]} to {self.peer}") from None
        except OSError as exc:
            # The peer may have rejected us and closed; its ERROR frame says why, so prefer it.
            remote = self._peer_error()
            if remote is not None:
                raise remote from exc
            raise HandshakeError(
                f"connection to {self.peer} lost while sending {TYPE_NAMES[msg_type]}: {exc}") from exc

    def _peer_error(self) -> HandshakeError | None:
        try:
            header = self.recv_exact(HEADER_SIZE, "reading why the peer closed")
            msg_type, length = decode_header(header, self.max_message)
            if msg_type != ERROR:
                return None
            return remote_error(self.recv_exact(length, "reading an ERROR message"), self.peer)
        except HandshakeError:
            return None

    def send_error(self, error: HandshakeError) -> None:
        """Best effort, non-blocking: tell the server why we hang up."""
        try:
            self.sock.setblocking(False)
            self.sock.send(error_frame(error))
        except OSError:
            pass


def _request(host: str, port: int, msg_type: int, ours: bytes, token: object, timeout: float,
             max_message: int) -> bytes:
    key = auth.require_key(token)
    timeout = check_timeout(timeout)
    check_size(ours, max_message)
    deadline = Deadline.within(timeout)
    peer = f"server {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise HandshakeTimeoutError(f"could not connect to {peer} within {timeout}s") from None
    except OSError as exc:
        raise HandshakeError(f"could not connect to {peer}: {exc}; is its MetadataServer running?") from exc
    with sock:
        c = _Conn(sock, deadline, peer, max_message)
        try:
            return _converse(c, msg_type, ours, key)
        except HandshakeError as exc:
            c.send_error(exc)  # so the server's log says why we hung up
            raise


def _converse(c: _Conn, msg_type: int, ours: bytes, key: bytes | None) -> bytes:
    cn = secrets.token_bytes(NONCE_SIZE)
    c.send_frame(HELLO, bytes([FLAG_AUTH if key else 0]), cn)
    challenge = c.recv_frame(CHALLENGE)
    if len(challenge) != 2 * NONCE_SIZE + (TAG_SIZE if key else 0):
        raise HandshakeProtocolError(f"malformed CHALLENGE from {c.peer} ({len(challenge)} bytes)")
    auth.check_echo(challenge[:NONCE_SIZE], cn, f"CHALLENGE from {c.peer}")
    sn, proof = challenge[NONCE_SIZE:2 * NONCE_SIZE], challenge[2 * NONCE_SIZE:]
    if key is not None:
        auth.check_tag(proof, auth.server_proof(key, cn, sn),
                       f"{c.peer} failed to prove it holds our token: the two sides hold different tokens")
    c.send_frame(AUTH, sn, auth.client_proof(key, cn, sn) if key else b"")
    if c.recv_frame(READY):
        raise HandshakeProtocolError(f"malformed READY from {c.peer}")
    c.send_frame(msg_type, auth.data_tag(key, msg_type, cn, sn, ours) if key else b"", ours)

    reply = c.recv_frame(REPLY)
    tag_len = TAG_SIZE if key else 0
    if len(reply) < tag_len:
        raise HandshakeProtocolError(f"malformed REPLY from {c.peer}")
    tag, theirs = reply[:tag_len], reply[tag_len:]
    if key is not None:
        auth.check_tag(tag, auth.reply_tag(key, cn, sn, theirs),
                       f"REPLY from {c.peer} fails authentication (altered in flight?)")
    return check_size(theirs, c.max_message, f"metadata from {c.peer}")
