"""The agent's side of a verified transfer: check the digests fit the request, then verify.

Everything that can be decided before a byte moves is decided here first (digests for other
blocks, unknown members, another cell list): a replayed or mismatched digest set is refused
before posting. After DONE the transfer calls the returned check, which recomputes the cells
where our copy lies and compares.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import IntegrityError
from ..layout import KVCacheSpec
from .cells import Cells, gather_cells, gather_spans, local_spans
from .digests import Digests, verify

__all__ = ["pairing_check", "gather_check", "require"]


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


def pairing_check(local: KVCacheSpec, expect: Digests, local_blocks: Any, remote_blocks: Any,
                  peer: str) -> Callable[[], None]:
    """Same geometry (whole rows or split): our member pages are the source's, matched by name."""
    _same_blocks(expect, remote_blocks, peer)
    lb = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
    spans = local_spans(local, lb, expect.cells)  # unknown member or range: refused now
    return lambda: verify(expect, spans, lb)


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
