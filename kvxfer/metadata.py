"""Agent metadata: what a peer needs to reach this worker, as bytes for the wire.

Format: the 8-byte magic ``KVXFMETA`` followed by UTF-8 JSON. JSON (not pickle, not a
custom binary format) because metadata crosses trust boundaries and languages: decoding it
can build only dicts, lists, strings and numbers, and every field is then checked here
before anything else sees it. The backend's connection blob travels base64-encoded, and so
does the core device path's export (``device``, present only when the agent exports VRAM).

Signed form, for agents given the shared token: ``KVXFSIG1``, a 32-byte HMAC-SHA256 tag
keyed by the token (see :mod:`kvxfer.tokens`), then the unsigned bytes above. The tag is
checked before a single byte is parsed, so with a token the backend blob that reaches a
transport's native parser was produced by a token holder. Without a token every field is
still validated here, but the blob itself is opaque to the core: its parsing by the
transport is then the remaining exposure (README, "Trust").

Decoding is bounded: the size, the number of JSON items (counted before parsing), every
string a valid Unicode scalar sequence, and at most :data:`MAX_PEER_MEMBERS` members.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any

from . import _wire
from .errors import MetadataError, SpecError
from .geometry import KVCacheSpec
from .tokens import TAG_SIZE, mac, verify

__all__ = ["AgentMetadata", "PROTOCOL_VERSION", "MAX_METADATA_BYTES", "MAX_PEER_MEMBERS", "seal", "unseal"]

PROTOCOL_VERSION = 2  # 2: members say what their pages hold (dtype, axes, role, heads)
MAGIC = b"KVXFMETA"
SIGNED_MAGIC = b"KVXFSIG1"
#: Upper bound on encoded metadata; a 200-member spec plus a NIXL blob is well under 1 MiB.
MAX_METADATA_BYTES = 16 << 20
#: JSON items (values of lists and objects) a document may hold, counted before parsing so a
#: hostile list of a million numbers is refused before it is built.
MAX_JSON_ITEMS = 1 << 18
#: Members over all regions of a peer's spec: enough for 4096 layers split into K and V
#: pages four ways, small enough that building and pairing them stays bounded.
MAX_PEER_MEMBERS = 16384
_NAME = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")
_FIELDS = frozenset({"version", "name", "generation", "backend", "blob", "spec"})
#: ``device``: the core device path's export (:mod:`kvxfer.cuda.blob`), sent only by an agent exporting VRAM.
_WITH_DEVICE = _FIELDS | {"device"}
#: Upper bound on the device path's export (its own decoder bounds what is inside).
MAX_DEVICE_BYTES = 1 << 20


def seal(raw: bytes, key: bytes) -> bytes:
    """Sign encoded metadata with the token's key (see the module docstring for the form)."""
    return SIGNED_MAGIC + mac(key, "metadata", raw) + raw


def unseal(data: object, key: bytes | None) -> bytes:
    """The unsigned bytes inside ``data``, after checking its tag; raises :class:`MetadataError`.

    With a key, only signed metadata whose tag verifies is accepted. Without one, signed
    metadata is refused too: accepting it unverified would hide a misconfiguration.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MetadataError(f"metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_METADATA_BYTES + len(SIGNED_MAGIC) + TAG_SIZE:
        raise MetadataError(f"metadata is {len(data)} bytes, over the {MAX_METADATA_BYTES} limit")
    signed = data.startswith(SIGNED_MAGIC)
    if key is None:
        if signed:
            raise MetadataError("the peer signs its metadata with a token but this agent has none; give both "
                                "agents the same token (Agent(..., token=...))")
        return data
    if not signed:
        raise MetadataError("unsigned metadata: this agent requires metadata signed with the shared token; "
                            "give the peer the same token (Agent(..., token=...))")
    tag, raw = data[len(SIGNED_MAGIC):len(SIGNED_MAGIC) + TAG_SIZE], data[len(SIGNED_MAGIC) + TAG_SIZE:]
    if not verify(tag, key, "metadata", raw):
        raise MetadataError("metadata signature does not verify: the peer holds a different token, or the "
                            "bytes were altered")
    return raw


@dataclass(frozen=True)
class AgentMetadata:
    """Protocol version, agent name, generation, backend name, backend blob, KV spec, device export.

    ``generation`` changes whenever a worker restarts, so a peer can tell a restarted
    worker from the one whose memory keys it cached.
    """

    name: str
    generation: int
    backend: str
    blob: bytes
    spec: KVCacheSpec | None
    version: int = PROTOCOL_VERSION
    device: bytes = b""  # the agent's device path export (kvxfer._routed); decoded by kvxfer.cuda.blob

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise MetadataError(f"agent name {self.name!r} must match {_NAME.pattern}")
        if isinstance(self.generation, bool) or not isinstance(self.generation, int) or not 0 < self.generation < 1 << 63:
            raise MetadataError("generation must be a positive 63-bit integer")
        if not isinstance(self.backend, str) or not _NAME.fullmatch(self.backend):
            raise MetadataError(f"backend name {self.backend!r} is not valid")
        if not isinstance(self.blob, (bytes, bytearray)):
            raise MetadataError("backend blob must be bytes")
        if not isinstance(self.device, (bytes, bytearray)):
            raise MetadataError("device export must be bytes")
        if self.spec is not None and not isinstance(self.spec, KVCacheSpec):
            raise MetadataError("spec must be a KVCacheSpec or None")
        if type(self.version) is not int or self.version < 1:
            raise MetadataError("version must be a positive integer")

    def encode(self) -> bytes:
        doc = {
            "version": self.version,
            "name": self.name,
            "generation": self.generation,
            "backend": self.backend,
            "blob": base64.b64encode(bytes(self.blob)).decode("ascii"),
            "spec": self.spec.to_dict() if self.spec is not None else None,
        }
        if self.device:
            doc["device"] = base64.b64encode(bytes(self.device)).decode("ascii")
        out = MAGIC + json.dumps(doc, separators=(",", ":")).encode("utf-8")
        if len(out) > MAX_METADATA_BYTES:
            raise MetadataError(f"metadata is {len(out)} bytes, over the {MAX_METADATA_BYTES} limit")
        return out

    @classmethod
    def decode(cls, data: bytes) -> "AgentMetadata":
        """Parse and validate untrusted bytes; raises :class:`MetadataError`, nothing else."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MetadataError(f"metadata must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_METADATA_BYTES:
            raise MetadataError(f"metadata is {len(data)} bytes, over the {MAX_METADATA_BYTES} limit")
        if data.startswith(SIGNED_MAGIC):
            raise MetadataError("signed metadata: an agent with the token verifies it (unseal) before decoding")
        if not data.startswith(MAGIC):
            raise MetadataError("not kvxfer metadata (bad magic)")
        doc = _wire.load_json(memoryview(data)[len(MAGIC):], "metadata", limit=MAX_METADATA_BYTES,
                              max_items=MAX_JSON_ITEMS)
        if not isinstance(doc, dict):
            raise MetadataError("metadata must be a JSON object")
        version = doc.get("version")
        # type() check: True == 1 and 1.0 == 1 in Python, neither is a protocol version.
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise MetadataError(f"unsupported metadata version {version!r} (this kvxfer speaks {PROTOCOL_VERSION})")
        _wire.keys(doc, _WITH_DEVICE if "device" in doc else _FIELDS, "metadata")
        blob = _wire.b64(doc["blob"], "backend blob", MAX_METADATA_BYTES, empty=True)
        device = _wire.b64(doc["device"], "device export", MAX_DEVICE_BYTES) if "device" in doc else b""
        _check_member_count(doc["spec"])
        try:
            spec = KVCacheSpec.from_dict(doc["spec"]) if doc["spec"] is not None else None
        except SpecError as exc:
            raise MetadataError(f"peer KV cache spec is invalid: {exc}") from None
        except (TypeError, KeyError, AttributeError, ValueError, OverflowError, RecursionError) as exc:
            raise MetadataError(f"peer KV cache spec is malformed: {exc!r}") from None
        return cls(doc["name"], doc["generation"], doc["backend"], blob, spec, version, device)


def _check_member_count(spec: Any) -> None:
    """Refuse a spec with more than :data:`MAX_PEER_MEMBERS` members before building any of them."""
    try:
        n = sum(len(r["layout"]["members"]) for r in spec["regions"]) if isinstance(spec, dict) else 0
    except (TypeError, KeyError):
        return  # malformed: KVCacheSpec.from_dict says how
    if n > MAX_PEER_MEMBERS:
        raise MetadataError(f"peer KV cache spec has {n} members, over the {MAX_PEER_MEMBERS} limit")
