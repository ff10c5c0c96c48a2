"""From plan legs to backend posts: which prepared lists, which indices, how many posts.

Kept out of :mod:`kvxfer.agent` because it carries a bound of its own: a whole prepared list
is built once per (peer, granularity, kind) and kept, but only for backends that take
strided lists or when its expansion stays under
:data:`~kvxfer._bounds.MAX_PREPARED_DESCRIPTORS`. Past that, a backend that expands lists
gets only the spans of the transfer at hand (:meth:`~kvxfer.memory.DescriptorList.take`), so
a peer advertising 2^26 blocks costs what the request costs, not gigabytes.

Lists prepared for one transfer only carry their release in the chunk's cleanup, so the
caller can undo everything built so far if a later step fails. The local side of a gather's
sliced lists is cached with the peer's lists (``remote_cache``), not agent-wide: those lists
exist only for that peer, so they must go when it does (a restarted prefill rank would
otherwise leave one set per generation behind).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from ._bounds import MAX_PREPARED_DESCRIPTORS
from .geometry import Granularity, KVCacheSpec
from .memory import DescriptorList, MemoryKind
from .planner import TransferPlan
from .plugin.backend import Backend

__all__ = ["Chunk", "Preparer", "plan_chunks"]

Cache = dict[Any, Any]


class Chunk(NamedTuple):
    """One backend post: ``local[local_idx[i]] <-> remote[remote_idx[i]]``, and what undoes it."""

    local: Any
    local_idx: np.ndarray
    remote: Any
    remote_idx: np.ndarray
    cleanup: list[Callable[[], None]]  # called once the post is done (lists prepared for it alone)


def plan_chunks(backend: Backend, p: TransferPlan, peer_key: str, local_cache: Cache, remote_cache: Cache,
                out: list[Chunk]) -> None:
    """Append the posts for ``p`` to ``out``, honouring the backend's ``max_descriptors``."""
    limit = backend.capabilities.max_descriptors
    for leg in p.legs:
        lists = Preparer(backend, p, peer_key, local_cache, remote_cache)
        lp, li, rp, ri = leg.prepare(lists)
        n = leg.descriptors
        if n == 0:
            for fn in lists.cleanup:
                fn()
            continue
        if not limit or n <= limit:  # the common case: one post for the whole leg
            out.append(Chunk(lp, li, rp, ri, lists.cleanup))
            continue
        for s in range(0, n, limit):
            last = s + limit >= n
            out.append(Chunk(lp, li[s:s + limit], rp, ri[s:s + limit], lists.cleanup if last else []))


class Preparer:
    """The lists of one leg of one transfer (:class:`kvxfer._legs.Lists`): kept, or prepared for it alone."""

    __slots__ = ("backend", "plan", "peer_key", "local_cache", "remote_cache", "cleanup")

    def __init__(self, backend: Backend, plan: TransferPlan, peer_key: str, local_cache: Cache,
                 remote_cache: Cache) -> None:
        self.backend, self.plan, self.peer_key = backend, plan, peer_key
        self.local_cache, self.remote_cache = local_cache, remote_cache
        self.cleanup: list[Callable[[], None]] = []

    @property
    def strided(self) -> bool:
        return self.backend.capabilities.strided_lists

    def once(self, remote: bool, descs: DescriptorList) -> Any:
        h = self.backend.prepare(self.peer_key if remote else None, descs)
        self.cleanup.append(lambda: self.backend.release_prepared(h))
        return h

    def for_peer(self, key: Any, remote: bool, make: Callable[[], DescriptorList]) -> Any:
        h = self.remote_cache.get(key)  # the peer's cache: dropping the peer releases them
        if h is None:
            h = self.remote_cache[key] = self.backend.prepare(self.peer_key if remote else None, make())
        return h

    def of_spec(self, remote: bool, gran: Granularity, kind: MemoryKind, idx: np.ndarray) -> tuple[Any, np.ndarray]:
        """A prepared list of that side's spec and the indices into it (see the module doc)."""
        cache = self.remote_cache if remote else self.local_cache
        h = cache.get((gran, kind))
        if h is not None:  # only whole lists are cached: the common case costs one lookup
            return h, idx
        spec: KVCacheSpec = self.plan.remote_spec if remote else self.plan.local_spec
        strided = spec.descriptor_list(gran, kind, strided=True)
        takes_strided = self.backend.capabilities.strided_lists
        if takes_strided or strided.num_spans <= MAX_PREPARED_DESCRIPTORS:
            h = cache[(gran, kind)] = self.backend.prepare(self.peer_key if remote else None,
                                                          strided if takes_strided else strided.expand())
            return h, idx
        return self.once(remote, strided.take(idx)), np.arange(idx.shape[0], dtype=idx.dtype)
