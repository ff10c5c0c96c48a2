"""Row digests for the store: :mod:`kvxfer.integrity`'s row digest, over rows as the slab holds them.

One implementation: a stored row's digest is exactly what ``kvxfer.integrity.compute(spec,
blocks, rows=True)`` gives for the same logical block of any cache that pairs with the slab
(xxh3-64 of each member page, folded into one value per row), because the slab is described
to it as a host cache whose memory is the slab's read-only map. A source that already
computed its digests (a verified transfer) and the store therefore agree.

:data:`DIGEST_NAME` is written in the slab's header and the journal's header record: a slab
or journal written with another digest is reused, its entries dropped (misses, never errors).
"""

from __future__ import annotations

import numpy as np

from ..integrity import compute
from ..geometry._spec import KVCacheSpec

__all__ = ["row_digests", "DIGEST_NAME"]

DIGEST_NAME = "integrity-xxh3-rows"


def row_digests(mapped: KVCacheSpec, slots: np.ndarray) -> np.ndarray:
    """One ``uint64`` digest per slot of ``mapped`` (the slab spec over its map), as
    :func:`kvxfer.integrity.compute` defines row digests."""
    if slots.shape[0] == 0:
        return np.zeros(0, dtype=np.uint64)
    return compute(mapped, slots, algorithm="xxh3", rows=True).values[:, 0].astype(np.uint64)
