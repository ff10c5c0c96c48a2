"""The host stage's vectorised copies: real bytes, sentinels kept, and no byte outside the memory given.

A per-layer host cache's pages are gathered into rows and scattered back (the path NIXL POSIX
takes for a cache of many regions). The reference is numpy indexing over the pages. The
safety test hands a descriptor that leaves the cache's memory (a crafted plan): it is
refused before any byte moves; the control gives the same copy the memory it needs.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.errors import StoreError
from kvxfer.store.stage import HostCopies

PAGE, NB, REGIONS = 4096, 6, 5


def _setup(misaligned: bool = False):
    rng = np.random.default_rng(3)
    regions = [rng.integers(0, 256, NB * PAGE + 64, dtype=np.uint8) for _ in range(REGIONS)]
    stage = np.full(NB * REGIONS * PAGE + PAGE, 0xAA, np.uint8)
    blocks = np.array([4, 0, 5, 2])
    shift = [7 * i if misaligned else 0 for i in range(REGIONS)]  # pages at other addresses modulo the page
    src = np.array([[r.ctypes.data + shift[i] + int(b) * PAGE for i, r in enumerate(regions)] for b in blocks]).ravel()
    dst = stage.ctypes.data + np.arange(src.size, dtype=np.int64) * PAGE
    ref = np.stack([np.stack([r[shift[i] + b * PAGE: shift[i] + (b + 1) * PAGE] for i, r in enumerate(regions)])
                    for b in blocks.tolist()]).ravel()
    memory = [(r.ctypes.data, r.nbytes) for r in regions] + [(stage.ctypes.data, stage.nbytes)]
    return regions, stage, src, dst, ref, memory, shift, blocks


@pytest.mark.parametrize("misaligned", [False, True])
def test_gather_into_rows_and_scatter_back(misaligned: bool) -> None:
    regions, stage, src, dst, ref, memory, shift, blocks = _setup(misaligned)
    sizes = np.full(src.size, PAGE)
    HostCopies().copy(dst, src, sizes, memory)
    assert np.array_equal(stage[:ref.size], ref) and (stage[ref.size:] == 0xAA).all()
    back = [np.full_like(r, 0xAA) for r in regions]
    bmem = [(r.ctypes.data, r.nbytes) for r in back] + [(stage.ctypes.data, stage.nbytes)]
    bdst = np.array([[r.ctypes.data + shift[i] + int(b) * PAGE for i, r in enumerate(back)] for b in blocks]).ravel()
    HostCopies().copy(bdst, dst, sizes, bmem)
    for i, (r, o) in enumerate(zip(regions, back)):
        for b in range(NB):
            s = slice(shift[i] + b * PAGE, shift[i] + (b + 1) * PAGE)
            assert np.array_equal(o[s], r[s]) if b in blocks else (o[s] == 0xAA).all()
    # Scattered on both sides (neither a contiguous run): the two-step path.
    perm = np.random.default_rng(0).permutation(src.size)
    stage[...] = 0xAA
    HostCopies().copy(dst[perm], src, sizes, memory)
    assert np.array_equal(stage[:ref.size].reshape(-1, PAGE)[perm], ref.reshape(-1, PAGE))


def test_a_descriptor_outside_the_memory_given_is_refused_before_any_byte_moves() -> None:
    regions, stage, src, dst, ref, memory, _, _ = _setup()
    sizes = np.full(src.size, PAGE)
    bad = src.copy()
    bad[-1] = regions[-1].ctypes.data + regions[-1].nbytes - PAGE // 2  # runs past the region's end
    with pytest.raises(StoreError, match="leaves"):
        HostCopies().copy(dst, bad, sizes, memory)
    assert (stage == 0xAA).all()  # nothing moved
    with pytest.raises(StoreError, match="leaves"):  # memory not given at all (another region)
        HostCopies().copy(dst, src, sizes, memory[1:])
    assert (stage == 0xAA).all()
    HostCopies().copy(dst, src, sizes, memory)  # control: the same copy with its memory moves the bytes
    assert np.array_equal(stage[:ref.size], ref)
