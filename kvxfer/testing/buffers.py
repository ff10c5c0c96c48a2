"""KV cache buffers for tests and demos: host (numpy) or CUDA (torch), packed or per layer.

Kept separate from the pytest classes so the demo and the peer process can build exactly
the caches the conformance suite checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SENTINEL = 0xAA


@dataclass
class Cache:
    """A KV cache in one of two shapes, plus the tensors discovery sees.

    ``packed``: one block-outermost storage ``(num_blocks, row)``; every layer is a view of
    ``page`` bytes at ``layer * page`` inside the row (``pad`` spare bytes end each row).
    ``layers``: one ``(num_blocks, page)`` storage per layer (layer-outermost).
    """

    kind: str  # "packed" | "layers"
    memory: str  # "DRAM" | "VRAM"
    num_blocks: int
    num_layers: int
    page: int
    pad: int
    storages: list[Any]
    views: dict[str, Any]

    def block(self, layer: int, block: int) -> np.ndarray:
        """Host copy of one layer's page of one block."""
        if self.kind == "packed":
            row = self.storages[0][block]
            return _host(row[layer * self.page:(layer + 1) * self.page])
        return _host(self.storages[layer][block])

    def snapshot(self) -> list[np.ndarray]:
        return [_host(s).copy() for s in self.storages]

    def layer_pages(self) -> np.ndarray:
        """``(num_layers, num_blocks, page)`` host array of every page."""
        if self.kind == "packed":
            rows = _host(self.storages[0])[:, : self.num_layers * self.page]
            return rows.reshape(self.num_blocks, self.num_layers, self.page).transpose(1, 0, 2).copy()
        return np.stack([_host(s) for s in self.storages])

    def padding(self) -> np.ndarray:
        """Bytes that never belong to any page (row tails of a packed cache)."""
        if self.kind == "packed" and self.pad:
            return _host(self.storages[0])[:, self.num_layers * self.page:].copy()
        return np.zeros(0, np.uint8)


def _host(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return x.detach().cpu().numpy()


def _empty(shape: tuple[int, ...], memory: str, fill: int) -> Any:
    if memory == "VRAM":
        import torch

        return torch.full(shape, fill, dtype=torch.uint8, device="cuda")
    return np.full(shape, fill, dtype=np.uint8)


def make_cache(kind: str, *, num_blocks: int, num_layers: int, page: int, pad: int = 0, memory: str = "DRAM",
               seed: int | None = None, fill: int = SENTINEL) -> Cache:
    """Build a cache filled with random bytes (``seed`` given) or the sentinel."""
    if kind == "packed":
        storages = [_empty((num_blocks, num_layers * page + pad), memory, fill)]
        views = {f"layer.{i}": storages[0][:, i * page:(i + 1) * page] for i in range(num_layers)}
    elif kind == "layers":
        storages = [_empty((num_blocks, page), memory, fill) for _ in range(num_layers)]
        views = {f"layer.{i}": s for i, s in enumerate(storages)}
    else:
        raise ValueError(f"unknown cache kind {kind!r}")
    if seed is not None:
        rng = np.random.default_rng(seed)
        for s in storages:
            data = rng.integers(0, 256, size=tuple(s.shape), dtype=np.uint8)
            if isinstance(s, np.ndarray):
                s[...] = data
            else:
                import torch

                s.copy_(torch.from_numpy(data))
    return Cache(kind, memory, num_blocks, num_layers, page, pad, storages, views)


def expected_after(dst_before: np.ndarray, src: np.ndarray, dst_blocks: Any, src_blocks: Any) -> np.ndarray:
    """Reference result computed independently of kvxfer: per layer, per block, a plain copy.

    Both arrays are ``(num_layers, num_blocks, page)`` as from :meth:`Cache.layer_pages`.
    """
    out = dst_before.copy()
    for d, s in zip(np.asarray(dst_blocks).tolist(), np.asarray(src_blocks).tolist()):
        for layer in range(out.shape[0]):
            out[layer, d] = src[layer, s]
    return out
