"""kvxfer as an SGLang HiCache storage backend (L3), loaded out of tree (no patch to SGLang)::

    --enable-hierarchical-cache --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name": "kvxfer", "module_path": "kvxfer.integrations.sglang",
      "class_name": "KvxferHiCache", "interface_v1": 1,
      "store_path": "/nvme/kv", "capacity_bytes": 274877906944}'

Importing this package does not import SGLang; the class is loaded when it is first named
(SGLang's factory does so). docs/engines.md has what it gives and how it was tested.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferHiCache"]


def __getattr__(name: str) -> Any:
    if name == "KvxferHiCache":
        from .backend import KvxferHiCache

        return KvxferHiCache
    raise AttributeError(name)
