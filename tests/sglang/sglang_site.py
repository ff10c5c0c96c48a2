"""SGLang's real HiCache classes on CPU, and the independent reference the tests compare with.

The host pool is SGLang's ``MHATokenToKVPoolHost`` (unpinned, on CPU) over a tiny model's
geometry; the backend is built by SGLang's ``StorageBackendFactory`` from the ``dynamic``
extra config docs/engines.md gives, then registered as SGLang's cache controller does. A
page's bytes are derived from its key alone (:func:`pattern`), and the reference for a whole
pool is numpy indexing over ``(K/V, page, blob)``, the logical view of the page_first layouts.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import sys
import types
from typing import Any

import numpy as np


class _Anything(type):
    """A stand-in class whose every attribute is another stand-in (torchvision's enums and transforms)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


def stub_torchvision() -> None:
    """Module-level ``import torchvision...`` in SGLang's multimodal configs succeed; nothing
    here calls them."""
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io",
                 "torchvision.transforms.v2", "torchvision.transforms.v2.functional"):
        if name not in sys.modules:
            m = _Stub(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None)
            m.__path__ = []  # type: ignore[attr-defined]
            m.__version__ = "0.0.0"  # type: ignore[attr-defined]
            sys.modules[name] = m


stub_torchvision()

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 48, 4  # a K blob of 1,536 bytes: a row of 3,072, not 4 KiB aligned
SENTINEL = 0xAA
DYNAMIC = {"backend_name": "kvxfer", "module_path": "kvxfer.integrations.sglang", "class_name": "KvxferHiCache",
           "interface_v1": 1}


def pool(layout: str = "page_first") -> MHATokenToKVPoolHost:
    """SGLang's host pool (33 pages: 32 plus SGLang's padding page), filled with the sentinel."""
    k = tuple(torch.zeros(64, HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(LAYERS))
    v = tuple(torch.zeros(64, HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(LAYERS))
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                                           v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                         dtype=torch.float16, device=torch.device("cpu"))
    p = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                             device_capacity_tokens=64, start_layer=0, end_layer=LAYERS)
    raw(p)[:] = SENTINEL
    return p


def raw(p: MHATokenToKVPoolHost) -> np.ndarray:
    """The pool's bytes as (K/V, page, blob): each page_first layout keeps a page's K (and V)
    contiguous, all layers, so this is its logical view."""
    return p.kv_buffer.view(torch.uint8).numpy().reshape(2, p.page_num, -1)


def config(tmp: str, tp_rank: int = 0, tp_size: int = 1, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name="tiny",
                                extra_config={**DYNAMIC, "store_path": tmp, "capacity_bytes": 64 * 4096, **extra})


def backend(p: MHATokenToKVPoolHost, cfg: HiCacheStorageConfig) -> Any:
    """Built and registered the way SGLang's cache controller attaches a storage backend."""
    b = StorageBackendFactory.create_backend("dynamic", cfg, p)
    b.register_mem_pool_host(p)
    b.on_host_pools_registered()
    return b


def keys(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def pattern(key: str, blob: int) -> np.ndarray:
    """A page's K and V blobs (2, blob), from its key alone."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, (2, blob), dtype=np.uint8)


def fill(p: MHATokenToKVPoolHost, ks: list[str], pages: list[int]) -> None:
    r = raw(p)
    for k, pg in zip(ks, pages):
        r[:, pg] = pattern(k, r.shape[2])


def indices(pages: list[int]) -> torch.Tensor:
    """SGLang's host indices of whole pages: every token of each page."""
    return torch.tensor([pg * PAGE + t for pg in pages for t in range(PAGE)], dtype=torch.int64)


def expected(p: MHATokenToKVPoolHost, ks: list[str], pages: list[int]) -> np.ndarray:
    """The whole pool after loading ``ks`` into ``pages`` of a sentinel pool."""
    ref = np.full_like(raw(p), SENTINEL)
    for k, pg in zip(ks, pages):
        ref[:, pg] = pattern(k, ref.shape[2])
    return ref
