"""From the ``kv_caches`` vLLM hands ``register_kv_caches`` to a kvxfer :class:`KVCacheSpec`.

Built explicitly from each tensor's pointer, strides and storage, and cross-checked against
vLLM's own ``KVCacheConfig`` (block count, page bytes, layout name), so that no dimension
is guessed: a K/V dimension can never be taken for blocks, because the block dimension is
the one whose size is vLLM's block count *and* whose page matches vLLM's page size.

* Views over one storage are one allocation (registered once).
* Every view of a storage shares one block stride and all their pages sit inside the first
  row: the storage is block-outermost (``BL*``), and all its layers become members of one
  packed region, so a block moves as **one** descriptor.
* Otherwise each layer (or each K/V plane) is its own region: one descriptor per layer.

torch is not imported: tensors are read through their methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvxfer import Allocation, KVCacheSpec, Member, MemoryKind, PackedLayout, Region, SpecError, spec_from_tensors
from kvxfer.geometry import KNOWN_LAYOUTS

__all__ = ["View", "spec_from_vllm", "discovered_spec", "describe_spec"]

#: vLLM's per-layer view is ``[B, H, N, C]`` (or ``[B, N, H, C]``), K and V inside ``C``.
_DIMS = {"HNC": "BHND", "NHC": "BNHD"}


@dataclass(frozen=True)
class View:
    """One page kind: ``name``'s bytes of every block, ``stride`` bytes apart."""

    name: str
    ptr: int
    storage_ptr: int
    storage_nbytes: int
    stride: int
    page: int
    kind: MemoryKind
    device: int


def _dense(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """True when these dims form one gap-free span, in any order."""
    dims = sorted((st, sh) for st, sh in zip(strides, shape) if sh != 1)
    expect = itemsize
    for st, sh in dims:
        if st != expect:
            return False
        expect *= sh
    return True


def _views(name: str, t: Any, num_blocks: int, page_bytes: int) -> list[View]:
    if not (hasattr(t, "untyped_storage") and hasattr(t, "stride") and hasattr(t, "element_size")):
        raise SpecError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    dev = t.device
    if dev.type not in ("cpu", "cuda"):
        raise SpecError(f"{name}: KV cache on {dev.type!r}; kvxfer moves cpu and cuda memory")
    kind = MemoryKind.VRAM if dev.type == "cuda" else MemoryKind.DRAM
    device = int(dev.index or 0) if kind is MemoryKind.VRAM else 0
    es = int(t.element_size())
    shape = tuple(int(s) for s in t.shape)
    strides = tuple(int(s) * es for s in t.stride())
    st = t.untyped_storage()
    sptr, snb, ptr = int(st.data_ptr()), int(st.nbytes()), int(t.data_ptr())

    def page_of(dims: slice) -> int:
        n = es
        for s in shape[dims]:
            n *= s
        return n

    # Blocks first ([B, H, N, C] or [B, N, H, C], K and V inside the page): vLLM's layout.
    if len(shape) >= 2 and shape[0] == num_blocks and page_of(slice(1, None)) == page_bytes:
        if not _dense(shape[1:], strides[1:], es):
            raise SpecError(f"{name}: a block's page is not contiguous (shape {shape}, byte strides {strides}); "
                            "kvxfer needs a block-compact layout (LBHNC, LBNHC, BLHNC or BLNHC)")
        return [View(name, ptr, sptr, snb, strides[0], page_bytes, kind, device)]
    # K and V planes outermost ([2, B, ...]): two page kinds per layer.
    if (len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks
            and 2 * page_of(slice(2, None)) == page_bytes):
        if not _dense(shape[2:], strides[2:], es):
            raise SpecError(f"{name}: a block's K or V page is not contiguous (shape {shape}, byte strides {strides})")
        half = page_bytes // 2
        return [View(f"{name}.{kv}", ptr + i * strides[0], sptr, snb, strides[1], half, kind, device)
                for i, kv in enumerate(("k", "v"))]
    raise SpecError(f"{name}: shape {shape} has no block dimension of {num_blocks} blocks with "
                    f"{page_bytes}-byte pages (vLLM's KVCacheConfig); refusing to guess")


def spec_from_vllm(kv_caches: Mapping[str, Any], *, num_blocks: int, page_bytes: Mapping[str, int],
                   layout: str | None, block_tokens: int, tp_rank: int = 0, tp_size: int = 1,
                   replicated: bool = False) -> KVCacheSpec:
    """The spec for vLLM's ``{layer name: tensor}``.

    ``page_bytes`` is each layer's page size from vLLM's ``KVCacheConfig``; ``layout`` the
    layout vLLM resolved (``KVCacheConfig.kv_cache_layout``). ``replicated`` is True for
    MLA (every TP rank holds the same latent pages), False for head-split GQA/MHA pages.
    """
    if not kv_caches:
        raise SpecError("vLLM registered no KV cache tensors")
    views: list[View] = []
    layer_of: dict[str, str] = {}
    for name, t in kv_caches.items():
        if name not in page_bytes:
            raise SpecError(f"{name}: not in vLLM's KV cache groups; cannot check its page size")
        vs = _views(name, t, num_blocks, int(page_bytes[name]))
        views += vs
        layer_of.update((v.name, name) for v in vs)

    allocs: list[Allocation] = []
    by_storage: dict[tuple[MemoryKind, int, int], list[View]] = {}
    for v in views:
        key = (v.kind, v.device, v.storage_ptr)
        if key not in by_storage:
            by_storage[key] = []
            allocs.append(Allocation(v.storage_ptr, v.storage_nbytes, v.kind, v.device))
        by_storage[key].append(v)

    regions: list[Region] = []
    packed_layers = 0
    for ai, group in enumerate(by_storage.values()):
        stride = group[0].stride
        offsets = [v.ptr - v.storage_ptr for v in group]
        block_outer = (all(v.stride == stride for v in group)
                       and all(0 <= o and o + v.page <= stride for o, v in zip(offsets, group))
                       and 0 <= group[0].storage_nbytes - num_blocks * stride < stride)
        if block_outer:
            members = tuple(Member(v.name, v.page, o, replicated) for o, v in zip(offsets, group))
            regions.append(Region(ai, 0, num_blocks, PackedLayout(stride, members)))
            if len({layer_of[v.name] for v in group}) > 1:
                packed_layers += 1
        else:
            regions += [Region(ai, o, num_blocks, PackedLayout(v.stride, (Member(v.name, v.page, 0, replicated),)))
                        for o, v in zip(offsets, group)]

    found = "BL" if packed_layers else "LB"
    if layout is None:
        layout = found + "HNC"
    elif layout not in KNOWN_LAYOUTS:
        raise SpecError(f"vLLM's KV cache layout {layout!r} is not one kvxfer can move "
                        f"({', '.join(KNOWN_LAYOUTS)})")
    elif len(kv_caches) > 1 and not layout.startswith(found):
        raise SpecError(f"vLLM reports layout {layout} but the tensors are {found}-outermost in memory; "
                        "refusing a spec that contradicts the engine")
    return KVCacheSpec(tuple(allocs), tuple(regions), layout=layout, block_tokens=block_tokens,
                       tp_rank=tp_rank, tp_size=tp_size)


def _geometry(spec: KVCacheSpec) -> tuple:
    allocs = tuple((a.address, a.nbytes, a.kind, a.device) for a in spec.allocations)
    regions = sorted((spec.allocations[r.allocation].address, r.offset, r.num_blocks, r.layout.stride,
                      tuple(sorted((m.name, m.offset, m.size, m.replicated) for m in r.members)))
                     for r in spec.regions)
    return allocs, tuple(regions)


def discovered_spec(kv_caches: Mapping[str, Any], explicit: KVCacheSpec) -> KVCacheSpec:
    """kvxfer's generic discovery on the same tensors, told vLLM's dimension order.

    Returned only if it describes exactly the memory of ``explicit`` (allocations, regions,
    row strides, member offsets and sizes); it adds what the explicit spec leaves opaque
    (element type, page axes, head slices), which peers then check before pairing. Raises
    :class:`SpecError` when the two readings differ.
    """
    dims = _DIMS.get(explicit.layout[2:])
    if dims is None or any(len(getattr(t, "shape", ())) != 4 for t in kv_caches.values()):
        raise SpecError(f"no dimension names for vLLM's {explicit.layout} views; keeping the explicit spec")
    found = spec_from_tensors(kv_caches, dims=dims, layout=explicit.layout, block_tokens=explicit.block_tokens,
                              tp_rank=explicit.tp_rank, tp_size=explicit.tp_size,
                              replicated=all(m.replicated for m in explicit.members))
    if _geometry(found) != _geometry(explicit):
        raise SpecError(f"generic discovery (dims {dims}) reads other regions than vLLM's KVCacheConfig implies")
    return found


def describe_spec(spec: KVCacheSpec) -> str:
    """One log line: what is registered and what one block costs to move."""
    members = sum(len(r.members) for r in spec.regions)
    mib = sum(a.nbytes for a in spec.allocations) / 2**20
    return (f"{spec.layout}, {len(spec.allocations)} allocation(s) ({mib:.0f} MiB), {len(spec.regions)} region(s), "
            f"{members} member(s), {spec.num_blocks} blocks of {spec.block_tokens} tokens: "
            f"{len(spec.regions)} descriptor(s) per block ({spec.row_bytes} bytes)")
