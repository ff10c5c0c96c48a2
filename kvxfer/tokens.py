"""The shared token: what turns a caller's secret into an HMAC key, and the one HMAC, written once.

Several places authenticate with a secret: the metadata side channel (challenge and
response, see :mod:`kvxfer.sidechannel`), the agent metadata itself (a tag over the bytes
that will reach a transport's native parser, see :mod:`kvxfer.metadata`), directory values
(:mod:`kvxfer.directory.codec`) and vLLM transfer parameters
(:mod:`kvxfer.integrations.vllm.params`). All of them tag through :func:`mac` and no other
HMAC (``tests/test_wire.py`` greps for one), each under its own label from :data:`LABELS`,
so a tag made for one purpose is never accepted for another: the labels are the domain
separation, and a new use adds a row there.

Two token rules: :func:`token_key` (any non-empty secret: an agent's and the side channel's,
where the caller picks the token) and :func:`check_token` (at least 16 bytes), for tokens
an operator configures once for a whole cluster (the directory, the vLLM connector), where
a short one would be guessed offline from any tag it signed.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final, Union

from .errors import InvalidArgumentError, KvxferError, MetadataError

__all__ = ["NO_AUTH", "NoAuth", "Token", "token_key", "check_token", "mac", "verify", "LABELS", "TAG_SIZE",
           "MIN_CLUSTER_TOKEN"]

TAG_SIZE: Final = 32  # HMAC-SHA256
#: The bytes a cluster token needs at least (``secrets.token_bytes(32)`` gives 32).
MIN_CLUSTER_TOKEN: Final = 16

#: Domain labels, one per use of :func:`mac`. The bytes are the wire's: changing one breaks
#: every peer that tags with the old one, so a change is a format version bump.
LABELS: Final[dict[str, bytes]] = {
    "metadata": b"kvxfer-metadata\x01",          # kvxfer.metadata.seal
    "directory": b"kvxfer-directory-v1\0",       # kvxfer.directory.codec (key, 0, metadata follow)
    "vllm-params": b"kvxfer-vllm-params",        # kvxfer.integrations.vllm.params (canonical JSON)
    "side-server": b"kvxfer-server\x02",          # kvxfer.sidechannel.auth, frames.VERSION 2
    "side-client": b"kvxfer-client\x02",
    "side-data": b"kvxfer-data\x02",
    "side-reply": b"kvxfer-reply\x02",
}


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


def check_token(token: object, what: str = "cluster token", error: type[KvxferError] = MetadataError) -> bytes | None:
    """The key for a cluster token (``None``: no authentication): :func:`token_key`'s rule, and
    at least :data:`MIN_CLUSTER_TOKEN` bytes; ``error`` is the caller's configuration error."""
    try:
        key = token_key(token, what)
    except InvalidArgumentError as exc:
        raise error(str(exc)) from None
    if key is not None and len(key) < MIN_CLUSTER_TOKEN:
        raise error(f"a {what} must be at least {MIN_CLUSTER_TOKEN} bytes (for example secrets.token_bytes(32) "
                    f"or secrets.token_hex(16)), got {len(key)}")
    return key


def mac(key: bytes, label: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the domain label ``LABELS[label]`` and the parts, in order.

    Parts are concatenated: all but the last must be fixed-size or delimited by the caller.
    """
    h = hmac.new(key, LABELS[label], hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def verify(tag: bytes, key: bytes, label: str, *parts: bytes) -> bool:
    """Whether ``tag`` is :func:`mac` of the parts, compared in constant time."""
    return len(tag) == TAG_SIZE and hmac.compare_digest(tag, mac(key, label, *parts))
