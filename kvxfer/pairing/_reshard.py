"""Heterogeneous peers: other TP sizes, other PP stages, other block sizes, moved by byte copies.

When two caches do not hold the same pages (another TP rank's heads, another pipeline
stage's layers, smaller blocks) a single copy per block is wrong, but a few copies per block
out of one or several peers are right. This module decides, once per set of specs, which
peer supplies which heads of which local member, and which byte ranges inside the pages
that takes (:class:`Gather`); per request :func:`kvxfer.planner.plan_gather` broadcasts
those templates over block ids. Everything is refused, with a typed error, unless each copied range
is contiguous in both pages up to a constant factor: docs/geometry.md has the table.

Choices between peers holding the same bytes (replicated MLA pages, heads repeated when the
TP size exceeds the head count) are deterministic: candidates sorted by TP rank, the local
rank ``d`` takes candidate ``d % len(candidates)``. :func:`sources` and :func:`readers`
state the same rule from TP sizes alone, so a prefill rank knows whether anyone reads it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import (BlockTokensMismatchError, DtypeMismatchError, HeadSliceMismatchError, LayoutMismatchError,
                     PageFormatMismatchError)
from ..geometry import KVCacheSpec, Member, PageFormat
from ..memory import MemoryKind
from ._sliced import SlicedLists

__all__ = ["Gather", "HeadSource", "SlicedLists", "gather", "cached_gather", "pair_source", "sources", "readers", "may_free",
           "heads_of"]

# Pieces per page a slice may take when an outer axis other than tokens or heads (K, S, X)
# must be walked; tokens or heads outer to the slice are refused instead.
_MAX_PIECES = 16


# -- the rule, from TP sizes alone ----------------------------------------------------------
def heads_of(rank: int, tp: int, kv_heads: int) -> tuple[int, int]:
    """KV heads ``[first, stop)`` rank ``rank`` of ``tp`` holds: dealt in order, repeated past ``tp > kv_heads``."""
    if kv_heads >= tp:
        per = kv_heads // tp
        return rank * per, (rank + 1) * per
    first = rank * kv_heads // tp
    return first, first + 1


def sources(decode_rank: int, decode_tp: int, prefill_tp: int,
            kv_heads: int | None = None) -> list[tuple[int, tuple[int, int] | None]]:
    """Prefill ranks decode rank ``decode_rank`` reads, with the heads read from each.

    ``kv_heads=None``: a replicated (MLA) cache, read whole from rank ``decode_rank % prefill_tp``.
    """
    if kv_heads is None:
        return [(decode_rank % prefill_tp, None)]
    a, b = heads_of(decode_rank, decode_tp, kv_heads)
    held = [heads_of(p, prefill_tp, kv_heads) for p in range(prefill_tp)]
    out: list[tuple[int, tuple[int, int] | None]] = []
    for h in range(a, b):
        p = _choose([r for r in range(prefill_tp) if held[r][0] <= h < held[r][1]], decode_rank)
        last = out[-1] if out else None
        if last is not None and last[0] == p and last[1] is not None and last[1][1] == h:
            out[-1] = (p, (last[1][0], h + 1))
        else:
            out.append((p, (h, h + 1)))
    return out


def readers(prefill_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int | None = None) -> list[int]:
    """Decode ranks that read from ``prefill_rank`` (empty: it may free its blocks at once)."""
    return [d for d in range(decode_tp) if any(p == prefill_rank for p, _ in sources(d, decode_tp, prefill_tp,
                                                                                      kv_heads))]


def may_free(prefill_rank: int, prefill_tp: int, decode_tp: int, kv_heads: int | None = None) -> bool:
    """True when no decode rank reads this prefill rank, so it need not wait for a reader."""
    return not readers(prefill_rank, prefill_tp, decode_tp, kv_heads)


def _choose(candidates: Sequence[Any], rank: int) -> Any:
    return candidates[rank % len(candidates)]


# -- what a member holds --------------------------------------------------------------------
def _held(m: Member, spec: KVCacheSpec) -> tuple[Any, ...]:
    """``("all",)``, ``("heads", first, stop, total)`` or ``("tp", rank, size)`` (heads not described)."""
    if m.replicated:
        return ("all",)
    sh = m.shard
    if sh is None:
        return ("all",) if spec.tp_size == 1 else ("tp", spec.tp_rank, spec.tp_size)
    if sh.heads is not None:
        return ("heads", sh.heads[0], sh.heads[1], sh.total_heads)
    return ("all",) if sh.tp_size == 1 else ("tp", sh.tp_rank, sh.tp_size)


def _rank(m: Member, spec: KVCacheSpec) -> int:
    return m.shard.tp_rank if m.shard is not None else spec.tp_rank


def _full(h: tuple[Any, ...]) -> bool:
    return h[0] == "all" or (h[0] == "heads" and h[1] == 0 and h[2] == h[3])


# -- pieces of one page ---------------------------------------------------------------------
def _member_pieces(lm: Member, rm: Member, lheads: tuple[int, int] | None, rheads: tuple[int, int] | None,
                   k: int, peer: str) -> tuple[list[tuple[int, int, int]], int]:
    """:func:`_pieces`, failing closed: an untyped error is a refusal naming the member.

    A peer's spec is validated but its page geometry can still be one this module never
    met; whatever goes wrong deciding the byte ranges, the pair is refused, not crashed.
    """
    try:
        return _pieces(lm.name, lm, rm, lheads, rheads, k)
    except LayoutMismatchError:
        raise
    except Exception as exc:
        assert lm.page is not None and rm.page is not None
        raise PageFormatMismatchError(
            f"member {lm.name}: kvxfer cannot work out how to copy peer {peer or 'remote'!s}'s page into ours "
            f"({type(exc).__name__}: {exc}); refused rather than guessed",
            [(f"members[{lm.name}].page", lm.page.describe(), rm.page.describe())]) from exc


def _pieces(name: str, lm: Member, rm: Member, lheads: tuple[int, int] | None, rheads: tuple[int, int] | None,
            k: int) -> tuple[list[tuple[int, int, int]], int]:
    """Byte ranges ``(local offset, remote offset, length)`` copying one remote page into a local one.

    ``lheads``/``rheads``: the slice's head positions inside each page (None: every head).
    ``k``: remote pages per local page along tokens. Also returns the local byte step
    between the ``k`` remote pages. Refuses what byte copies would scramble or what would
    take a descriptor per token or per head.
    """
    lp, rp = lm.page, rm.page
    assert lp is not None and rp is not None
    if (lp.dtype, lp.itemsize) != (rp.dtype, rp.itemsize):
        raise DtypeMismatchError("the two sides' pages hold different element types; a byte copy would "
                                 "reinterpret them", [(f"members[{name}].dtype", lp.dtype, rp.dtype)])
    if lm.role != rm.role:
        raise PageFormatMismatchError("the two sides' pages hold different things",
                                      [(f"members[{name}].role", lm.role or "-", rm.role or "-")])
    if lp.is_opaque or rp.is_opaque:
        if lheads is None and rheads is None and k == 1 and lm.size == rm.size and lp == rp:
            return [(0, 0, lm.size)], 0
        raise PageFormatMismatchError(
            f"member {name}: its pages are described only by their size, so kvxfer cannot address heads or "
            "tokens inside them; register the cache from tensors (or give Member.page) to read a slice",
            [(f"members[{name}].page", lp.describe(), rp.describe())])
    if k > 1 and "N" not in lp.axes:
        raise BlockTokensMismatchError(
            f"member {name}: its {lp.describe()} page has no token axis (a {lm.role or 'per-block'} page, such as "
            f"Mamba state), so one local block cannot be assembled from {k} remote blocks; pair it with peers of "
            "the same block size", [(f"members[{name}].page", lp.describe(), rp.describe())])
    if lp.axes != rp.axes:
        lp, rp = _align(lp, rp)
    if lp.axes != rp.axes:
        raise PageFormatMismatchError("the two sides lay out their pages differently; a byte copy would scramble "
                                      "tokens and heads", [(f"members[{name}].order", lp.axes, rp.axes)])
    sel: list[tuple[int, int, int]] = []  # per axis: (count, local start, remote start)
    for ax, le, re_ in zip(lp.axes, lp.shape, rp.shape):
        if ax == "H" and (lheads is not None or rheads is not None):
            lo, hi = lheads if lheads is not None else (0, le)
            ro = rheads[0] if rheads is not None else 0
            sel.append((hi - lo, lo, ro))
        elif ax == "N" and k > 1:
            if le != re_ * k:
                raise BlockTokensMismatchError(
                    f"member {name}: a local page of {le} tokens is not {k} remote pages of {re_}",
                    [(f"members[{name}].tokens", le, re_)])
            sel.append((re_, 0, 0))
        elif le != re_:
            raise PageFormatMismatchError("the two sides' pages differ in shape",
                                          [(f"members[{name}].shape", lp.describe(), rp.describe())])
        else:
            sel.append((le, 0, 0))
    item = lp.itemsize
    lstr = [item * math.prod(lp.shape[i + 1:]) for i in range(len(lp.axes))]
    rstr = [item * math.prod(rp.shape[i + 1:]) for i in range(len(rp.axes))]
    j = len(sel) - 1
    unit = item
    while j >= 0 and sel[j][0] == lp.shape[j] == rp.shape[j]:
        unit *= lp.shape[j]
        j -= 1
    loff = roff = 0
    if j >= 0:  # the innermost partial axis: one contiguous run on both sides
        c, ls, rs = sel[j]
        unit *= c
        loff, roff = ls * lstr[j], rs * rstr[j]
        j -= 1
    walk = [i for i in range(j + 1) if sel[i][0] > 1]
    for i in range(j + 1):
        loff += sel[i][1] * lstr[i]
        roff += sel[i][2] * rstr[i]
    bad = [lp.axes[i] for i in walk if lp.axes[i] in "NH"]
    if bad and "N" in bad:
        raise PageFormatMismatchError(
            f"member {name}: reading heads out of a {lp.axes} page would take one descriptor per token "
            f"({sel[lp.axes.index('N')][0]} per page); register HND pages (heads outermost) on both sides, "
            "where a head slice is one contiguous range",
            [(f"members[{name}].order", lp.axes, rp.axes)])
    if bad:
        raise BlockTokensMismatchError(
            f"member {name}: a local block covers {k} remote blocks only where tokens are the outermost page "
            f"axis (NHD); this {lp.axes} page would take one descriptor per head per block",
            [(f"members[{name}].order", lp.axes, rp.axes)])
    counts = [sel[i][0] for i in walk]
    if math.prod(counts) > _MAX_PIECES:
        raise PageFormatMismatchError(f"member {name}: a slice of this {lp.axes} page takes {math.prod(counts)} "
                                      "descriptors per page", [(f"members[{name}].page", lp.describe(), rp.describe())])
    out = [(loff, roff, unit)]
    for i in walk:
        out = [(lo + t * lstr[i], ro + t * rstr[i], n) for lo, ro, n in out for t in range(sel[i][0])]
    lsub = rp.shape[lp.axes.index("N")] * lstr[lp.axes.index("N")] if k > 1 else 0
    return out, lsub


def _align(lp: PageFormat, rp: PageFormat) -> tuple[PageFormat, PageFormat]:
    """Both pages in one axis order when they differ only in where extent-1 axes are listed.

    Discovery lists axes of extent 1 last (they carry no order), so one head of an HND page
    reads ``NDH``; moving an extent-1 axis changes no byte offset.
    """
    if sorted(lp.axes) != sorted(rp.axes):
        return lp, rp
    for target in (lp.axes, rp.axes):
        out = []
        for p in (lp, rp):
            big = [a for a, e in zip(p.axes, p.shape) if e > 1]
            if [a for a in target if a in big] != big:
                break
            ext = dict(zip(p.axes, p.shape))
            out.append(PageFormat(p.dtype, p.itemsize, target, tuple(ext[a] for a in target)))
        else:
            return out[0], out[1]
    return lp, rp


# -- the plan for a set of specs ------------------------------------------------------------
@dataclass(frozen=True)
class HeadSource:
    """Which peer supplies which heads of one local member, and at what cost per local block."""

    member: str
    peer: str
    heads: tuple[int, int] | None  # global heads read; None: every head the page holds
    descriptors: int  # per remote block
    how: str  # "whole", "sliced" or "tokens" (part of a larger local block)


# Template columns: local address of block 0, local stride, local sub-block step, local
# device, remote address of block 0, remote stride, remote device, length.
_COLS = 8


class Gather:
    """Per-peer copy templates for one local spec against a set of peer specs.

    ``k``: remote blocks per local block (prefill blocks a decode block covers). ``missing``
    lists what no peer holds; a plan refuses while it is not empty.
    """

    def __init__(self, local: KVCacheSpec, remotes: Mapping[str, KVCacheSpec], k: int,
                 tables: dict[str, dict[tuple[MemoryKind, MemoryKind], np.ndarray]], routes: list[HeadSource],
                 missing: list[str], lists: dict[str, dict[tuple[MemoryKind, MemoryKind], "SlicedLists"]] | None = None):
        self.k = k
        self.tables = tables
        self.lists = lists or {}
        self.routes = routes
        self.missing = missing
        self.whole_rows = 0
        self.split_rows = len(local.regions)
        self._local = weakref.ref(local)
        self._remotes = {n: weakref.ref(s) for n, s in remotes.items()}

    mode = "gather"

    @property
    def peers(self) -> list[str]:
        """Peers read from (the others hold nothing this rank needs: they may free their blocks)."""
        return list(self.tables)

    def matches(self, local: KVCacheSpec, remote: KVCacheSpec | Mapping[str, KVCacheSpec]) -> bool:
        remotes = remote if isinstance(remote, Mapping) else {"": remote}
        return (self._local() is local and remotes.keys() == self._remotes.keys()
                and all(self._remotes[n]() is s for n, s in remotes.items()))

    @property
    def stale(self) -> bool:
        """True once the local spec or any peer spec it was built for is gone."""
        return self._local() is None or any(r() is None for r in self._remotes.values())

    def per_block(self, peer: str) -> int:
        """Descriptors one remote block of ``peer`` takes before merging."""
        return sum(int(t.shape[0]) for t in self.tables.get(peer, {}).values())

    def __repr__(self) -> str:
        return f"Gather(k={self.k}, peers={self.peers}, missing={len(self.missing)})"


def gather(local: KVCacheSpec, remotes: Mapping[str, KVCacheSpec]) -> Gather:
    """Decide once which peer supplies each local member's heads; refuses what cannot be copied.

    Members are matched by name across all peers (pipeline stages hold disjoint layers);
    remote members nobody local needs are ignored.
    """
    if not remotes:
        raise LayoutMismatchError("no peers to read from")
    k, rem = divmod(local.block_tokens, next(iter(remotes.values())).block_tokens)
    for n, s in remotes.items():
        if local.block_tokens % s.block_tokens or local.block_tokens // s.block_tokens != k:
            raise BlockTokensMismatchError(
                f"a local block of {local.block_tokens} tokens must cover a whole number of remote blocks; "
                f"peer {n or 'remote'!s} has {s.block_tokens}-token blocks (a remote block larger than a local "
                "one would have to be split over several local blocks, which is not supported)",
                [("block_tokens", local.block_tokens, s.block_tokens)])
    owners: dict[str, list[tuple[str, KVCacheSpec, int, Member]]] = {}
    for n in sorted(remotes):
        s = remotes[n]
        for ri, r in enumerate(s.regions):
            for m in r.members:
                owners.setdefault(m.name, []).append((n, s, ri, m))
    rows: dict[str, dict[tuple[MemoryKind, MemoryKind], list[tuple[int, ...]]]] = {}
    routes: list[HeadSource] = []
    missing: list[str] = []
    for li, lr in enumerate(local.regions):
        la = local.allocations[lr.allocation]
        for lm in lr.members:
            cands = owners.get(lm.name, [])
            if not cands:
                missing.append(lm.name)
                continue
            need = _held(lm, local)
            rank = _rank(lm, local)
            cands = sorted(cands, key=lambda c: (_rank(c[3], c[1]), c[0]))
            for (n, s, ri, rm), heads in _assign(lm.name, need, cands, rank, missing):
                rr = s.regions[ri]
                ra = s.allocations[rr.allocation]
                have = _held(rm, s)
                lh = rh = None
                if heads is not None:
                    lh = (heads[0] - need[1], heads[1] - need[1]) if need[0] == "heads" else heads
                    rh = (heads[0] - have[1], heads[1] - have[1]) if have[0] == "heads" else heads
                    if lh == (0, _h(lm)) and rh == (0, _h(rm)):
                        lh = rh = None
                pieces, lsub = _member_pieces(lm, rm, lh, rh, k, n)
                tab = rows.setdefault(n, {}).setdefault((la.kind, ra.kind), [])
                lbase = la.address + lr.offset + lm.offset
                rbase = ra.address + rr.offset + rm.offset
                for lo, ro, ln in pieces:
                    tab.append((lbase + lo, lr.block_stride, lsub, la.device, rbase + ro, rr.block_stride,
                                ra.device, ln))
                how = "tokens" if k > 1 else ("sliced" if lh is not None or rh is not None else "whole")
                routes.append(HeadSource(lm.name, n, heads, len(pieces), how))
    tables = {n: {kk: np.array(v, dtype=np.int64).reshape(-1, _COLS) for kk, v in t.items()}
              for n, t in rows.items()}
    lists = {n: {kk: SlicedLists(t, k, local.num_blocks, remotes[n].num_blocks, *kk) for kk, t in tabs.items()}
             for n, tabs in tables.items()}
    return Gather(local, remotes, k, tables, routes, missing, lists)


def _h(m: Member) -> int | None:
    assert m.page is not None
    return m.page.extent("H")


def _assign(name: str, need: tuple[Any, ...], cands: list[tuple[str, KVCacheSpec, int, Member]], rank: int,
            missing: list[str]) -> list[tuple[tuple[str, KVCacheSpec, int, Member], tuple[int, int] | None]]:
    """Pick a candidate per needed head run: ``[(candidate, global heads or None)]``."""
    if need[0] != "heads" or _full(need) and any(_full(_held(c[3], c[1])) for c in cands):
        ok = [c for c in cands if _held(c[3], c[1]) == need or (_full(need) and _full(_held(c[3], c[1])))]
        if not ok:
            c = cands[0]
            raise HeadSliceMismatchError(
                "the two sides hold different KV heads; a copy would deliver another rank's heads. GQA/MHA "
                "pages are registered with tp_rank=, tp_size= and kv_heads=; replicated=True is only for pages "
                "byte-identical on every TP rank, such as an MLA latent or indexer cache",
                [(f"members[{name}].heads", _say(need), _say(_held(c[3], c[1])))])
        return [(_choose(ok, rank), None)]
    first, stop, total = need[1], need[2], need[3]
    held = []
    for c in cands:
        h = _held(c[3], c[1])
        if h[0] == "heads" and h[3] == total:
            held.append((c, h[1], h[2]))
        else:
            raise HeadSliceMismatchError(
                "the two sides describe their KV heads differently; kvxfer cannot tell which heads a page holds",
                [(f"members[{name}].heads", _say(need), _say(h))])
    out: list[tuple[tuple[str, KVCacheSpec, int, Member], tuple[int, int] | None]] = []
    for h in range(first, stop):
        opts = [c for c, a, b in held if a <= h < b]
        if not opts:
            missing.append(f"{name} head {h}")
            continue
        c = _choose(opts, rank)
        if out and out[-1][0] is c and out[-1][1] is not None and out[-1][1][1] == h:
            out[-1] = (c, (out[-1][1][0], h + 1))
        else:
            out.append((c, (h, h + 1)))
    return out


def _say(h: tuple[Any, ...]) -> str:
    if h[0] == "all":
        return "every head"
    if h[0] == "heads":
        return f"heads [{h[1]}, {h[2]}) of {h[3]}"
    return f"TP rank {h[1]} of {h[2]} (heads not described)"


def cached_gather(local: KVCacheSpec, remotes: Mapping[str, KVCacheSpec]) -> Gather:
    """:func:`gather`, remembered in the local spec for this exact set of peer specs."""
    key = ("gather", tuple(sorted((n, id(s)) for n, s in remotes.items())))
    hit = local._cache.get(key)
    if hit is not None and hit.matches(local, remotes):
        return hit  # type: ignore[no-any-return]
    g = gather(local, remotes)
    for kk in [kk for kk, v in local._cache.items() if isinstance(v, Gather) and v.stale]:
        del local._cache[kk]
    local._cache[key] = g
    return g


def pair_source(local: KVCacheSpec, remote: KVCacheSpec) -> Any:
    """The pairing for a peer that may supply only part of our cache (``Agent.add_source``).

    Same geometry: the ordinary :func:`~kvxfer.pairing._templates.pair` (whole rows where possible).
    Otherwise a :class:`Gather` over this one peer: accepted when every member both sides
    hold pairs by the rules here, even if the peer holds only some of our heads or layers;
    reading from it alone is refused by :func:`kvxfer.planner.plan_gather` while anything is missing.
    A peer sharing nothing with us is refused with the ordinary pairing error.
    """
    from ._rules import check_pairing
    from ._templates import pair

    try:
        check_pairing(local, remote)
    except LayoutMismatchError as exc:
        g = gather(local, {"": remote})
        if not g.tables and not any(m.name in {x.name for x in remote.members} for m in local.members):
            raise exc
        return g
    return pair(local, remote)
