"""Cells (what a digest covers) and spans (where a side's copy of each cell lives).

A :class:`Cells` list is logical: member names and byte ranges inside member pages, the same
whatever the layout. :class:`CellSpans` is one side's placement of those cells for a set of
blocks: per cell, the address of block 0 and the block stride; per digest row, the block id
(and, for a destination block that covers several source blocks, the sub-block). Address
arithmetic is the layout model's (docs/geometry.md), vectorised over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import IntegrityError, UnsupportedError
from ..geometry import KVCacheSpec
from ..memory import MemoryKind

__all__ = ["Cells", "CellSpans", "cells_for", "gather_cells", "gather_spans", "local_spans", "source_spans"]

#: The most cells one digest set may name (a peer-supplied list is bounded before use).
MAX_CELLS = 1 << 16


@dataclass(frozen=True)
class Cells:
    """``(member, offset, length)`` byte ranges of a member page, one digest each per block."""

    members: tuple[str, ...]
    offsets: np.ndarray  # int64 [C], bytes from the page start
    lengths: np.ndarray  # int64 [C]

    def __len__(self) -> int:
        return len(self.members)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Cells) and self.members == other.members
                and np.array_equal(self.offsets, other.offsets) and np.array_equal(self.lengths, other.lengths))

    def __hash__(self) -> int:
        return hash((self.members, self.offsets.tobytes(), self.lengths.tobytes()))

    @property
    def whole_pages(self) -> bool:
        return bool((self.offsets == 0).all()) and len(set(self.members)) == len(self.members)

    @classmethod
    def tokens(cls, spec: KVCacheSpec, n: int) -> "Cells":
        """The bytes of a block's first ``n`` tokens: what a partly filled last block holds.

        Per member page, one cell per index of the axes outside the token axis (``N``); a
        page with no token axis (or described only by its size) is one whole-page cell.
        """
        names: list[str] = []
        offs: list[np.ndarray] = []
        lens: list[np.ndarray] = []
        for m in spec.members:
            p = m.page
            if p is None or p.is_opaque or "N" not in p.axes:
                names.append(m.name)
                offs.append(np.zeros(1, np.int64))
                lens.append(np.array([m.size], np.int64))
                continue
            i = p.axes.index("N")
            if not 0 < n <= p.shape[i]:
                raise IntegrityError(f"member {m.name!r}: {n} tokens of a {p.shape[i]}-token page", member=m.name)
            inner = int(np.prod(p.shape[i + 1:], dtype=np.int64)) * p.itemsize
            outer = p.shape[:i]
            strides = [int(np.prod(p.shape[k + 1:], dtype=np.int64)) * p.itemsize for k in range(i)]
            idx = np.indices(outer, dtype=np.int64).reshape(len(outer), -1) if outer else np.zeros((0, 1), np.int64)
            o = (idx * np.array(strides, np.int64)[:, None]).sum(axis=0) if outer else np.zeros(1, np.int64)
            names.extend([m.name] * o.shape[0])
            offs.append(o)
            lens.append(np.full(o.shape[0], n * inner, np.int64))
        return cls(tuple(names), np.concatenate(offs), np.concatenate(lens))

    @classmethod
    def pages(cls, spec: KVCacheSpec, members: Sequence[str] | None = None) -> "Cells":
        """One cell per member page: the default, and what names a block and member."""
        if members is None:  # the default, asked per group of rows by the store: made once per spec
            got = spec._cache.get(("integrity-pages",))
            if got is None:
                got = spec._cache[("integrity-pages",)] = cls.pages(spec, [m.name for m in spec.members])
                got.offsets.setflags(write=False)
                got.lengths.setflags(write=False)
            return got
        by = {m.name: m for m in spec.members}
        names = tuple(members)
        missing = [n for n in names if n not in by]
        if missing:
            raise IntegrityError(f"no member {missing[0]!r} in this cache; cannot digest it", member=missing[0])
        return cls(names, np.zeros(len(names), np.int64), np.array([by[n].size for n in names], np.int64))


@dataclass(frozen=True)
class CellSpans:
    """One side's copy of ``cells`` for ``rows`` blocks: address = base + b*stride + sub*substride."""

    base: np.ndarray  # int64 [C] absolute address of block 0, sub-block 0
    stride: np.ndarray  # int64 [C]
    substride: np.ndarray  # int64 [C]
    length: np.ndarray  # int64 [C]
    alloc: np.ndarray  # int64 [C] index into allocations
    allocations: tuple[Any, ...]
    block: np.ndarray  # int64 [B]
    sub: np.ndarray  # int64 [B]

    def addresses(self) -> np.ndarray:
        """``[B, C]`` start address of every cell copy (a few broadcasts)."""
        return (self.base[None, :] + self.block[:, None] * self.stride[None, :]
                + self.sub[:, None] * self.substride[None, :])

    def kinds(self) -> set[MemoryKind]:
        return {self.allocations[a].kind for a in set(self.alloc.tolist())}  # a few members: no np.unique


def _member_places(spec: KVCacheSpec) -> dict[str, tuple[int, int, int, int]]:
    """name -> (allocation index, address of block 0's page, block stride, page size)."""
    key = ("integrity-places",)
    got = spec._cache.get(key)
    if got is None:
        got = {}
        for r in spec.regions:
            a = spec.allocations[r.allocation]
            for m in r.members:
                got[m.name] = (r.allocation, a.address + r.offset + m.offset, r.block_stride, m.size)
        spec._cache[key] = got
    return got


def _spans(spec: KVCacheSpec, cells: Cells, block: np.ndarray, sub: np.ndarray | None = None) -> CellSpans:
    key = ("integrity-spans", cells)
    arr = spec._cache.get(key)
    if arr is None:
        arr = _template(spec, cells)
        if len(spec._cache) < 64:  # a few cell lists per cache (pages, a partial block's tokens)
            spec._cache[key] = arr
    b = np.asarray(block, dtype=np.int64).reshape(-1)
    if b.size and (b.min() < 0 or b.max() >= spec.num_blocks):
        raise IntegrityError(f"block id out of range for a cache of {spec.num_blocks} blocks")
    s = np.zeros_like(b) if sub is None else np.asarray(sub, dtype=np.int64)
    return CellSpans(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4], spec.allocations, b, s)


def _template(spec: KVCacheSpec, cells: Cells) -> np.ndarray:
    """``[C, 5]`` (address of block 0, block stride, 0, length, allocation) of each cell, checked."""
    places = _member_places(spec)
    rows = []
    for name, off, ln in zip(cells.members, cells.offsets.tolist(), cells.lengths.tolist()):
        p = places.get(name)
        if p is None:
            raise IntegrityError(f"member {name!r} of the digests is not in this cache", member=name)
        if off < 0 or ln <= 0 or off + ln > p[3]:
            raise IntegrityError(f"cell {off}+{ln} lies outside member {name!r} ({p[3]} bytes)", member=name)
        rows.append((p[1] + off, p[2], 0, ln, p[0]))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 5)
    arr.setflags(write=False)  # shared by every CellSpans made from it
    return arr


def source_spans(spec: KVCacheSpec, blocks: Any, cells: Cells) -> CellSpans:
    """Where the source's cells lie for ``blocks``."""
    return _spans(spec, cells, np.asarray(blocks))


def local_spans(spec: KVCacheSpec, blocks: Any, cells: Cells) -> CellSpans:
    """Where a same-geometry destination holds the same cells (members matched by name)."""
    return _spans(spec, cells, np.asarray(blocks))


def gather_cells(gather: Any, peer: str, local: KVCacheSpec, remote: KVCacheSpec) -> tuple[Cells, np.ndarray]:
    """For a heterogeneous read from ``peer``: the cells of its pages we copy, and our templates.

    Each row of the gather's copy table is one byte range of a remote page landing at one
    place in a local page; that range is the cell. Returns the cells (remote member, offset,
    length) and ``[C, 4]`` local templates (address of block 0, stride, sub-block step,
    allocation index).
    """
    tabs = gather.tables.get(peer)
    if not tabs:
        raise UnsupportedError(f"peer {peer!r} supplies nothing to this cache; there is nothing to verify")
    t = np.concatenate(list(tabs.values()), axis=0)
    places = sorted((p[1], p[1] + p[3], n) for n, p in _member_places(remote).items())
    starts = np.array([p[0] for p in places], dtype=np.int64)
    idx = np.searchsorted(starts, t[:, 4], side="right") - 1
    names = tuple(places[int(i)][2] for i in idx)
    offs = t[:, 4] - starts[idx]
    lens = t[:, 7]
    if (idx < 0).any() or (offs + lens > np.array([places[int(i)][1] - places[int(i)][0] for i in idx])).any():
        raise UnsupportedError("a copied range does not lie inside one remote page; cannot verify it")
    lallocs = np.array([_alloc_of(local, int(a)) for a in t[:, 0]], dtype=np.int64)
    return Cells(names, offs.astype(np.int64), lens.astype(np.int64)), np.stack([t[:, 0], t[:, 1], t[:, 2], lallocs], 1)


def _alloc_of(spec: KVCacheSpec, address: int) -> int:
    for i, a in enumerate(spec.allocations):
        if a.address <= address < a.end:
            return i
    raise UnsupportedError(f"address {address:#x} lies in no local allocation")


def cells_for(gather: Any, peer: str, local: KVCacheSpec, remote: KVCacheSpec) -> Cells:
    """The cells a heterogeneous destination asks ``peer`` to digest (sent to the source)."""
    return gather_cells(gather, peer, local, remote)[0]


def gather_spans(local: KVCacheSpec, templates: np.ndarray, cells: Cells, lblk: np.ndarray, sub: np.ndarray) -> CellSpans:
    """Our copy of a gather's cells: block ``lblk[j]``, sub-block ``sub[j]`` for remote block ``j``."""
    return CellSpans(templates[:, 0].copy(), templates[:, 1].copy(), templates[:, 2].copy(),
                 cells.lengths.copy(), templates[:, 3].copy(), local.allocations,
                 np.asarray(lblk, np.int64), np.asarray(sub, np.int64))
