"""Test-only: let vLLM's CPU attention backend accept a block-outermost (BLHNC) KV cache.

vLLM 0.32's CPU backend declares only ``LBHNC``, so ``VLLM_KV_CACHE_LAYOUT=BLHNC`` is refused
on CPU, while GPU backends (FlashInfer and others) offer ``BLHNC`` themselves. Its kernels
follow the block stride of each layer's view, so adding ``BLHNC`` to the declared set gives
a real block-outermost cache on CPU; the end-to-end tests check the greedy tokens against a
plain ``LBHNC`` instance. This directory is put on ``PYTHONPATH`` of those test engines only
(every process vLLM spawns runs this file), and nothing changes until vLLM imports the module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

_TARGET = "vllm.v1.attention.backends.cpu_attn"


def _patch(module: ModuleType) -> None:
    from vllm.v1.kv_cache_interface import KVCacheLayout

    backend = module.CPUAttentionBackend
    backend.supported_kv_cache_layouts = classmethod(lambda cls: (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC))


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
