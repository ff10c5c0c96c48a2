"""A vLLM native offload tier backed by a kvxfer tier (docs/engines.md has the config).

The tier is a :class:`kvxfer.Store` (``store_path``: one machine's slab) or a
:class:`kvxfer.tiers.MooncakeTier` (``mooncake_master``: a Mooncake Store cluster); both are
:class:`kvxfer.tiers.Tier`, and nothing below asks which one it holds.

vLLM's ``TieringOffloadingManager`` keeps a CPU primary tier (an mmap of ``num_chunks`` rows)
and cascades chunks to secondary tiers, then promotes them back on a prefix hit. This tier is
one of those: each chunk is one whole row of a slab, so a job over consecutive rows is one
system call per 8 MiB, every promoted row is read into its chunk and checked there against its
digest before the job is reported (a damaged row fails the job for vLLM to recompute, and its
group's chunks are zeroed: none of its bytes stays in the primary), and a store
killed mid-way publishes nothing (docs/storage.md, "Crash consistency").

Everything here runs in vLLM's scheduler process, which has no handler around these calls:
the copies run on the store's threads, ``get_finished_jobs`` polls them, and every callback
is wrapped by :func:`.guard.boundary`, so a malformed job becomes a failed job and a bad key
a miss. A job is reported finished only once the store's worker has returned (the store's
``Transfer`` polls its future), and jobs are never cancelled: a reported job writes nothing
after, into the primary or the slab.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

import kvxfer
from kvxfer.errors import InvalidArgumentError, KvxferError
from kvxfer.geometry import KVCacheSpec, spec_from_pointers
from kvxfer.tiers import MooncakeTier, Tier  # Mooncake's own client loads only when one is created
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from .guard import boundary

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KvxferStoreTier", "NAMESPACE", "MAX_VLLM_KEY"]

log = logging.getLogger("vllm.kvxfer")

#: Prefix of every store key this tier writes: vLLM's keys never collide with the connector's.
NAMESPACE = b"kvxfer-vllm-tier-v1\0"
#: Longest vLLM key accepted (an OffloadKey is a block hash plus a 4-byte group index: ~36 bytes).
MAX_VLLM_KEY = 512
_MEMBER = "vllm.offload.chunk"


@dataclass
class _Job:
    """One submitted job: the store's transfer (None when it failed at submit) and its facts."""

    job_id: int
    transfer: kvxfer.Transfer | None
    nbytes: int
    t0: float
    failed: bool = False  # refused at submit (a malformed job, a key no longer stored)


def _namespace(spec: Any, explicit: str) -> str:
    """What must match for two engines to share rows, beyond the row's size (in the slab's
    fingerprint already): model, dtype, hash granularity and parallel shape, as vLLM's fs
    tier keys its directory on. Hashed, so any model name fits the store's bound."""
    fields: dict[str, Any] = {"namespace": explicit}
    try:
        cfg = spec.config
        fields.update(model=str(cfg.model.name), dtype=str(cfg.model.dtype), tokens_per_hash=cfg.cache.tokens_per_hash,
                      tp=cfg.parallel.tp_size, pp=cfg.parallel.pp_size, rank=cfg.parallel.rank,
                      groups=[[g.tokens_per_block, list(g.layer_names)] for g in cfg.groups])
    except Exception:  # noqa: BLE001  # a spec without these facts: the explicit namespace alone
        pass
    return "vllm-tier:" + hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _open_tier(spec: KVCacheSpec, model: str, store_path: str | None, capacity_bytes: int | None, durable: bool,
               threads: int, cluster: dict[str, Any]) -> Tier:
    """The local slab (``store_path``) or the cluster tier (``mooncake_master``): exactly one."""
    master = cluster.pop("master")
    if (store_path is None) == (master is None):
        raise InvalidArgumentError("give exactly one of store_path (a local kvxfer.Store) and mooncake_master "
                                   "(a Mooncake Store cluster)")
    if master is not None:
        unused = sorted(k for k, v in (("capacity_bytes", capacity_bytes), ("durable", durable or None)) if v)
        if unused:
            raise InvalidArgumentError(f"{unused} apply to store_path only (the cluster's segments set its size)")
        return MooncakeTier(master, layout=spec, model=model, **{k: v for k, v in cluster.items() if v is not None})
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise InvalidArgumentError(f"capacity_bytes must be a number of bytes, got {capacity_bytes!r:.40}")
    os.makedirs(store_path, mode=0o700, exist_ok=True)  # type: ignore[arg-type]
    return kvxfer.Store(store_path, capacity=capacity_bytes, layout=spec, model=model,  # type: ignore[arg-type]
                        durable=bool(durable), threads=int(threads))


class KvxferStoreTier(SecondaryTierManager):
    """A ``SecondaryTierManager`` whose chunks are rows of a kvxfer tier.

    ``store_path``: the local store's directory (created ``0700``). ``capacity_bytes``: its bytes
    of rows on disk. ``durable``: fdatasync before publishing (survives power loss). ``threads``:
    the store's I/O threads. Or ``mooncake_master`` (``host:port``): the cluster tier, with
    ``mooncake_hostname`` (this process's address as other clients reach it),
    ``mooncake_segment`` (bytes this process lends the cluster; 0: none), ``mooncake_buffer``
    (its bounce buffer's bytes) and ``mooncake_timeout`` (seconds, each job and each call to the
    master). ``locality``: vLLM's ``"LOCAL"``/``"REMOTE"`` tag. ``namespace``: an extra string
    engines must share to share rows.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 store_path: str | None = None, capacity_bytes: int | None = None, durable: bool = False,
                 threads: int = 4, namespace: str = "", locality: str | None = None,
                 mooncake_master: str | None = None, mooncake_hostname: str | None = None,
                 mooncake_segment: int | None = None, mooncake_buffer: int | None = None,
                 mooncake_timeout: float | None = None,
                 backpressure_detector: "BackpressureDetector | None" = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        if primary_kv_view.ndim < 1 or not primary_kv_view.c_contiguous:
            raise InvalidArgumentError("the primary view must be C-contiguous rows, one per chunk")
        self._rows = np.frombuffer(primary_kv_view.cast("B"), dtype=np.uint8)  # alive as long as the tier
        self.num_chunks = int(primary_kv_view.shape[0])  # type: ignore[index]
        if self._rows.nbytes != self.num_chunks * self.block_size_bytes:
            raise InvalidArgumentError("the primary view's rows are not packed back to back")
        self.spec = spec_from_pointers((int(self._rows.ctypes.data), int(self._rows.nbytes), 0),
                                       num_blocks=self.num_chunks, members=[(_MEMBER, self.block_size_bytes)])
        cluster = {"master": mooncake_master, "hostname": mooncake_hostname, "segment": mooncake_segment,
                   "buffer": mooncake_buffer, "timeout": mooncake_timeout}
        self.store: Tier = _open_tier(self.spec, _namespace(offloading_spec, namespace), store_path, capacity_bytes,
                                      durable, threads, cluster)
        self._jobs: dict[int, _Job] = {}
        self.errors = 0  # contained errors (bad jobs, bad keys, failed submits)

    # -- validation ---------------------------------------------------------------------------
    def _key(self, key: Any) -> bytes:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_VLLM_KEY:
            raise InvalidArgumentError(f"an offload key must be 1 to {MAX_VLLM_KEY} bytes, got {key!r:.60}")
        return NAMESPACE + key

    def _job(self, job: Any) -> tuple[int, list[bytes], np.ndarray]:
        """(job id, store keys, chunk ids) of a job from vLLM, or a typed error."""
        if not isinstance(job, TransferJob):
            raise InvalidArgumentError(f"expected a TransferJob, got {type(job).__name__}")
        jid = job.job_id
        if isinstance(jid, bool) or not isinstance(jid, int):
            raise InvalidArgumentError(f"a job id must be an int, got {jid!r:.40}")
        if jid in self._jobs:
            raise InvalidArgumentError(f"job {jid} is already in flight")
        raw = list(job.keys) if isinstance(job.keys, (list, tuple)) else None
        if raw is None or len(raw) > self.num_chunks:
            raise InvalidArgumentError(f"a job's keys must be a list of at most {self.num_chunks}")
        keys = [self._key(k) for k in raw]
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("a key appears twice in one job")
        ids = job.chunk_ids
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidArgumentError("chunk_ids must be a 1-D integer array")
        if ids.shape[0] != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {ids.shape[0]} chunk ids")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_chunks):
            raise InvalidArgumentError(f"a chunk id lies outside the primary's {self.num_chunks} chunks")
        if np.unique(ids).shape[0] != ids.shape[0]:
            raise InvalidArgumentError("a chunk id appears twice in one job")
        return jid, keys, ids.astype(np.int64)

    def _failed(self, job: Any, *args: Any) -> None:
        """The fallback of a submit that raised: report the job failed (vLLM unpins its chunks and
        recomputes), unless its id is unusable or already names a job in flight."""
        self.errors += 1
        jid = getattr(job, "job_id", None)
        if isinstance(jid, int) and not isinstance(jid, bool) and jid not in self._jobs:
            self._jobs[jid] = _Job(jid, None, 0, time.monotonic(), failed=True)

    # -- vLLM's interface -----------------------------------------------------------------------
    @boundary(lambda: LookupResult.MISS)
    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        """HIT when the row is stored now (it may be evicted before the load: that load fails)."""
        return LookupResult.HIT if bool(self.store.lookup([self._key(key)])[0]) else LookupResult.MISS

    @boundary(lambda: None, salvage=_failed)
    def submit_store(self, job_metadata: TransferJob) -> None:
        jid, keys, ids = self._job(job_metadata)
        new = ~self.store.lookup(keys) if keys else np.zeros(0, dtype=bool)  # already stored: skip
        t = self.store.offload(self.spec, ids[new], [k for k, n in zip(keys, new) if n]) if new.any() else None
        self._jobs[jid] = _Job(jid, t, int(new.sum()) * self.block_size_bytes, time.monotonic())

    @boundary(lambda: None, salvage=_failed)
    def submit_load(self, job_metadata: TransferJob) -> None:
        jid, keys, ids = self._job(job_metadata)
        # The slab reads into the primary's chunks and checks them there (one pass; a failed group is
        # zeroed before the job ends); the cluster tier checks each object in its bounce before copying.
        kw = {} if isinstance(self.store, MooncakeTier) else {"in_place": True}
        t = self.store.restore(keys, self.spec, ids, **kw) if keys else None  # a missing key: StoreMissError
        self._jobs[jid] = _Job(jid, t, len(keys) * self.block_size_bytes, time.monotonic())

    @boundary(list)
    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        for jid, j in list(self._jobs.items()):
            ok = not j.failed
            if j.transfer is not None:
                try:
                    if not j.transfer.done():
                        continue
                    ok = True
                except KvxferError as exc:  # a damaged row (StoreCorruptError), a store error: a failed job
                    ok = False
                    self.errors += 1
                    log.warning("kvxfer tier: job %d failed: %s", jid, exc)
            del self._jobs[jid]
            out.append(JobResult(job_id=jid, success=ok, transfer_time=time.monotonic() - j.t0,
                                 transfer_bytes=j.nbytes if ok else None))
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    @boundary(RequestOffloadingContext)
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @boundary(lambda: None)
    def drain_jobs(self) -> None:
        """Wait for every job's worker to return (never cancel: a cancelled copy could still land)."""
        for j in list(self._jobs.values()):
            while j.transfer is not None:
                try:
                    if j.transfer.done():
                        break
                except KvxferError:
                    break
                time.sleep(1e-4)

    def shutdown(self) -> None:
        try:
            self.drain_jobs()
            self.store.close()
        except Exception as exc:  # noqa: BLE001  # shutting down: log, never raise into vLLM
            log.error("kvxfer tier: closing the store failed: %r", exc)

    def close(self) -> None:
        self.shutdown()

