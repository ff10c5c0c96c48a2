"""The arithmetic both digest paths share: the mm8 sketch constants and the 64-bit mixer.

Kept apart so the numpy path (:mod:`kvxfer.integrity.digests`) and the torch path
(:mod:`kvxfer.integrity._gpu`) use one definition and give identical values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import MissingDependencyError

CHUNK = 1024  # mm8: bytes per sketch row; 1024 * 128 * 127 < 2**24, so float32 products are exact
COLS = 8
_M64 = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


_M1, _M2 = _signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53)


def _splitmix(i: np.ndarray) -> np.ndarray:
    z = (i.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sketch_matrix() -> np.ndarray:
    """``[CHUNK, 8]`` int8, every entry non-zero: any single changed byte changes every column."""
    v = _splitmix(np.arange(CHUNK * COLS, dtype=np.uint64) + np.uint64(1 << 40))
    mag = (v % np.uint64(127)).astype(np.int16) + 1
    sign = np.where((v >> np.uint64(8)) & np.uint64(1), -1, 1).astype(np.int16)
    return (mag * sign).astype(np.int8).reshape(CHUNK, COLS)


_R: list[np.ndarray] = [np.zeros((0, COLS), np.int64)]


def fold_weights(n: int) -> np.ndarray:
    """``[n, 8]`` odd int64 weights of chunk ``s`` of a cell: position matters, nothing cancels."""
    if _R[0].shape[0] < n:
        m = max(n, 2 * _R[0].shape[0], 64)
        w = _splitmix(np.arange(m * COLS, dtype=np.uint64)) | np.uint64(1)
        _R[0] = w.view(np.int64).reshape(m, COLS)
    return _R[0][:n]


def _lsr(x: Any, s: int) -> Any:
    return (x >> s) & ((1 << (64 - s)) - 1)  # a logical shift on int64, the same in numpy and torch


def length_key(length: int) -> int:
    return _signed(length * 0x9E3779B97F4A7C15)


def finalize(d: Any, length: int) -> Any:
    """Mix the folded sum with the cell length into 64 well-spread bits (int64 in, int64 out)."""
    return mix(d ^ length_key(length))


def mix(h: Any) -> Any:
    """A 64-bit finaliser on int64 arrays, identical in numpy and torch."""
    h = h ^ _lsr(h, 33)
    h = h * _M1
    h = h ^ _lsr(h, 29)
    h = h * _M2
    return h ^ _lsr(h, 32)


def _xxh3() -> Any:
    try:
        import xxhash
    except ImportError as exc:
        raise MissingDependencyError("the xxh3 digest needs xxhash, a kvxfer dependency: pip install xxhash") from exc
    return xxhash.xxh3_64_intdigest


def _xxh3_stream() -> Any:
    """The streaming xxh3-64 (``update`` per cell, then ``intdigest``): equal to one call over the concatenation."""
    _xxh3()  # the same typed error when xxhash is missing
    import xxhash

    return xxhash.xxh3_64
