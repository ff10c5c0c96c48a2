"""``kvxfer_mm8_tc`` (batch_copy.cu) on the CPU, lane by lane, and the packing it depends on.

The tensor-core kernel decides which byte meets which sketch entry through the fragment
layouts of ``mma.m16n8k32`` (s8, PTX ISA "Matrix Fragments for mma.m16n8k32") and the B
fragments packed here (:func:`pack_b`, the very words the host uploads). A wrong index there
gives digests that differ from :mod:`kvxfer.integrity.mm8`, so :func:`emulate` rebuilds the
kernel's work from the same table and words: each lane's registers, the A and B matrices
those registers mean to the tensor core, each lane's four int32 results, its weighting by
the fold weights, the warp and block sums, one add per piece into its cell. It is slow (a
test reference), and it is the kernel's order of combination exactly, so the CPU tests check
the kernel's arithmetic and the GPU tests (tests/test_cuda_digest_gpu.py) check the hardware.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..integrity.mm8 import CHUNK, COLS, fold_weights, sketch_matrix

__all__ = ["pack_b", "emulate"]

TILE = 16  # chunks (rows of A) per tile
WARPS = 8  # DTHREADS / 32
SLICE = 64  # bytes of a chunk one warp covers per slice; warp w owns slices w and w + 8
_lane = np.arange(32)
_G, _T = _lane >> 2, _lane & 3


def pack_b() -> np.ndarray:
    """``bp[slice][lane][k]`` (uint32, 16 x 32 x 4): word k of lane (g, t) in slice q holds
    sketch rows ``q*64 + t*16 + 4k .. +3`` of column ``g`` (byte j in bits 8j)."""
    K = sketch_matrix().view(np.uint8)  # [CHUNK, 8]
    q = np.arange(CHUNK // SLICE)[:, None, None, None]
    byte = q * SLICE + _T[None, :, None, None] * 16 + np.arange(4)[None, None, :, None] * 4 + np.arange(4)
    b = K[byte, _G[None, :, None, None]].astype(np.uint32)  # [16, 32, 4, 4]
    return (b << (np.arange(4, dtype=np.uint32) * 8)).sum(-1, dtype=np.uint32).astype(np.uint32)


def _words(v: np.ndarray) -> np.ndarray:
    """``[32, 16]`` uint8 -> ``[32, 4]`` uint32 (x, y, z, w of each lane's uint4)."""
    return np.ascontiguousarray(v).view(np.uint32).reshape(32, 4)


def _mma(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One ``mma.m16n8k32.row.col.s32.s8.s8.s32`` from its fragments: ``a`` [32, 4] and ``b``
    [32, 2] uint32 per lane -> ``[32, 4]`` int32 per lane (c0..c3), by the PTX layouts."""
    av = a.view(np.uint8).reshape(32, 4, 4).view(np.int8)  # lane, register, byte
    bv = b.view(np.uint8).reshape(32, 2, 4).view(np.int8)
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for r in range(4):  # a0: row g, k t*4+j; a1: row g+8; a2: row g, k 16+t*4+j; a3: row g+8, k 16+...
        row = _G + (8 if r in (1, 3) else 0)
        k0 = _T * 4 + (16 if r >= 2 else 0)
        for j in range(4):
            A[row, k0 + j] = av[:, r, j]
    for r in range(2):  # b0: k t*4+j, column g; b1: k 16+t*4+j
        for j in range(4):
            B[_T * 4 + 16 * r + j, _G] = bv[:, r, j]
    D = A @ B  # [16, 8]
    return np.stack([D[_G, 2 * _T], D[_G, 2 * _T + 1], D[_G + 8, 2 * _T], D[_G + 8, 2 * _T + 1]], 1)


def _take(read: Callable[[int, int], np.ndarray], base: int, off: np.ndarray, length: int) -> np.ndarray:
    """load16 for 32 lanes: the 16 bytes at each offset, zeros past the piece's end."""
    out = np.zeros((32, 16), np.uint8)
    for i, o in enumerate(off.tolist()):
        if o < length:
            k = min(16, length - o)
            out[i, :k] = read(base + o, k)
    return out


def emulate(table: np.ndarray, cells: int, read: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """The kernel's ``out`` (uint64 sums, before the host mixes in the lengths) for ``table``
    (:func:`kvxfer.cuda.digest.mm8_table`), reading source bytes with ``read(address, n)``."""
    n = table.shape[0] // 4
    src, ln, meta = table[n:2 * n], table[2 * n:3 * n], table[3 * n:]
    bp = pack_b()
    out = np.zeros(cells, np.uint64)
    with np.errstate(over="ignore"):  # sums modulo 2**64, as on the GPU
        _run(table, n, src, ln, meta, bp, out, read)
    return out


def _run(table: np.ndarray, n: int, src: np.ndarray, ln: np.ndarray, meta: np.ndarray, bp: np.ndarray,
         out: np.ndarray, read: Callable[[int, int], np.ndarray]) -> None:
    for p in range(n):
        s, length = int(src[p]), int(ln[p])
        s0, cell = int(meta[p] >> np.uint64(32)), int(meta[p] & np.uint64(0xFFFFFFFF))
        chunks = -(-length // CHUNK)
        R = fold_weights(s0 + chunks + 2 * TILE).view(np.uint64)
        lane_acc = np.zeros((WARPS, 32), np.uint64)
        for c in range(0, chunks, TILE):
            for w in range(WARPS):
                y = np.zeros((32, 4), np.int64)
                for h in range(2):
                    off = (w + 8 * h) * SLICE + _T * 16
                    va = _words(_take(read, s, (c + _G) * CHUNK + off, length))
                    vb = _words(_take(read, s, (c + _G + 8) * CHUNK + off, length))
                    b = bp[w + 8 * h]
                    y += _mma(np.stack([va[:, 0], vb[:, 0], va[:, 1], vb[:, 1]], 1), b[:, 0:2])
                    y += _mma(np.stack([va[:, 2], vb[:, 2], va[:, 3], vb[:, 3]], 1), b[:, 2:4])
                y64 = y.astype(np.int64).view(np.uint64)
                for rows, (c0, c1) in ((c + _G, (0, 1)), (c + _G + 8, (2, 3))):
                    live = rows < chunks
                    wr = R[s0 + np.minimum(rows, chunks)]  # [32, 8]; rows past the piece add nothing
                    add = y64[:, c0] * wr[_lane, 2 * _T] + y64[:, c1] * wr[_lane, 2 * _T + 1]
                    lane_acc[w] += np.where(live, add, np.uint64(0))
        out[cell] += lane_acc.sum(dtype=np.uint64)  # shuffles, the block's parts, one atomicAdd


assert COLS == 8 and CHUNK == (CHUNK // SLICE) * SLICE and (CHUNK // SLICE) == 2 * WARPS
