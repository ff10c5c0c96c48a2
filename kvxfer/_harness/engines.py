"""KV caches shaped the way serving engines allocate them, plus their logical contents.

Property tests pair two of these and check the result against plain numpy indexing over
the logical ``[block, layer, kv, token, head, dim]`` arrays, never against kvxfer's own
arithmetic. Host memory only (numpy); the peer process builds the same caches from the
same :class:`EngineCache` description.

Styles (what the engine hands its connector, per layer unless stated):

``flash``       ``[2, blocks, tokens, heads, dim]`` (K/V outermost)
``flashinfer``  ``[blocks, 2, tokens, heads, dim]``
``cross``       one block-outermost storage ``[blocks, layers, 2, ...]``, FlashAttention-shaped views
``kv_tuple``    a ``(k, v)`` pair of ``[blocks, tokens, heads, dim]`` storages
``mla``         ``[blocks, tokens, channels]`` latent pages (replicated across TP ranks)
``mla_cross``   one ``[blocks, layers, tokens, channels]`` storage, per-layer views
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .._buffers import SENTINEL

STYLES = ("flash", "flashinfer", "cross", "kv_tuple")
MLA_STYLES = ("mla", "mla_cross")


@dataclass(frozen=True)
class EngineCache:
    """One worker's cache: the model's geometry plus this worker's layout and TP rank."""

    style: str
    order: str  # "NHD" or "HND": the page's memory order (ignored for MLA)
    dtype: str  # a numpy dtype name
    layers: int
    blocks: int
    block_tokens: int
    kv_heads: int  # the model's total KV heads (MLA: unused)
    head_dim: int  # MLA: latent channels
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def mla(self) -> bool:
        return self.style in MLA_STYLES

    @property
    def local_heads(self) -> int:
        """Heads each rank allocates: an even share, at least one (heads repeat when TP > heads)."""
        return 1 if self.mla else max(1, self.kv_heads // self.tp_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> "EngineCache":
        return cls(**json.loads(s))

    def register_options(self) -> dict[str, Any]:
        """What the engine tells kvxfer's discovery besides the tensors."""
        if self.mla:
            return {"replicated": True, "tp_rank": self.tp_rank, "tp_size": self.tp_size}
        opts: dict[str, Any] = {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "kv_heads": self.kv_heads}
        if self.blocks == 2 and self.style in ("flash", "cross", "flashinfer"):
            # [2, 2, ...] could be either K/V layout: an engine says which (recognised otherwise).
            opts["dims"] = "BKNHD" if self.style == "flashinfer" else "KBNHD"
        return opts


@dataclass
class Built:
    """The storages (what owns the memory), the views handed to ``register`` and a reader."""

    cache: EngineCache
    storages: list[np.ndarray]
    views: dict[str, Any]

    def logical(self) -> np.ndarray:
        """``[block, layer, kv, token, head, dim]`` copy of every value (MLA: kv = head = 1)."""
        c = self.cache
        per_layer = []
        for i in range(c.layers):
            v = self.views[f"layers.{i}"]
            if c.mla:
                per_layer.append(np.asarray(v)[:, None, :, None, :])  # [b, 1, n, 1, d]
            elif c.style == "kv_tuple":
                per_layer.append(np.stack([v[0], v[1]], axis=1))
            elif c.style == "flashinfer":
                per_layer.append(np.asarray(v))
            else:  # flash-shaped [2, b, n, h, d]
                per_layer.append(np.asarray(v).swapaxes(0, 1))
        return np.ascontiguousarray(np.stack(per_layer, axis=1))

    def raw(self) -> list[np.ndarray]:
        """Byte copies of every storage, to prove what did not change."""
        return [s.view(np.uint8).reshape(-1).copy() for s in self.storages]


def _page(c: EngineCache) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Physical page shape, and the permutation giving the logical (N, H, D) page."""
    n, h, d = c.block_tokens, c.local_heads, c.head_dim
    if c.mla:
        return (n, d), None
    return ((n, h, d), None) if c.order == "NHD" else ((h, n, d), (1, 0, 2))


def _logical_page_view(x: np.ndarray, perm: tuple[int, ...] | None) -> np.ndarray:
    """Permute the last three axes of ``x`` from physical to logical order."""
    if perm is None:
        return x
    lead = x.ndim - 3
    return x.transpose(*range(lead), *(lead + p for p in perm))


def build(c: EngineCache, *, seed: int | None = None) -> Built:
    """Allocate the cache; random bytes when ``seed`` is given, else the 0xAA sentinel."""
    dt = np.dtype(c.dtype)
    page, perm = _page(c)
    b, L = c.blocks, c.layers

    def alloc(shape: tuple[int, ...]) -> np.ndarray:
        a = np.empty(shape, dtype=dt)
        raw = a.view(np.uint8).reshape(-1)
        if seed is None:
            raw[:] = SENTINEL
        else:
            raw[:] = np.random.default_rng([seed, len(storages)]).integers(0, 256, raw.size, dtype=np.uint8)
        storages.append(a)
        return a

    storages: list[np.ndarray] = []
    views: dict[str, Any] = {}
    for i in range(L) if c.style not in ("cross", "mla_cross") else ():
        name = f"layers.{i}"
        if c.style == "mla":
            views[name] = alloc((b, *page))
        elif c.style == "flash":
            views[name] = _logical_page_view(alloc((2, b, *page)), perm)
        elif c.style == "flashinfer":
            views[name] = _logical_page_view(alloc((b, 2, *page)), perm)
        elif c.style == "kv_tuple":
            views[name] = (_logical_page_view(alloc((b, *page)), perm), _logical_page_view(alloc((b, *page)), perm))
        else:
            raise ValueError(f"unknown style {c.style!r}")
    if c.style == "cross":
        st = alloc((b, L, 2, *page))
        for i in range(L):
            views[f"layers.{i}"] = _logical_page_view(st[:, i].swapaxes(0, 1), perm)
    elif c.style == "mla_cross":
        st = alloc((b, L, *page))
        for i in range(L):
            views[f"layers.{i}"] = st[:, i]
    return Built(c, storages, views)
