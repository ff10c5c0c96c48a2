"""Pairing rules: which members a byte copy moves correctly, and typed refusals for the rest.

The planner moves bytes; it cannot convert them. So two members pair only when their
bytes mean the same thing on both sides: the same element type, the same page axes in the
same order with the same extents, the same role, and the same slice of KV heads. Every
other pairing is refused here, once per spec pair, with an error that names the field and
both values (docs/geometry.md explains each rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import (BlockTokensMismatchError, DtypeMismatchError, HeadSliceMismatchError, LayoutMismatchError,
                     PageFormatMismatchError)
from ..geometry import KVCacheSpec, Member, Shard, abbreviate, natural_key

__all__ = ["Refusal", "refusals", "check_pairing", "spec_diff", "head_slice"]

# Most basic first: the raised error is the class of the first refusal in this order.
_ORDER: tuple[type[LayoutMismatchError], ...] = (BlockTokensMismatchError, LayoutMismatchError, DtypeMismatchError,
                                                 HeadSliceMismatchError, PageFormatMismatchError)
_HEADLINE = {
    BlockTokensMismatchError: "the two sides put a different number of tokens in a block",
    LayoutMismatchError: "the two KV cache specs do not hold the same members",
    DtypeMismatchError: "the two sides' pages hold different element types; a byte copy would reinterpret them",
    PageFormatMismatchError: "the two sides lay out their pages differently; a byte copy would scramble tokens "
                             "and heads",
    HeadSliceMismatchError: "the two sides hold different KV heads: GQA/MHA pages pair only with the rank "
                            "holding the same heads (register them with tp_rank=, tp_size= and kv_heads=, and "
                            "gather other TP sizes with add_source and read_many); replicated=True is only for "
                            "pages byte-identical on every TP rank, such as an MLA latent or indexer cache",
}
_GROUP_LIMIT = 4


@dataclass(frozen=True)
class Refusal:
    """One reason two specs cannot be paired: the field, both values, the error it raises."""

    field: str
    local: object
    remote: object
    error: type[LayoutMismatchError]


def head_slice(m: Member, spec: KVCacheSpec) -> tuple[object, ...]:
    """A key equal on two members exactly when they hold the same heads.

    Replicated members and slices that cover every head hold the same bytes whatever the
    ranks; described ranges compare as ranges (several ranks may hold one range when the
    TP size exceeds the head count); undescribed slices compare by TP rank and size.
    """
    if m.replicated:
        return ("all",)
    sh = m.shard if m.shard is not None else Shard(spec.tp_rank, spec.tp_size)
    if sh.whole:
        return ("all",)
    if sh.heads is not None:
        return ("heads", sh.heads[0], sh.heads[1], sh.total_heads)
    return ("tp", sh.tp_rank, sh.tp_size)


def _describe_slice(m: Member, spec: KVCacheSpec) -> str:
    if m.replicated:
        return "replicated (every rank holds every head)"
    sh = m.shard if m.shard is not None else Shard(spec.tp_rank, spec.tp_size)
    return ("every head, " if sh.whole else "") + sh.describe()


def _inner(layout: str) -> str:
    return layout[2:] if layout[:2] in ("BL", "LB") else layout


def _member(name: str, a: Member, b: Member, ls: KVCacheSpec, rs: KVCacheSpec) -> list[Refusal]:
    f = f"members[{name}]"
    out: list[Refusal] = []
    pa, pb = a.page, b.page
    assert pa is not None and pb is not None
    sa, sb = head_slice(a, ls), head_slice(b, rs)
    if pa != pb:
        if pa.is_opaque != pb.is_opaque:
            out.append(Refusal(f"{f}.page", pa.describe(), pb.describe(), PageFormatMismatchError))
        elif pa.is_opaque and pa.dtype == pb.dtype and a.size != b.size:
            out.append(Refusal(f"{f}.size", a.size, b.size, LayoutMismatchError))
        else:
            if (pa.dtype, pa.itemsize) != (pb.dtype, pb.itemsize):
                lv, rv = pa.dtype, pb.dtype
                if lv == rv:
                    lv, rv = f"{lv} ({pa.itemsize} bytes)", f"{rv} ({pb.itemsize} bytes)"
                out.append(Refusal(f"{f}.dtype", lv, rv, DtypeMismatchError))
            if pa.axes != pb.axes:
                out.append(Refusal(f"{f}.order", pa.axes, pb.axes, PageFormatMismatchError))
            elif pa.shape != pb.shape:
                for ax, x, y in zip(pa.axes, pa.shape, pb.shape):
                    if x == y:
                        continue
                    if ax == "N":
                        out.append(Refusal(f"{f}.tokens", x, y, BlockTokensMismatchError))
                    elif ax == "H":
                        if sa == sb:  # else the slice refusal below says it
                            out.append(Refusal(f"{f}.heads", f"{x} heads", f"{y} heads", HeadSliceMismatchError))
                    else:
                        out.append(Refusal(f"{f}.shape", pa.describe(), pb.describe(), PageFormatMismatchError))
                        break
    if a.role != b.role:
        out.append(Refusal(f"{f}.role", a.role or "-", b.role or "-", PageFormatMismatchError))
    if sa != sb:
        out.append(Refusal(f"{f}.heads", _describe_slice(a, ls), _describe_slice(b, rs), HeadSliceMismatchError))
    return out


def refusals(local: KVCacheSpec, remote: KVCacheSpec) -> list[Refusal]:
    """Every reason the pair cannot move correctly by byte copies, most basic first."""
    out: list[Refusal] = []
    if local.block_tokens != remote.block_tokens:
        out.append(Refusal("block_tokens", local.block_tokens, remote.block_tokens, BlockTokensMismatchError))
    lm = {m.name: m for m in local.members}
    rm = {m.name: m for m in remote.members}
    only_l = sorted(lm.keys() - rm.keys(), key=natural_key)
    only_r = sorted(rm.keys() - lm.keys(), key=natural_key)
    if only_l or only_r:
        out.append(Refusal("members", abbreviate(only_l) or "-", abbreviate(only_r) or "-", LayoutMismatchError))
    common = [n for n in lm if n in rm]  # in the local spec's order
    # The spec's layout label is the only word on the within-page order of opaque pages.
    if _inner(local.layout) != _inner(remote.layout) and any(
            lm[n].page.is_opaque and rm[n].page.is_opaque for n in common):  # type: ignore[union-attr]
        out.append(Refusal("layout", local.layout, remote.layout, PageFormatMismatchError))
    for name in common:
        a, b = lm[name], rm[name]
        if a.page == b.page and a.role == b.role and (a.replicated and b.replicated or a.shard == b.shard
                                                      and head_slice(a, local) == head_slice(b, remote)):
            continue  # the common case, checked cheaply
        out.extend(_member(name, a, b, local, remote))
    out.sort(key=lambda r: _ORDER.index(r.error))
    return _grouped(out)


def _grouped(rs: list[Refusal]) -> list[Refusal]:
    """One line for many members that differ in the same field by the same values."""
    groups: dict[tuple[str, str, str, type], list[Refusal]] = {}
    for r in rs:
        suffix = r.field.rsplit("].", 1)[1] if r.field.startswith("members[") and "]." in r.field else ""
        key = (suffix, repr(r.local), repr(r.remote), r.error) if suffix else (r.field, "", "", r.error)
        groups.setdefault(key, []).append(r)
    out = []
    for (suffix, _, _, _), g in groups.items():
        if len(g) == 1 or not suffix:
            out.extend(g)
            continue
        names = [r.field[len("members["):r.field.rindex("].")] for r in g]
        out.append(Refusal(f"members[{abbreviate(names, _GROUP_LIMIT)}].{suffix}", g[0].local, g[0].remote, g[0].error))
    return out


def check_pairing(local: KVCacheSpec, remote: KVCacheSpec) -> None:
    """Raise the typed :class:`LayoutMismatchError` subclass for the first kind of refusal."""
    rs = refusals(local, remote)
    if rs:
        cls = rs[0].error
        raise cls(_HEADLINE[cls], [(r.field, r.local, r.remote) for r in rs])


def spec_diff(local: KVCacheSpec, remote: KVCacheSpec) -> list[tuple[str, object, object]]:
    """Every difference between two specs that matters for pairing them.

    The refusals, plus the differences the planner accepts (the layout label, the specs'
    TP rank and size), so a caller can show the whole picture.
    """
    out = [(r.field, r.local, r.remote) for r in refusals(local, remote)]
    seen = {f for f, _, _ in out}
    for f in ("layout", "tp_size", "tp_rank"):
        lv, rv = getattr(local, f), getattr(remote, f)
        if lv != rv and f not in seen:
            out.append((f, lv, rv))
    return out

