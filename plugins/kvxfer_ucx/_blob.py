"""The UCX backend's connection blob: what a peer needs to reach this worker's memory.

JSON (never pickle) because it crosses the network inside kvxfer's agent metadata and is
hostile until proven otherwise: sizes are bounded before parsing, every field is
type-checked, spans must not wrap, and nothing reaches libucp until all of it passed.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from kvxfer.errors import MetadataError

from . import _samehost as SH

__all__ = ["encode_blob", "parse_blob", "BLOB_VERSION"]

BLOB_MAGIC = "kvxfer-ucx"
#: Version 2 adds ``host`` (same-host fast path); version-1 blobs are still accepted (RMA only).
BLOB_VERSION = 2
BLOB_VERSIONS = (1, 2)
_HOST_KEYS = {"boot_id", "hostname", "pidns", "pid", "token", "token_addr"}
MAX_BLOB = 16 << 20  # metadata from the network: bounded before json.loads
MAX_ALLOCATIONS = 4096
MAX_WORKER_ADDRESS = 1 << 16
MAX_RKEY = 1 << 16
MAX_NAME = 256
_U64 = (1 << 64) - 1


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(value: Any, what: str, limit: int) -> bytes:
    if not isinstance(value, str) or len(value) > 4 * limit // 3 + 4:
        raise MetadataError(f"ucx metadata: {what} must be a base64 string of at most {limit} bytes")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise MetadataError(f"ucx metadata: {what} is not valid base64") from None
    if not raw:
        raise MetadataError(f"ucx metadata: {what} is empty")
    return raw


def _uint(value: Any, what: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _U64:
        raise MetadataError(f"ucx metadata: {what} must be an integer in [{lo}, 2**64)")
    return value


def _parse_host(value: Any) -> dict[str, Any] | None:
    """Validate the ``host`` entry of a version-2 blob (None: no same-host copy offered)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != _HOST_KEYS:
        raise MetadataError(f"ucx metadata: host must be null or an object with keys {sorted(_HOST_KEYS)}")
    for key, limit in (("boot_id", 64), ("hostname", 255), ("pidns", 64)):
        v = value[key]
        if not isinstance(v, str) or not 0 < len(v) <= limit:
            raise MetadataError(f"ucx metadata: host.{key} must be a non-empty string of at most {limit} characters")
    pid = value["pid"]
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < (1 << 31):
        raise MetadataError("ucx metadata: host.pid must be a positive 32-bit integer")
    token = _unb64(value["token"], "host.token", SH.TOKEN_BYTES)
    if len(token) != SH.TOKEN_BYTES:
        raise MetadataError(f"ucx metadata: host.token must be {SH.TOKEN_BYTES} bytes")
    return {**value, "token": token, "token_addr": _uint(value["token_addr"], "host.token_addr", lo=1)}


def encode_blob(agent: str, ucx_version: str, worker: bytes, allocations: list[list[Any]],
                host: dict[str, Any] | None) -> bytes:
    """``allocations`` holds ``[address, nbytes, base64 rkey]`` per registered span."""
    doc = {"magic": BLOB_MAGIC, "version": BLOB_VERSION, "agent": agent, "ucx": ucx_version,
           "worker": _b64(worker), "allocations": allocations, "host": host}
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_blob(blob: bytes) -> tuple[str, bytes, list[tuple[int, int, bytes]], dict[str, Any] | None]:
    """Validate a peer's blob: ``(agent, worker address, [(address, nbytes, rkey)], host)``.

    The blob comes from the network: sizes are bounded before parsing, every field is
    type-checked, spans must not wrap, and nothing is handed to UCX until it all passed.
    Version 1 (no ``host``) is still accepted, so an upgraded agent talks to an older one
    over UCX RMA; ``host`` is ``None`` then, or when the peer opted out of the fast path.
    """
    if not isinstance(blob, (bytes, bytearray)) or len(blob) > MAX_BLOB:
        raise MetadataError(f"ucx metadata must be bytes of at most {MAX_BLOB} bytes")
    try:
        doc = json.loads(bytes(blob))
    except (ValueError, UnicodeDecodeError):
        raise MetadataError("ucx metadata is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("magic") != BLOB_MAGIC:
        raise MetadataError("ucx metadata: not a kvxfer ucx blob (wrong magic); does the peer use backend 'ucx'?")
    version = doc.get("version")
    if isinstance(version, bool) or version not in BLOB_VERSIONS:
        raise MetadataError(f"ucx metadata version {version!r} is not one of {BLOB_VERSIONS}; upgrade both sides")
    expected = {"magic", "version", "agent", "ucx", "worker", "allocations"} | ({"host"} if version >= 2 else set())
    if set(doc) != expected:
        raise MetadataError(f"ucx metadata: keys {sorted(doc)} differ from {sorted(expected)}")
    agent = doc["agent"]
    if not isinstance(agent, str) or not 0 < len(agent.encode()) <= MAX_NAME:
        raise MetadataError("ucx metadata: agent must be a non-empty string")
    worker = _unb64(doc["worker"], "worker address", MAX_WORKER_ADDRESS)
    allocs = doc["allocations"]
    if not isinstance(allocs, list) or len(allocs) > MAX_ALLOCATIONS:
        raise MetadataError(f"ucx metadata: allocations must be a list of at most {MAX_ALLOCATIONS}")
    out = []
    for i, a in enumerate(allocs):
        if not isinstance(a, list) or len(a) != 3:
            raise MetadataError(f"ucx metadata: allocation {i} must be [address, nbytes, rkey]")
        addr, n = _uint(a[0], f"allocation {i} address"), _uint(a[1], f"allocation {i} nbytes", lo=1)
        if addr + n > _U64:
            raise MetadataError(f"ucx metadata: allocation {i} wraps around the address space")
        out.append((addr, n, _unb64(a[2], f"allocation {i} rkey", MAX_RKEY)))
    return agent, worker, out, _parse_host(doc.get("host"))
