"""TCP side channel that lets two workers swap agent metadata before any KV block moves.

Prefill and decode each hold a metadata blob (agent name, generation, backend connection
blob, KV cache spec; see :mod:`kvxfer.metadata`). Before either side can post a transfer it
needs the other's: decode needs prefill's to READ, prefill needs decode's to WRITE. One side
runs a :class:`MetadataServer`; the other calls :func:`exchange` (send ours, get theirs) or
:func:`fetch` (get theirs only). The server hands what clients sent to ``on_peer``.

A token is required on both sides: the shared secret, or :data:`NO_AUTH` to opt out
explicitly (README, "Side channel", says what that exposes). The modules:

* :mod:`.frames`: the 12-byte header, message types and the errors carried on the wire;
* :mod:`.auth`: the conversation, nonces and HMAC proofs (authenticate, then talk);
* :mod:`.loop`: one event loop for all sockets; a slot only after authentication;
* :mod:`.server`: the protocol on that loop (HELLO, AUTH, metadata) and the callback thread;
* :mod:`.client`: blocking :func:`exchange` / :func:`fetch` with one deadline.

Why stdlib sockets, not asyncio or pyzmq: no new dependency for a handful of messages per
peer pair, exact control over deadlines and sizes, and a plain blocking call for connectors
that run in engine threads (asyncio would clash with an engine loop already running).
"""

from kvxfer.errors import HandshakeError
from kvxfer.tokens import NO_AUTH

from .client import exchange, fetch
from .frames import (
    DEFAULT_MAX_MESSAGE, HEADER_SIZE, MAGIC, VERSION, HandshakeAuthError, HandshakeProtocolError,
    HandshakeReplayError, HandshakeTimeoutError, MessageTooLargeError, PeerRejectedError, ServerBusyError,
    TokenRequiredError, decode_header, encode_header,
)
from .server import Metadata, MetadataServer

__all__ = [
    "MetadataServer", "Metadata", "exchange", "fetch", "NO_AUTH", "encode_header", "decode_header",
    "DEFAULT_MAX_MESSAGE", "HEADER_SIZE", "MAGIC", "VERSION", "HandshakeError", "HandshakeTimeoutError",
    "HandshakeProtocolError", "MessageTooLargeError", "HandshakeAuthError", "HandshakeReplayError",
    "TokenRequiredError", "PeerRejectedError", "ServerBusyError",
]
