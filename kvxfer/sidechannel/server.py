"""Side-channel server: who may do what, when (HELLO, AUTH, then the metadata), and the callbacks.

The sockets, framing, deadlines and bounds are :class:`~.loop.ConnectionLoop`'s; this module
is the protocol on top of it. User callbacks (``on_peer``, a metadata callable) run one at a
time in a separate thread, so a slow callback delays other replies but never the loop that
authenticates newcomers.
"""

from __future__ import annotations

import collections
import queue
import secrets
import threading
from collections.abc import Callable

from kvxfer.deadlines import check_timeout
from kvxfer.errors import HandshakeError

from . import auth
from .frames import (
    AUTH, CHALLENGE, DEFAULT_MAX_MESSAGE, EXCHANGE, FETCH, FLAG_AUTH, HELLO, NONCE_SIZE, READY, REPLY, TAG_SIZE,
    TYPE_NAMES, HandshakeAuthError, HandshakeProtocolError, PeerRejectedError, as_bytes, check_size,
    encode_header,
)
from .loop import ConnectionLoop
from .sockets import AUTH_WAIT, CALLBACK, DATA_WAIT, REPLYING, Client, listen

__all__ = ["MetadataServer", "Metadata"]

Metadata = bytes | Callable[[], bytes]


class MetadataServer(ConnectionLoop):
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
        key = auth.require_key(token)
        timeout = check_timeout(timeout)
        if max_message < 0 or max_connections < 1 or max_pending < 1:
            raise ValueError("max_connections and max_pending must be positive, max_message >= 0")
        if max_buffered is None:
            max_buffered = 4 * (max_message + TAG_SIZE)
        if max_buffered < max_message + TAG_SIZE:
            raise ValueError("max_buffered must hold at least one message (max_message + 32 bytes)")
        self._metadata_fn: Callable[[], bytes] | None = None
        self._static: bytes | None = None
        if callable(metadata):
            self._metadata_fn = metadata
        else:
            self._static = check_size(as_bytes(metadata, "metadata"), max_message)
        self._key, self._on_peer = key, on_peer
        listener = listen(host, port)
        name = listener.getsockname()
        self._address = (str(name[0]), int(name[1]))
        super().__init__(listener, timeout=timeout, max_message=max_message, max_connections=max_connections,
                         max_pending=max_pending, max_buffered=max_buffered, on_error=on_error)
        self._jobs: queue.SimpleQueue[tuple[Client, int, bytes] | None] = queue.SimpleQueue()
        self._results: collections.deque[tuple[Client, bytes | HandshakeError]] = collections.deque()
        self._callbacks = threading.Thread(target=self._callback_loop,
                                           name=f"kvxfer-sidechannel-cb:{self._address[1]}", daemon=True)
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

    # -- the protocol ----------------------------------------------------------------------
    def _deliver(self) -> None:
        """Send the replies the callback thread produced (called by the loop when woken)."""
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
            self._take_slot(c)
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
