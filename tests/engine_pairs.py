"""Random pairs of engine-shaped caches, and the independent verdict on each pair.

The verdict is stated here from what the bytes mean, without kvxfer: a byte copy between
two caches is correct exactly when both hold the same element type, the same tokens per
block, the same KV heads, and pages whose bytes are in the same order. NHD and HND pages
hold their bytes in the same order when tokens or heads have extent 1.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvxfer.errors import (BlockTokensMismatchError, DtypeMismatchError, HeadSliceMismatchError,
                           LayoutMismatchError, PageFormatMismatchError)
from kvxfer._harness.engines import MLA_STYLES, STYLES, EngineCache

DTYPES = ("float16", "int16", "float32", "uint8")  # float16 and int16: same size, other values


def heads_held(c: EngineCache) -> tuple[int, int] | None:
    """Global KV heads ``[first, stop)`` a rank holds: dealt out in order, repeated when TP > heads."""
    if c.mla or c.tp_size == 1:
        return None  # every head
    if c.kv_heads >= c.tp_size:
        per = c.kv_heads // c.tp_size
        return (c.tp_rank * per, (c.tp_rank + 1) * per)
    first = c.tp_rank * c.kv_heads // c.tp_size
    return (first, first + 1) if c.kv_heads > 1 else None  # one head: every rank holds all of it


def verdict(a: EngineCache, b: EngineCache) -> type[LayoutMismatchError] | None:
    """None when reading ``b`` into ``a`` by byte copies is correct, else the expected error."""
    if a.block_tokens != b.block_tokens:
        return BlockTokensMismatchError
    if a.dtype != b.dtype:
        return DtypeMismatchError
    if heads_held(a) != heads_held(b):
        return HeadSliceMismatchError
    same_order = a.mla or a.order == b.order or a.block_tokens == 1 or a.local_heads == 1
    return None if same_order else PageFormatMismatchError


@st.composite
def engine_pairs(draw: st.DrawFn) -> tuple[EngineCache, EngineCache]:
    mla = draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else False
    layers = draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([1, 2, 4, 8, 8]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    tokens = draw(st.sampled_from([1, 2, 4]))

    tp0 = draw(st.sampled_from([1, 2, 4]))
    rank0 = draw(st.integers(0, tp0 - 1))

    def maybe(shared: object, other: st.SearchStrategy, odds: int) -> object:
        """The shared value, except one time in ``odds``: most pairs get past the first checks."""
        return draw(other) if draw(st.integers(0, odds - 1)) == 0 else shared

    def side() -> EngineCache:
        dt = maybe(dtype, st.sampled_from(DTYPES), 8)
        n = maybe(tokens, st.sampled_from([1, 2, 4]), 8)
        tp = maybe(tp0, st.sampled_from([1, 2, 4]), 3)
        rank = rank0 if tp == tp0 and draw(st.booleans()) else draw(st.integers(0, tp - 1))  # type: ignore[operator]
        return EngineCache(draw(st.sampled_from(MLA_STYLES if mla else STYLES)), draw(st.sampled_from(["NHD", "HND"])),
                           dt, layers, draw(st.integers(2, 8)), n, kv_heads, head_dim, tp, rank)  # type: ignore[arg-type]

    return side(), side()


@st.composite
def block_ids(draw: st.DrawFn, n_dst: int, n_src: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct destination ids (sources may repeat), in random order."""
    k = draw(st.integers(0, n_dst))
    dst = draw(st.permutations(range(n_dst)))[:k]
    src = [draw(st.integers(0, n_src - 1)) for _ in range(k)]
    return np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64)
