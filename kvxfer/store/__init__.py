"""KV beyond GPU memory: whole rows offloaded to, and restored from, a slab file by key.

:class:`Store` is the API; :mod:`.slab` (file and row geometry), :mod:`.journal` (the
crash-consistent index file), :mod:`.index` (LRU, pins), :mod:`.fileio` (the vectorised
``preadv``/``pwritev`` path) and :mod:`.digest` (row digests) are its parts.
docs/storage.md explains the formats and guarantees.
"""

from __future__ import annotations

from .store import Store

__all__ = ["Store"]
