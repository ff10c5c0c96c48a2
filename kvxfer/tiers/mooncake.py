"""The cluster tier: whole KV rows as objects in a Mooncake Store, with the store's API.

Mooncake Store is a master and clients that each lend a memory segment; an object put by
one host can be read by any other. :class:`MooncakeTier` rides it and brings what it lacks:

* one object per whole row (:mod:`.objects`), written from the rows the core packs: the
  planner gathers a per-layer cache's pages into rows in a registered bounce buffer, as the
  slab path does, and scatters them back on a restore;
* a header and the row's digest in every object, checked before a byte is copied into the
  cache: a torn, evicted, overwritten or foreign object is a typed miss, never garbage;
* typed misses for what Mooncake reports with return codes (a silent eviction, a master
  restart that lost everything, a segment holder that died), and deadlines on every wait.

Objects are fetched into the bounce, never into the cache: a fetch that is still running
when its transfer timed out or was cancelled writes only the bounce, and the copy into the
cache runs inside the job's fence (:meth:`kvxfer.store.fileio.Job.io`), refused once the
transfer ended. docs/storage.md ("The cluster tier") says what it trusts and what it loses.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from ..deadlines import Deadline, check_timeout
from ..errors import (BlockCountMismatchError, DuplicateBlockIdError, InvalidArgumentError, SpecError,
                      StoreBusyError, StoreCorruptError, StoreError, TransferCancelledError, TransferTimeoutError)
from ..geometry import KVCacheSpec
from ..memory import Op
from ..planner import TransferPlan, as_block_ids
from ..store.fileio import ENGINE, Job
from ..store.slab import geometry
from ..store.store import _keys
from ..transfer import Transfer, TransferStats, _Post
from . import _client
from .lookup import check_namespace, exist
from .objects import Bounce, check_objects, copy_plan, object_name, pack_header

__all__ = ["MooncakeTier"]

#: The smallest segment a Mooncake client lends (its setup() refuses less with -600).
MIN_SEGMENT = 16 << 20
# How severe a failed fetch is, most first: the error of the worst one names every failed key.
_WORST = (_client.UNREACHABLE, _client.GONE, _client.MISSING, _client.SIZE)


class MooncakeTier:
    """KV rows in a Mooncake Store cluster, by opaque key (the :class:`~.base.Tier` protocol).

    ``master``: the master's ``host:port``. ``layout``: the local cache's spec (or any that
    pairs with it); with ``model`` it fixes the layout fingerprint that namespaces the keys.
    ``hostname``: this client's address as the other clients reach it (its segment is served
    from there). ``segment``: bytes of memory this process lends to the cluster (0: none; it
    only reads and writes others'). ``buffer``: bytes of the registered bounce buffer every
    object passes through (a larger request is moved in several rounds). ``timeout``: the
    default deadline of a transfer and of every call to the master, creation included.
    """

    #: Seconds between attempts to remove an object a read still leases (:meth:`discard`).
    LEASE_RETRY = 0.05

    def __init__(self, master: str, *, layout: KVCacheSpec, model: str = "", hostname: str = "127.0.0.1",
                 segment: int = 0, buffer: int = 64 << 20, local_buffer: int = 16 << 20, protocol: str = "tcp",
                 device: str = "", metadata: str = "P2PHANDSHAKE", namespace: str = "kvxfer",
                 timeout: float = 30.0) -> None:
        self.geometry = g = geometry(layout, model)
        self.timeout = check_timeout(timeout, "MooncakeTier timeout")
        for name, v in (("segment", segment), ("buffer", buffer), ("local_buffer", local_buffer)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{name} must be a number of bytes, got {v!r}")
        if 0 < segment < MIN_SEGMENT:
            raise InvalidArgumentError(f"segment must be 0 (lend none) or at least {MIN_SEGMENT} bytes "
                                       f"(Mooncake's smallest), got {segment}")
        self.namespace, self.master = check_namespace(namespace), master
        self._bounce = Bounce(g, max(buffer, 1))
        deadline = Deadline.within(self.timeout)
        self._client = _client.Client(master, hostname, segment, local_buffer, protocol, device, metadata, deadline)
        self._store = self._client.store
        try:
            rc = self._client.call(lambda: self._store.register_buffer(self._bounce.address, self._bounce.nbytes),
                                   deadline, "registering the bounce buffer")
            if rc != 0:
                raise StoreError(f"Mooncake Store refused to register the {self._bounce.nbytes}-byte bounce ({rc})")
        except BaseException:
            self._client.close()
            raise
        self._lock = threading.Lock()  # the bounce: one request's round at a time
        self._plan_lock = threading.Lock()  # the bounce's pairings (never held across a Mooncake call)
        self._jobs = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvxfer-tier-job")
        self._closed = False
        #: Test hook: called with a stage name on the worker thread: "issue" before each put or
        #: fetch, "fetched" after a fetch, "verified" after the checks (before the copy).
        self._fault: Callable[[str], None] | None = None

    def __repr__(self) -> str:
        return f"<MooncakeTier {self.master} {self.geometry.fingerprint} rows of {self.geometry.row_len} bytes>"

    def __enter__(self) -> "MooncakeTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self, keys: Sequence[bytes]) -> list[str]:
        """The objects' names in the cluster store (namespace, layout fingerprint, key)."""
        fp = self.geometry.fingerprint
        return [object_name(self.namespace, fp, k) for k in _keys(keys)]

    # -- lookups ----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> np.ndarray:
        """A bool per key: an object is held under it now (a hint: it may be evicted, or fail
        its checks, before a restore). An unreachable master raises a typed miss."""
        ks = _keys(keys)
        return exist(self._client, ks, self.names(ks), self._deadline(timeout))

    def prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading keys are held."""
        hit = self.lookup(keys, timeout=timeout)
        return int(hit.shape[0] if hit.all() else np.argmin(hit))

    def discard(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove objects; returns how many were removed. An object a read still leases cannot
        be removed until the lease ends (Mooncake's ``default_kv_lease_ttl``): retried until
        the deadline, then :class:`~kvxfer.errors.StoreBusyError` naming them."""
        ks = list(dict.fromkeys(_keys(keys)))
        names = dict(zip(self.names(ks), ks))
        deadline, removed = self._deadline(timeout), 0
        while names:
            if self._closed:  # closed while waiting out a lease
                raise StoreError(f"the tier was closed with {len(names)} object(s) not yet removed")
            todo = list(names)
            got = self._client.call(lambda: self._store.batch_remove(todo), deadline, "discard")
            for n, rc in zip(todo, got):
                if rc == 0:
                    removed += 1
                if rc != _client.LEASED:
                    key = names.pop(n)
                    if rc not in (0, _client.MISSING):
                        raise _client.typed(int(rc), "discard", [key])
            if names and Deadline.within(self.LEASE_RETRY) >= deadline:
                raise StoreBusyError(f"{len(names)} object(s) are still leased by a read at the deadline; "
                                     f"{removed} removed; retry after the lease (Mooncake default_kv_lease_ttl)")
            if names:
                time.sleep(self.LEASE_RETRY)
        return removed

    # -- transfers --------------------------------------------------------------------------
    def offload(self, spec: Any, local_blocks: Any, keys: Sequence[bytes], *,
                timeout: float | None = None) -> Transfer:
        """Write ``local_blocks[i]`` of ``spec`` (a :class:`KVCacheSpec` or an agent) under
        ``keys[i]``: one object per row, its header and digest computed from the gathered row.

        An object is visible once its round's put returned; a transfer that fails or is
        cancelled between rounds leaves the rounds before it stored (whole, checked objects).
        A full cluster evicts older objects silently (Mooncake's policy): their restores are
        misses.
        """
        t0, deadline, limit = self._begin(timeout)
        ks = _keys(keys)
        if len(set(ks)) != len(ks):
            raise DuplicateBlockIdError("a key appears twice in one offload; each key names one row")
        spec = self._local(spec)
        blocks = as_block_ids(local_blocks, spec.num_blocks, "local")
        if blocks.shape[0] != len(ks):
            raise BlockCountMismatchError(f"{blocks.shape[0]} local blocks for {len(ks)} keys; give one key per block")
        rounds = self._rounds(spec, blocks, ks, Op.WRITE)
        b, store = self._bounce, self._store

        def one(job: Job, p: TransferPlan, rk: list[bytes], names: list[str]) -> None:
            n = len(rk)
            with job.io():  # the cache is read only while the transfer is live
                copy_plan(p, to_cache=False)
            dig, heads = b.digests(n), b.heads(n)
            for i, name in enumerate(names):
                heads[i] = np.frombuffer(pack_header(b.row_len, int(dig[i]), name), dtype=np.uint8)
            if job.cancelled:
                raise TransferCancelledError("offload was cancelled")
            self._stage("issue")
            got = np.asarray(store.batch_upsert_from(names, b.pointers(n), [b.object_len] * n), dtype=np.int64)
            bad = got != 0
            if bad.any():
                raise _client.typed(int(got[bad][0]), "offload", [k for k, x in zip(rk, bad.tolist()) if x])

        return self._transfer(rounds, one, Op.WRITE, t0, deadline, limit, spec)

    def restore(self, keys: Sequence[bytes], spec: Any, local_blocks: Any, *,
                timeout: float | None = None) -> Transfer:
        """Read the objects under ``keys[i]`` into ``local_blocks[i]`` of ``spec``.

        Each round fetches its objects into the bounce and checks every one (whole, our
        header for that name and row length, the row's digest) before copying any: a round
        with a failed fetch copies nothing and fails the transfer with a typed miss
        (:class:`~kvxfer.errors.StoreMissError`, or :class:`~kvxfer.errors.StoreUnavailableError`
        when the master or the holder is gone), one with a failed check with
        :class:`~kvxfer.errors.StoreCorruptError`; ``.keys`` names the rows. Earlier rounds
        of a large request may have been copied: they passed their checks.
        """
        t0, deadline, limit = self._begin(timeout)
        ks = _keys(keys)
        spec = self._local(spec)
        blocks = as_block_ids(local_blocks, spec.num_blocks, "local")
        if blocks.shape[0] != len(ks):
            raise BlockCountMismatchError(f"{len(ks)} keys for {blocks.shape[0]} local blocks; give one block per key")
        rounds = self._rounds(spec, blocks, ks, Op.READ)
        b, store = self._bounce, self._store

        def one(job: Job, p: TransferPlan, rk: list[bytes], names: list[str]) -> None:
            n = len(rk)
            b.heads(n)[:] = 0  # a fetch that writes nothing must not find the last round's headers
            self._stage("issue")
            got = np.asarray(store.batch_get_into(names, b.pointers(n), [b.object_len] * n), dtype=np.int64)
            self._stage("fetched")
            failed, ok = self._verdict(got, b.heads(n), b.digests(n), names)
            if failed.any():
                codes = set(got[failed].tolist())
                code = next((c for c in _WORST if c in codes), int(got[failed][0]))
                raise _client.typed(code, "restore", [k for k, x in zip(rk, failed.tolist()) if x])
            if not ok.all():
                lost = [k for k, x in zip(rk, ok.tolist()) if not x]
                raise StoreCorruptError(f"{len(lost)} of {len(ks)} objects failed their checks (torn, overwritten "
                                        "or not ours); they were not copied: recompute those blocks", lost)
            self._stage("verified")
            with job.io():  # refused once the transfer ended: nothing lands after a typed end
                copy_plan(p, to_cache=True)

        return self._transfer(rounds, one, Op.READ, t0, deadline, limit, spec)

    # -- internals --------------------------------------------------------------------------
    def _verdict(self, got: np.ndarray, heads: np.ndarray, digests: np.ndarray,
                 names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Per fetched object: did the fetch fail (a negative code), and does it pass its
        checks (tests bypass this to show what would land without it)."""
        return got < 0, check_objects(heads, got, digests, names, self._bounce.row_len)

    def _begin(self, timeout: float | None) -> tuple[float, float, float]:
        if self._closed:
            raise StoreError("the tier is closed")
        limit = self.timeout if timeout is None else check_timeout(timeout)
        return time.perf_counter(), Deadline.within(limit), limit

    def _deadline(self, timeout: float | None) -> float:
        return self._begin(timeout)[1]

    def _local(self, spec: Any) -> KVCacheSpec:
        if isinstance(spec, KVCacheSpec):
            return spec
        if not all(hasattr(spec, a) for a in ("_check_open", "spec")):  # an Agent (not imported: a cycle)
            raise InvalidArgumentError(f"the tier moves a KVCacheSpec's or an Agent's cache, got {type(spec).__name__}")
        spec._check_open()
        if spec.spec is None:
            raise SpecError("register a KV cache before offloading or restoring")
        return spec.spec

    def _rounds(self, spec: KVCacheSpec, blocks: np.ndarray, ks: list[bytes],
                op: Op) -> list[tuple[TransferPlan, list[bytes], list[str]]]:
        """The request cut into rounds of at most one bounce of rows, each planned now (what a
        plan refuses is refused before anything moves)."""
        step = self._bounce.slots
        names = self.names(ks)
        with self._plan_lock:
            return [(self._bounce.plan(spec, blocks[i:i + step], op), ks[i:i + step], names[i:i + step])
                    for i in range(0, len(ks), step)]

    def _transfer(self, rounds: list[tuple[TransferPlan, list[bytes], list[str]]],
                  one: Callable[[Job, TransferPlan, list[bytes], list[str]], None], op: Op, t0: float,
                  deadline: float, limit: float, spec: KVCacheSpec) -> Transfer:
        def body(job: Job) -> None:
            if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TransferTimeoutError("the tier's bounce buffer was busy until the deadline")
            try:  # held until Mooncake's calls returned: a late fetch writes only the bounce
                for p, rk, names in rounds:
                    if job.cancelled:
                        raise TransferCancelledError("tier transfer was cancelled")
                    one(job, p, rk, names)
            finally:
                self._lock.release()

        nbytes = sum(p.nbytes for p, _, _ in rounds)
        descs = sum(p.descriptors for p, _, _ in rounds)
        objects = sum(len(rk) for _, rk, _ in rounds)
        mode = rounds[0][0].mode if rounds else ""
        stats = TransferStats(descs, nbytes, len(rounds), time.perf_counter() - t0, path="mooncake-store",
                              telemetry=[{"objects": objects, "ios": len(rounds)}], backend="mooncake-store",
                              op=op.value, peer=self.geometry.fingerprint, mode=mode)
        job = Job(self._jobs, body, lambda job, err: None, "mooncake-store", keep=spec)
        return Transfer(ENGINE, [_Post(job)], stats, default_timeout=limit, deadline=deadline,  # type: ignore[arg-type]
                        started=time.perf_counter())

    def _stage(self, name: str) -> None:
        if self._fault is not None:
            self._fault(name)

    def close(self) -> None:
        """Wait for jobs in flight, then leave the cluster (this process's segment goes with it;
        Mooncake's client takes about 2 s to leave)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.shutdown(wait=True)
        try:
            self._store.unregister_buffer(self._bounce.address)
        except Exception:  # a master that is gone: the client's close below ends it anyway
            pass
        self._client.close()
