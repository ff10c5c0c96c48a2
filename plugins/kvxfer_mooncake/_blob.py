"""The connection blob: the sender's identity, its Mooncake session id and the buffers
registered there, as JSON. The identity (``kvxfer.plugin.identity``, hex) is checked against
the session in :mod:`._identity`.

It comes from the peer, so it is bounded before parsing and validated field by field into
:class:`~kvxfer.errors.MetadataError`; it is never unpickled. Its regions are what bounds
every remote descriptor (``backend.prepare``): Mooncake itself refuses an address outside a
registration, but only after a round trip and with an untyped -1.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from kvxfer import MetadataError
from kvxfer.plugin import identity as ident

__all__ = ["MAX_BLOB", "MAX_REGIONS", "Blob", "decode", "encode"]

VERSION = 2
MAX_BLOB = 1 << 20
MAX_REGIONS = 1 << 14
_SESSION = re.compile(r"^([A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})$")
_U64 = 1 << 64


@dataclass(frozen=True)
class Blob:
    session: str
    regions: tuple[tuple[int, int], ...]  # (address, nbytes), sorted, disjoint
    identity: ident.Identity  # the sending process, as it claims (checked by _identity.check)


def encode(session: str, regions: Sequence[tuple[int, int]], identity: ident.Identity | None = None) -> bytes:
    who = ident.encode(ident.here() if identity is None else identity).hex()
    return json.dumps({"v": VERSION, "identity": who, "session": session,
                       "regions": sorted([int(a), int(n)] for a, n in regions)}, separators=(",", ":")).encode()


def decode(blob: bytes, who: str) -> Blob:
    """The peer's blob, or :class:`MetadataError` saying what is wrong with it."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MetadataError(f"mooncake blob from {who!r} is not bytes")
    if len(blob) > MAX_BLOB:
        raise MetadataError(f"mooncake blob from {who!r} is {len(blob)} bytes; at most {MAX_BLOB}")
    try:
        d: Any = json.loads(bytes(blob).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MetadataError(f"mooncake blob from {who!r} is not JSON: {type(exc).__name__}") from None
    if not isinstance(d, dict) or set(d) != {"v", "identity", "session", "regions"}:
        raise MetadataError(f"mooncake blob from {who!r} must be an object with v, identity, session, regions")
    if d["v"] != VERSION or type(d["v"]) is not int:
        raise MetadataError(f"mooncake blob from {who!r} has version {d['v']!r}; this plugin speaks {VERSION}")
    raw = d["identity"]
    if not isinstance(raw, str) or len(raw) != 2 * ident.IDENTITY.size:
        raise MetadataError(f"mooncake blob from {who!r} has a malformed identity")
    try:
        identity = ident.decode(bytes.fromhex(raw), f"mooncake blob from {who!r}")
    except ValueError:
        raise MetadataError(f"mooncake blob from {who!r} has a malformed identity") from None
    session = d["session"]
    m = _SESSION.match(session) if isinstance(session, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise MetadataError(f"mooncake blob from {who!r} has a malformed session id")
    regions = d["regions"]
    if not isinstance(regions, list) or len(regions) > MAX_REGIONS:
        raise MetadataError(f"mooncake blob from {who!r}: regions must be a list of at most {MAX_REGIONS}")
    out: list[tuple[int, int]] = []
    for r in regions:
        if (not isinstance(r, list) or len(r) != 2 or any(type(x) is not int for x in r)
                or not (0 < r[0] and 0 < r[1] and r[0] + r[1] < _U64)):
            raise MetadataError(f"mooncake blob from {who!r} has a malformed region")
        if out and r[0] < out[-1][0] + out[-1][1]:
            raise MetadataError(f"mooncake blob from {who!r}: regions must be sorted and disjoint")
        out.append((r[0], r[1]))
    return Blob(session, tuple(out), identity)
