"""The NIXL backend's connection blob: a kvxfer header and NIXL's metadata.

The core device path's export travels in the agent's metadata, not here (:mod:`kvxfer._routed`).

The blob arrives from the network and its NIXL part is handed to C++ (NIXL, then UCX) that
trusts it. So it is parsed completely here first, record by record, exactly as NIXL will
read it, and refused with :class:`~kvxfer.errors.MetadataError` unless every length is
bounded, every record is where NIXL expects it, the embedded agent name is the peer's name,
and nothing follows the last record. What reaches NIXL is then re-serialized from the
parsed fields, never the received bytes, under a name this backend picks.

Checking everything NIXL checks matters beyond crashes: NIXL loads a blob in steps
(connection first, then memory), and a blob refused after the first step leaves the
connection behind under the peer's name (see :mod:`kvxfer_nixl.backend` for how that is
contained). What no parser here can check is the inside of the two opaque payloads that
go to UCX: the worker address and the remote keys. Those are only as trustworthy as the
channel that delivered them (kvxfer's side channel can authenticate it).

Layout of NIXL's metadata (NIXL 1.5; one record = tag, native ``size_t`` length, payload,
``|``)::

    "nixlSerDes|"
    Agent <name>  Conns <u64 n>  n x (t <backend>  c <connection info>)
    "" "MemSection"  nixlSecElms <u64 m>
    m x (bknd <backend>  nixlDList "nixlSDList"  t <u32 mem type>  n <u64 k>
         k x ("" <u64 addr, u64 len, u64 device, remote key>))
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from kvxfer import Allocation, MemoryKind, MetadataError
from kvxfer.plugin import identity as peers, wire
from kvxfer.plugin.identity import Identity

__all__ = ["HEADER", "PeerBlob", "Section", "encode", "parse"]

MAGIC = b"KVXNIXL5"  # 5: the device path's export left the blob for the agent's metadata
#: magic, process identity (kvxfer.peers.encode), instance id, registration epoch
#: (little-endian like NIXL's own)
HEADER = struct.Struct(f"<8s{peers.IDENTITY.size}s16sQ")

MAX_BLOB = 4 << 20
MAX_NAME = 256
MAX_CONNS = 8
MAX_CONN_INFO = 1 << 16
MAX_SECTIONS = 16
MAX_DESCS = 1 << 16
MAX_KEY = 1 << 16

_SERDES = b"nixlSerDes|"
_LEN = struct.Struct("<Q")
_DESC = struct.Struct("<QQQ")
_U32 = struct.Struct("<I")
_KINDS = {0: MemoryKind.DRAM, 1: MemoryKind.VRAM}  # NIXL's DRAM_SEG, VRAM_SEG
_CODES = {k: c for c, k in _KINDS.items()}
_BACKEND = re.compile(rb"[A-Za-z0-9_]{1,32}")
_UCX_ADDRESS_VERSIONS = (0, 1)  # low nibble of a UCX worker address's first byte
_U64 = (1 << 64) - 1
_UCX_HOST, _UCX_MEMORY_TYPES = 0, 16  # ucs_memory_type_t: HOST first, a handful of device types


@dataclass(frozen=True)
class Section:
    """Registered memory of one kind, as the peer's NIXL backend ``backend`` publishes it."""

    backend: str
    kind: MemoryKind
    descs: tuple[tuple[int, int, int, bytes], ...]  # (address, nbytes, device, remote key)


@dataclass(frozen=True)
class PeerBlob:
    """A validated blob: who sent it, how to reach it, and what memory it registered."""

    identity: Identity  # the sending process, as it claims (kvxfer_nixl._identity checks the claim)
    instance: bytes  # random per backend instance
    reg_epoch: int  # the sender's registration epoch when it wrote the blob
    conns: tuple[tuple[str, bytes], ...]  # (NIXL backend, connection info)
    sections: tuple[Section, ...]

    def worker_address(self) -> bytes:
        """The UCX worker address the peer offers (b"" without the UCX backend)."""
        return next((info for backend, info in self.conns if backend == "UCX"), b"")

    def allocations(self) -> tuple[Allocation, ...]:
        """Every registered span of the peer: what a remote list must stay inside."""
        return tuple(Allocation(a, n, s.kind, d) for s in self.sections for a, n, d, _ in s.descs)

    def nixl_metadata(self, agent_name: str) -> bytes:
        """NIXL metadata rebuilt from the parsed fields, naming the agent ``agent_name``."""
        out = [_SERDES, _record(b"Agent", agent_name.encode()), _record(b"Conns", _LEN.pack(len(self.conns)))]
        for backend, info in self.conns:
            out += [_record(b"t", backend.encode()), _record(b"c", info)]
        out += [_record(b"", b"MemSection"), _record(b"nixlSecElms", _LEN.pack(len(self.sections)))]
        for s in self.sections:
            out += [_record(b"bknd", s.backend.encode()), _record(b"nixlDList", b"nixlSDList"),
                    _record(b"t", _U32.pack(_CODES[s.kind])), _record(b"n", _LEN.pack(len(s.descs)))]
            out += [_record(b"", _DESC.pack(a, n, d) + key) for a, n, d, key in s.descs]
        return b"".join(out)


def encode(identity: Identity, instance: bytes, reg_epoch: int, nixl_md: bytes) -> bytes:
    return HEADER.pack(MAGIC, peers.encode(identity), instance, reg_epoch) + nixl_md


def parse(blob: bytes, peer_name: str, backends: tuple[str, ...]) -> PeerBlob:
    """Validate ``blob`` from ``peer_name`` for an agent running NIXL ``backends``."""
    if not isinstance(peer_name, str):
        raise MetadataError(f"peer name must be a str, got {type(peer_name).__name__}")
    try:
        name_bytes = peer_name.encode("utf-8")
    except UnicodeEncodeError:
        raise MetadataError(f"peer name {peer_name!r} is not valid Unicode") from None
    if not isinstance(blob, (bytes, bytearray)):
        raise MetadataError(f"NIXL connection blob of {peer_name!r} must be bytes")
    if not HEADER.size < len(blob) <= MAX_BLOB:
        raise MetadataError(f"NIXL connection blob of {peer_name!r} has {len(blob)} bytes; "
                            f"expected {HEADER.size + 1} to {MAX_BLOB}")
    magic, ident, instance, reg_epoch = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise MetadataError(f"peer {peer_name!r} did not send a kvxfer NIXL blob of this version "
                            f"(magic {magic!r}, expected {MAGIC!r}); run the same kvxfer on both sides")
    r = _Reader(bytes(blob[HEADER.size:]), peer_name)
    r.expect(_SERDES)
    name = r.field(b"Agent", MAX_NAME)
    if name != name_bytes:
        raise MetadataError(f"NIXL metadata names agent {name[:64]!r}, but the kvxfer metadata names "
                            f"{peer_name!r}")
    conns: list[tuple[str, bytes]] = []
    for _ in range(r.count(b"Conns", 1, MAX_CONNS)):
        backend = r.backend(b"t")
        if any(backend == b for b, _ in conns):
            raise MetadataError(f"NIXL metadata of {peer_name!r} lists backend {backend!r} twice")
        info = r.field(b"c", MAX_CONN_INFO, empty=False)
        if backend == "UCX" and info[0] & 0x0F not in _UCX_ADDRESS_VERSIONS:
            raise MetadataError(f"NIXL metadata of {peer_name!r}: UCX worker address of unknown version "
                                f"{info[0] & 0x0F}")  # UCX aborts the process on one
        conns.append((backend, info))
    if not any(b in backends for b, _ in conns):
        raise MetadataError(f"peer {peer_name!r} offers NIXL backends {[b for b, _ in conns]}, none of {list(backends)}")
    if r.field(b"", 10) != b"MemSection":
        raise MetadataError(f"NIXL metadata of {peer_name!r}: memory section missing")
    sections: list[Section] = []
    for _ in range(r.count(b"nixlSecElms", 0, MAX_SECTIONS)):
        sections.append(_section(r, {b for b, _ in conns}, sections))
    if r.left:
        raise MetadataError(f"NIXL metadata of {peer_name!r} has {r.left} bytes after its last record")
    identity = peers.decode(ident, f"NIXL connection blob of {peer_name!r}")
    return PeerBlob(identity, instance, reg_epoch, tuple(conns), tuple(sections))


def _section(r: "_Reader", conn_backends: set[str], seen: list[Section]) -> Section:
    backend = r.backend(b"bknd")
    if backend not in conn_backends:
        raise MetadataError(f"NIXL metadata of {r.peer!r}: memory of backend {backend!r} without its connection")
    if r.field(b"nixlDList", 16) != b"nixlSDList":
        raise MetadataError(f"NIXL metadata of {r.peer!r}: unknown descriptor list type")
    code = _U32.unpack(r.field(b"t", 4, exact=4))[0]
    if code not in _KINDS:
        raise MetadataError(f"NIXL metadata of {r.peer!r}: memory type {code} is neither DRAM nor VRAM")
    kind = _KINDS[code]
    if any(s.backend == backend and s.kind is kind for s in seen):
        raise MetadataError(f"NIXL metadata of {r.peer!r}: two {kind.value} sections for {backend!r}")
    descs = []
    spans = set()
    for _ in range(r.count(b"n", 1, MAX_DESCS)):
        raw = r.field(b"", _DESC.size + MAX_KEY)
        if len(raw) <= _DESC.size:
            raise MetadataError(f"NIXL metadata of {r.peer!r}: a {kind.value} descriptor has no remote key")
        addr, nbytes, device = _DESC.unpack_from(raw)
        if nbytes == 0 or addr + nbytes > _U64 or device >= 1 << 31:
            raise MetadataError(f"NIXL metadata of {r.peer!r}: bad {kind.value} span ({addr:#x}, {nbytes}, "
                                f"device {device})")
        if (addr, nbytes, device) in spans:
            raise MetadataError(f"NIXL metadata of {r.peer!r}: span {addr:#x}+{nbytes} listed twice")
        spans.add((addr, nbytes, device))
        key = raw[_DESC.size:]
        if backend == "UCX" and not _ucx_key_ok(key, kind):
            raise MetadataError(f"NIXL metadata of {r.peer!r}: a {kind.value} remote key is not a UCX key for "
                                f"{kind.value} memory (corrupt)")
        descs.append((addr, nbytes, device, key))
    return Section(backend, kind, tuple(descs))


def _ucx_key_ok(key: bytes, kind: MemoryKind) -> bool:
    """The frame of a key UCX packed (``ucp_rkey_pack``): MD map, memory type, one sized key per MD.

    ``ucp_ep_rkey_unpack`` takes no length and indexes tables with these fields, and whether a
    corrupt one crashes depends on what lies past those tables in the process, which a
    helper process cannot reproduce. So the frame is checked here; what is inside each MD's
    key is left to the prover (:mod:`kvxfer_nixl._probe`).
    """
    if len(key) < 9:
        return False
    md_map, mem_type = int.from_bytes(key[:8], "little"), key[8]
    # An empty MD map is genuine: with TCP alone (``UCX_TLS=tcp``) no MD packs a key.
    if (md_map == 0 and len(key) != 9) or (mem_type == _UCX_HOST) != (kind is MemoryKind.DRAM) \
            or mem_type >= _UCX_MEMORY_TYPES:
        return False
    pos = 9
    for _ in range(bin(md_map).count("1")):
        if pos >= len(key):
            return False
        pos += 1 + key[pos]
    return pos <= len(key)


class _Reader(wire.Reader):
    """The core's bounded cursor, reading NIXL records (``|``-terminated) and refusing anything
    NIXL would misread."""

    __slots__ = ("peer",)

    def __init__(self, data: bytes, peer: str) -> None:
        super().__init__(data, f"NIXL metadata of {peer!r}")
        self.peer = peer

    def field(self, tag: bytes, limit: int, *, length: struct.Struct = _LEN, end: bytes = b"|",
              exact: int | None = None, empty: bool = True) -> bytes:
        return super().field(tag, limit, length=length, end=end, exact=exact, empty=empty)

    def count(self, tag: bytes, lo: int, hi: int) -> int:
        (n,) = _LEN.unpack(self.field(tag, 8, exact=8))
        if not lo <= n <= hi:
            raise self.bad(f"{tag.decode()} = {n}, expected {lo} to {hi}")
        return int(n)

    def backend(self, tag: bytes) -> str:
        raw = self.field(tag, 32)
        if not _BACKEND.fullmatch(raw):
            raise self.bad(f"backend name {raw!r} is not an identifier")
        return raw.decode("ascii")


def _record(tag: bytes, payload: bytes) -> bytes:
    return tag + _LEN.pack(len(payload)) + payload + b"|"
