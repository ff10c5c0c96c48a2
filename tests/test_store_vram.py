"""The store with VRAM caches: through the pinned host stage (no GDS), byte-exact, on a GPU.

Skipped without CUDA; the CPU suite covers the same path with host memory standing in for
the GPU (``staged`` in tests/store_paths.py). The source holds the logical array ``X`` on the
GPU, the destination the sentinel; the reference is numpy indexing over ``X`` after copying
the destination back to the host. ``benchmarks/gpu_store.sh`` runs this file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvxfer
from store_caches import DIMS, SENTINEL, logical, row_bytes


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def _vram_cache(torch: Any, kind: str, dims: tuple[int, ...], X: np.ndarray | None) -> tuple[dict, list]:
    """A row cache (one storage) or a layer cache (K, V per layer) on cuda:0; logical ``X`` or sentinel."""
    layers, blocks, tokens, heads, dim = dims
    if kind == "row":
        st = torch.empty((blocks, layers, 2, tokens, heads, dim), dtype=torch.int16, device="cuda:0")
        st.view(torch.uint8).fill_(SENTINEL)
        if X is not None:
            st.copy_(torch.from_numpy(np.ascontiguousarray(X.transpose(2, 0, 1, 3, 4, 5))))
        return {f"layer.{l}": (st[:, l, 0], st[:, l, 1]) for l in range(layers)}, [st]
    out, keep = {}, []
    for l in range(layers):
        kv = []
        for i in (0, 1):
            t = torch.empty((blocks, tokens, heads, dim), dtype=torch.int16, device="cuda:0")
            t.view(torch.uint8).fill_(SENTINEL)
            if X is not None:
                t.copy_(torch.from_numpy(np.ascontiguousarray(X[l, i])))
            kv.append(t)
            keep.append(t)
        out[f"layer.{l}"] = tuple(kv)
    return out, keep


def _logical(tensors: dict) -> np.ndarray:
    return np.stack([np.stack([tensors[f"layer.{l}"][kv].cpu().numpy() for kv in (0, 1)])
                     for l in range(len(tensors))])


@pytest.mark.parametrize("src_kind,dst_kind", [("row", "row"), ("layer", "row"), ("row", "layer")])
def test_vram_round_trip_through_the_pinned_stage(tmp_path, src_kind, dst_kind) -> None:
    torch = _torch()
    dims = DIMS["padded"]
    X = logical(dims)
    src, _ks = _vram_cache(torch, src_kind, dims, X)
    dst, _kd = _vram_cache(torch, dst_kind, dims, None)
    sspec, dspec = kvxfer.spec_from_tensors(src), kvxfer.spec_from_tensors(dst)
    sb, db = [3, 4, 5, 11, 0, 17], [9, 2, 3, 4, 20, 5]
    stride = -(-row_bytes(dims) // 4096) * 4096
    with kvxfer.Store(tmp_path, capacity=64 * stride, layout=sspec) as st:
        t = st.offload(sspec, sb, [b"k%d" % i for i in range(6)]).wait()
        assert t.stats.path.startswith("staged-cuda")
        t = st.restore([b"k%d" % i for i in range(6)], dspec, db).wait()
        assert t.stats.path.startswith("staged-cuda")
    torch.cuda.synchronize()
    got = _logical(dst)
    assert np.array_equal(got[:, :, db], X[:, :, sb])
    rest = np.setdiff1d(np.arange(dims[1]), db)
    assert (np.ascontiguousarray(got[:, :, rest]).view(np.uint8) == SENTINEL).all()
    assert not np.array_equal(got[:, :, db], X[:, :, sb[::-1]])  # control
