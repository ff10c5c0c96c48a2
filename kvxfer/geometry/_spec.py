"""Backend-neutral KV geometry: members, packed layouts, regions and the whole-cache spec.

The model (docs/geometry.md)::

    address of member m of block b = alloc.address + region.offset + b * stride + m.offset

A layer-outermost cache is one region per layer, each with a single member at offset 0.
A block-outermost cache is one region whose :class:`PackedLayout` lists every layer's page
inside the row. Both are the same object, which is why the planner needs no special cases.

Every object validates itself when built and converts to/from a dict of JSON types, because
peers send specs over the network and a corrupt one must fail here, not inside a transport.
"""

from __future__ import annotations

import collections
import enum
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import SpecError
from ..memory import Allocation, DescriptorList, MemoryKind, _expect_keys, spec_int
from ._pageformat import PageFormat, Shard

__all__ = ["Member", "PackedLayout", "Region", "KVCacheSpec", "Granularity", "KNOWN_LAYOUTS", "PageFormat",
           "Shard"]

#: Layout names kvxfer knows. B = block, L = layer, H = heads, N = tokens, C = channels.
KNOWN_LAYOUTS = ("BLHNC", "BLNHC", "LBHNC", "LBNHC")

# Bounds on what a peer may send. Generous for real models (a 100-layer model with K and V
# split is 200 members), small enough that a hostile spec cannot make us allocate gigabytes.
MAX_ALLOCATIONS = 4096
MAX_REGIONS = 65536
MAX_MEMBERS = 65536
MAX_NAME = 256
MAX_BLOCKS = 1 << 40
#: Per-member descriptors a spec may imply (sum of blocks x members over regions). A peer
#: claiming more would make every prepared list a memory bomb; 2^26 covers a 200k-block
#: pool of a 160-member GQA cache.
MAX_DESCRIPTORS = 1 << 26
MAX_LAYER = 1 << 24
_ROLE = re.compile(r"^[a-z][a-z0-9_]{0,15}$")


class Granularity(str, enum.Enum):
    """Which prepared list a descriptor index points into."""

    ROWS = "rows"  # one descriptor per (region, block): the whole packed row
    MEMBERS = "members"  # one descriptor per (member, block)


@dataclass(frozen=True)
class Member:
    """One named page kind inside a block (``layer.17``, ``layer.17.k``, ``layer.3.ssm``).

    ``replicated`` says every tensor-parallel rank holds the same bytes (an MLA latent
    cache); a head-split member holds only this rank's KV heads, described by ``shard``
    (``None`` there means: the spec's ``tp_rank``/``tp_size``, heads not described).
    ``page`` says what the bytes are (element type, axes, shape); without it the page is
    opaque and pairs only with another opaque page of the same size. ``role`` names what
    the page holds (``k``, ``v``, ``kv``, ``latent``, ``state`` or empty); ``layer`` is the
    model layer index when known. The planner refuses to pair members whose page, role or
    slice differ, because a byte copy between them would deliver wrong values.
    """

    name: str
    size: int
    offset: int = 0
    replicated: bool = True
    page: PageFormat | None = None
    role: str = ""
    shard: Shard | None = None
    layer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME:
            raise SpecError(f"member name must be a non-empty string of at most {MAX_NAME} chars")
        object.__setattr__(self, "size", spec_int(self.size, f"member {self.name}: size", lo=1))
        object.__setattr__(self, "offset", spec_int(self.offset, f"member {self.name}: offset"))
        if not isinstance(self.replicated, bool):
            raise SpecError(f"member {self.name}: replicated must be a bool")
        if self.page is None:
            object.__setattr__(self, "page", PageFormat.opaque(self.size))
        elif not isinstance(self.page, PageFormat):
            raise SpecError(f"member {self.name}: page must be a PageFormat")
        elif self.page.nbytes != self.size:
            raise SpecError(f"member {self.name}: page {self.page.describe()} is {self.page.nbytes} bytes, "
                            f"the member is {self.size}")
        if not isinstance(self.role, str) or not (self.role == "" or _ROLE.fullmatch(self.role)):
            raise SpecError(f"member {self.name}: role {self.role!r} must be empty or a short lowercase word")
        if self.shard is not None:
            if not isinstance(self.shard, Shard):
                raise SpecError(f"member {self.name}: shard must be a Shard")
            if self.replicated:
                raise SpecError(f"member {self.name}: a replicated member holds every head and has no shard")
            h = self.page.extent("H")
            if self.shard.heads is not None and h is not None and self.shard.heads[1] - self.shard.heads[0] != h:
                raise SpecError(f"member {self.name}: shard holds {self.shard.heads[1] - self.shard.heads[0]} "
                                f"heads but the page has H={h}")
        if self.layer is not None:
            object.__setattr__(self, "layer", spec_int(self.layer, f"member {self.name}: layer", hi=MAX_LAYER))

    @property
    def end(self) -> int:
        return self.offset + self.size

    def to_dict(self) -> dict[str, Any]:
        assert self.page is not None
        return {"name": self.name, "size": self.size, "offset": self.offset, "replicated": self.replicated,
                "role": self.role, "layer": self.layer, "page": self.page.to_dict(),
                "shard": self.shard.to_dict() if self.shard is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Member":
        _expect_keys("member", d, {"name", "size", "offset", "replicated", "role", "layer", "page", "shard"})
        shard = Shard.from_dict(d["shard"]) if d["shard"] is not None else None
        return cls(d["name"], d["size"], d["offset"], d["replicated"], PageFormat.from_dict(d["page"]), d["role"],
                   shard, d["layer"])


@dataclass(frozen=True)
class PackedLayout:
    """A row's stride plus every member's ``(offset, size)`` inside it.

    Members may alias (several transfer groups viewing a row from byte 0); the row's
    *extent* (first member byte to last member byte) is what a whole-row move copies.
    """

    stride: int
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stride", spec_int(self.stride, "row stride", lo=1))
        members = tuple(self.members)
        if not members:
            raise SpecError("a packed layout needs at least one member")
        if len(members) > MAX_MEMBERS:
            raise SpecError(f"too many members ({len(members)} > {MAX_MEMBERS})")
        for m in members:
            if not isinstance(m, Member):
                raise SpecError("members must be Member objects")
            if m.end > self.stride:
                raise SpecError(f"member {m.name}: offset {m.offset} + size {m.size} exceeds row stride {self.stride}")
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            # Counter, not names.count per name: a hostile spec may carry 65536 members.
            dup = sorted((n for n, c in collections.Counter(names).items() if c > 1), key=natural_key)
            raise SpecError(f"duplicate member names in one region: {abbreviate(dup)}")
        object.__setattr__(self, "members", members)

    @functools.cached_property
    def row_start(self) -> int:
        return min(m.offset for m in self.members)

    @functools.cached_property
    def row_len(self) -> int:
        """Bytes a whole-row descriptor moves: tail padding is never copied."""
        return max(m.end for m in self.members) - self.row_start

    @functools.cached_property
    def canonical(self) -> tuple[tuple[int, str, int], ...]:
        """Members as ``(offset from row start, name, size)`` in row order.

        Sorting makes comparisons independent of the order a peer lists its members in.
        What the pages hold is checked member by member before rows are compared.
        """
        return tuple(sorted((m.offset - self.row_start, m.name, m.size) for m in self.members))

    def to_dict(self) -> dict[str, Any]:
        return {"stride": self.stride, "members": [m.to_dict() for m in self.members]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PackedLayout":
        _expect_keys("packed layout", d, {"stride", "members"})
        if not isinstance(d["members"], list) or len(d["members"]) > MAX_MEMBERS:
            raise SpecError("packed layout: members must be a bounded list")
        return cls(d["stride"], tuple(Member.from_dict(m) for m in d["members"]))


@dataclass(frozen=True)
class Region:
    """How blocks are addressed inside one allocation.

    ``allocation`` is an index into the owning spec's allocations; ``offset`` is the byte
    offset of block 0's row inside that allocation.
    """

    allocation: int
    offset: int
    num_blocks: int
    layout: PackedLayout

    def __post_init__(self) -> None:
        object.__setattr__(self, "allocation", spec_int(self.allocation, "region allocation", hi=MAX_ALLOCATIONS - 1))
        object.__setattr__(self, "offset", spec_int(self.offset, "region offset"))
        object.__setattr__(self, "num_blocks", spec_int(self.num_blocks, "num_blocks", lo=1, hi=MAX_BLOCKS))
        if not isinstance(self.layout, PackedLayout):
            raise SpecError("region layout must be a PackedLayout")

    @property
    def members(self) -> tuple[Member, ...]:
        return self.layout.members

    @property
    def block_stride(self) -> int:
        return self.layout.stride

    @property
    def block_bytes(self) -> int:
        return self.layout.row_len

    @property
    def packed(self) -> bool:
        return len(self.layout.members) > 1

    @property
    def span(self) -> int:
        """Bytes from the region's offset to the end of the last block's last member."""
        return (self.num_blocks - 1) * self.layout.stride + self.layout.row_start + self.layout.row_len

    def to_dict(self) -> dict[str, Any]:
        return {"allocation": self.allocation, "offset": self.offset, "num_blocks": self.num_blocks,
                "layout": self.layout.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Region":
        _expect_keys("region", d, {"allocation", "offset", "num_blocks", "layout"})
        return cls(d["allocation"], d["offset"], d["num_blocks"], PackedLayout.from_dict(d["layout"]))


@dataclass(frozen=True)
class KVCacheSpec:
    """One worker's whole KV cache: allocations, regions, members and block geometry.

    Immutable and validated: every region lies inside its allocation, allocations are not
    duplicated, member names are unique across the spec (peers match members by name), and
    all regions index the same number of blocks.
    """

    allocations: tuple[Allocation, ...]
    regions: tuple[Region, ...]
    layout: str = "BLHNC"
    block_tokens: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: The tensors or arrays a spec was discovered from: a spec keeps its memory alive.
    _keepalive: tuple[Any, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        allocs = tuple(self.allocations)
        regions = tuple(self.regions)
        object.__setattr__(self, "allocations", allocs)
        object.__setattr__(self, "regions", regions)
        if not isinstance(self.layout, str) or not 0 < len(self.layout) <= 32:
            raise SpecError("layout must be a short non-empty string")
        object.__setattr__(self, "block_tokens", spec_int(self.block_tokens, "block_tokens", lo=1, hi=1 << 24))
        object.__setattr__(self, "tp_size", spec_int(self.tp_size, "tp_size", lo=1, hi=1 << 16))
        object.__setattr__(self, "tp_rank", spec_int(self.tp_rank, "tp_rank", hi=self.tp_size - 1))
        if not allocs or not regions:
            raise SpecError("a spec needs at least one allocation and one region")
        if len(allocs) > MAX_ALLOCATIONS or len(regions) > MAX_REGIONS:
            raise SpecError("too many allocations or regions")
        if not all(isinstance(a, Allocation) for a in allocs) or not all(isinstance(r, Region) for r in regions):
            raise SpecError("allocations must be Allocation and regions Region objects")
        keys = [(a.kind, a.device, a.address) for a in allocs]
        if len(set(keys)) != len(keys):
            raise SpecError("duplicate allocations: views over one storage must be one allocation")
        # Overlapping allocations of the same device would be registered twice.
        by_dev: dict[tuple[MemoryKind, int], list[Allocation]] = {}
        for a in allocs:
            by_dev.setdefault((a.kind, a.device), []).append(a)
        for group in by_dev.values():
            group.sort(key=lambda a: a.address)
            for prev, cur in zip(group, group[1:]):
                if cur.address < prev.end:
                    raise SpecError(f"allocations overlap at {cur.address:#x}; register the storage once")
        nb = {r.num_blocks for r in regions}
        if len(nb) != 1:
            raise SpecError(f"all regions must index the same number of blocks, got {sorted(nb)}")
        implied = sum(r.num_blocks * len(r.members) for r in regions)
        if implied > MAX_DESCRIPTORS:
            raise SpecError(f"spec implies {implied} per-member descriptors, over the {MAX_DESCRIPTORS} limit")
        seen: set[str] = set()
        for i, r in enumerate(regions):
            if r.allocation >= len(allocs):
                raise SpecError(f"region {i}: allocation index {r.allocation} out of range ({len(allocs)})")
            a = allocs[r.allocation]
            if r.offset + r.span > a.nbytes:
                raise SpecError(f"region {i} ends {r.offset + r.span - a.nbytes} bytes past its allocation")
            for m in r.members:
                if m.name in seen:
                    raise SpecError(f"member {m.name!r} appears in more than one region")
                seen.add(m.name)

    # -- derived facts -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def members(self) -> tuple[Member, ...]:
        return tuple(m for r in self.regions for m in r.members)

    @property
    def kinds(self) -> tuple[MemoryKind, ...]:
        return tuple(dict.fromkeys(self.allocations[r.allocation].kind for r in self.regions))

    def region_kind(self, region: int) -> MemoryKind:
        return self.allocations[self.regions[region].allocation].kind

    @property
    def row_bytes(self) -> int:
        """Bytes per block summed over regions (what one block costs to move)."""
        return sum(r.block_bytes for r in self.regions)

    # -- prepared lists ------------------------------------------------------------------
    def list_bases(self, granularity: Granularity) -> np.ndarray:
        """Index of each region's first descriptor inside its kind's prepared list.

        ``ROWS``: descriptor of block b of region r is ``base[r] + b``.
        ``MEMBERS``: member m (position in the region) of block b is ``base[r] + m*B + b``;
        member-major order lets each member be one strided row.
        """
        key = ("bases", Granularity(granularity))
        if key not in self._cache:
            bases = np.zeros(len(self.regions), dtype=np.int64)
            nxt: dict[MemoryKind, int] = {}
            for i, r in enumerate(self.regions):
                k = self.region_kind(i)
                bases[i] = nxt.get(k, 0)
                per = 1 if key[1] is Granularity.ROWS else len(r.members)
                nxt[k] = int(bases[i]) + per * r.num_blocks
            self._cache[key] = bases
        return self._cache[key]

    def allocation_starts(self, kind: MemoryKind) -> np.ndarray:
        """Start addresses of this spec's allocations of one kind, sorted (computed once).

        Two storages can sit back to back in memory; a run of descriptors must not cross
        from one registered allocation into the next, or the merged descriptor spans two
        registrations. Allocations of one kind and device never overlap, so two contiguous
        descriptors lie in different allocations exactly when the second starts where an
        allocation starts. Read on every coalesced transfer.
        """
        key = ("alloc_starts", kind)
        if key not in self._cache:
            self._cache[key] = np.array(sorted({a.address for a in self.allocations if a.kind is kind}),
                                        dtype=np.uint64)
        return self._cache[key]  # type: ignore[no-any-return]

    def descriptor_list(self, granularity: Granularity, kind: MemoryKind, *, strided: bool = False) -> DescriptorList:
        """The list a backend prepares once; plans index into it."""
        granularity, kind = Granularity(granularity), MemoryKind(kind)
        key = ("list", granularity, kind, strided)
        if key not in self._cache:
            rows = []
            for i, r in enumerate(self.regions):
                a = self.allocations[r.allocation]
                if a.kind is not kind:
                    continue
                base = a.address + r.offset
                if granularity is Granularity.ROWS:
                    rows.append((base + r.layout.row_start, r.layout.row_len, a.device, r.block_stride, r.num_blocks))
                else:
                    rows.extend((base + m.offset, m.size, a.device, r.block_stride, r.num_blocks) for m in r.members)
            if not rows:
                raise SpecError(f"spec has no {kind.value} regions")
            dl = DescriptorList(np.array(rows, dtype=np.uint64), kind)
            self._cache[key] = dl if strided else dl.expand()
        return self._cache[key]

    # -- wire form -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "block_tokens": self.block_tokens,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "allocations": [a.to_dict() for a in self.allocations],
            "regions": [r.to_dict() for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KVCacheSpec":
        _expect_keys("spec", d, {"layout", "block_tokens", "tp_rank", "tp_size", "allocations", "regions"})
        for k in ("allocations", "regions"):
            if not isinstance(d[k], list):
                raise SpecError(f"spec: {k} must be a list")
        if len(d["allocations"]) > MAX_ALLOCATIONS or len(d["regions"]) > MAX_REGIONS:
            raise SpecError("spec: too many allocations or regions")
        return cls(
            tuple(Allocation.from_dict(a) for a in d["allocations"]),
            tuple(Region.from_dict(r) for r in d["regions"]),
            layout=d["layout"], block_tokens=d["block_tokens"], tp_rank=d["tp_rank"], tp_size=d["tp_size"],
        )


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting ``layer.2`` before ``layer.10``: digit runs compare as numbers."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p)


def abbreviate(names: Iterable[str], limit: int = 6) -> str:
    """The first ``limit`` names, joined, and how many more: a refusal stays one readable line."""
    names = list(names)
    s = ", ".join(names[:limit])
    return s + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
