"""The UCX backend's connection blob: what a peer needs to reach this worker.

JSON (never pickle) because it crosses the network inside kvxfer's agent metadata and is
hostile until proven otherwise. It is read with the core's toolkit and rules
(:mod:`kvxfer.plugin.wire`): the size is bounded before parsing, the text must be UTF-8,
duplicate keys, non-finite numbers and unknown keys are refused, names are printable, every field is type- and range-checked, allocations must be sorted and disjoint, and any
failure (deep nesting and oversized integers included) is a :class:`MetadataError`.

What the parser cannot check is the meaning of the bytes handed to libucp (the worker
address and remote keys): UCX parses them without defending itself. Only metadata that
arrived over an authenticated channel should reach :func:`parse_blob`'s caller.
"""

from __future__ import annotations

import base64
import json
from typing import Any, NamedTuple

from kvxfer import MetadataError
from kvxfer.plugin import wire as _wire

__all__ = ["BLOB_VERSION", "Blob", "Host", "encode_blob", "parse_blob"]

BLOB_MAGIC = "kvxfer-ucx"
#: Version 3: same-host proof by a registration page (``host.page`` and ``host.digest``).
BLOB_VERSION = 3
_KEYS = {"magic", "version", "agent", "ucx", "worker", "allocations", "host"}
_HOST_KEYS = {"boot_id", "hostname", "pidns", "pid", "start", "page", "digest"}
MAX_BLOB = 1 << 20  # metadata from the network: bounded before json.loads
MAX_ALLOCATIONS = 4096
MAX_WORKER_ADDRESS = 1 << 16
MAX_RKEY = 4096
MAX_NAME = 256
DIGEST_BYTES = 32
_U64 = (1 << 64) - 1


class Host(NamedTuple):
    """A peer's host identity: boot id, hostname and PID namespace (a pre-filter), pid and
    start time (a liveness signal), and, when it offers the same-host copy, the address of
    its registration page with the digest of the page's token (the proof)."""

    boot_id: str
    hostname: str
    pidns: str
    pid: int
    start: int
    page: int | None
    digest: bytes | None


class Blob(NamedTuple):
    agent: str
    worker: bytes
    allocations: list[tuple[int, int, bytes]]  # (address, nbytes, packed rkey), sorted, disjoint
    host: Host | None


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _bad(msg: str) -> MetadataError:
    return MetadataError(f"ucx metadata: {msg}")


def _host(value: Any) -> Host | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != _HOST_KEYS:
        raise _bad(f"host must be null or an object with keys {sorted(_HOST_KEYS)}")
    page, digest = value["page"], value["digest"]
    if (page is None) != (digest is None):
        raise _bad("host.page and host.digest are both set or both null")
    if digest is not None:
        digest = _wire.b64(digest, "ucx metadata: host.digest", DIGEST_BYTES)
        if len(digest) != DIGEST_BYTES:
            raise _bad(f"host.digest must be {DIGEST_BYTES} bytes")
        page = _wire.integer(page, "ucx metadata: host.page", 1)
    return Host(_wire.text(value["boot_id"], "ucx metadata: host.boot_id", 64),
                _wire.text(value["hostname"], "ucx metadata: host.hostname", 255),
                _wire.text(value["pidns"], "ucx metadata: host.pidns", 64),
                _wire.integer(value["pid"], "ucx metadata: host.pid", 1, (1 << 31) - 1),
                _wire.integer(value["start"], "ucx metadata: host.start"), page, digest)


def encode_blob(agent: str, ucx_version: str, worker: bytes, allocations: list[tuple[int, int, bytes]],
                host: Host | None) -> bytes:
    """The blob for ``allocations`` (``(address, nbytes, packed rkey)``, any order)."""
    allocs = [[a, n, _b64(rk)] for a, n, rk in sorted(allocations)]
    h = None if host is None else {**host._asdict(), "digest": None if host.digest is None else _b64(host.digest)}
    doc = {"magic": BLOB_MAGIC, "version": BLOB_VERSION, "agent": agent, "ucx": ucx_version,
           "worker": _b64(worker), "allocations": allocs, "host": h}
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_blob(blob: Any) -> Blob:
    """Validate a peer's blob; every failure is a :class:`MetadataError`."""
    doc = _wire.load_json(blob, "ucx metadata", limit=MAX_BLOB)
    if not isinstance(doc, dict) or doc.get("magic") != BLOB_MAGIC:
        raise MetadataError("ucx metadata: not a kvxfer ucx blob (wrong magic); does the peer use backend 'ucx'?")
    version = doc.get("version")
    if type(version) is not int or version != BLOB_VERSION:
        raise _bad(f"version {version!r} is not {BLOB_VERSION}; upgrade both sides")
    if set(doc) != _KEYS:
        raise _bad(f"keys {sorted(doc)} differ from {sorted(_KEYS)}")
    agent = _wire.text(doc["agent"], "ucx metadata: agent", MAX_NAME)
    _wire.text(doc["ucx"], "ucx metadata: ucx version", 32)
    worker = _wire.b64(doc["worker"], "ucx metadata: worker address", MAX_WORKER_ADDRESS)
    allocs = doc["allocations"]
    if not isinstance(allocs, list) or len(allocs) > MAX_ALLOCATIONS:
        raise _bad(f"allocations must be a list of at most {MAX_ALLOCATIONS}")
    out: list[tuple[int, int, bytes]] = []
    end = 0
    for i, a in enumerate(allocs):
        if not isinstance(a, list) or len(a) != 3:
            raise _bad(f"allocation {i} must be [address, nbytes, rkey]")
        addr = _wire.integer(a[0], f"ucx metadata: allocation {i} address")
        n = _wire.integer(a[1], f"ucx metadata: allocation {i} nbytes", lo=1)
        if addr + n > _U64:
            raise _bad(f"allocation {i} wraps around the address space")
        if addr < end:
            raise _bad(f"allocation {i} overlaps or precedes the one before (they must be sorted and disjoint)")
        end = addr + n
        out.append((addr, n, _wire.b64(a[2], f"ucx metadata: allocation {i} rkey", MAX_RKEY)))
    return Blob(agent, worker, out, _host(doc["host"]))
