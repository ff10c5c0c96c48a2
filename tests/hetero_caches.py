"""Engine-shaped caches for heterogeneous pairings, filled from logical arrays.

The logical truth is ``X[layer, kv, block, token, head, dim]`` (MLA: ``[layer, block, token,
channel]``); a rank's cache holds a slice of it in NHD or HND memory order. Expected results
are plain numpy indexing over ``X``, never kvxfer's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvxfer

SENTINEL = 0xAA
DT = np.int16


def logical(layers: int, blocks: int, tokens: int, heads: int, dim: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-30000, 30000, size=(layers, 2, blocks, tokens, heads, dim), dtype=DT)


@dataclass
class Rank:
    """One rank's cache: per (layer, kv) a logical ``[block, token, head, dim]`` view over its storage."""

    layers: list[int]
    heads: tuple[int, int]
    order: str
    views: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    storages: list[np.ndarray] = field(default_factory=list)

    def tensors(self) -> dict[str, Any]:
        return {f"layer.{l}": (self.views[(l, 0)], self.views[(l, 1)]) for l in self.layers}


def gqa_rank(layers: list[int], blocks: int, tokens: int, heads: tuple[int, int], dim: int, order: str,
             source: np.ndarray | None = None) -> Rank:
    """A rank holding ``heads`` of each layer; filled from ``source`` or with the sentinel."""
    r = Rank(layers, heads, order)
    h = heads[1] - heads[0]
    for l in layers:
        for kv in (0, 1):
            if order == "NHD":
                st = np.empty((blocks, tokens, h, dim), dtype=DT)
                view = st
            else:
                st = np.empty((blocks, h, tokens, dim), dtype=DT)
                view = st.transpose(0, 2, 1, 3)
            if source is None:
                st.view(np.uint8)[...] = SENTINEL
            else:
                view[...] = source[l, kv][:, :, heads[0]:heads[1], :]
            r.storages.append(st)
            r.views[(l, kv)] = view
    return r


def mla_rank(layers: int, blocks: int, tokens: int, channels: int, source: np.ndarray | None = None
             ) -> dict[str, np.ndarray]:
    out = {}
    for l in range(layers):
        st = np.empty((blocks, tokens, channels), dtype=DT)
        if source is None:
            st.view(np.uint8)[...] = SENTINEL
        else:
            st[...] = source[l]
        out[f"layer.{l}"] = st
    return out


def agent(name: str, tensors: dict[str, Any], **opts: Any) -> kvxfer.Agent:
    a = kvxfer.Agent(name, backend="loopback")
    a.register(tensors, **opts)
    return a


def untouched(view: np.ndarray, written: np.ndarray) -> bool:
    """Every block not in ``written`` still holds only sentinel bytes."""
    rest = np.setdiff1d(np.arange(view.shape[0]), written)
    return bool((np.ascontiguousarray(view[rest]).view(np.uint8) == SENTINEL).all())


def assert_gathered(views: Any, logical: np.ndarray, layers: int, local: np.ndarray, remote: np.ndarray) -> None:
    """Every layer's K and V pages hold the logical source's ``remote`` blocks at ``local``, and
    every other block still holds the sentinel."""
    for layer in range(layers):
        for kv in (0, 1):
            assert (views[(layer, kv)][local] == logical[layer, kv][remote]).all(), (layer, kv)
            assert untouched(views[(layer, kv)], local), (layer, kv)
