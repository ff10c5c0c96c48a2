"""Digests of VRAM cells on the GPU (imported only when a VRAM cell is digested).

``mm8`` goes first to the device path's kernel (:mod:`kvxfer.cuda.digest`: every cell in one
launch, read once where it lies, no torch); the torch ops below serve where it cannot
(a cell off a 16-byte boundary, no loadable kernel) and are the reference it is tested against.

``mm8`` runs where the bytes are: adjacent cells that are contiguous in memory form one
group, a group becomes one ``[rows, 1024]`` int8 matrix and one ``torch._int_mm`` with the
sketch matrix (tensor cores, one pass over the bytes); folding and mixing then touch only
the small ``int32`` sketch. Rows are gathered (one copy) unless the blocks are one ascending
run of densely packed rows, which are read in place. ``xxh3`` of a VRAM cell copies it to the
host first (correct, not fast: a VRAM source picks ``mm8``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .cells import CellSpans
from .mm8 import CHUNK, COLS, _xxh3, fold_weights, length_key, mix, sketch_matrix

_consts: dict[Any, Any] = {}


class _CudaSpan:
    """Just enough of ``__cuda_array_interface__`` for torch to view a raw device pointer."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _const(torch: Any, name: str, dev: Any, make: Any) -> Any:
    t = _consts.get((name, dev))
    if t is None or (name == "R" and t.shape[0] < make().shape[0]):
        t = _consts[(name, dev)] = torch.from_numpy(np.ascontiguousarray(make())).to(dev)
    return t


def _groups(spans: CellSpans, cols: np.ndarray) -> list[list[int]]:
    """Runs of columns whose cells sit back to back (same allocation, strides, 1024-aligned)."""
    out: list[list[int]] = []
    for c in cols.tolist():
        if out:
            p = out[-1][-1]
            if (spans.alloc[p] == spans.alloc[c] and spans.stride[p] == spans.stride[c]
                    and spans.substride[p] == spans.substride[c] and spans.base[p] + spans.length[p] == spans.base[c]
                    and spans.length[p] % CHUNK == 0 and spans.length[c] % CHUNK == 0):
                out[-1].append(c)
                continue
        out.append([c])
    return out


def _rows(torch: Any, spans: CellSpans, group: list[int]) -> Any:
    """``[B, n]`` uint8 view (in place when possible) or gathered copy of one group's cells."""
    a = spans.allocations[int(spans.alloc[group[0]])]
    mem = torch.as_tensor(_CudaSpan(a.address, a.nbytes), device=f"cuda:{a.device}")
    dev = mem.device
    n = int(spans.length[group].sum())
    base, stride, subs = int(spans.base[group[0]]) - a.address, int(spans.stride[group[0]]), int(spans.substride[group[0]])
    b, s = spans.block, spans.sub
    B = b.shape[0]
    first = int(b[0])
    if not s.any() and (stride == n or B == 1) and (B == 1 or bool((np.diff(b) == 1).all())):
        return mem[base + first * stride: base + first * stride + B * n].view(B, n)
    nb, k = int(b.max()) + 1, int(s.max()) + 1
    view = torch.as_strided(mem, (nb, k, n), (stride, subs, 1), base)
    bi = torch.from_numpy(b).to(dev)
    if k == 1:
        return view[:, 0].index_select(0, bi)
    return view[bi, torch.from_numpy(s).to(dev)]


#: Which product worked on this machine: "int_mm" (B column-major), "int_mm-rowmajor" or "float32".
PRODUCT: list[str] = []


def _product(torch: Any, m: Any, K: Any) -> Any:
    """``m @ K`` exactly in int32: the int8 tensor-core GEMM where torch offers it, else float32
    (exact too: every sum stays under 2**24), remembering which worked."""
    tries = {"int_mm": lambda: torch._int_mm(m, K.t().contiguous().t()),
             "int_mm-rowmajor": lambda: torch._int_mm(m, K),
             "float32": lambda: (m.float() @ K.float()).round().to(torch.int32)}
    for name in PRODUCT[:1] or list(tries):
        try:
            y = tries[name]()
        except (RuntimeError, AttributeError):
            continue
        if not PRODUCT:
            PRODUCT.append(name)
        return y
    raise RuntimeError("no exact int8 product on this device")


def _mm8(torch: Any, x: Any, lengths: list[int]) -> Any:
    """mm8 of consecutive cells of each row of ``x`` ``[B, sum(lengths)]`` -> int64 ``[B, C]``."""
    B, n = x.shape
    dev = x.device
    if any(ln % CHUNK for ln in lengths):  # one unaligned cell: padded on its own
        assert len(lengths) == 1
        x = torch.nn.functional.pad(x, (0, -(-n // CHUNK) * CHUNK - n))
    m = x.reshape(-1, CHUNK).view(torch.int8)
    rows = m.shape[0]
    if rows <= 16:  # _int_mm wants more than 16 rows; zero rows add nothing
        m = torch.cat([m, m.new_zeros(17 - rows, CHUNK)])
    K = _const(torch, "K", dev, sketch_matrix)
    y = _product(torch, m, K)[:rows]
    S = [-(-ln // CHUNK) for ln in lengths]
    y = y.view(B, sum(S), COLS).to(torch.int64)
    w = torch.cat([_const(torch, "R", dev, lambda: fold_weights(max(S)))[:k] for k in S])
    t = (y * w[None]).sum(-1).cumsum(1)
    ends = torch.tensor(np.cumsum(S) - 1, device=dev)
    d = t.index_select(1, ends)
    d[:, 1:] = d[:, 1:] - t.index_select(1, ends[:-1])
    keys = torch.tensor([length_key(ln) for ln in lengths], dtype=torch.int64, device=dev)
    return mix(d ^ keys[None, :])  # still on the device: the caller copies all groups at once


def vram_cells(spans: CellSpans, cols: np.ndarray) -> dict[int, np.ndarray]:
    """Host copies ``[B, length]`` of VRAM columns ``cols`` (an ``xxh3`` row digest hashes bytes on the host)."""
    import torch

    out: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for g in _groups(spans, cols):
            host = _rows(torch, spans, g).cpu().numpy()
            at = 0
            for c in g:
                ln = int(spans.length[c])
                out[c] = host[:, at:at + ln]
                at += ln
    return out


#: mm8 through the device path's kernel (kvxfer.cuda.digest: one pass, no torch) where it serves,
#: else the torch ops below (benchmarks compare the two by unsetting it). The kernel's entry, set by :mod:`kvxfer.cuda.digest` when the device path loads (the device
#: path depends on this package's definition, never the reverse: no import circle).
KERNEL: list[Callable[[np.ndarray, np.ndarray, list[int]], np.ndarray | None] | None] = [None]


def _by_kernel(spans: CellSpans, cols: np.ndarray) -> np.ndarray | None:
    fn = KERNEL[0]
    if fn is None:
        return None
    addr = spans.addresses()[:, cols].astype(np.uint64)
    devices = [int(spans.allocations[int(spans.alloc[c])].device) for c in cols.tolist()]
    return fn(addr, spans.length[cols], devices)


def hash_vram(spans: CellSpans, cols: np.ndarray, algorithm: str) -> np.ndarray:
    if algorithm == "mm8":
        got = _by_kernel(spans, cols)
        if got is not None:
            return got
    import torch

    out = np.empty((spans.block.shape[0], cols.shape[0]), np.uint64)
    at = {int(c): i for i, c in enumerate(cols.tolist())}
    pending: dict[Any, list[tuple[list[int], Any]]] = {}  # device -> groups still on it
    with torch.no_grad():
        for g in _groups(spans, cols):
            x = _rows(torch, spans, g)
            lengths = [int(spans.length[c]) for c in g]
            if algorithm == "mm8":
                pending.setdefault(x.device, []).append((g, _mm8(torch, x, lengths)))
                continue
            else:
                h, host = _xxh3(), x.cpu().numpy()
                edges = np.concatenate([[0], np.cumsum(lengths)]).tolist()
                vals = np.array([[h(row[edges[i]:edges[i + 1]].data) for i in range(len(g))] for row in host],
                                np.uint64).reshape(-1, len(g))
            for i, c in enumerate(g):
                out[:, at[c]] = vals[:, i]
        for groups in pending.values():  # one copy to the host per device, not one per group
            host = torch.cat([v for _, v in groups], dim=1).cpu().numpy().view(np.uint64)
            i = 0
            for g, _ in groups:
                for c in g:
                    out[:, at[c]] = host[:, i]
                    i += 1
    return out
