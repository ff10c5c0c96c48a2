"""The agent's side of a verified transfer: check the digests fit the request, then verify.

Everything that can be decided before a byte moves is decided here first (digests for other
blocks, unknown members, another cell list): a replayed or mismatched digest set is refused
before posting. After DONE the transfer calls the returned check, which recomputes the cells
where our copy lies and compares.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ..errors import IntegrityError
from ..geometry import KVCacheSpec
from .cells import Cells, gather_cells, gather_spans, local_spans
from .digests import Digests, _in_place, verify

__all__ = ["PairingCheck", "pairing_check", "gather_check", "require", "check_received"]


def check_received(agent: Any, local_blocks: Any, expect: Digests) -> None:
    """A WRITE's destination (or a restore): verify our ``local_blocks`` against the writer's digests."""
    if agent.spec is None:
        raise IntegrityError("register a KV cache before verifying it")
    lb = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
    if lb.shape != expect.blocks.shape:
        raise IntegrityError(f"{lb.shape[0]} local blocks for digests of {expect.blocks.shape[0]}")
    verify(expect, local_spans(agent.spec, lb, expect.cells), lb)


def require(expect: Any, peer: str) -> Digests:
    if not isinstance(expect, Digests):
        raise IntegrityError(f"verification is on for reads from {peer!r} but no kvxfer.integrity.Digests came "
                             "with the request; pass expect= (the source's Agent.digest of the same blocks)")
    return expect


def _same_blocks(expect: Digests, remote_blocks: Any, peer: str) -> np.ndarray:
    rb = np.asarray(remote_blocks, dtype=np.int64).reshape(-1)
    if rb.shape != expect.blocks.shape or not np.array_equal(rb, expect.blocks):
        raise IntegrityError(f"the digests from {peer!r} are for source blocks {expect.blocks[:8].tolist()}..., "
                             f"this request reads {rb[:8].tolist()}...; refused before any byte moved")
    return rb


def pairing_check(local: KVCacheSpec, expect: Any, local_blocks: Any, remote_blocks: Any,
                  peer: str) -> Callable[[], None]:
    """Same geometry (whole rows or split): our member pages are the source's, matched by name.

    ``expect`` is one :class:`Digests` for the request's blocks, or a list of them that
    together cover each block once (a partly filled last block has cells of its own).
    """
    lb = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
    if isinstance(expect, Digests):
        _same_blocks(expect, remote_blocks, peer)
        spans = local_spans(local, lb, expect.cells)  # unknown member or range: refused now
        return PairingCheck(expect, spans, lb)
    rb = np.asarray(remote_blocks, dtype=np.int64).reshape(-1)
    at = {int(b): i for i, b in enumerate(rb.tolist())}
    parts, covered = [], 0
    for d in expect:
        d = require(d, peer)
        pos = [at.get(int(b), -1) for b in d.blocks.tolist()]
        if -1 in pos:
            raise IntegrityError(f"the digests from {peer!r} name source blocks this request does not read; "
                                 "refused before any byte moved")
        mine = lb[np.array(pos, dtype=np.int64)]
        parts.append((d, local_spans(local, mine, d.cells), mine))
        covered += len(pos)
    if covered != rb.shape[0] or len({b for d in expect for b in d.blocks.tolist()}) != rb.shape[0]:
        raise IntegrityError(f"the digests from {peer!r} do not cover each block of the request once; "
                             "refused before any byte moved")

    def check() -> None:
        for d, spans, mine in parts:
            verify(d, spans, mine)
    return check


class PairingCheck:
    """One :class:`Digests` against our copy: whole (after DONE), or one part of the request's
    blocks at a time while the rest still moves (:mod:`kvxfer.integrity.overlap`)."""

    __slots__ = ("expect", "spans", "lb")

    def __init__(self, expect: Digests, spans: Any, lb: np.ndarray) -> None:
        self.expect, self.spans, self.lb = expect, spans, lb

    def __call__(self) -> None:
        verify(self.expect, self.spans, self.lb)

    def part(self, a: int, b: int) -> Callable[[], None]:
        """The check of the request's blocks at positions ``[a, b)``."""
        e = self.expect.take(np.arange(a, b))
        sp = dataclasses.replace(self.spans, block=self.spans.block[a:b], sub=self.spans.sub[a:b])
        lb = self.lb[a:b]
        return lambda: verify(e, sp, lb)

    def folder(self) -> Any:
        """A :class:`~kvxfer.integrity.overlap.Folded` check hashing rows as they are copied, or
        None: only ``xxh3`` row digests over rows that are one run of host memory each."""
        from .overlap import Folded

        if not (self.expect.row and self.expect.algorithm == "xxh3") or not self.lb.shape[0]:
            return None
        run = _in_place(self.spans)
        if run is None:
            return None
        view, offs, n = run
        base = self.spans.allocations[int(self.spans.alloc[0])].address
        return Folded(self.expect, self.spans, self.lb, view, offs.tolist(), n, base)


def gather_check(gather: Any, local: KVCacheSpec, remote: KVCacheSpec, expect: Digests, local_blocks: Any,
                 remote_blocks: Any, peer: str) -> Callable[[], None]:
    """Another TP or block size: the cells are the byte ranges the gather copies (cells_for)."""
    rb = _same_blocks(expect, remote_blocks, peer)
    cells, templates = gather_cells(gather, peer, local, remote)
    if expect.cells != cells:
        raise IntegrityError(f"the digests from {peer!r} cover other cells than this read copies; the source must "
                             "digest Agent.cells_for(...) of this destination")
    lb = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
    j = np.arange(rb.shape[0], dtype=np.int64)
    lblk, sub = lb[j // gather.k], j % gather.k
    spans = gather_spans(local, templates, cells, lblk, sub)
    return lambda: verify(expect, spans, lblk)


def default_cells(local: KVCacheSpec) -> Cells:
    return Cells.pages(local)
