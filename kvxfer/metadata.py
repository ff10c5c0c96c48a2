"""Agent metadata: what a peer needs to reach this worker, as bytes for the wire.

Format: the 8-byte magic ``KVXFMETA`` followed by UTF-8 JSON. JSON (not pickle, not a
custom binary format) because metadata crosses trust boundaries and languages: decoding it
can build only dicts, lists, strings and numbers, and every field is then checked here
before anything else sees it. The backend's connection blob travels base64-encoded.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from .errors import MetadataError, SpecError
from .layout import KVCacheSpec

__all__ = ["AgentMetadata", "PROTOCOL_VERSION", "MAX_METADATA_BYTES"]

PROTOCOL_VERSION = 2  # 2: members say what their pages hold (dtype, axes, role, heads)
MAGIC = b"KVXFMETA"
#: Upper bound on encoded metadata; a 200-member spec plus a NIXL blob is well under 1 MiB.
MAX_METADATA_BYTES = 16 << 20
_NAME = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")


@dataclass(frozen=True)
class AgentMetadata:
    """Protocol version, agent name, generation, backend name, backend blob and KV spec.

    ``generation`` changes whenever a worker restarts, so a peer can tell a restarted
    worker from the one whose memory keys it cached.
    """

    name: str
    generation: int
    backend: str
    blob: bytes
    spec: KVCacheSpec | None
    version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise MetadataError(f"agent name {self.name!r} must match {_NAME.pattern}")
        if isinstance(self.generation, bool) or not isinstance(self.generation, int) or not 0 < self.generation < 1 << 63:
            raise MetadataError("generation must be a positive 63-bit integer")
        if not isinstance(self.backend, str) or not _NAME.fullmatch(self.backend):
            raise MetadataError(f"backend name {self.backend!r} is not valid")
        if not isinstance(self.blob, (bytes, bytearray)):
            raise MetadataError("backend blob must be bytes")
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
        if not data.startswith(MAGIC):
            raise MetadataError("not kvxfer metadata (bad magic)")
        try:
            doc: Any = json.loads(data[len(MAGIC):].decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise MetadataError(f"metadata is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise MetadataError("metadata must be a JSON object")
        version = doc.get("version")
        # type() check: True == 1 and 1.0 == 1 in Python, neither is a protocol version.
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise MetadataError(f"unsupported metadata version {version!r} (this kvxfer speaks {PROTOCOL_VERSION})")
        expected = {"version", "name", "generation", "backend", "blob", "spec"}
        if set(doc) != expected:
            raise MetadataError(f"metadata fields {sorted(doc)} != {sorted(expected)}")
        try:
            blob = base64.b64decode(doc["blob"], validate=True) if isinstance(doc["blob"], str) else None
        except (binascii.Error, ValueError):
            blob = None
        if blob is None:
            raise MetadataError("backend blob is not valid base64")
        try:
            spec = KVCacheSpec.from_dict(doc["spec"]) if doc["spec"] is not None else None
        except SpecError as exc:
            raise MetadataError(f"peer KV cache spec is invalid: {exc}") from None
        except (TypeError, KeyError, AttributeError) as exc:  # defensive: shape errors in nested data
            raise MetadataError(f"peer KV cache spec is malformed: {exc}") from None
        return cls(doc["name"], doc["generation"], doc["backend"], blob, spec, version)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
