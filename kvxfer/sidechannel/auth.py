"""Side-channel authentication: nonces, HMAC proofs, and errors that say which check failed.

Conversation (client C, server S); ``[..]`` is present only with a token::

    C -> S  HELLO           flags(1) client_nonce(32)            flags bit 0: C holds a token
    S -> C  CHALLENGE       client_nonce(32) server_nonce(32) [server_proof(32)]
    C -> S  AUTH            server_nonce(32) [client_proof(32)]
    S -> C  READY                                                 C now holds a server slot
    C -> S  EXCHANGE|FETCH  [data_tag(32)] metadata               FETCH carries no metadata
    S -> C  REPLY           [reply_tag(32)] metadata
    either  ERROR           code(1) utf-8 text                    then the sender hangs up

Each proof and tag is HMAC-SHA256 keyed by the token over a label, the protocol version,
both fresh random nonces and, for tags, the message type and metadata. The token never
crosses the wire. The server proves itself before the client sends anything that depends on
the token, and the client proves itself *before* the server accepts a payload, buffers more
than a few dozen bytes for it, or gives it one of its ``max_connections`` slots: a client
without the token costs the server one socket and about a hundred bytes, for a short time.

Each side echoes the other's nonce. A mismatched echo means the message answers a
conversation this side never had (a recording played back, or two conversations spliced):
that is :class:`HandshakeReplayError`, distinct from a wrong token, which can only show up
as a proof that fails over the right nonces. The channel authenticates, it does not encrypt.
"""

from __future__ import annotations

import hmac

from kvxfer.tokens import NO_AUTH, mac, token_key

from .frames import HandshakeAuthError, HandshakeReplayError, TokenRequiredError

__all__ = ["require_key", "server_proof", "client_proof", "data_tag", "reply_tag", "check_echo",
           "check_tag"]


def require_key(token: object) -> bytes | None:
    """Key for the side channel: a token is required, ``NO_AUTH`` is the explicit opt-out."""
    if token is None:
        raise TokenRequiredError(
            "the metadata side channel needs the shared token (token=...); pass "
            "token=kvxfer.sidechannel.NO_AUTH to run without authentication, which lets anyone "
            "who can reach the port read and feed agent metadata (see README, Side channel)")
    if token is NO_AUTH:
        return None
    return token_key(token)


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return mac(key, "side-server", client_nonce, server_nonce)


def client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return mac(key, "side-client", client_nonce, server_nonce)


def data_tag(key: bytes, msg_type: int, client_nonce: bytes, server_nonce: bytes, data: bytes) -> bytes:
    return mac(key, "side-data", bytes([msg_type]), client_nonce, server_nonce, data)


def reply_tag(key: bytes, client_nonce: bytes, server_nonce: bytes, data: bytes) -> bytes:
    return mac(key, "side-reply", client_nonce, server_nonce, data)


def check_echo(echo: bytes, ours: bytes, what: str) -> None:
    """The peer must echo the nonce we sent in *this* conversation."""
    if not hmac.compare_digest(echo, ours):
        raise HandshakeReplayError(
            f"{what} answers a challenge this side never sent in this conversation: a replayed "
            "recording or a spliced conversation, not a token mismatch")


def check_tag(got: bytes, want: bytes, message: str) -> None:
    if not hmac.compare_digest(got, want):
        raise HandshakeAuthError(message)
