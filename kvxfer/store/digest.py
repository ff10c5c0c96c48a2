"""Row digests for the store: :mod:`kvxfer.integrity`'s row digest, over rows as the slab holds them.

One implementation: a stored row's digest is exactly what ``kvxfer.integrity.compute(spec,
blocks, rows=True)`` gives for the same logical block of any cache that pairs with the slab
(xxh3-64 of the row's member pages back to back: one hash per slot, in place, since the slab
is described to it as a host cache whose memory is the slab's read-only map). A source that
already computed its digests (a verified transfer) and the store therefore agree.

:data:`DIGEST_NAME` is written in the slab's header and the journal's header record. A journal
of :data:`LEGACY_NAME` (the page-wise digest of journal version 2) is migrated at open: each
entry's row is checked against its old digest (:func:`legacy_row_digests`) and gets the new
one, or is dropped (:mod:`.journal`, ``Store.__init__``). Any other digest: entries dropped.
"""

from __future__ import annotations

import numpy as np

from ..geometry._spec import KVCacheSpec
from ..integrity import compute
from ..integrity.cells import Cells, source_spans
from ..integrity.digests import _combine, _in_place, hash_spans
from ..integrity.mm8 import _xxh3

__all__ = ["row_digests", "local_row_digests", "buffer_row_digests", "bounces", "legacy_row_digests", "DIGEST_NAME",
           "LEGACY_NAME"]

DIGEST_NAME = "integrity-xxh3-row2"
LEGACY_NAME = "integrity-xxh3-rows"


def _runs(spec: KVCacheSpec) -> tuple[memoryview, int, int, int] | None:
    """Where block ``b``'s row lies when every row of ``spec`` is one run of one host
    allocation: ``(view, offset of block 0, block stride, length)``, found once per spec from
    block 0's cells (:func:`kvxfer.integrity.digests._in_place` decides, so the hash is the
    definition's); None for any other layout (then :func:`~kvxfer.integrity.compute` streams)."""
    key = ("store-row-runs",)
    if key not in spec._cache:
        spans = source_spans(spec, np.zeros(1, np.int64), Cells.pages(spec))
        run = _in_place(spans) if spans.base.shape[0] and (spans.stride == spans.stride[0]).all() else None
        spec._cache[key] = None if run is None else (run[0], int(run[1][0]), int(spans.stride[0]), run[2])
    return spec._cache[key]  # type: ignore[no-any-return]


def _digests(spec: KVCacheSpec, blocks: np.ndarray) -> np.ndarray:
    """Row digests of ``blocks``: one xxh3 call per row (it releases the GIL) and no other
    Python per row, where rows are runs (a group's digests on a store worker cost its hash);
    else the definition's own path. Equal either way (tests/test_store.py compares them)."""
    if blocks.shape[0] == 0:
        return np.zeros(0, dtype=np.uint64)
    run = _runs(spec)
    if run is None:
        return compute(spec, blocks, algorithm="xxh3", rows=True).values[:, 0].astype(np.uint64)
    mv, at, stride, n = run
    b = np.asarray(blocks, dtype=np.int64)
    if int(b.min()) < 0 or int(b.max()) >= spec.num_blocks:  # the same refusal as compute's
        compute(spec, b, algorithm="xxh3", rows=True)
    h = _xxh3()
    return np.fromiter([h(mv[o:o + n]) for o in (at + b * stride).tolist()], dtype=np.uint64, count=b.shape[0])


def row_digests(mapped: KVCacheSpec, slots: np.ndarray) -> np.ndarray:
    """One ``uint64`` digest per slot of ``mapped`` (the slab spec over its map), as
    :func:`kvxfer.integrity.compute` defines row digests."""
    return _digests(mapped, slots)


def local_row_digests(spec: KVCacheSpec, blocks: np.ndarray) -> np.ndarray:
    """The same digest of ``blocks`` of a host cache, where the cache holds them: an offload
    hashes its source (warm, already mapped) instead of the slab's map (cold pages, a page
    fault each), a restore the rows it just read (:meth:`kvxfer.Store._run`)."""
    return _digests(spec, blocks)


def bounces(mapped: KVCacheSpec) -> bool:
    """Whether the slab's rows are runs (always, for the slab kvxfer lays out), so a bounce
    buffer holding slots as the slab does can be hashed by :func:`buffer_row_digests`."""
    return _runs(mapped) is not None


def buffer_row_digests(mapped: KVCacheSpec, buf: np.ndarray, lo: int, slots: np.ndarray) -> np.ndarray:
    """The digests of ``slots`` where a buffer ``buf`` holds them as the slab would from slot
    ``lo`` on (:mod:`.bounce`: what an offload writes, hashed before it is written)."""
    run = _runs(mapped)
    if run is None:
        raise ValueError("the slab's rows are not runs")  # bounces() said so first
    _, at, stride, n = run
    h, mv = _xxh3(), memoryview(buf)
    return np.fromiter([h(mv[o:o + n]) for o in (at + (slots - lo) * stride).tolist()], dtype=np.uint64,
                       count=slots.shape[0])


def legacy_row_digests(mapped: KVCacheSpec, slots: np.ndarray) -> np.ndarray:
    """The version-2 journal's row digest (xxh3 per page, folded): read only to migrate a journal."""
    if slots.shape[0] == 0:
        return np.zeros(0, dtype=np.uint64)
    return _combine(hash_spans(source_spans(mapped, slots, Cells.pages(mapped)), "xxh3"))[:, 0]
