"""Shared caches for the micro-benchmarks (pytest-benchmark's ``benchmark`` fixture).

Run with ``make bench`` (compares against ``baseline.json``) or, as CI does, once with
``--benchmark-disable`` (tests/test_bench_micro.py): every benchmark then runs its body once
and checks its result, with no timing at all.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kvxfer

LAYERS, TOKENS, DIM = 80, 16, 128  # 4 KiB pages, 160 per row (benchmarks/bench_store.py's cache, fewer blocks)


def caches(blocks: int, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any], list[np.ndarray]]:
    """The same logical pages as one packed row per block and as one array per layer and K/V."""
    rng = np.random.default_rng(seed)
    row = rng.integers(0, 1 << 16, (blocks, LAYERS, 2, TOKENS, DIM), dtype=np.uint16).view(np.float16)
    layers = [np.ascontiguousarray(row[:, l, kv]) for l in range(LAYERS) for kv in (0, 1)]
    packed = {f"layer.{l}": (row[:, l, 0], row[:, l, 1]) for l in range(LAYERS)}
    per = {f"layer.{l}": (layers[2 * l], layers[2 * l + 1]) for l in range(LAYERS)}
    return packed, per, [row] + layers


def sentinel_like(arrays: list[np.ndarray]) -> list[np.ndarray]:
    out = [np.empty_like(a) for a in arrays]
    for a in out:
        a.view(np.uint8)[...] = 0xAA
    return out


def spec(tensors: dict[str, Any]) -> kvxfer.KVCacheSpec:
    return kvxfer.spec_from_tensors(tensors)
