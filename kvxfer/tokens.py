"""The shared token: what turns a caller's secret into an HMAC key, written once.

Two places authenticate with the same secret: the metadata side channel (challenge and
response, see :mod:`kvxfer.sidechannel`) and the agent metadata itself (a tag over the bytes
that will reach a transport's native parser, see :mod:`kvxfer.metadata`). Both derive their
key here so that one token means the same key everywhere, and each uses its own label so a
tag made for one purpose is never accepted for another.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final, Union

from .errors import InvalidArgumentError

__all__ = ["NO_AUTH", "NoAuth", "Token", "token_key", "mac", "TAG_SIZE"]

TAG_SIZE: Final = 32  # HMAC-SHA256


class NoAuth:
    """Type of :data:`NO_AUTH`: the explicit, greppable way to run without a token."""

    _instance: "NoAuth | None" = None

    def __new__(cls) -> "NoAuth":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_AUTH"

    def __reduce__(self) -> str:
        return "NO_AUTH"


#: Pass as ``token=NO_AUTH`` to opt out of authentication (README: what that exposes).
NO_AUTH: Final = NoAuth()

Token = Union[str, bytes, bytearray, NoAuth, None]


def token_key(token: object, what: str = "token") -> bytes | None:
    """The HMAC key for ``token``; ``None`` for ``NO_AUTH`` or ``None`` (no authentication).

    A token must be a non-empty ``str`` (UTF-8 encoded) or ``bytes``: an empty one would
    authenticate nothing, and a silently stringified list would be a different secret on the
    other side.
    """
    if token is None or token is NO_AUTH:
        return None
    if isinstance(token, str):
        try:
            key = token.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(f"{what} is not valid Unicode (a lone surrogate?)") from None
    elif isinstance(token, (bytes, bytearray, memoryview)):
        key = bytes(token)
    else:
        raise InvalidArgumentError(f"{what} must be str or bytes (or NO_AUTH), got {type(token).__name__}")
    if not key:
        raise InvalidArgumentError(f"an empty {what} authenticates nothing; pass NO_AUTH to run without one")
    return key


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over a domain label and the parts (all fixed-size except the last)."""
    h = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()
