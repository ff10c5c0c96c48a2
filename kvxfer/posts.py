"""From plan legs to backend posts: which prepared lists, which indices, how many posts.

Kept out of :mod:`kvxfer.agent` because it carries a bound of its own: a whole prepared list
is built once per (peer, granularity, kind) and kept, but only for backends that take
strided lists or when its expansion stays under
:data:`~kvxfer.bounds.MAX_PREPARED_DESCRIPTORS`. Past that, a backend that expands lists
gets only the spans of the transfer at hand (:meth:`~kvxfer.memory.DescriptorList.take`), so
a peer advertising 2^26 blocks costs what the request costs, not gigabytes.

Lists prepared for one transfer only carry their release in the chunk's cleanup, so the
caller can undo everything built so far if a later step fails. The local side of a gather's
sliced lists is cached with the peer's lists (``remote_cache``), not agent-wide: those lists
exist only for that peer, so they must go when it does (a restarted prefill rank would
otherwise leave one set per generation behind).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .bounds import MAX_PREPARED_DESCRIPTORS
from .layout import Granularity, KVCacheSpec
from .memory import DescriptorList, MemoryKind
from .planner import TransferPlan
from .plugin.backend import Backend

__all__ = ["Chunk", "plan_chunks"]

#: local list, local indices, remote list, remote indices, what to call once it is done
Chunk = tuple[Any, np.ndarray, Any, np.ndarray, list[Callable[[], None]]]
Cache = dict[Any, Any]


def plan_chunks(backend: Backend, p: TransferPlan, peer_key: str, local_cache: Cache, remote_cache: Cache,
                out: list[Chunk]) -> None:
    """Append the posts for ``p`` to ``out``, honouring the backend's ``max_descriptors``."""
    limit = backend.capabilities.max_descriptors
    for leg in p.legs:
        cleanup: list[Callable[[], None]] = []
        if leg.local_idx is None:  # coalesced: prepare the explicit lists for this transfer
            ld, rd = p.explicit(leg)
            lp = _prepare_once(backend, None, ld, cleanup)
            rp = _prepare_once(backend, peer_key, rd, cleanup)
            li = ri = np.arange(leg.descriptors, dtype=np.int32)
        elif leg.lists is not None:  # a gather's sliced pages: lists of its own, prepared once
            assert leg.remote_idx is not None
            strided = backend.capabilities.strided_lists
            # Both sides of a gather's lists belong to the peer: dropping it releases them.
            lp = _cached(remote_cache, (leg.lists, "local"), lambda: backend.prepare(None, leg.lists.local(strided)))
            rp = _cached(remote_cache, (leg.lists, "remote"),
                         lambda: backend.prepare(peer_key, leg.lists.remote(strided)))
            li, ri = leg.local_idx, leg.remote_idx
        else:
            assert leg.remote_idx is not None
            lp, li = _prepared(backend, None, p.local_spec, local_cache, leg.local_granularity, leg.local_kind,
                               leg.local_idx, cleanup)
            rp, ri = _prepared(backend, peer_key, p.remote_spec, remote_cache, leg.remote_granularity,
                               leg.remote_kind, leg.remote_idx, cleanup)
        n = leg.descriptors
        if n == 0:
            for fn in cleanup:
                fn()
            continue
        if not limit or n <= limit:  # the common case: one post for the whole leg
            out.append((lp, li, rp, ri, cleanup))
            continue
        for s in range(0, n, limit):
            last = s + limit >= n
            out.append((lp, li[s:s + limit], rp, ri[s:s + limit], cleanup if last else []))


def _cached(cache: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    h = cache.get(key)
    if h is None:
        h = cache[key] = make()
    return h


def _prepare_once(backend: Backend, key: str | None, descs: DescriptorList, cleanup: list[Callable[[], None]]) -> Any:
    h = backend.prepare(key, descs)
    cleanup.append(lambda: backend.release_prepared(h))
    return h


def _prepared(backend: Backend, key: str | None, spec: KVCacheSpec, cache: Cache, gran: Granularity,
              kind: MemoryKind, idx: np.ndarray, cleanup: list[Callable[[], None]]) -> tuple[Any, np.ndarray]:
    """A prepared list of ``spec`` and the indices into it for this transfer (see the module doc)."""
    h = cache.get((gran, kind))
    if h is not None:  # only whole lists are cached: the common case costs one lookup
        return h, idx
    strided = spec.descriptor_list(gran, kind, strided=True)
    takes_strided = backend.capabilities.strided_lists
    if takes_strided or strided.num_spans <= MAX_PREPARED_DESCRIPTORS:
        h = cache.get((gran, kind))
        if h is None:
            h = backend.prepare(key, strided if takes_strided else strided.expand())
            cache[(gran, kind)] = h
        return h, idx
    return _prepare_once(backend, key, strided.take(idx), cleanup), np.arange(idx.shape[0], dtype=idx.dtype)
