"""The prepared device post and the mm8 kernel's tables, on CPU.

``kvxfer_copy_few`` and ``kvxfer_mm8`` (kvxfer/cuda/batch_copy.cu) are emulated here from the
very words the host hands them (the by-value parameter block, the piece table), so the
packing, the launch shapes and the digest's cutting into pieces are checked against numpy
references without a GPU; tests/test_cuda_digest_gpu.py runs the kernels themselves.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from kvxfer.cuda.copy import FEW, Copier, few_shape
from kvxfer.cuda.digest import mm8_table
from kvxfer.integrity.digests import _mm8_rows
from kvxfer.integrity.mm8 import CHUNK, finalize, fold_weights, sketch_matrix

SENTINEL = 0xAA


def _run_few(words: np.ndarray) -> None:
    """What kvxfer_copy_few does with its parameter block, piece by piece."""
    n, piece = int(words[0]), int(words[1])
    first = words[2:3 + FEW].astype(np.int64)
    dst, src, ln = (words[3 + FEW + k * FEW:3 + FEW + (k + 1) * FEW].astype(np.int64) for k in range(3))
    for p in range(int(first[n])):
        i = 0
        while i + 1 < n and first[i + 1] <= p:
            i += 1
        off = (p - int(first[i])) * piece
        ctypes.memmove(int(dst[i]) + off, int(src[i]) + off, min(piece, int(ln[i]) - off))


class _Lib:
    """Runtime and driver entry points the copier calls, recorded; launches run on the host."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.uploads: list[int] = []  # bytes of each cudaMemcpyAsync
        self.keep: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append(name)
            if name in ("cudaHostAlloc", "cudaMalloc"):  # gates: real memory, so they can be written
                buf = ctypes.create_string_buffer(int(args[1]))
                self.keep.append(buf)
                args[0]._obj.value = ctypes.addressof(buf)
            if name == "cudaMemcpyAsync":
                self.uploads.append(int(args[2]))
            if name == "cuLaunchKernel":
                params = ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))[0]
                _run_few(np.ctypeslib.as_array(ctypes.cast(params, ctypes.POINTER(ctypes.c_uint64)),
                                               shape=(2 + (FEW + 1) + 3 * FEW,)).copy())
            return 0
        return call


class _Cuda:
    def __init__(self) -> None:
        self.rt = self.drv = _Lib()

    def on(self, device: int) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def check(self, rc: int, what: str) -> None:
        assert rc == 0, what

    check_drv = check

    def enable_peer(self, a: int, b: int) -> None:
        pass


@pytest.mark.parametrize("sizes", [[4096], [65536], [61 * 73728], [1, 7, 100000, 3], [33000] * FEW])
def test_prepared_post_moves_exactly_the_spans_and_reuses_its_shape(sizes: list[int]) -> None:
    rng = np.random.default_rng(len(sizes))
    n = np.array(sizes, dtype=np.int64)
    src = rng.integers(0, 256, int(n.sum()) + 64, dtype=np.uint8)
    dst = np.full(int(n.sum()) * 2 + 64, SENTINEL, np.uint8)
    so = np.concatenate([[0], np.cumsum(n)[:-1]])
    do = so * 2 + 16  # gaps between destination spans must keep the sentinel
    cp = Copier(_Cuda())  # type: ignore[arg-type]
    cp._function = lambda device, name="": 1  # type: ignore[method-assign]
    for _ in range(3):
        cp.copy((do + dst.ctypes.data).astype(np.uint64), (so + src.ctypes.data).astype(np.uint64),
                n.astype(np.uint64), 0)
    ref = np.full_like(dst, SENTINEL)
    for a, b, k in zip(do.tolist(), so.tolist(), sizes):  # numpy reference
        ref[a:a + k] = src[b:b + k]
    np.testing.assert_array_equal(dst, ref)
    d = cp._devices[0]
    assert len(d.shapes) == 1  # one shape, prepared once, reused by the later posts
    calls = cp.c.rt.calls
    assert calls.count("cuLaunchKernel") == 3 and calls.count("cudaEventRecord") == 3
    assert cp.c.rt.uploads == [24] * 3  # no table upload on this path: only each new event's gate (none recycled here)


def test_a_post_of_more_spans_takes_the_table() -> None:
    cp = Copier(_Cuda())  # type: ignore[arg-type]
    cp._function = lambda device, name="": 1  # type: ignore[method-assign]

    class Table(Exception):
        pass

    def slot(d: Any, nbytes: int) -> Any:
        raise Table(nbytes)

    cp._slot = slot  # type: ignore[method-assign]
    with pytest.raises(Table):
        cp.copy(np.arange(FEW + 1, dtype=np.uint64) * 64 + 4096, np.arange(FEW + 1, dtype=np.uint64) * 64 + 8192,
                np.full(FEW + 1, 64, np.uint64), 0)
    assert "cuLaunchKernel" not in cp.c.rt.calls


def test_few_shape_gives_every_span_its_pieces() -> None:
    sizes = np.array([1, 32768, 32769, 4_500_000], np.uint64)
    piece, first = few_shape(sizes)
    counts = np.diff(first.astype(np.int64))
    np.testing.assert_array_equal(counts, -(-sizes.astype(np.int64) // piece))


def _emulate_mm8(table: np.ndarray, mem: np.ndarray, base: int, lengths: list[int], s0_off: bool = False) -> np.ndarray:
    """What kvxfer_mm8 sums, piece by piece (chunk = int8 bytes . K, weighted by R[s0 + c])."""
    m = table.shape[0] // 4
    src, ln, meta = table[m:2 * m], table[2 * m:3 * m], table[3 * m:]
    K = sketch_matrix().astype(np.int64)
    sums = np.zeros(len(lengths), np.int64)
    for p in range(m):
        s0, cell, n = int(meta[p] >> np.uint64(32)), int(meta[p] & np.uint64(0xFFFFFFFF)), int(ln[p])
        if s0_off:
            s0 = 0
        a = int(src[p]) - base
        chunks = -(-n // CHUNK)
        buf = np.zeros(chunks * CHUNK, np.uint8)
        buf[:n] = mem[a:a + n]
        y = buf.view(np.int8).astype(np.int64).reshape(chunks, CHUNK) @ K
        sums[cell] += int((y * fold_weights(s0 + chunks)[s0:s0 + chunks]).sum())
    return np.concatenate([finalize(sums[i:i + 1], n) for i, n in enumerate(lengths)]).view(np.uint64)


def test_mm8_pieces_add_up_to_the_integrity_definition() -> None:
    lengths = [1, 1000, 1024, 1025, 70000, 200000]
    rng = np.random.default_rng(5)
    mem = rng.integers(0, 256, sum(lengths) + 16 * len(lengths), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(np.array(lengths) + 16)[:-1]])
    base = mem.ctypes.data
    table = mm8_table((starts + base).astype(np.uint64), np.array(lengths, np.uint64), piece=8192)
    got = _emulate_mm8(table, mem, base, lengths)
    want = np.array([int(_mm8_rows(mem[None, s:s + n])[0]) for s, n in zip(starts, lengths)]).view(np.uint64)
    np.testing.assert_array_equal(got, want)
    # control: pieces that forget where they start in their cell give other digests
    bad = _emulate_mm8(table, mem, base, lengths, s0_off=True)
    assert (bad != want)[np.array(lengths) > 8192].all()
