"""mm8 digests on the GPU with the copier's own kernel: one pass over the bytes, no torch.

``kvxfer_mm8_tc`` (``batch_copy.cu``) computes :mod:`kvxfer.integrity.mm8`'s definition
exactly: each 1024-byte chunk of a cell against the int8 sketch on the tensor cores
(``mma.m16n8k32``; :mod:`kvxfer.cuda.mm8_model` is its lane-by-lane CPU model), weighted by
the fold weights, summed modulo 2**64; the host mixes each sum with its cell's length
(:func:`kvxfer.integrity.mm8.finalize`). With a destination it also copies what it hashes,
so a verified copy reads its bytes once: the device path's verified posts use it
(:meth:`kvxfer.cuda.DevicePath.post`, ``expect=``). ``kvxfer_mm8`` (``__dp4a``) is the
earlier kernel, compute-bound at a third of the copy's rate (BENCHMARKS.md).

Why not torch: its path gathers the cells (one copy), runs one int8 product per group and a
handful of small ops; this is one launch over the cells where they lie. Cells must start on a
16-byte boundary (they do in every KV layout seen); :func:`mm8` returns ``None`` otherwise and
the caller keeps its other path.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..integrity.mm8 import CHUNK, fold_weights, length_key, mix, sketch_matrix  # noqa: F401 (length_key: the definition)
from ._driver import CudaError
from .copy import Copier, CopyHandle, launch_grid

__all__ = ["mm8", "mm8_table", "post", "result"]

_D2H = 2
_GOLDEN = 0x9E3779B97F4A7C15  # length_key's multiplier
#: Largest piece one CTA hashes (a multiple of CHUNK): long cells are cut so every SM works.
DPIECE = 64 << 10
_DTHREADS = 256  # must match batch_copy.cu


def mm8_table(src: np.ndarray, lengths: np.ndarray, dst: np.ndarray | None = None,
              piece: int = DPIECE) -> np.ndarray:
    """The kernel's table ``[dst..., src..., len..., meta...]`` (uint64): cell ``i`` cut into
    pieces of at most ``piece`` bytes, each tagged ``s0 << 32 | i`` (its first chunk, its cell)."""
    assert piece % CHUNK == 0
    src = np.asarray(src, dtype=np.uint64)
    lengths = np.asarray(lengths, dtype=np.uint64)
    dst = np.zeros_like(src) if dst is None else np.asarray(dst, dtype=np.uint64)
    k = ((lengths + np.uint64(piece - 1)) // np.uint64(piece)).astype(np.int64)
    cell = np.repeat(np.arange(src.shape[0], dtype=np.uint64), k)
    first = np.cumsum(k) - k
    j = (np.arange(int(k.sum()), dtype=np.int64) - np.repeat(first, k)).astype(np.uint64)
    off = j * np.uint64(piece)
    ln = np.minimum(lengths[cell.astype(np.int64)] - off, np.uint64(piece))
    d = np.where(dst[cell.astype(np.int64)] != 0, dst[cell.astype(np.int64)] + off, np.uint64(0))
    meta = ((off // np.uint64(CHUNK)) << np.uint64(32)) | cell
    return np.concatenate([d, src[cell.astype(np.int64)] + off, ln, meta])


class _Consts:
    """The packed sketch: ``kp`` for kvxfer_mm8 (``[8][256]`` words: column j, bytes 4w..4w+3),
    ``bp`` for kvxfer_mm8_tc (the B fragments, :func:`kvxfer.cuda.mm8_model.pack_b`), and
    the fold weights ``r`` (``rows`` of them)."""

    def __init__(self) -> None:
        self.kp = 0
        self.bp = 0
        self.r = 0
        self.rows = 0


_consts: dict[int, _Consts] = {}
#: The kernel mm8 posts use: the tensor-core one (sm_80+, the PTX's target), or "kvxfer_mm8"
#: (``__dp4a``), kept as the benchmarks' comparison (bench_digest_gpu.py --kernels).
KERNEL = ["kvxfer_mm8_tc"]


def _upload(c: Any, arr: np.ndarray) -> int:
    g = ctypes.c_void_p()
    c.check(c.rt.cudaMalloc(ctypes.byref(g), arr.nbytes), "cudaMalloc")
    c.check(c.rt.cudaMemcpyAsync(g, arr.ctypes.data, arr.nbytes, 1, None), "uploading mm8 constants")
    c.check(c.rt.cudaStreamSynchronize(None), "cudaStreamSynchronize")
    return int(g.value or 0)


def _constants(copier: Copier, device: int, chunks: int) -> _Consts:
    from .mm8_model import pack_b

    k = _consts.get(device)
    if k is None:
        k = _consts[device] = _Consts()
        kp = np.ascontiguousarray(sketch_matrix().T).view(np.uint32)  # [8, 256]
        k.kp = _upload(copier.c, np.ascontiguousarray(kp))
        k.bp = _upload(copier.c, np.ascontiguousarray(pack_b()))
    if k.rows < chunks:
        rows = max(chunks, 2 * k.rows, 64)
        old = k.r
        k.r, k.rows = _upload(copier.c, np.ascontiguousarray(fold_weights(rows))), rows
        if old:
            copier.c.rt.cudaFree(old)
    return k


def post(copier: Copier, device: int, src: np.ndarray, lengths: np.ndarray,
         dst: np.ndarray | None = None) -> CopyHandle | None:
    """Enqueue mm8 of the cells at ``src`` (``lengths`` bytes each, all on ``device``), copying
    each to ``dst`` first when given (one read of every byte); ``None`` where the kernel cannot
    serve (a cell off a 16-byte boundary, no loadable kernel). Completion is the handle's event
    (:meth:`Copier.wait`, :meth:`Copier.query`); :func:`result` then gives the digests. The
    tensor-core kernel reads the event's gate before each piece: :meth:`Copier.fence` works as for copies."""
    src = np.ascontiguousarray(src, dtype=np.uint64).reshape(-1)
    lengths = np.ascontiguousarray(lengths, dtype=np.uint64).reshape(-1)
    n = src.shape[0]
    if n == 0 or (src & np.uint64(15)).any() or (dst is not None and (np.asarray(dst, np.uint64) & np.uint64(15)).any()):
        return None
    name = KERNEL[0]
    fn = copier._function(device, name)
    if fn is None:
        return None
    d = copier._device(device)
    c = copier.c
    chunks = int((int(lengths.max()) + CHUNK - 1) // CHUNK)
    with c.on(device):
        k = _constants(copier, device, chunks)
        table = mm8_table(src, lengths, dst)
        pieces = table.shape[0] // 4
        ev = copier._event(d)
        tslot = copier._slot(d, table.nbytes)
        oslot = copier._slot(d, 8 * n)
        h = CopyHandle(device, ev, slot=tslot, engine="mm8", spans=n, gate=d.gates[ev][0], out=(oslot, lengths))
        try:
            tslot.view[: table.shape[0]] = table
            c.check(c.rt.cudaMemcpyAsync(tslot.dev, tslot.host, table.nbytes, 1, d.stream), "uploading the mm8 table")
            c.check(c.rt.cudaMemsetAsync(oslot.dev, 0, 8 * n, d.stream), "cudaMemsetAsync")
            words = (tslot.dev, pieces, k.bp, k.r, oslot.dev, d.gates[ev][1]) if name == "kvxfer_mm8_tc" else \
                (tslot.dev, pieces, k.kp, k.r, oslot.dev)
            a = [ctypes.c_ulonglong(v) for v in words]
            args = (ctypes.c_void_p * len(a))(*[ctypes.addressof(x) for x in a])
            grid = launch_grid(pieces, name == "kvxfer_mm8_tc" and bool(d.gates[ev][1]))
            c.check_drv(c.drv.cuLaunchKernel(fn, grid, 1, 1, _DTHREADS, 1, 1, 0, d.stream, args, None),
                        "launching the mm8 kernel")
            c.check(c.rt.cudaMemcpyAsync(oslot.host, oslot.dev, 8 * n, _D2H, d.stream), "reading the mm8 sums")
            c.check(c.rt.cudaEventRecord(ev, d.stream), "cudaEventRecord")
        except CudaError:
            with copier._pool:
                d.free_slots += [oslot, tslot]
                d.events.append(ev)
            raise
    return h


def result(copier: Copier, h: CopyHandle) -> np.ndarray:
    """The digests (uint64, one a cell) of a finished :func:`post`; its sums slot goes back."""
    assert h.done and h.out is not None
    oslot, lengths = h.out
    h.out = None
    sums = oslot.view[:lengths.shape[0]].copy()
    with copier._pool:
        copier._devices[h.device].free_slots.append(oslot)
    keys = (lengths * np.uint64(_GOLDEN)).view(np.int64)  # length_key, vectorised (modulo 2**64)
    return np.asarray(mix(sums.view(np.int64) ^ keys)).view(np.uint64)


def mm8(copier: Copier, device: int, src: np.ndarray, lengths: np.ndarray,
        dst: np.ndarray | None = None) -> np.ndarray | None:
    """mm8 of the cells at ``src`` as uint64 (after copying each to ``dst`` when given), or
    ``None`` where the kernel cannot serve. Synchronous: :func:`post`, wait, :func:`result`."""
    if np.asarray(src).size == 0:
        return np.zeros(0, np.uint64)
    h = post(copier, device, src, lengths, dst)
    if h is None:
        return None
    copier.synchronize(h)
    return result(copier, h)

