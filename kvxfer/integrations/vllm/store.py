"""Prompt prefixes served from a :class:`kvxfer.Store` (``store_path`` in the extra config).

A finished request's full prompt blocks are offloaded under prefix keys; a later request,
in this engine or a new one on the same store, whose prompt starts with those blocks
restores them instead of computing them. Who does what (docs/vllm.md, "Prefixes from a
store"):

* Each worker opens the store for its own cache (one slab per TP rank: the TP slice is part
  of the layout fingerprint) and is its only opener; it does every offload and restore.
* The scheduler never opens it. The worker hands it a :class:`~kvxfer.store.view.ViewHandle`
  through vLLM's handshake metadata at start-up, and the scheduler reads the index journal
  through a read-only :class:`~kvxfer.store.view.IndexView` to answer
  ``get_num_new_matched_tokens``. What the view shows is a hint: a key evicted or a row
  damaged since then fails the restore, and vLLM recomputes those blocks.

With ``tier`` instead of ``store_path`` the rows live in the cluster tier
(:class:`kvxfer.tiers.MooncakeTier`), which engines on other hosts share: each worker holds a
tier client (lending its segment), hands the scheduler its layout fingerprint
(:class:`ClusterHandle`), and the scheduler asks the master through a client that lends nothing
(:class:`kvxfer.tiers.MooncakeLookup`).

Keys are opaque bytes, a SHA-256 chain over the prompt's token ids block by block (seeded
with the request's cache salt), so they are equal in every process and engine whatever
``PYTHONHASHSEED`` says; the model and layout are in the slab's fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

import kvxfer
from kvxfer.errors import KvxferError, StoreBusyError, StoreCorruptError
from kvxfer.store.view import IndexView, ViewHandle
from kvxfer.tiers import MooncakeLookup, MooncakeTier, Tier
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from .stats import KvxferConnectorStats

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["prefix_keys", "ClusterHandle", "StoreHandshake", "StoreLoad", "StoreSave", "SchedulerStore", "WorkerStore"]

log = logging.getLogger("vllm.kvxfer")

_ROOT = b"kvxfer-vllm-prefix-v1\0"
#: Reports a failed restore: (request id, its vLLM blocks, the error); vLLM recomputes them.
Fail = Callable[[str, list[int], BaseException], None]


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """One key per full block: key[i] names tokens ``[0, (i+1) * block_size)``.

    A chain (``key[i] = sha256(key[i-1] + block i's ids as little-endian int64)``), so a key
    names its whole prefix and two prompts share exactly the keys of their common full blocks.
    """
    ids = np.asarray(token_ids, dtype="<i8")
    n = ids.shape[0] // block_size
    h = hashlib.sha256(_ROOT + (salt or "").encode() + b"\0").digest()
    rows = ids[:n * block_size].reshape(n, block_size)
    out = []
    for row in rows:  # one hash per block: chaining is sequential by nature
        h = hashlib.sha256(h + row.tobytes()).digest()
        out.append(h)
    return out


@dataclass
class ClusterHandle:
    """What the scheduler needs to name a worker's objects in the cluster tier (plain values)."""

    fingerprint: str
    namespace: str


@dataclass
class StoreHandshake(KVConnectorHandshakeMetadata):
    """A worker's store, for the scheduler's view (None in a rank means: no store there)."""

    handle: ViewHandle | ClusterHandle | None


@dataclass
class StoreLoad:
    """Restore ``keys[i]`` into vLLM block ``block_ids[i]``."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    tokens: int


@dataclass
class StoreSave:
    """Offload vLLM block ``block_ids[i]`` under ``keys[i]``; vLLM frees the blocks after."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]


def _storable(request: "Request") -> bool:
    """Token ids name the KV only for plain text prompts (no images, no adapter)."""
    return (request.prompt_token_ids is not None and not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None)


class SchedulerStore:
    """The scheduler's half: what to restore and what to offload, from the view of the index."""

    def __init__(self, block_size: int, min_tokens: int, tier: dict[str, Any] | None = None) -> None:
        self.block_size, self.min_tokens, self.tier = block_size, min_tokens, tier
        self.views: list[IndexView | MooncakeLookup] | None = None  # None until every worker said it holds its store
        self._keys: dict[str, list[bytes]] = {}
        self._hits: dict[str, int] = {}  # request id -> first block the load covers
        # Requests that had a restore: vLLM asks again only when it failed (its computed tokens
        # back at 0); a second try would fetch the same damaged object (the cluster tier cannot
        # drop it while the failed read's lease holds), so the request computes.
        self._tried: set[str] = set()
        self.loads: list[StoreLoad] = []
        self.saves: list[StoreSave] = []

    def attach(self, ranks: dict[int, Any]) -> None:
        handles = [getattr(m, "handle", None) for m in ranks.values()]
        kind = ClusterHandle if self.tier is not None else ViewHandle
        if not handles or not all(isinstance(h, kind) for h in handles):
            log.warning("kvxfer: a worker holds no store; prompts are not served from it")
            return
        if self.tier is None:
            self.views = [IndexView(h) for h in handles]
            return
        t, views = self.tier, []
        try:
            for h in handles:
                views.append(MooncakeLookup(t["master"], h.fingerprint, namespace=h.namespace,
                                            hostname=t.get("hostname", "127.0.0.1"), timeout=t.get("timeout", 5.0)))
        except KvxferError as exc:  # the master absent: this engine computes every prompt
            log.warning("kvxfer: cannot reach the cluster tier for lookups; prompts are not served from it: %s", exc)
            for v in views:
                v.close()
            return
        self.views = views

    def _request_keys(self, request: "Request") -> list[bytes]:
        rid = request.request_id
        if rid not in self._keys:
            self._keys[rid] = (prefix_keys(request.prompt_token_ids, self.block_size, request.cache_salt)
                               if _storable(request) else [])
        return self._keys[rid]

    def _stored(self, keys: list[bytes]) -> int:
        assert self.views is not None
        try:
            return min(v.prefix(keys) for v in self.views)
        except KvxferError as exc:  # the cluster's master gone or late: a miss, computed here
            log.warning("kvxfer: store lookup failed, computing the prompt: %s", exc)
            return 0

    def matched(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (block aligned) the store holds; at least one
        prompt token is always left to compute, as vLLM needs."""
        if self.views is None or request.request_id in self._tried:
            return 0
        bs = self.block_size
        keys = self._request_keys(request)[:(request.num_prompt_tokens - 1) // bs]
        start = num_computed_tokens // bs
        have = self._stored(keys) if len(keys) > start else 0
        if (have - start) * bs < max(self.min_tokens, 1):
            self._hits.pop(request.request_id, None)
            return 0
        self._hits[request.request_id] = start
        return (have - start) * bs

    def allocated(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> bool:
        """vLLM gave the request its blocks: queue the restore. True if this was a store hit."""
        start = self._hits.pop(request.request_id, None)
        if start is None:
            return False
        n = num_external_tokens // self.block_size
        if n > 0:
            self._tried.add(request.request_id)
            keys = self._request_keys(request)[start:start + n]
            self.loads.append(StoreLoad(request.request_id, keys, list(block_ids[start:start + n]),
                                        n * self.block_size))
        return True

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self._hits.pop(request_id, None)
        self._tried.discard(request_id)

    def finished(self, request: "Request", block_ids: list[int], done: bool) -> bool:
        """A request ended: offload its full prompt blocks the store lacks. True: vLLM keeps the
        blocks until the worker reports the offload finished (``finished_sending``)."""
        rid = request.request_id
        self._hits.pop(rid, None)
        self._tried.discard(rid)
        if self.views is None or not done:
            self._keys.pop(rid, None)
            return False
        keys = self._request_keys(request)
        del self._keys[rid]
        n = min(len(keys), int(request.num_computed_tokens) // self.block_size, len(block_ids))
        if n <= 0:
            return False
        missing = np.zeros(n, dtype=bool)  # missing on any rank: every rank writes it (a replace is harmless)
        try:
            for v in self.views:
                missing |= ~v.lookup(keys[:n])
        except KvxferError as exc:  # the cluster's master gone: an offload would fail too
            log.warning("kvxfer: store lookup failed, not offloading request %s: %s", rid, exc)
            return False
        todo = np.flatnonzero(missing).tolist()
        if not todo:
            return False
        self.saves.append(StoreSave(rid, [keys[i] for i in todo], [int(block_ids[i]) for i in todo]))
        return True


class WorkerStore:
    """The worker's half: the store's only opener in this process; offloads and restores."""

    def __init__(self, store: Tier, spec: kvxfer.KVCacheSpec, stats: KvxferConnectorStats,
                 unpinned: Callable[[], Any]) -> None:
        self.store, self.spec, self.stats, self._unpinned = store, spec, stats, unpinned
        self._loads: dict[str, tuple[StoreLoad, kvxfer.Transfer]] = {}
        self._saves: dict[str, tuple[StoreSave, kvxfer.Transfer]] = {}
        self.sent: set[str] = set()
        self.drops: list[threading.Thread] = []  # removals of damaged cluster objects under way

    @classmethod
    def open(cls, path: str | None, capacity: int, spec: kvxfer.KVCacheSpec, model: str, stats: KvxferConnectorStats,
             unpinned: Callable[[], Any], tier: dict[str, Any] | None = None) -> "WorkerStore | None":
        """The store for this cache (``tier``: the cluster tier's, instead of one at ``path``), or
        None (logged) when it cannot be used: another process holds it (StoreBusyError), the
        cache is in VRAM, the path or capacity is wrong, the cluster's master does not answer."""
        try:
            if tier is not None:
                opts = {k: v for k, v in tier.items() if k not in ("type", "master")}
                with unpinned():  # the tier's threads: not on the engine's core
                    store: Tier = MooncakeTier(tier["master"], layout=spec, model=model, **opts)
            else:
                store = kvxfer.Store(path, capacity=capacity, layout=spec, model=model)
        except StoreBusyError as exc:
            log.warning("kvxfer: the store is held by another process; this engine runs without it: %s", exc)
            stats.count("store_busy")
            return None
        except (KvxferError, OSError) as exc:
            log.warning("kvxfer: cannot use the store at %s; running without it: %s", path or tier, exc)
            return None
        log.info("kvxfer: serving prompt prefixes from %r", store)
        return cls(store, spec, stats, unpinned)

    def handshake(self) -> StoreHandshake:
        s = self.store
        if isinstance(s, MooncakeTier):
            return StoreHandshake(ClusterHandle(s.geometry.fingerprint, s.namespace))
        return StoreHandshake(ViewHandle.of(s))

    def start(self, loads: list[StoreLoad], saves: list[StoreSave], fail: Fail) -> None:
        with self._unpinned():  # the store's threads are made on first use: not on the engine's core
            for s in saves:
                try:
                    self._saves[s.request_id] = (s, self.store.offload(self.spec, s.block_ids, s.keys))
                except KvxferError as exc:
                    log.warning("kvxfer: offload of request %s refused: %s", s.request_id, exc)
                    self.stats.count("store_save_failures")
                    self.sent.add(s.request_id)
            for ld in loads:
                try:
                    self._loads[ld.request_id] = (ld, self.store.restore(ld.keys, self.spec, ld.block_ids))
                except KvxferError as exc:  # StoreMissError: evicted since the scheduler looked
                    self._failed(ld, exc, fail)

    def _failed(self, ld: StoreLoad, exc: BaseException, fail: Fail) -> None:
        self.stats.count("store_failures")
        if isinstance(exc, StoreCorruptError):
            self.stats.count("store_corrupt")
            if isinstance(self.store, MooncakeTier) and exc.keys:  # the slab drops its own damaged rows
                t = threading.Thread(target=self._drop, args=(list(exc.keys),), name="kvxfer-vllm-drop", daemon=True)
                t.start()
                self.drops = [d for d in self.drops if d.is_alive()] + [t]
        fail(ld.request_id, ld.block_ids, exc)

    def _drop(self, keys: list[bytes]) -> None:
        """Remove damaged objects from the cluster, so later requests compute and store them
        again; off the engine's thread, as a removal waits out the failed read's lease (which
        each lookup of the object renews: a busy prompt's object may outlive the deadline)."""
        try:
            self.store.discard(keys)
        except KvxferError as exc:
            log.warning("kvxfer: could not remove %d damaged object(s) from the cluster tier: %s", len(keys), exc)

    def poll(self, done: Callable[[str], None], fail: Fail) -> set[str]:
        """Finished restores go to ``done`` or ``fail``; returns the offloads that ended.

        No deadline cancels a store job: a cancelled restore could still be copying into blocks
        vLLM has given back (a job stops only at its next call), so each one runs to its end.
        """
        for rid, (ld, t) in list(self._loads.items()):
            try:
                if not t.done():
                    continue
            except KvxferError as exc:
                del self._loads[rid]
                self._failed(ld, exc, fail)
                continue
            del self._loads[rid]
            s = t.stats
            self.stats.record_load(seconds=s.seconds or 0.0, plan_seconds=s.plan_seconds, nbytes=s.nbytes,
                                   descriptors=s.descriptors, runs=s.descriptors, posts=s.posts, tokens=ld.tokens)
            done(rid)
        for rid, (sv, t) in list(self._saves.items()):
            try:
                if not t.done():
                    continue
                self.stats.count("store_saved_blocks", len(sv.keys))
            except KvxferError as exc:
                log.warning("kvxfer: offload of request %s failed (nothing published): %s", rid, exc)
                self.stats.count("store_save_failures")
            del self._saves[rid]
            self.sent.add(rid)
        out, self.sent = self.sent, set()
        return out

    def close(self) -> None:
        self.store.close()  # waits for the jobs in flight
