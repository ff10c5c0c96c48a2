"""Side-channel framing: the 12-byte header, the message types, and the errors on the wire.

Every message is ``magic(4) version(1) type(1) reserved(2) length(4)`` (big-endian) and
``length`` payload bytes. The header is validated (magic, version, known type, reserved == 0,
length within the bound for that type) *before* any payload is read, so a hostile length
costs 12 bytes, never an allocation. Payloads are raw bytes and fixed-size fields; nothing
is pickled. Both the server's event loop and the blocking client use these functions.
"""

from __future__ import annotations

import struct
from typing import ClassVar

from kvxfer.errors import HandshakeError
from kvxfer.tokens import TAG_SIZE

__all__ = [
    "MAGIC", "VERSION", "HEADER_SIZE", "NONCE_SIZE", "TAG_SIZE", "DEFAULT_MAX_MESSAGE",
    "HELLO", "CHALLENGE", "EXCHANGE", "FETCH", "REPLY", "ERROR", "AUTH", "READY", "TYPE_NAMES",
    "encode_header", "decode_header", "error_frame", "remote_error", "check_size", "as_bytes",
    "HandshakeTimeoutError", "HandshakeProtocolError", "MessageTooLargeError", "HandshakeAuthError",
    "HandshakeReplayError", "TokenRequiredError", "PeerRejectedError", "ServerBusyError",
]

MAGIC = b"KVXH"
VERSION = 2  # 2: authentication (AUTH/READY) before any payload is accepted
HEADER = struct.Struct("!4sBBHI")
HEADER_SIZE = HEADER.size  # 12
NONCE_SIZE = 32
DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024  # metadata is a few KB to a few MB
MAX_ERROR_TEXT = 1024

HELLO, CHALLENGE, EXCHANGE, FETCH, REPLY, ERROR, AUTH, READY = 1, 2, 3, 4, 5, 6, 7, 8
TYPE_NAMES = {HELLO: "HELLO", CHALLENGE: "CHALLENGE", EXCHANGE: "EXCHANGE", FETCH: "FETCH",
              REPLY: "REPLY", ERROR: "ERROR", AUTH: "AUTH", READY: "READY"}
# Payload bounds of the fixed-size types; EXCHANGE and REPLY are bounded by max_message.
FIXED_MAX = {HELLO: 1 + NONCE_SIZE, CHALLENGE: 2 * NONCE_SIZE + TAG_SIZE, AUTH: NONCE_SIZE + TAG_SIZE,
             READY: 0, FETCH: TAG_SIZE, ERROR: 1 + MAX_ERROR_TEXT}
FLAG_AUTH = 0x01


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
    """The server is at its connection or buffering limit; retry shortly."""
    code: ClassVar[int] = 6


class HandshakeReplayError(HandshakeAuthError):
    """A message answers a challenge this side never sent: a replayed or spliced conversation."""
    code: ClassVar[int] = 7


class TokenRequiredError(HandshakeAuthError, ValueError):
    """No token given. Pass the shared token, or ``token=NO_AUTH`` to opt out explicitly."""
    code: ClassVar[int] = 4


_ERRORS_BY_CODE: dict[int, type[HandshakeError]] = {
    cls.code: cls
    for cls in (HandshakeTimeoutError, HandshakeProtocolError, MessageTooLargeError,
                HandshakeAuthError, PeerRejectedError, ServerBusyError, HandshakeReplayError)
}


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
    if msg_type not in TYPE_NAMES:
        raise HandshakeProtocolError(f"unknown message type {msg_type}")
    if reserved != 0:
        raise HandshakeProtocolError(f"reserved header field is {reserved}, expected 0")
    if msg_type in FIXED_MAX and length > FIXED_MAX[msg_type]:
        raise HandshakeProtocolError(
            f"{TYPE_NAMES[msg_type]} of {length} bytes is longer than that message allows")
    if msg_type not in FIXED_MAX and length > TAG_SIZE + max_message:
        raise MessageTooLargeError(
            f"{TYPE_NAMES[msg_type]} of {length} bytes exceeds max_message={max_message} "
            "(+32 for the tag); raise max_message on the receiving side if the metadata is "
            "legitimately this large")
    return msg_type, length


def error_frame(error: HandshakeError) -> bytes:
    """The ERROR frame telling the peer why we hang up (its text bounded)."""
    code = getattr(error, "code", 0)
    text = str(error).encode("utf-8", "replace")[:MAX_ERROR_TEXT]
    return encode_header(ERROR, 1 + len(text)) + bytes([code]) + text


def remote_error(payload: bytes, peer: str) -> HandshakeError:
    """Turn a peer's ERROR frame into our exception; its text is untrusted, so sanitize it."""
    code = payload[0] if payload else 0
    text = payload[1:].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    cls = _ERRORS_BY_CODE.get(code, HandshakeError)
    return cls(f"{peer} refused the handshake: {text}")


def as_bytes(metadata: object, what: str) -> bytes:
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(metadata).__name__}")
    return bytes(metadata)


def check_size(data: bytes, limit: int, what: str = "our metadata") -> bytes:
    if len(data) > limit:
        raise MessageTooLargeError(
            f"{what} is {len(data)} bytes, over max_message={limit}; raise max_message on "
            "both sides")
    return data
