"""The two digest functions, their wire form, and the comparison that names a block and member.

``xxh3``: xxh3-64 of each cell's bytes (the ``xxhash`` library): the fastest kept hash on a
CPU core. An ``xxh3`` *row* digest is xxh3-64 of the block's cells back to back, in cell order
(:func:`hash_rows`, the one definition): one hash per row, in place where the row is one run of
memory (a packed row, the store's slab), so a row costs one call that releases the GIL rather
than one per page. ``mm8``: a linear sketch that a GPU computes with one int8 matrix product (tensor
cores), then folded and mixed to 64 bits; defined exactly over integers, so numpy and torch
give identical values. docs/integrity.md compares them and says what each catches.

Either side can compute either function on either memory kind (a VRAM cell under ``xxh3`` is
copied to the host first; a DRAM cell under ``mm8`` takes numpy's float32 product, exact for
these sizes), so a DRAM source and a VRAM destination still agree: the verifier always uses
the function named in the digests it was given.
"""

from __future__ import annotations

import base64
import ctypes
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _wire
from ..errors import IntegrityError, MetadataError
from ..geometry import KVCacheSpec
from ..memory import MemoryKind
from .cells import MAX_CELLS, Cells, CellSpans, source_spans
from .mm8 import CHUNK, COLS, _xxh3, _xxh3_stream, finalize, fold_weights, sketch_matrix

__all__ = ["ALGORITHMS", "Digests", "compare", "compute", "hash_rows", "hash_spans", "mm8_rows", "verify"]

ALGORITHMS = ("xxh3", "mm8")
MAX_DIGEST_BLOCKS = 1 << 20
#: Threads that hash host cells of one large digest set (1: the caller's thread only). Worth
#: raising only where the hash library releases the GIL; BENCHMARKS.md has the measurement.
THREADS = 1
#: Wire version 2: xxh3 row digests hash the row (version 1 folded page digests; refused, typed).
_MAGIC = b"KVXD2"
_OLD_MAGIC = b"KVXD1"
_HEADER_KEYS = frozenset({"a", "r", "m", "o", "l", "b"})


def _host_view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_uint8 * nbytes).from_address(address)).cast("B")


def _host_cells(spans: CellSpans, c: int) -> np.ndarray:
    """``[B, length]`` copy of column ``c``'s host cells (numpy fancy indexing, one pass)."""
    a = spans.allocations[int(spans.alloc[c])]
    arr = np.frombuffer(_host_view(a.address, a.nbytes), dtype=np.uint8)
    off = spans.addresses()[:, c] - a.address
    return arr[off[:, None] + np.arange(int(spans.length[c]))[None, :]]


def mm8_rows(rows: np.ndarray) -> np.ndarray:
    """mm8 of each row of ``[B, n]`` uint8 (one cell per row) -> int64 [B]: the definition, on the
    host, that the GPU's kernel and torch ops are tested and benchmarked against."""
    b, n = rows.shape
    s = -(-n // CHUNK)
    if n % CHUNK:
        rows = np.concatenate([rows, np.zeros((b, s * CHUNK - n), np.uint8)], axis=1)
    x = rows.view(np.int8).reshape(b * s, CHUNK).astype(np.float32)
    y = (x @ sketch_matrix().astype(np.float32)).astype(np.int64).reshape(b, s, COLS)
    d = (y * fold_weights(s)[None]).sum(axis=(1, 2))
    return finalize(d, n)


_mm8_rows = mm8_rows

def hash_spans(spans: CellSpans, algorithm: str) -> np.ndarray:
    """``[B, C]`` uint64 digests of every cell copy described by ``spans``."""
    if algorithm not in ALGORITHMS:
        raise IntegrityError(f"unknown digest algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    B, C = spans.block.shape[0], spans.base.shape[0]
    out = np.zeros((B, C), dtype=np.uint64)
    if B == 0 or C == 0:
        return out
    vram = np.array([spans.allocations[int(a)].kind is MemoryKind.VRAM for a in spans.alloc])
    if vram.any():
        from ._gpu import hash_vram

        cols = np.flatnonzero(vram)
        out[:, cols] = hash_vram(spans, cols, algorithm)
    cols = np.flatnonzero(~vram)
    if not cols.size:
        return out
    if algorithm == "mm8":
        for c in cols.tolist():
            out[:, c] = _mm8_rows(_host_cells(spans, c)).view(np.uint64)
        return out
    h = _xxh3()
    addr = spans.addresses()
    jobs = []
    for c in cols.tolist():
        a = spans.allocations[int(spans.alloc[c])]
        jobs.append((c, _host_view(a.address, a.nbytes), int(spans.length[c]), (addr[:, c] - a.address).tolist()))

    def run(job: tuple[int, memoryview, int, list[int]]) -> None:
        c, mv, n, offs = job
        out[:, c] = [h(mv[o:o + n]) for o in offs]

    if THREADS > 1 and len(jobs) > 1 and int(spans.length[cols].sum()) * B >= 1 << 24:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(run, jobs))
    else:
        for job in jobs:
            run(job)
    return out


_POOLS: dict[int, Any] = {}


def _pool() -> Any:
    """One shared pool of :data:`THREADS` hashing threads (made once: a pool per call costs more than a row)."""
    p = _POOLS.get(THREADS)
    if p is None:
        from concurrent.futures import ThreadPoolExecutor

        p = _POOLS[THREADS] = ThreadPoolExecutor(THREADS, thread_name_prefix="kvxfer-digest")
    return p


def _combine(values: np.ndarray) -> np.ndarray:
    """One digest per row from its cells' digests (odd weights: one changed cell always shows)."""
    w = fold_weights(values.shape[1])[:, 0]
    return finalize((values.view(np.int64) * w[None, :]).sum(axis=1), values.shape[1]).view(np.uint64)[:, None]


def _in_place(spans: CellSpans) -> tuple[memoryview, np.ndarray, int] | None:
    """Each block's cells as one run of one host allocation (cell ``c + 1`` starts where ``c``
    ends): the allocation's view, the runs' offsets and their length; else None."""
    if not spans.alloc.shape[0] or not (spans.alloc == spans.alloc[0]).all():
        return None
    a = spans.allocations[int(spans.alloc[0])]
    if a.kind is MemoryKind.VRAM:
        return None
    st, ss = spans.stride, spans.substride
    if (st == st[0]).all() and (ss == ss[0]).all():  # every block laid out alike: its cells are checked once
        b = spans.base
        if b.shape[0] > 1 and not (b[1:] == b[:-1] + spans.length[:-1]).all():
            return None
        start = b[0] + spans.block * st[0] + spans.sub * ss[0]
        return _host_view(a.address, a.nbytes), start - a.address, int(spans.length.sum())
    addr = spans.addresses()  # [B, C]: each block's cells checked
    if addr.shape[1] > 1 and not (addr[:, 1:] == addr[:, :-1] + spans.length[None, :-1]).all():
        return None
    return _host_view(a.address, a.nbytes), addr[:, 0] - a.address, int(spans.length.sum())


def hash_rows(spans: CellSpans) -> np.ndarray:
    """``[B]`` uint64 ``xxh3`` row digests: xxh3-64 of each block's cells back to back, in cell order.

    Hashed in place when the cells of each block are one run of host memory; otherwise
    streamed cell by cell (the same value, no copy; VRAM cells are copied to the host first).
    """
    B = spans.block.shape[0]
    out = np.zeros(B, dtype=np.uint64)
    if B == 0 or spans.base.shape[0] == 0:
        return out
    h = _xxh3()
    run = _in_place(spans)
    if run is not None:
        mv, offs, n = run
        at = offs.tolist()
        if THREADS > 1 and B > 1 and B * n >= 1 << 24:  # xxhash releases the GIL for large buffers
            parts = np.array_split(np.arange(B), min(THREADS, B))

            def part(ix: np.ndarray) -> None:
                out[ix] = [h(mv[at[i]:at[i] + n]) for i in ix.tolist()]

            list(_pool().map(part, parts))
        else:
            out[:] = [h(mv[o:o + n]) for o in at]
        return out
    cols = np.flatnonzero([spans.allocations[int(a)].kind is MemoryKind.VRAM for a in spans.alloc])
    vram = {}
    if cols.size:
        from ._gpu import vram_cells

        vram = vram_cells(spans, cols)
    # Streamed: xxh3 over the cells in order equals xxh3 of their concatenation, with no copy.
    addr = spans.addresses()
    views, starts = [], []
    for c in range(spans.base.shape[0]):
        if c in vram:
            host = np.ascontiguousarray(vram[c])
            views.append(memoryview(host.reshape(-1)))
            starts.append((np.arange(B, dtype=np.int64) * host.shape[1]).tolist())
        else:
            al = spans.allocations[int(spans.alloc[c])]
            views.append(_host_view(al.address, al.nbytes))
            starts.append((addr[:, c] - al.address).tolist())
    lengths = spans.length.tolist()
    cells = list(zip(views, starts, lengths))
    new = _xxh3_stream()
    for i in range(B):
        x = new()
        for mv, st, n in cells:
            x.update(mv[st[i]:st[i] + n])
        out[i] = x.intdigest()
    return out


@dataclass(frozen=True, eq=False)
class Digests:
    """Digests of ``cells`` for source blocks ``blocks``: ``values[i, c]`` (or one per row).

    ``row`` digests (``values`` of shape ``[B, 1]``) combine a block's cells into one value,
    small enough for request parameters; a mismatch then names the block but not the member.
    """

    algorithm: str
    blocks: np.ndarray
    cells: Cells
    values: np.ndarray
    row: bool = False

    def take(self, positions: Any) -> "Digests":
        """The digests of some of the blocks (by position), for a load that reads part of them."""
        i = np.asarray(positions, dtype=np.int64)
        return Digests(self.algorithm, self.blocks[i], self.cells, self.values[i], self.row)

    def rows(self) -> "Digests":
        """Row digests from cell digests: ``mm8`` only (an ``xxh3`` row digest hashes the row's
        bytes, which cell digests do not hold: ask :func:`compute` with ``rows=True``)."""
        if self.row:
            return self
        if self.algorithm == "xxh3":
            raise IntegrityError("xxh3 row digests hash the rows' bytes; compute them with compute(..., rows=True)")
        return Digests(self.algorithm, self.blocks, self.cells, _combine(self.values), True)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Digests) and (self.algorithm, self.row) == (other.algorithm, other.row)
                and np.array_equal(self.blocks, other.blocks) and self.cells == other.cells
                and np.array_equal(self.values, other.values))

    def encode(self) -> bytes:
        head = json.dumps({"a": self.algorithm, "r": self.row, "m": list(self.cells.members),
                           "o": self.cells.offsets.tolist(), "l": self.cells.lengths.tolist(),
                           "b": int(self.blocks.shape[0])}, separators=(",", ":")).encode()
        return (_MAGIC + struct.pack("<I", len(head)) + head + self.blocks.astype("<i8").tobytes()
                + self.values.astype("<u8").tobytes())

    def to_text(self) -> str:
        return base64.b64encode(self.encode()).decode()

    @classmethod
    def from_text(cls, text: Any) -> "Digests":
        raw = _wire.b64(text, "digests", 48 << 20)
        return cls.decode(raw)

    @classmethod
    def decode(cls, raw: bytes) -> "Digests":
        """Parse untrusted bytes: every size bounded, every field typed, or a MetadataError."""
        try:
            if not isinstance(raw, (bytes, bytearray)):
                raise ValueError("not kvxfer digests")
            if raw[:5] == _OLD_MAGIC:
                raise ValueError("version 1 digests (row digests folded from page digests), from an older "
                                 "kvxfer: this side verifies version 2; upgrade the source")
            r = _wire.Reader(raw, "digests")
            r.expect(_MAGIC)
            (n,) = r.unpack(_wire.U32)
            h = _wire.keys(_wire.load_json(r.take(n), "digests header", limit=n), _HEADER_KEYS, "digests header")
            algo, row, names, offs, lens, nb = h["a"], h["r"], h["m"], h["o"], h["l"], h["b"]
            if algo not in ALGORITHMS or not isinstance(row, bool):
                raise ValueError(f"unknown algorithm {algo!r}")
            if not (isinstance(names, list) and isinstance(offs, list) and isinstance(lens, list)
                    and 0 < len(names) == len(offs) == len(lens) <= MAX_CELLS):
                raise ValueError("cells must be equal, bounded lists")
            for x in names:
                _wire.text(x, "digests: a member name", 256)
            if not all(type(x) is int and 0 <= x < 1 << 40 for x in offs + lens):
                raise ValueError("cell offsets and lengths must be bounded integers")
            if type(nb) is not int or not 0 <= nb <= MAX_DIGEST_BLOCKS:
                raise ValueError("block count out of range")
            cols = 1 if row else len(names)
            body = r.rest()
            if len(body) != 8 * nb * (1 + cols):
                raise ValueError(f"{len(body)} body bytes for {nb} blocks of {cols} digests")
            blocks = np.frombuffer(body, "<i8", nb).astype(np.int64)
            values = np.frombuffer(body, "<u8", nb * cols, 8 * nb).astype(np.uint64).reshape(nb, cols)
            cells = Cells(tuple(names), np.array(offs, np.int64), np.array(lens, np.int64))
        except (ValueError, TypeError, struct.error, RecursionError) as exc:
            raise MetadataError(f"digests rejected: {exc}") from None
        return cls(algo, blocks, cells, values, row)


def default_algorithm(spec: KVCacheSpec) -> str:
    """``mm8`` when the cache lives in VRAM (the GPU computes it), ``xxh3`` otherwise."""
    return "mm8" if MemoryKind.VRAM in spec.kinds else "xxh3"


def compute(spec: KVCacheSpec, blocks: Any, *, cells: Cells | None = None, algorithm: str = "auto",
            rows: bool = False) -> Digests:
    """Digests of ``blocks`` of a locally registered cache (the source side of a transfer)."""
    b = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if b.shape[0] > MAX_DIGEST_BLOCKS:
        raise IntegrityError(f"{b.shape[0]} blocks: at most {MAX_DIGEST_BLOCKS} per digest set")
    cells = Cells.pages(spec) if cells is None else cells
    algo = default_algorithm(spec) if algorithm == "auto" else algorithm
    spans = source_spans(spec, b, cells)
    if rows and algo == "xxh3":
        return Digests(algo, b.copy(), cells, hash_rows(spans)[:, None], True)
    d = Digests(algo, b.copy(), cells, hash_spans(spans, algo))
    return d.rows() if rows else d


def verify(expected: Digests, spans: CellSpans, local_blocks: np.ndarray) -> None:
    """Recompute ``expected``'s cells where ``spans`` says our copy lives; raise on any difference."""
    if expected.row and expected.algorithm == "xxh3":
        got = hash_rows(spans)[:, None]
    else:
        got = hash_spans(spans, expected.algorithm)
        got = _combine(got) if expected.row else got
    compare(expected, got, local_blocks)


def compare(expected: Digests, got: np.ndarray, local_blocks: np.ndarray) -> None:
    """``got`` (digests recomputed over our copy, shaped as ``expected.values``) against
    ``expected``: raise :class:`IntegrityError` naming the first block that differs."""
    if got.shape != expected.values.shape:
        raise IntegrityError(f"digests cover {expected.values.shape} cells, this transfer {got.shape}")
    bad = got != expected.values
    if not bad.any():
        return
    i, c = (int(x) for x in np.argwhere(bad)[0])
    lb, rb = int(local_blocks[i]), int(expected.blocks[i])
    member = None if expected.row else expected.cells.members[c]
    where = "row digest (member not known)" if expected.row else (
        f"member {member!r} bytes {int(expected.cells.offsets[c])}+{int(expected.cells.lengths[c])}")
    raise IntegrityError(f"block {lb} (source block {rb}): {where} differs from the source's digest; "
                         f"{int(bad.sum())} of {bad.size} digests differ. The bytes are not the source's: "
                         "recompute this request", block=lb, remote_block=rb, member=member,
                         mismatches=int(bad.sum()))
