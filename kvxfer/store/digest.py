"""Row digests: the one function the store checks every restored row with.

STORE-DIGEST: this is a stand-in, kept behind :func:`row_digests` alone so that the lead can
switch it to the shared row digest (issue 23) at merge; the journal records only its 64-bit
output, and :data:`DIGEST_NAME` is written into the slab header so a slab written with
another digest is refused rather than misread.

The stand-in is numpy only (no new dependency): a row's little-endian 64-bit words are summed
with fixed odd pseudo-random weights, modulo 2**64, then finalised with the splitmix64 mixer
and the row length. An odd weight is invertible modulo 2**64, so changing any single word
always changes the digest; torn, zeroed, shifted or stale rows are caught with overwhelming
probability. It is not a cryptographic hash: it guards against accidents, not an adversary
who can write the slab (the slab is 0600 and locked).
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["row_digests", "DIGEST_NAME"]

DIGEST_NAME = "kvxfer-wsum64-v1"
_SEED = 0x6B76786665720001  # fixed: digests must be equal across processes and restarts
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@functools.lru_cache(maxsize=8)
def _weights(words: int) -> np.ndarray:
    w = np.random.default_rng(_SEED).integers(0, 1 << 63, size=max(words, 1), dtype=np.uint64)
    w = (w << np.uint64(1)) | np.uint64(1)  # odd, full 64 bits
    w.flags.writeable = False
    return w


def _mix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * _M1
    h = h ^ (h >> np.uint64(27))
    h = h * _M2
    return h ^ (h >> np.uint64(31))


def row_digests(rows: np.ndarray) -> np.ndarray:
    """One ``uint64`` digest per row of an ``(n, row_len)`` ``uint8`` array.

    Rows may be a strided view (rows of an mmap'd slab): when each row's bytes are contiguous
    the words are read in place. Vectorised over rows: no Python loop per row.
    """
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError("row_digests takes an (n, row_len) uint8 array")
    n, length = rows.shape
    words = length // 8
    w = _weights(words + 1)
    h = np.zeros(n, dtype=np.uint64)
    if words and n:
        body = rows[:, :words * 8]
        if body.strides[1] != 1:
            body = np.ascontiguousarray(body)
        h += np.einsum("ij,j->i", body.view("<u8"), w[:words])
    tail = length - words * 8
    if tail and n:
        t = np.zeros((n, 8), dtype=np.uint8)
        t[:, :tail] = rows[:, words * 8:]
        h += t.view("<u8")[:, 0] * w[words]
    return _mix(h ^ np.uint64((length * int(_GOLDEN)) & ((1 << 64) - 1)))
