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

    def heads(self, n: int = 8) -> np.ndarray:
        """The first ``n`` bytes of every page, ``(num_layers, num_blocks, n)``: a cheap probe of
        which pages a transfer has reached, without copying the cache."""
        if self.kind == "packed":
            return np.stack([_host(self.storages[0][:, i * self.page:i * self.page + n])
                             for i in range(self.num_layers)])
        return np.stack([_host(s[:, :n]) for s in self.storages])

    def pages_reached(self, fill: int = SENTINEL) -> int:
        """How many pages no longer start with ``fill`` bytes (a transfer has written there)."""
        return int((self.heads() != fill).any(axis=2).sum())

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


# -- caches laid out by a model geometry (presets and spec files) --------------------------
#
# The demo, `kvxfer bench` and the peer process move these. Content is defined per logical
# block, independently of the layout: block b's row (every member's page, in the geometry's
# row order) is `block_rows(seed, [b], row)`, so either side can recompute what any block
# must hold without asking the other, and a packed and a per-layer cache compare directly.


def block_rows(seed: int, blocks: Any, row: int) -> np.ndarray:
    """``(len(blocks), row)`` bytes: the logical rows of those blocks for ``seed``."""
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    out = np.empty((ids.shape[0], row), dtype=np.uint8)
    words = -(-row // 8)
    for i, b in enumerate(ids.tolist()):  # raw PCG64 output: ~6x faster than Generator.bytes
        out[i] = np.random.default_rng((seed, b)).bit_generator.random_raw(words).view(np.uint8)[:row]
    return out


@dataclass
class GeometryCache:
    """A cache with a geometry's members, one row per block (``packed``) or one array per member.

    ``views`` maps member names to ``(num_blocks, page)`` views, what discovery and
    :meth:`kvxfer.geometry.Geometry.spec_for` take. A packed row ends in ``pad`` bytes that
    belong to no member.
    """

    geometry: Any
    packed: bool
    memory: str
    num_blocks: int
    pad: int
    storages: list[Any]
    views: dict[str, Any]

    CHUNK_BYTES = 16 << 20  # rows generated at a time while filling or checking (cache-sized)

    def _chunks(self, blocks: np.ndarray) -> list[np.ndarray]:
        per = max(1, self.CHUNK_BYTES // max(1, self.geometry.row))
        return [blocks[i:i + per] for i in range(0, blocks.shape[0], per)]

    def register(self, agent: Any) -> Any:
        """Register with ``agent``: host arrays through the geometry's spec, CUDA tensors through
        discovery with the geometry's options; returns the spec."""
        g = self.geometry
        if self.memory == "DRAM":
            return agent.register(g.spec_for(self.views))
        return agent.register(self.views, replicated=g.replicated(), layout=g.layout, block_tokens=g.block_tokens,
                              tp_rank=g.tp_rank, tp_size=g.tp_size)

    def reset(self, fill: int = SENTINEL) -> None:
        for s in self.storages:
            if isinstance(s, np.ndarray):
                s.fill(fill)
            else:
                s.fill_(fill)

    def fill_blocks(self, seed: int, blocks: Any = None) -> None:
        """Write the logical rows of ``blocks`` (default: all) for ``seed``."""
        ids = np.arange(self.num_blocks) if blocks is None else np.asarray(blocks, dtype=np.int64).reshape(-1)
        offsets = self.geometry.offsets()
        row = self.geometry.row
        for chunk in self._chunks(ids):
            data = block_rows(seed, chunk, row)
            if self.packed:
                _assign(self.storages[0], chunk, data, 0, row)
            else:
                for name, (off, size) in offsets.items():
                    _assign(self.views[name], chunk, data, off, off + size)

    def verify(self, dst_blocks: Any, src_blocks: Any, seed: int) -> str | None:
        """None when blocks ``dst_blocks[i]`` hold the rows of ``src_blocks[i]`` for ``seed`` and
        every other byte (other blocks, row padding) still holds the sentinel; else what differs."""
        db = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
        sb = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
        offsets = self.geometry.offsets()
        row = self.geometry.row
        hosts = [_host(s) for s in self.storages]
        for chunk in self._chunks(np.arange(db.shape[0])):
            want = block_rows(seed, sb[chunk], row)
            d = db[chunk]
            if self.packed:
                got = hosts[0][d, :row]
                if not np.array_equal(got, want):
                    i = int(np.flatnonzero((got != want).any(axis=1))[0])
                    return f"block {int(d[i])} differs from source block {int(sb[chunk][i])}"
                continue
            for (name, (off, size)), h in zip(offsets.items(), hosts):
                if not np.array_equal(h[d], want[:, off:off + size]):
                    i = int(np.flatnonzero((h[d] != want[:, off:off + size]).any(axis=1))[0])
                    return f"{name} of block {int(d[i])} differs from source block {int(sb[chunk][i])}"
        moved = np.zeros(self.num_blocks, dtype=bool)
        moved[db] = True
        for h in hosts:
            if not (h[~moved] == SENTINEL).all():
                return "bytes of blocks outside the request changed"
        if self.packed and self.pad and not (hosts[0][moved, row:] == SENTINEL).all():
            return "row padding changed"
        return None


def _assign(target: Any, rows: np.ndarray, data: np.ndarray, lo: int, hi: int) -> None:
    """``target[rows, :hi-lo] = data[:, lo:hi]`` for a numpy array or a torch tensor."""
    if isinstance(target, np.ndarray):
        target[rows, : hi - lo] = data[:, lo:hi]
        return
    import torch

    idx = torch.from_numpy(rows).to(target.device)
    target[idx, : hi - lo] = torch.from_numpy(np.ascontiguousarray(data[:, lo:hi])).to(target.device)


def allocate(geometry: Any, num_blocks: int, *, packed: bool | None = None, memory: str = "DRAM", device: int = 0,
             pad: int = 0, fill: int = SENTINEL) -> GeometryCache:
    """Buffers with ``geometry``'s members for ``num_blocks`` blocks, every byte ``fill``."""
    g = geometry.with_layout(packed)
    names = [n for n, _ in g.member_names()]
    if g.packed:
        storage = _empty_on((num_blocks, g.row + pad), memory, fill, device)
        storages = [storage]
        views = {n: storage[:, off:off + size] for n, (off, size) in g.offsets().items()}
    else:
        storages = [_empty_on((num_blocks, size), memory, fill, device) for _, size in g.member_names()]
        views = dict(zip(names, storages))
    return GeometryCache(g, g.packed, memory, num_blocks, pad if g.packed else 0, storages, views)


def _empty_on(shape: tuple[int, ...], memory: str, fill: int, device: int) -> Any:
    if memory == "VRAM":
        import torch

        return torch.full(shape, fill, dtype=torch.uint8, device=f"cuda:{device}")
    return np.full(shape, fill, dtype=np.uint8)
