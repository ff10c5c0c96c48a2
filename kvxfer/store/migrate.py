"""Bring a version-2 journal's entries to the current row digest, checking each row first.

Version 2 recorded page-wise row digests (:func:`~.digest.legacy_row_digests`). A row is
re-digested only after it matched its old digest, so a row damaged while the store was closed
is dropped (a miss), never given a fresh digest that would vouch for its wrong bytes.
"""

from __future__ import annotations

import numpy as np

from ..geometry._spec import KVCacheSpec
from .digest import legacy_row_digests, row_digests
from .index import Index

__all__ = ["migrate"]


def migrate(index: Index, mapped: KVCacheSpec) -> tuple[int, list[bytes]]:
    """Rewrite ``index``'s digests in place (the caller then rewrites the journal); returns how
    many entries were kept and the keys dropped because their rows failed the old digest."""
    live = list(index.entries.values())
    if not live:
        return 0, []
    slots = np.fromiter((e.slot for e in live), dtype=np.int64, count=len(live))
    old = np.fromiter((e.digest for e in live), dtype=np.uint64, count=len(live))
    ok = legacy_row_digests(mapped, slots) == old
    new = row_digests(mapped, slots)
    for e, good, d in zip(live, ok.tolist(), new.tolist()):
        if good:
            e.digest = int(d)
    bad = [e.key for e, good in zip(live, ok.tolist()) if not good]
    index.drop(bad)
    return len(live) - len(bad), bad
