"""KV beyond GPU memory: whole rows offloaded to, and restored from, a slab file by key.

:class:`Store` is the API; :mod:`.slab` (file and row geometry), :mod:`.journal` (the
crash-consistent index file), :mod:`.index` (LRU, pins), :mod:`.fileio` (planning calls and
the vectorised ``preadv``/``pwritev`` path), :mod:`.paths` (which data path moves a request:
that one, or a backend's file path such as NIXL POSIX), :mod:`.stage` (VRAM through a pinned
host stage) and :mod:`.digest` (``kvxfer.integrity``'s row digests) are its parts.
docs/storage.md explains the formats and guarantees.
"""

from __future__ import annotations

from .store import Store

__all__ = ["Store"]
