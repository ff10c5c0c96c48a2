"""An SGLang HiCache storage backend (L3) backed by :class:`kvxfer.Store` (docs/engines.md).

SGLang's HiCache keeps a host memory pool between GPU memory and storage and moves pages to
and from storage on its own threads, through a ``HiCacheStorage``. This is one: a host page's
K blob and V blob (each all layers of the page, contiguous in the ``page_first`` layouts)
are one whole row of a slab, so a batch of pages is one system call per 8 MiB run, every
loaded row is checked against its digest before it is copied (a damaged row is a miss,
never bytes in the pool), and a write killed mid-way publishes nothing (docs/storage.md,
"Crash consistency").

SGLang builds it with its ``dynamic`` backend (``cls(storage_config, kwargs)``), then calls
:meth:`register_mem_pool_host`, where the store is opened over the pool's geometry. With
``interface_v1`` SGLang uses the zero-copy trio (``batch_exists``, ``batch_get_v1``,
``batch_set_v1``); the five older methods move one flat page each. Every call after start-up
is wrapped by :func:`.._boundary.boundary`: a bad key or index is a miss or a failed write,
never an exception into SGLang's storage threads. A call waits for its transfer at most the
store's timeout; one that expires is cancelled, and the cancel returns only once no read can
still land in the pool (the store's fence), so a page reported not loaded is never written after.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

import kvxfer
from kvxfer.errors import InvalidArgumentError, KvxferError, StoreMissError
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .._boundary import boundary as _boundary
from .pages import PoolRows, keys_of, leading, namespace, store_key

__all__ = ["KvxferHiCache", "OPTIONS"]

log = logging.getLogger("sglang.kvxfer")
#: Keys of ``--hicache-storage-backend-extra-config`` this backend reads (SGLang's own keys aside).
OPTIONS = ("store_path", "capacity_bytes", "durable", "threads", "timeout", "namespace")
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "tp_lcm_size")
#: Most pages in one call (SGLang batches 128).
MAX_BATCH = 4096


def boundary(default: Any, salvage: Any = None) -> Any:
    return _boundary(default, salvage, log=log)


def _misses(self: "KvxferHiCache", keys: Any, *args: Any, **kw: Any) -> list[bool]:
    """The fallback of a batch call that raised: every page failed (SGLang counts a prefix)."""
    self.errors += 1
    return [False] * len(keys) if isinstance(keys, (list, tuple)) else []


class KvxferHiCache(HiCacheStorage):
    """A ``HiCacheStorage`` whose pages are rows of a :class:`kvxfer.Store`.

    Extra config: ``store_path`` (the store's directory, created ``0700``; another uid's or a
    world-writable one is refused), ``capacity_bytes`` (bytes of rows on disk); optional
    ``durable`` (fdatasync before publishing), ``threads`` (I/O threads), ``timeout`` (seconds a
    call waits for its transfer), ``namespace`` (an extra string engines must share to share rows).
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        unknown = sorted(set(extra) - set(OPTIONS) - set(_SGLANG_KEYS))
        if unknown:
            raise InvalidArgumentError(f"unknown kvxfer HiCache options {unknown}; known: {', '.join(OPTIONS)}")
        for need in ("store_path", "capacity_bytes"):
            if need not in extra:
                raise InvalidArgumentError(f"the kvxfer HiCache backend needs {need!r} in the extra config")
        self.config = storage_config
        self.options = extra
        self.store: kvxfer.Store | None = None
        self.rows: PoolRows | None = None
        self.errors = 0  # contained errors (bad keys, bad indices, failed transfers)

    # -- start-up (not wrapped: a backend that cannot run stops SGLang before it serves) ------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            raise InvalidArgumentError("this backend already has a host pool and a store")
        rows = PoolRows.of(mem_pool_host)
        o = self.options
        path = os.fspath(o["store_path"])
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.store = kvxfer.Store(path, capacity=o["capacity_bytes"], layout=rows.spec,
                                  model=namespace(self.config, mem_pool_host, str(o.get("namespace", ""))),
                                  durable=bool(o.get("durable", False)), threads=int(o.get("threads", 4)),
                                  timeout=float(o.get("timeout", 30.0)))
        self.rows = rows

    def _ready(self) -> tuple[kvxfer.Store, PoolRows]:
        if self.store is None or self.rows is None:
            raise InvalidArgumentError("no host pool registered yet (register_mem_pool_host)")
        return self.store, self.rows

    def _wait(self, t: kvxfer.Transfer) -> None:
        """Wait up to the store's timeout; an expired transfer is cancelled behind the fence."""
        try:
            t.wait()
        except BaseException:
            t.cancel()  # a no-op once ended; otherwise returns only when no call can still land
            raise

    # -- the zero-copy trio (interface_v1) ----------------------------------------------------
    @boundary(lambda: 0)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading keys are stored (a bad key ends the prefix)."""
        store, _ = self._ready()
        if not isinstance(keys, (list, tuple)) or len(keys) > MAX_BATCH:
            raise InvalidArgumentError(f"keys must be a list of at most {MAX_BATCH} page keys")
        ks: list[bytes] = []
        for k in keys:
            try:
                ks.append(store_key(k))
            except InvalidArgumentError:
                self.errors += 1
                break
        return store.prefix(ks) if ks else 0

    @boundary(list, salvage=_misses)
    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Load the leading stored pages into the host pool; True for each page loaded whole
        and checked. A damaged row fails the call (every page False, none copied from it)."""
        store, rows = self._ready()
        ks = keys_of(keys, MAX_BATCH)
        blocks = rows.blocks(host_indices, len(ks))
        n = store.prefix(ks)
        if n:
            try:
                self._wait(store.restore(ks[:n], rows.spec, blocks[:n]))
            except StoreMissError as exc:  # evicted since, or failed its digest (StoreCorruptError)
                self.errors += 1
                log.warning("kvxfer HiCache: load of %d pages failed: %s", n, exc)
                return [False] * len(ks)
        return [True] * n + [False] * (len(ks) - n)

    @boundary(list, salvage=_misses)
    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write the pages not stored yet; True for each page stored once this returns."""
        store, rows = self._ready()
        ks = keys_of(keys, MAX_BATCH)
        blocks = rows.blocks(host_indices, len(ks))
        new = ~store.lookup(ks) if ks else np.zeros(0, dtype=bool)
        if new.any():
            try:
                self._wait(store.offload(rows.spec, blocks[new], [k for k, m in zip(ks, new) if m]))
            except KvxferError as exc:  # nothing of this call was published
                self.errors += 1
                log.warning("kvxfer HiCache: store of %d pages failed: %s", int(new.sum()), exc)
                return [not m for m in new.tolist()]
        return [True] * len(ks)

    # -- one flat page at a time (SGLang's path without interface_v1) --------------------------
    @boundary(lambda: False)
    def exists(self, key: str) -> bool:
        store, _ = self._ready()
        return bool(store.lookup([store_key(key)])[0])

    @boundary(lambda: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Load one page into ``target_location`` (a flat page: K blob, V blob); None on a miss."""
        store, rows = self._ready()
        k = store_key(key)
        if not store.lookup([k])[0]:
            return None
        try:
            self._wait(store.restore([k], rows.flat_spec(target_location), np.zeros(1, dtype=np.int64)))
        except StoreMissError:
            self.errors += 1
            return None
        return target_location

    @boundary(list)
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        if not isinstance(keys, (list, tuple)) or not isinstance(target_locations, (list, tuple)) or \
                len(keys) != len(target_locations) or len(keys) > MAX_BATCH:
            raise InvalidArgumentError("batch_get takes equal lists of keys and flat pages")
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    @boundary(lambda: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        store, rows = self._ready()
        k = store_key(key)
        if store.lookup([k])[0]:
            return True
        self._wait(store.offload(rows.flat_spec(value), np.zeros(1, dtype=np.int64), [k]))
        return True

    @boundary(lambda: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)) or \
                len(keys) != len(values) or len(keys) > MAX_BATCH:
            raise InvalidArgumentError("batch_set takes equal lists of keys and flat pages")
        return all([self.set(k, v) for k, v in zip(keys, values)])

    # -- housekeeping -----------------------------------------------------------------------
    @boundary(lambda: None)
    def clear(self) -> None:
        """Drop every page this backend stored (SGLang's flush)."""
        store, _ = self._ready()
        store.discard(store.keys())

    def close(self) -> None:
        """Wait for transfers in flight and release the store (SGLang's detach)."""
        if self.store is not None:
            try:
                self.store.close()
            except Exception as exc:  # noqa: BLE001  # detaching: log, never raise into SGLang
                log.error("kvxfer HiCache: closing the store failed: %r", exc)
