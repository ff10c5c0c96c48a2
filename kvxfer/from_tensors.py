"""Discovery: from the tensors a serving engine hands its connector to a :class:`KVCacheSpec`.

Rules (DESIGN.md section 3):

* Dimension 0 of every tensor indexes blocks.
* Views over one storage are **one** allocation, however many views there are.
* If ``num_blocks * stride(0) == storage bytes`` the storage is block-outermost: every block
  is one row holding all the views' pages, so all those views become members of **one**
  packed region, each at its offset inside the row. Views may alias (start at the same byte).
* Otherwise each tensor is a layer-outermost region with a single member.

torch is never imported here: a tensor is recognised by its methods, so a CPU-only install
with numpy alone works, and torch is touched only when the caller passes torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import SpecError
from .layout import KNOWN_LAYOUTS, KVCacheSpec, Member, PackedLayout, Region
from .memory import Allocation, MemoryKind

__all__ = ["spec_from_tensors", "spec_from_arrays", "spec_from_pointers"]

Replication = bool | Iterable[str] | Callable[[str], bool]


@dataclass(frozen=True)
class _View:
    name: str
    ptr: int
    storage_ptr: int
    storage_nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int
    kind: MemoryKind
    device: int

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.itemsize


def _describe(name: str, x: Any) -> _View:
    """Read pointer, storage and strides from a torch tensor or a numpy array."""
    if isinstance(x, np.ndarray):
        owner = x
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        return _View(name, int(x.__array_interface__["data"][0]), int(owner.__array_interface__["data"][0]),
                     int(owner.nbytes), tuple(int(s) for s in x.shape), tuple(int(s) for s in x.strides),
                     int(x.itemsize), MemoryKind.DRAM, 0)
    if hasattr(x, "untyped_storage") and hasattr(x, "data_ptr") and hasattr(x, "element_size"):
        st = x.untyped_storage()
        dev = x.device
        kind = MemoryKind.VRAM if dev.type == "cuda" else MemoryKind.DRAM
        if dev.type not in ("cuda", "cpu"):
            raise SpecError(f"{name}: tensors on {dev.type!r} are not supported (cpu or cuda)")
        es = int(x.element_size())
        return _View(name, int(x.data_ptr()), int(st.data_ptr()), int(st.nbytes()), tuple(int(s) for s in x.shape),
                     tuple(int(s) * es for s in x.stride()), es, kind, int(dev.index or 0) if kind is MemoryKind.VRAM else 0)
    raise SpecError(f"{name}: expected a torch tensor or numpy array, got {type(x).__name__}")


def _dense_inner(v: _View) -> bool:
    """True when one block's page (dims 1..) is one dense span, in any dim order."""
    dims = [(st, sh) for st, sh in zip(v.strides[1:], v.shape[1:]) if sh != 1]
    dims.sort(reverse=True)
    expect = v.itemsize
    for st, sh in reversed(dims):
        if st != expect:
            return False
        expect *= sh
    return True


def _inner_order(v: _View) -> str:
    """Physical order of heads and tokens for a logical ``(B, N, H, C)`` view."""
    if len(v.shape) == 4 and v.shape[1] > 1 and v.shape[2] > 1:
        return "NHC" if v.strides[1] > v.strides[2] else "HNC"
    return "HNC"


def _split_kv(name: str, v: _View, kv_dim: int) -> list[_View]:
    """A page holding K then V along ``kv_dim`` becomes two members ``name.k`` / ``name.v``."""
    if len(v.shape) <= kv_dim or v.shape[kv_dim] != 2:
        raise SpecError(f"{name}: kv_dim={kv_dim} needs size 2 there, shape is {v.shape}")
    out = []
    for i, suffix in enumerate(("k", "v")):
        shape = v.shape[:kv_dim] + v.shape[kv_dim + 1:]
        strides = v.strides[:kv_dim] + v.strides[kv_dim + 1:]
        out.append(_View(f"{name}.{suffix}", v.ptr + i * v.strides[kv_dim], v.storage_ptr, v.storage_nbytes,
                         shape, strides, v.itemsize, v.kind, v.device))
    return out


def _replication(replicated: Replication) -> Callable[[str], bool]:
    if isinstance(replicated, bool):
        return lambda _n: replicated
    if callable(replicated):
        return lambda n: bool(replicated(n))  # type: ignore[operator]
    names = set(replicated)
    return lambda n: n in names or n.rsplit(".", 1)[0] in names


def spec_from_tensors(kv_caches: Mapping[str, Any], *, replicated: Replication = False, tp_rank: int = 0,
                      tp_size: int = 1, layout: str | None = None, block_tokens: int | None = None,
                      kv_dim: int | None = None) -> KVCacheSpec:
    """Build a spec from ``{name: tensor | array | (k, v)}``.

    ``replicated``: True/False for every member, a set of names, or a predicate. MLA latent
    caches are replicated across TP ranks; GQA/MHA pages are head-split (the default, the
    safe answer: whole rows then move only between ranks holding the same slice).
    ``kv_dim``: split each page into ``.k``/``.v`` members along that dimension.
    """
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise SpecError("kv_caches must be a non-empty mapping of name -> tensor")
    views: list[_View] = []
    source: dict[str, str] = {}  # view name -> the kv_caches entry it came from
    for name, x in kv_caches.items():
        if not isinstance(name, str):
            raise SpecError(f"layer names must be strings, got {name!r}")
        n0 = len(views)
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise SpecError(f"{name}: a tuple must be (k, v)")
            views += [_describe(f"{name}.k", x[0]), _describe(f"{name}.v", x[1])]
        else:
            v = _describe(name, x)
            views += _split_kv(name, v, kv_dim) if kv_dim is not None else [v]
        source.update((v.name, name) for v in views[n0:])
    for v in views:
        if len(v.shape) < 2:
            raise SpecError(f"{v.name}: need at least 2 dims (blocks first), shape is {v.shape}")
        if not _dense_inner(v):
            raise SpecError(f"{v.name}: one block's page is not contiguous (strides {v.strides}); "
                            "pass a view whose dims after the first are dense")
        if v.strides[0] < v.page_bytes:
            raise SpecError(f"{v.name}: dimension 0 must index blocks (stride {v.strides[0]} < page {v.page_bytes})")
    is_rep = _replication(replicated)

    # One allocation per storage.
    alloc_index: dict[tuple[MemoryKind, int, int], int] = {}
    allocs: list[Allocation] = []
    for v in views:
        key = (v.kind, v.device, v.storage_ptr)
        if key not in alloc_index:
            alloc_index[key] = len(allocs)
            allocs.append(Allocation(v.storage_ptr, v.storage_nbytes, v.kind, v.device))

    # Block-outermost storages: one packed region per (storage, stride); else one per view.
    packed: dict[tuple[int, int, int], list[_View]] = {}
    regions: list[Region] = []
    block_outer = True
    for v in views:
        ai = alloc_index[(v.kind, v.device, v.storage_ptr)]
        if v.shape[0] * v.strides[0] == v.storage_nbytes:
            packed.setdefault((ai, v.strides[0], v.shape[0]), []).append(v)
        else:
            off = v.ptr - v.storage_ptr
            regions.append(Region(ai, off, v.shape[0], PackedLayout(
                v.strides[0], (Member(v.name, v.page_bytes, 0, is_rep(v.name)),))))
            block_outer = False
    for (ai, stride, nb), group in packed.items():
        members = tuple(Member(v.name, v.page_bytes, v.ptr - v.storage_ptr, is_rep(v.name)) for v in group)
        regions.append(Region(ai, 0, nb, PackedLayout(stride, members)))
        # A storage of its own per layer (even one holding that layer's K and V per block)
        # is layer-outermost: block-outermost means one row holds several layers' pages.
        if len(kv_caches) > 1 and len({source[v.name] for v in group}) < 2:
            block_outer = False

    if layout is None:
        layout = ("BL" if block_outer else "LB") + _inner_order(views[0])
    elif layout not in KNOWN_LAYOUTS:
        raise SpecError(f"unknown layout {layout!r}; known: {', '.join(KNOWN_LAYOUTS)}")
    if block_tokens is None:
        block_tokens = views[0].shape[1] if len(views[0].shape) >= 3 else 1
    return KVCacheSpec(tuple(allocs), tuple(regions), layout=layout, block_tokens=block_tokens,
                       tp_rank=tp_rank, tp_size=tp_size)


def spec_from_arrays(kv_caches: Mapping[str, Any], **options: Any) -> KVCacheSpec:
    """numpy arrays in host memory; same rules and options as :func:`spec_from_tensors`."""
    for name, x in kv_caches.items():
        items = x if isinstance(x, (tuple, list)) else (x,)
        if not all(isinstance(i, np.ndarray) for i in items):
            raise SpecError(f"{name}: spec_from_arrays takes numpy arrays")
    return spec_from_tensors(kv_caches, **options)


def spec_from_pointers(spans: Sequence[tuple[int, int, int]] | tuple[int, int, int], *, num_blocks: int,
                       members: Sequence[Member | tuple[str, int]], layout: str = "BLHNC",
                       kind: MemoryKind | str = MemoryKind.DRAM, block_stride: int | None = None,
                       replicated: Replication = False, block_tokens: int = 1, tp_rank: int = 0,
                       tp_size: int = 1) -> KVCacheSpec:
    """Build a spec from raw ``(pointer, nbytes, device)`` spans and an explicit geometry.

    ``BL*`` layouts: one span, one packed region; members without offsets are packed back
    to back and the row stride defaults to ``nbytes // num_blocks``. ``LB*`` layouts: either
    one span per member, or one span holding each member's region one after another.
    """
    if isinstance(spans, tuple) and len(spans) == 3 and all(isinstance(s, (int, np.integer)) for s in spans):
        spans = [spans]  # type: ignore[list-item]
    spans = [(int(s[0]), int(s[1]), int(s[2])) for s in spans]  # type: ignore[index]
    if layout not in KNOWN_LAYOUTS:
        raise SpecError(f"unknown layout {layout!r}; known: {', '.join(KNOWN_LAYOUTS)}")
    is_rep = _replication(replicated)
    ms: list[Member] = []
    cursor = 0
    for m in members:
        if isinstance(m, Member):
            ms.append(m)
            cursor = m.end
        else:
            name, size = m
            ms.append(Member(name, int(size), cursor, is_rep(name)))
            cursor += int(size)
    kind = MemoryKind(kind)
    allocs = tuple(Allocation(p, n, kind, d) for p, n, d in spans)
    if layout.startswith("BL"):
        if len(allocs) != 1:
            raise SpecError("a block-outermost layout takes exactly one span")
        stride = block_stride if block_stride is not None else allocs[0].nbytes // num_blocks
        regions: tuple[Region, ...] = (Region(0, 0, num_blocks, PackedLayout(stride, tuple(ms))),)
    else:
        flat = [Member(m.name, m.size, 0, m.replicated) for m in ms]
        if len(allocs) == len(flat):
            regions = tuple(Region(i, 0, num_blocks, PackedLayout(block_stride or m.size, (m,)))
                            for i, m in enumerate(flat))
        elif len(allocs) == 1:
            off, rs = 0, []
            for m in flat:
                stride = block_stride or m.size
                rs.append(Region(0, off, num_blocks, PackedLayout(stride, (m,))))
                off += stride * num_blocks
            regions = tuple(rs)
        else:
            raise SpecError("a layer-outermost layout takes one span per member, or one span for all")
    return KVCacheSpec(allocs, regions, layout=layout, block_tokens=block_tokens, tp_rank=tp_rank, tp_size=tp_size)
