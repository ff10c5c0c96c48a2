"""Discovery: from the tensors a serving engine hands its connector to a :class:`KVCacheSpec`.

Rules (docs/geometry.md has the table of recognised engine shapes):

* Each tensor's dimensions are named by letters (``B`` blocks, ``L`` layers, ``K`` the K/V
  pair, ``N`` tokens, ``H`` heads, ``D`` head dim or latent channels, ``S`` state, ``X``
  other), taken from the ``dims`` option or recognised from the shape; shapes that could
  mean two things are refused until ``dims`` says which.
* ``L`` makes one member per layer; ``K`` (or ``kv_dim``) makes ``.k``/``.v`` members, so
  vLLM's ``[2, blocks, ...]`` and FlashInfer's ``[blocks, 2, ...]`` name the same members.
* Views over one storage are **one** allocation, however many views there are.
* If ``num_blocks * block stride == storage bytes`` the storage is block-outermost: every
  block is one row holding all the views' pages, so all those views become members of
  **one** packed region, each at its offset inside the row. Views may alias.
* Otherwise each piece is a layer-outermost region with a single member.
* Each member records its element type, its page axes in memory order, its role and, when
  head-split, the KV heads this rank holds, so that mismatched peers are refused.

torch is never imported here: a tensor is recognised by its methods, so a CPU-only install
with numpy alone works, and torch is touched only when the caller passes torch tensors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, SpecError, UnknownOptionError
from ._spec import KNOWN_LAYOUTS, MAX_ALLOCATIONS, MAX_MEMBERS, KVCacheSpec, Member, PackedLayout, Region
from ..memory import Allocation, MemoryKind
from ._options import (Replication, check_options, check_pointer_members, check_spans, check_tp, replicated_heads,
                       replication)
from ._pageformat import PageFormat, Shard

__all__ = ["spec_from_tensors", "spec_from_arrays", "spec_from_pointers", "DIM_LETTERS", "DISCOVERY_OPTIONS"]

Dims = str | Mapping[str, str | Sequence[str]] | None

#: The options :func:`spec_from_tensors` (and so ``Agent.register``) takes.
DISCOVERY_OPTIONS = frozenset({"replicated", "tp_rank", "tp_size", "layout", "block_tokens", "kv_dim", "dims",
                               "kv_heads"})
#: Letters the ``dims`` option accepts, one per tensor dimension.
DIM_LETTERS = "BLKNHDSX"
_HINT = ("pass dims={name: letters}, one letter per dimension: B blocks, L layers, K the K/V pair (size 2), "
         "N tokens, H KV heads, D head dim or latent channels, S state, X other; e.g. 'KBNHD' for "
         "[2, blocks, tokens, heads, head_dim]")


@dataclass(frozen=True)
class _Tensor:
    """Pointer, storage and strides of one torch tensor or numpy array (strides in bytes)."""

    name: str
    ptr: int
    storage_ptr: int
    storage_nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    kind: MemoryKind
    device: int


@dataclass(frozen=True)
class _Piece:
    """One member's pages: where block 0's page starts, the block dim, the page format."""

    name: str
    entry: str
    ptr: int
    t: _Tensor
    num_blocks: int
    block_stride: int
    page: PageFormat
    role: str
    layer: int | None

    @property
    def page_bytes(self) -> int:
        return self.page.nbytes


def _describe(name: str, x: Any) -> _Tensor:
    """Read pointer, storage, strides and dtype from a torch tensor or a numpy array.

    An already described tensor (a spec file's planning view at a fake address) passes
    through, so spec files are discovered by these same rules.
    """
    if isinstance(x, _Tensor):
        return dataclasses.replace(x, name=name)
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise SpecError(f"{name}: arrays of Python objects hold pointers, not KV bytes")
        if not x.flags.writeable:
            raise SpecError(f"{name}: the array is read-only, but transfers write into registered memory; "
                            "pass a writable array")
        owner = x
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        return _Tensor(name, int(x.__array_interface__["data"][0]), int(owner.__array_interface__["data"][0]),
                       int(owner.nbytes), tuple(int(s) for s in x.shape), tuple(int(s) for s in x.strides),
                       int(x.itemsize), _dtype_name(name, x.dtype.name), MemoryKind.DRAM, 0)
    if hasattr(x, "untyped_storage") and hasattr(x, "data_ptr") and hasattr(x, "element_size"):
        st = x.untyped_storage()
        dev = x.device
        if dev.type not in ("cuda", "cpu"):
            raise SpecError(f"{name}: tensors on {dev.type!r} are not supported (cpu or cuda)")
        kind = MemoryKind.VRAM if dev.type == "cuda" else MemoryKind.DRAM
        es = int(x.element_size())
        return _Tensor(name, int(x.data_ptr()), int(st.data_ptr()), int(st.nbytes()), tuple(int(s) for s in x.shape),
                       tuple(int(s) * es for s in x.stride()), es, _dtype_name(name, str(x.dtype).split(".")[-1]),
                       kind, int(dev.index or 0) if kind is MemoryKind.VRAM else 0)
    raise SpecError(f"{name}: expected a torch tensor or numpy array, got {type(x).__name__}")


def _dtype_name(name: str, dt: str) -> str:
    dt = dt.lower()
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", dt):
        raise SpecError(f"{name}: element type {dt!r} cannot be described")
    return dt


def _auto_dims(t: _Tensor, form: str) -> str:
    """Letters for the shapes engines hand over; anything that could mean two things is refused."""
    n, shape = len(t.shape), t.shape
    if n < 2:
        raise SpecError(f"{t.name}: need at least 2 dims (blocks first), shape is {shape}")
    if form == "state":
        if n in (3, 4):
            return "BDS" if n == 3 else "BHDS"
        raise SpecError(f"{t.name}: a state tensor of shape {shape} is not recognised; {_HINT}")
    if n == 2:
        return "BX"
    if n == 3:
        return "BND"
    if n == 4:
        return "BNHD"
    if n == 5 and form == "tensor":
        k_first, k_second = shape[0] == 2, shape[1] == 2
        if k_first and not k_second:
            return "KBNHD"  # vLLM FlashAttention: K and V outermost
        if k_second and not k_first:
            return "BKNHD"  # FlashInfer: K and V inside each block
        if k_first and k_second:
            raise SpecError(f"{t.name}: shape {shape} is either [2, blocks=2, ...] or [blocks=2, 2, ...]; {_HINT}")
    raise SpecError(f"{t.name}: cannot tell what the dimensions of shape {shape} are; {_HINT}")


def _check_dims(t: _Tensor, dims: str) -> None:
    if not isinstance(dims, str) or len(dims) != len(t.shape):
        raise SpecError(f"{t.name}: dims {dims!r} needs one letter per dimension of shape {t.shape}")
    bad = set(dims) - set(DIM_LETTERS)
    if bad:
        raise SpecError(f"{t.name}: dims {dims!r} has unknown letters {''.join(sorted(bad))}; {_HINT}")
    if dims.count("B") != 1 or any(dims.count(a) > 1 for a in "LKNHD"):
        raise SpecError(f"{t.name}: dims {dims!r} needs exactly one B and at most one of L, K, N, H, D")
    if "K" in dims and t.shape[dims.index("K")] != 2:
        raise SpecError(f"{t.name}: dims {dims!r} puts K/V on a dimension of size {t.shape[dims.index('K')]}")


def _page(t: _Tensor, letters: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> PageFormat | None:
    """Page axes in memory order, or None when one block's page is not one dense span.

    Axes of extent 1 carry no order, so they go last: two pages that differ only there
    hold identical bytes and must compare equal.
    """
    big = sorted(((st, i) for i, (sh, st) in enumerate(zip(shape, strides)) if sh != 1), key=lambda p: -p[0])
    expect = t.itemsize
    for st, i in reversed(big):
        if st != expect:
            return None
        expect *= shape[i]
    order = [i for _, i in big] + [i for i, sh in enumerate(shape) if sh == 1]
    if not order:
        return PageFormat(t.dtype, t.itemsize, "X", (1,))
    axes = "".join(letters[i] for i in order)
    return PageFormat(t.dtype, t.itemsize, axes, tuple(shape[i] for i in order))


def _pieces(entry: str, base: str, t: _Tensor, dims: str, role: str, kv_dim: int | None) -> list[_Piece]:
    """Split one tensor into members: one per layer (``L``), ``.k`` and ``.v`` (``K``)."""
    _check_dims(t, dims)
    if kv_dim is not None and dims[kv_dim] != "K":
        raise SpecError(f"{t.name}: kv_dim={kv_dim} but dims {dims!r} do not put K/V there")
    # (name suffix, pointer offset, role, layer) per piece, then the dims that remain.
    parts: list[tuple[str, int, str, int | None]] = [("", 0, role, None)]
    keep = list(range(len(dims)))
    if "L" in dims:
        li = dims.index("L")
        parts = [(f"{s}.{j}", off + j * t.strides[li], r, j) for s, off, r, _ in parts for j in range(t.shape[li])]
        keep.remove(li)
    if "K" in dims:  # K and V become members of their own, so every engine's K/V layout pairs by name
        ki = dims.index("K")
        parts = [(f"{s}.{kv}", off + j * t.strides[ki], kv, lay)
                 for s, off, _, lay in parts for j, kv in enumerate(("k", "v"))]
        keep.remove(ki)
    bi = dims.index("B")
    inner = [i for i in keep if i != bi]
    letters = "".join(dims[i] for i in inner)
    page = _page(t, letters, tuple(t.shape[i] for i in inner), tuple(t.strides[i] for i in inner))
    if page is None:
        raise SpecError(f"{t.name}: one block's page is not contiguous (shape {t.shape}, strides {t.strides}); "
                        "pass a view whose page dims are dense")
    if not role:
        role = "state" if "S" in page.axes else "latent" if ("N" in page.axes and "D" in page.axes
                                                             and "H" not in letters) else ""
    nb, bstride = t.shape[bi], t.strides[bi]
    if bstride < page.nbytes and nb > 1:
        raise SpecError(f"{t.name}: the block dimension must be outermost in memory "
                        f"(its stride {bstride} < page {page.nbytes} bytes); {_HINT}")
    out = []
    for suffix, off, r, lay in parts:
        out.append(_Piece(base + suffix, entry, t.ptr + off, t, nb, max(bstride, page.nbytes), page, r or role,
                          lay if lay is not None else _layer_of(entry)))
    return out


def _layer_of(name: str) -> int | None:
    """The layer index in a name holding exactly one number (``model.layers.17.attn``)."""
    nums = re.findall(r"\d+", name)
    return int(nums[0]) if len(nums) == 1 and len(nums[0]) <= 7 else None


def _shard(p: _Piece, tp_rank: int, tp_size: int, kv_heads: int | None) -> Shard:
    """The KV heads this rank holds, assuming heads are dealt out to ranks in order."""
    h = p.page.extent("H")
    if h is None:
        return Shard(tp_rank, tp_size)
    total = kv_heads if kv_heads is not None and p.role != "state" else h * tp_size
    if total >= tp_size:
        if total % tp_size or total // tp_size != h:
            raise SpecError(f"{p.name}: {h} heads per rank does not fit kv_heads={total} over TP size {tp_size}")
        return Shard(tp_rank, tp_size, (tp_rank * h, tp_rank * h + h), total)
    if tp_size % total or h != 1:  # more ranks than heads: each head is held by tp_size / total ranks
        raise SpecError(f"{p.name}: {h} heads per rank does not fit kv_heads={total} over TP size {tp_size}")
    first = tp_rank * total // tp_size
    return Shard(tp_rank, tp_size, (first, first + 1), total)


def _entries(name: str, x: Any, dims: Any) -> list[tuple[str, Any, str, str | None]]:
    """``(member base name, tensor, form, dims)`` for one ``kv_caches`` entry."""
    if isinstance(x, Mapping):
        if not x or not all(isinstance(k, str) and k for k in x):
            raise SpecError(f"{name}: a dict entry maps non-empty suffixes to tensors")
        return [(f"{name}.{k}", v, "kv" if k in ("k", "v") else "tensor",
                 _one(dims.get(k) if isinstance(dims, Mapping) else dims)) for k, v in x.items()]
    if isinstance(x, (tuple, list)):
        ds = list(dims) if isinstance(dims, (tuple, list)) else [dims] * len(x)
        shapes = [tuple(getattr(v, "shape", ())) for v in x]
        if len(x) == 2 and shapes[0] == shapes[1] and shapes[0]:
            return [(f"{name}.k", x[0], "kv", _one(ds[0])), (f"{name}.v", x[1], "kv", _one(ds[1]))]
        if len(x) == 2 and all(shapes):  # Mamba-style (conv state, ssm state)
            return [(f"{name}.conv", x[0], "state", _one(ds[0])), (f"{name}.ssm", x[1], "state", _one(ds[1]))]
        raise SpecError(f"{name}: a sequence entry must be (k, v) of one shape or (conv state, ssm state); "
                        "pass a dict {suffix: tensor} to name other members")
    return [(name, x, "tensor", _one(dims))]


def _one(d: Any) -> str | None:
    if d is None or isinstance(d, str):
        return d
    raise SpecError(f"dims must be a string of letters, got {d!r}")


def spec_from_tensors(kv_caches: Mapping[str, Any], *, replicated: Replication = False, tp_rank: int | None = None,
                      tp_size: int = 1, layout: str | None = None, block_tokens: int | None = None,
                      kv_dim: int | None = None, dims: Dims = None, kv_heads: int | None = None) -> KVCacheSpec:
    """Build a spec from ``{name: tensor | array | (k, v) | (conv, ssm) | {suffix: tensor}}``.

    ``replicated``: True/False for every member, a set of names, or a predicate. True means
    every TP rank holds identical bytes (MLA latent caches); False (the default, the safe
    answer) means pages hold this rank's heads and pair only with the same heads. With
    ``tp_size > 1``, ``tp_rank`` is required, and a replicated page with a heads axis needs
    ``kv_heads`` (it must hold all of them): the caller's statement that no rank holds others.
    ``dims``: letters naming each dimension, for all tensors or per entry name (see
    :data:`DIM_LETTERS`); needed only for shapes that are not recognised.
    ``kv_heads``: the model's total KV heads, when the TP size may exceed it.
    ``kv_dim``: split each page into ``.k``/``.v`` members along that dimension.
    The returned spec keeps the tensors alive for as long as it exists.
    """
    return _discover(kv_caches, replicated, tp_rank, tp_size, layout, block_tokens, kv_dim, dims, kv_heads, False)


def _discover(kv_caches: Mapping[str, Any], replicated: Replication, tp_rank: int | None, tp_size: int,
              layout: str | None, block_tokens: int | None, kv_dim: int | None, dims: Dims, kv_heads: int | None,
              heads_stated: bool) -> KVCacheSpec:
    """:func:`spec_from_tensors`; ``heads_stated``: the caller (a spec file, which gives every
    replicated member's heads as the whole model's) has said each replicated page holds every head."""
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise SpecError("kv_caches must be a non-empty mapping of name -> tensor")
    if len(kv_caches) > MAX_MEMBERS:  # each entry is at least one member: refused before walking them
        raise SpecError(f"kv_caches has {len(kv_caches)} entries; a spec holds at most {MAX_MEMBERS} members")
    tp_rank, tp_size = check_tp(tp_rank, tp_size)
    check_options(layout, block_tokens, kv_dim, dims, kv_heads)
    pieces: list[_Piece] = []
    keep: list[Any] = []
    storages: set[tuple[MemoryKind, int, int]] = set()
    for name, x in kv_caches.items():
        if not isinstance(name, str) or not name:
            raise SpecError(f"layer names must be non-empty strings, got {name!r}")
        d = dims.get(name) if isinstance(dims, Mapping) else dims
        for base, tensor, form, dd in _entries(name, x, d):
            t = _describe(base, tensor)
            keep.append(tensor)
            storages.add((t.kind, t.device, t.storage_ptr))
            if len(storages) > MAX_ALLOCATIONS:
                raise SpecError(f"{base}: more than {MAX_ALLOCATIONS} separate storages; a spec holds at most "
                                f"{MAX_ALLOCATIONS} allocations (views of one storage count once)")
            kd = kv_dim if form == "tensor" else None
            if kd is not None and (not 0 <= kd < len(t.shape) or t.shape[kd] != 2):
                raise SpecError(f"{base}: kv_dim={kd} needs size 2 there, shape is {t.shape}")
            if dd is not None:
                letters = dd
            elif kd is not None:  # recognise the shape without the K/V dimension, then put K back
                rest = _auto_dims(dataclasses.replace(t, shape=t.shape[:kd] + t.shape[kd + 1:]), form)
                letters = rest[:kd] + "K" + rest[kd:]
            else:
                letters = _auto_dims(t, form)
            role = ("k" if base.endswith(".k") else "v") if form == "kv" else ""
            pieces += _pieces(name, base, t, letters, role, kd)
            if len(pieces) > MAX_MEMBERS:
                raise SpecError(f"{base}: more than {MAX_MEMBERS} members; a spec holds at most {MAX_MEMBERS}")
    is_rep = replication(replicated)
    members_of = {p.name: p for p in pieces}
    if len(members_of) != len(pieces):
        raise SpecError("two tensors would give members the same name; rename the entries")

    def member(p: _Piece, offset: int) -> Member:
        rep = is_rep(p.name)
        h = p.page.extent("H")
        if rep and kv_heads is not None and h is not None and h < kv_heads and p.role != "state":
            # The engine says the model has more KV heads than this page: it holds this rank's
            # share, so "identical on every rank" is false and would pair ranks' heads wrongly.
            raise SpecError(f"{p.name}: replicated=True, but its page holds {h} of the model's kv_heads={kv_heads} "
                            "KV heads, so other TP ranks hold other heads; register GQA/MHA pages with tp_rank= "
                            "and tp_size= (replicated=True is for pages identical on every rank: MLA, indexer)")
        if rep and not heads_stated:
            replicated_heads(p.name, h, tp_size, kv_heads)
        shard = None if rep else _shard(p, tp_rank, tp_size, kv_heads)
        return Member(p.name, p.page_bytes, offset, rep, p.page, p.role, shard, p.layer)

    # One allocation per storage.
    alloc_index: dict[tuple[MemoryKind, int, int], int] = {}
    allocs: list[Allocation] = []
    for p in pieces:
        key = (p.t.kind, p.t.device, p.t.storage_ptr)
        if key not in alloc_index:
            alloc_index[key] = len(allocs)
            allocs.append(Allocation(p.t.storage_ptr, p.t.storage_nbytes, p.t.kind, p.t.device))

    # Block-outermost storages: one packed region per (storage, stride); else one per piece.
    packed: dict[tuple[int, int, int], list[_Piece]] = {}
    regions: list[Region] = []
    block_outer = True
    for p in pieces:
        ai = alloc_index[(p.t.kind, p.t.device, p.t.storage_ptr)]
        if p.num_blocks * p.block_stride == p.t.storage_nbytes:
            packed.setdefault((ai, p.block_stride, p.num_blocks), []).append(p)
        else:
            regions.append(Region(ai, p.ptr - p.t.storage_ptr, p.num_blocks,
                                  PackedLayout(p.block_stride, (member(p, 0),))))
            block_outer = False
    several_layers = len({p.entry if p.layer is None else (p.entry, p.layer) for p in pieces}) > 1
    for (ai, stride, nb), group in packed.items():
        regions.append(Region(ai, 0, nb, PackedLayout(stride, tuple(member(p, p.ptr - p.t.storage_ptr)
                                                                    for p in group))))
        # A storage of its own per layer (even one holding that layer's K and V per block)
        # is layer-outermost: block-outermost means one row holds several layers' pages.
        if several_layers and len({p.entry if p.layer is None else (p.entry, p.layer) for p in group}) < 2:
            block_outer = False

    if layout is None:
        attn = next((p.page for p in pieces if "N" in p.page.axes and "H" in p.page.axes), None)
        inner = "NHC" if attn is not None and attn.axes.index("N") < attn.axes.index("H") else "HNC"
        layout = ("BL" if block_outer else "LB") + inner
    elif layout not in KNOWN_LAYOUTS:
        raise SpecError(f"unknown layout {layout!r}; known: {', '.join(KNOWN_LAYOUTS)}")
    if block_tokens is None:
        block_tokens = _block_tokens(pieces)
    spec = KVCacheSpec(tuple(allocs), tuple(regions), layout=layout, block_tokens=block_tokens,
                       tp_rank=tp_rank, tp_size=tp_size)
    object.__setattr__(spec, "_keepalive", tuple(keep))
    return spec


def _block_tokens(pieces: Sequence[_Piece]) -> int:
    """Tokens per block, when every page with a token axis agrees on it.

    Taking the first entry's extent would make pairing depend on the order a dict lists
    its entries; when pages disagree, only the caller knows what a block covers.
    """
    extents: dict[int, list[str]] = {}
    for p in pieces:
        n = p.page.extent("N")
        if n:
            extents.setdefault(n, []).append(p.name)
    if len(extents) > 1:
        said = "; ".join(f"{n} tokens: {', '.join(names[:3])}" + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
                         for n, names in sorted(extents.items()))
        raise SpecError(f"pages hold different token extents ({said}); pass block_tokens= to say how many "
                        "tokens one block covers, so both sides agree whatever order their entries are listed in")
    return next(iter(extents), 1)


def spec_from_arrays(kv_caches: Mapping[str, Any], **options: Any) -> KVCacheSpec:
    """numpy arrays in host memory; same rules and options as :func:`spec_from_tensors`."""
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise SpecError("kv_caches must be a non-empty mapping of name -> array")
    unknown = sorted(set(options) - DISCOVERY_OPTIONS)
    if unknown:
        raise UnknownOptionError(f"spec_from_arrays() has no option {unknown[0]!r}; its options: "
                                 f"{', '.join(sorted(DISCOVERY_OPTIONS))}", tuple(sorted(DISCOVERY_OPTIONS)))
    for name, x in kv_caches.items():
        items = x.values() if isinstance(x, Mapping) else x if isinstance(x, (tuple, list)) else (x,)
        if not all(isinstance(i, np.ndarray) for i in items):
            raise SpecError(f"{name}: spec_from_arrays takes numpy arrays")
    return spec_from_tensors(kv_caches, **options)


def spec_from_pointers(spans: Sequence[tuple[int, int, int]] | tuple[int, int, int], *, num_blocks: int,
                       members: Sequence[Member | tuple[str, int]], layout: str = "BLHNC",
                       kind: MemoryKind | str = MemoryKind.DRAM, block_stride: int | None = None,
                       replicated: Replication = False, block_tokens: int = 1, tp_rank: int | None = None,
                       tp_size: int = 1) -> KVCacheSpec:
    """Build a spec from raw ``(pointer, nbytes, device)`` spans and an explicit geometry.

    ``BL*`` layouts: one span, one packed region; members without offsets are packed back
    to back and the row stride defaults to ``nbytes // num_blocks``. ``LB*`` layouts: either
    one span per member, or one span holding each member's region one after another.
    ``(name, size)`` members are opaque pages (they pair only with opaque pages of the same
    size); pass :class:`Member` objects with a :class:`PageFormat` to say what they hold.
    """
    if isinstance(spans, tuple) and len(spans) == 3 and all(isinstance(s, (int, np.integer)) for s in spans):
        spans = [spans]  # type: ignore[list-item]
    tp_rank, tp_size = check_tp(tp_rank, tp_size)
    spans = check_spans(spans)
    members = check_pointer_members(members)
    for name, v in (("num_blocks", num_blocks), ("block_tokens", block_tokens), ("block_stride", block_stride)):
        if (v is not None or name != "block_stride") and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                                          or v < 1):
            raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r:.60}")
    if not isinstance(layout, str) or not isinstance(kind, (str, MemoryKind)) or kind not in ("DRAM", "VRAM"):
        raise InvalidArgumentError(f"layout is a string and kind 'DRAM' or 'VRAM', got {layout!r:.60}, {kind!r:.60}")
    if layout not in KNOWN_LAYOUTS:
        raise SpecError(f"unknown layout {layout!r}; known: {', '.join(KNOWN_LAYOUTS)}")
    is_rep = replication(replicated)
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
        flat = [dataclasses.replace(m, offset=0) for m in ms]
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
