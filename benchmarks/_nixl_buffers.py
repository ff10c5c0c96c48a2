"""Buffers for ``bench_nixl.py``: seeded sources that either process can regenerate exactly.

The source rows are random bytes from a seeded generator (numpy for DRAM, torch's CUDA
generator for VRAM), so the side that checks a transfer rebuilds the expected bytes itself and
compares **every byte** (``torch.equal`` on the GPU), instead of trusting checksums.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SENTINEL = 0xAA


class Buffers:
    def __init__(self, memory: str, device: int) -> None:
        self.memory = memory
        self.device = device
        if memory == "VRAM":
            import torch

            self.torch = torch

    def random(self, rows: int, cols: int, seed: int) -> Any:
        if self.memory == "VRAM":
            t = self.torch
            g = t.Generator(device=f"cuda:{self.device}")
            g.manual_seed(seed)
            return t.randint(0, 256, (rows, cols), dtype=t.uint8, device=f"cuda:{self.device}", generator=g)
        return np.random.default_rng(seed).integers(0, 256, size=(rows, cols), dtype=np.uint8)

    def full(self, rows: int, cols: int, fill: int) -> Any:
        if self.memory == "VRAM":
            t = self.torch
            return t.full((rows, cols), fill, dtype=t.uint8, device=f"cuda:{self.device}")
        return np.full((rows, cols), fill, dtype=np.uint8)

    def ptr(self, a: Any) -> int:
        return int(a.data_ptr()) if self.memory == "VRAM" else int(a.ctypes.data)

    def dev(self) -> int:
        return self.device if self.memory == "VRAM" else 0

    def index(self, ids: np.ndarray, like: Any) -> Any:
        return self.torch.as_tensor(ids, device=like.device) if self.memory == "VRAM" else ids

    def equal(self, a: Any, b: Any) -> bool:
        if self.memory == "VRAM":
            return bool(self.torch.equal(a, b))
        return bool(np.array_equal(a, b))

    def all_equal(self, rows: Any, value: int) -> bool:
        if self.memory == "VRAM":
            return bool((rows == value).all().item())
        return bool((rows == value).all())

    def concat(self, parts: list[Any]) -> Any:
        if self.memory == "VRAM":
            return self.torch.cat(parts, dim=1)
        return np.concatenate(parts, axis=1)

    def fill(self, a: Any, value: int) -> None:
        if self.memory == "VRAM":
            a.fill_(value)
        else:
            a.fill(value)
        self.sync()

    def copy(self, dst: Any, src: Any) -> None:
        if self.memory == "VRAM":
            dst.copy_(src)
        else:
            dst[...] = src
        self.sync()

    def sync(self) -> None:
        if self.memory == "VRAM":
            self.torch.cuda.synchronize(self.device)

    def check_rows(self, got_rows: Any, got_ids: np.ndarray, src: Any, src_ids: np.ndarray) -> bool:
        """Every byte of ``got_rows[got_ids]`` equals ``src[src_ids]``."""
        return self.equal(got_rows[self.index(got_ids, got_rows)], src[self.index(src_ids, src)])
