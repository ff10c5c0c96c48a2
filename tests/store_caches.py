"""Host KV caches for the store tests, filled from a logical array, read back as one.

The logical truth is ``X[layer, kv, block, token, head, dim]``. A *row* cache keeps every
layer's K and V page of a block in one row (block-outermost, one storage); a *layer* cache
keeps one array per layer and K/V (layer-outermost). Expected results are numpy indexing
over ``X``, never kvxfer's arithmetic. Also imported by the child processes the fault
tests start (``sys.path`` gets this directory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvxfer

SENTINEL = 0xAA
DT = np.int16
#: (layers, blocks, tokens, heads, dim): a 16 KiB row (4 KiB multiple), and a 2560-byte row
#: whose slot carries 1536 bytes of padding.
DIMS = {"aligned": (4, 24, 16, 2, 32), "padded": (4, 24, 8, 1, 20)}


def logical(dims: tuple[int, ...], seed: int = 1) -> np.ndarray:
    layers, blocks, tokens, heads, dim = dims
    rng = np.random.default_rng(seed)
    return rng.integers(-30000, 30000, size=(layers, 2, blocks, tokens, heads, dim), dtype=DT)


@dataclass
class Cache:
    kind: str  # "row" or "layer"
    dims: tuple[int, ...]
    storages: list[np.ndarray] = field(default_factory=list)
    tensors: dict[str, Any] = field(default_factory=dict)
    spec: Any = None

    def logical(self) -> np.ndarray:
        """The cache's current contents as ``[layer, kv, block, token, head, dim]``."""
        if self.kind == "row":
            return self.storages[0].transpose(1, 2, 0, 3, 4, 5)
        return np.stack([np.stack([self.tensors[f"layer.{l}"][kv] for kv in (0, 1)])
                         for l in range(self.dims[0])])

    def untouched(self, written: Any) -> bool:
        """Every block not in ``written`` still holds only sentinel bytes."""
        rest = np.setdiff1d(np.arange(self.dims[1]), np.asarray(written, dtype=np.int64))
        return bool((np.ascontiguousarray(self.logical()[:, :, rest]).view(np.uint8) == SENTINEL).all())


def cache(kind: str, dims: tuple[int, ...], source: np.ndarray | None = None) -> Cache:
    """A cache of ``kind`` filled from ``source`` (a logical array), or with the sentinel."""
    layers, blocks, tokens, heads, dim = dims
    c = Cache(kind, dims)
    if kind == "row":
        st = np.empty((blocks, layers, 2, tokens, heads, dim), dtype=DT)
        c.storages.append(st)
        c.tensors = {f"layer.{l}": (st[:, l, 0], st[:, l, 1]) for l in range(layers)}
    else:
        for l in range(layers):
            k, v = (np.empty((blocks, tokens, heads, dim), dtype=DT) for _ in range(2))
            c.storages += [k, v]
            c.tensors[f"layer.{l}"] = (k, v)
    for st in c.storages:
        st.view(np.uint8)[...] = SENTINEL
    if source is not None:
        if kind == "row":
            c.logical()[...] = source
        else:
            for l in range(layers):
                for kv in (0, 1):
                    c.tensors[f"layer.{l}"][kv][...] = source[l, kv]
    c.spec = kvxfer.spec_from_tensors(c.tensors)
    return c


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def row_bytes(dims: tuple[int, ...]) -> int:
    layers, _, tokens, heads, dim = dims
    return layers * 2 * tokens * heads * dim * np.dtype(DT).itemsize
