"""What a directory value holds: the agent's metadata, optionally signed with a cluster token.

Value format::

    b"KVXD" version(1)=1 flags(1) [tag(32)] metadata

``metadata`` is exactly :meth:`kvxfer.Agent.metadata` (kvxfer's own bytes: name, generation,
backend, the backend's connection blob and the KV cache spec). With flag bit 0 set, ``tag`` is
HMAC-SHA256(token, label || key || 0 || metadata): the key is inside the tag, so a signed value
cannot be moved to another name, role or rank. Why a token of our own next to etcd's access
control: whoever can write the prefix can otherwise point every decode worker at memory of
their choosing; the token lets readers refuse entries that no worker of the cluster wrote,
whatever the store's configuration (docs/directory.md, "Who can write the directory").
"""

from __future__ import annotations

import struct

from .. import _wire
from ..errors import MetadataError
from ..metadata import MAX_METADATA_BYTES, AgentMetadata
from ..tokens import TAG_SIZE, check_token as _check_token, mac, verify

__all__ = ["encode_value", "decode_value", "check_token", "MAX_VALUE_BYTES"]

_MAGIC = b"KVXD"
_VERSION = 1
_FLAG_SIGNED = 0x01
_HEAD = struct.Struct("!4sBB")
MAX_VALUE_BYTES = _HEAD.size + TAG_SIZE + MAX_METADATA_BYTES


def check_token(token: bytes | str | None) -> bytes | None:
    """The directory's key: :func:`kvxfer.tokens.check_token` (at least 16 bytes), a MetadataError."""
    return _check_token(token, "directory token", MetadataError)


def _parts(key: str, metadata: bytes) -> tuple[bytes, bytes, bytes]:
    return key.encode("utf-8"), b"\0", metadata


def encode_value(key: str, metadata: bytes, token: bytes | None) -> bytes:
    if token is None:
        return _HEAD.pack(_MAGIC, _VERSION, 0) + metadata
    return _HEAD.pack(_MAGIC, _VERSION, _FLAG_SIGNED) + mac(token, "directory", *_parts(key, metadata)) + metadata


def decode_value(key: str, value: bytes, token: bytes | None) -> tuple[AgentMetadata, bytes]:
    """Validate a stored value for ``key``: the decoded metadata and its bytes.

    Raises :class:`MetadataError` for anything else.
    """
    if not isinstance(value, (bytes, bytearray)):
        raise MetadataError("directory value must be bytes")
    value = bytes(value)
    if len(value) > MAX_VALUE_BYTES:
        raise MetadataError(f"directory value of {len(value)} bytes is over the {MAX_VALUE_BYTES} limit")
    r = _wire.Reader(value, "directory value")
    if r.left < _HEAD.size:
        raise MetadataError("directory value is truncated")
    magic, version, flags = r.unpack(_HEAD)
    if magic != _MAGIC or version != _VERSION or flags & ~_FLAG_SIGNED:
        raise MetadataError("directory value is not a kvxfer directory entry of a known version")
    signed = bool(flags & _FLAG_SIGNED)
    if token is not None:
        if not signed:
            raise MetadataError(f"entry {key!r} is not signed, and this directory requires the cluster token")
        tag = r.take(min(TAG_SIZE, r.left))
        body = r.rest()
        if not verify(tag, token, "directory", *_parts(key, body)):
            raise MetadataError(f"entry {key!r} has a wrong signature: written without this cluster's token")
    elif signed:
        raise MetadataError(f"entry {key!r} is signed: give this directory the cluster's token to read it")
    else:
        body = r.rest()
    return AgentMetadata.decode(body), body
