"""The store: offload whole rows of a local KV cache to a slab and restore them, by key.

:meth:`Store.offload` reserves slots (evicting least recently used entries), plans the local
cache against the slab spec with the unchanged planner, writes on worker threads and, only
when every write returned, digests the rows and publishes the entries (journal first, then
the index). :meth:`Store.restore` pins the entries, checks every row against its digest
right *before* copying it, and unpins. Both return a :class:`~kvxfer.Transfer`, so
deadlines and cancellation behave as for a peer transfer. docs/storage.md has the formats.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from .. import _lifecycle as lifecycle
from ..deadlines import Deadline, check_timeout
from ..errors import (BlockCountMismatchError, DuplicateBlockIdError, InvalidArgumentError, SpecError,
                      StoreCorruptError, StoreError, StoreFullError, StoreMissError, UnsupportedError)
from ..geometry._spec import KVCacheSpec
from ..memory import MemoryKind, Op
from ..pairing._templates import Pairing, pair
from ..planner import TransferPlan, as_block_ids, plan
from ..transfer import Transfer, TransferStats, _Post
from . import journal
from .bounce import Buffers
from .digest import bounces, local_row_digests, row_digests
from .fileio import ENGINE, MAX_CALL, Calls, Job, JobTransfer, build_calls, groups, run_calls
from .rungroups import _Damaged, run
from .index import Entry, Index, check_keys as _keys
from .migrate import migrate
from .dirs import StoreDir, run_all as _all
from .journal import encode_drops, encode_puts
from .paths import Files, Mover, posix_mover
from .stage import DeviceCopies, HostCopies, Stage
from .slab import HEADER, Slab, geometry, slab_spec

__all__ = ["Store"]


class Store:
    """KV rows beyond GPU memory: one slab file per layout fingerprint under ``path``.

    ``capacity``: bytes of row slots (rounded down to whole 4 KiB-aligned slots). ``layout``:
    the local cache's spec (or any spec that pairs with it); it fixes the slab's row.
    ``durable``: fdatasync the slab before publishing and the journal after (survives power
    loss); without it a process crash is still safe, and a power loss costs at most entries
    whose rows then fail their digest (a miss). ``threads``: worker threads for I/O.
    ``offload``/``restore`` take a :class:`KVCacheSpec` or an :class:`~kvxfer.Agent` (its
    registered spec and timeout); :meth:`kvxfer.Agent.offload`/``restore`` call them.
    """

    #: Journal bytes appended before a compaction is considered (see :meth:`_append`).
    COMPACT_BYTES = 4 << 20
    #: Test hook: host caches go through the staged path too (how the CPU suite covers it).
    _stage_host = False

    def __init__(self, path: str | os.PathLike[str], *, capacity: int, layout: KVCacheSpec, model: str = "",
                 durable: bool = False, threads: int = 4, timeout: float = 30.0) -> None:
        self.geometry = g = geometry(layout, model)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise StoreError(f"capacity must be a positive number of bytes, got {capacity!r}")
        self.timeout = check_timeout(timeout, "Store timeout")
        slots = capacity // g.stride
        self.spec = slab_spec(g, max(slots, 1))  # validates the slot count against the spec bounds
        d = StoreDir(path)  # refuses a directory this uid does not own, or that others may write
        try:
            self._slab = Slab(d, g, slots)
        except BaseException:
            d.close()
            raise
        try:
            name, r = self._slab.index_name, journal.Reader(g.fingerprint, slots)
            self._index = Index(slots, () if self._slab.created else journal.records(d, name, r))
            if r.legacy:  # a version-2 journal: rows checked against their old digests, then re-digested
                kept, lost = migrate(self._index, self._slab.mapped)
                lifecycle.store_event("store_migrate", self.path, f"journal digests migrated: {kept} row(s) kept, "
                                      f"{len(lost)} failed their old digest and were dropped", kept=kept, dropped=len(lost))
            try:
                self._journal = journal.rewrite(d, name, g.fingerprint, slots, self._index.live(), durable)  # compact
            except StoreFullError:
                if self._slab.created or not r.headed or r.legacy:  # a migration must rewrite the journal
                    raise
                self._journal = journal.reopen(d, name, r.at, durable)  # no room to compact: cut the torn tail only
        except BaseException:
            self._slab.close(remove=self._slab.created)  # a store that did not come up leaves no file
            d.close()
            raise
        self.durable = durable
        self._jbytes = 0  # appended since the last compaction
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(threads)), thread_name_prefix="kvxfer-store")
        self._jobs = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvxfer-store-job")
        self._pairings: dict[int, Pairing] = {}
        self._files = Files(self._slab.fd, self._slab.size)  # the slab's registrations with file paths
        self._posix = posix_mover(self._slab.fd)
        self._bounce = Buffers(max(1, MAX_CALL // g.stride) * g.stride)  # an offload's groups, gathered
        self._stages: dict[tuple[MemoryKind, int, int], Stage] = {}
        self._closed = False
        lifecycle.store_event("store_open", self.path, f"{'created' if self._slab.created else 'opened'}, "
                              f"{len(self._index)} of {slots} rows of {g.row_len} bytes held",
                              created=self._slab.created, entries=len(self._index), slots=slots)
        #: Test hook: called with a stage name on the worker thread: "issue" right before and
        #: "call" right after each system call or post, "written" after an offload's writes
        #: (before publishing), "verified" after a restore's digest check (before copying).
        self._fault: Callable[[str], None] | None = None

    # -- facts ------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._slab.path

    @property
    def slots(self) -> int:
        return self._slab.slots

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __repr__(self) -> str:
        return f"<Store {self.path} {len(self)}/{self.slots} rows of {self.geometry.row_len} bytes>"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        """A bool per key: is it stored now (it may still be evicted before a restore)."""
        ks = _keys(keys)
        with self._lock:
            return np.array([e is not None for e in self._index.lookup(ks)], dtype=bool)

    def keys(self) -> list[bytes]:
        """Every stored key, least recently used first."""
        with self._lock:
            return list(self._index.entries)

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored: the prefix a restore can serve."""
        hit = self.lookup(keys)
        return int(hit.shape[0] if hit.all() else np.argmin(hit))

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drop entries (their slots are reused once no restore pins them); returns how many.
        Journaled first: a journal that cannot take the drops (a full disk) raises
        :class:`~kvxfer.errors.StoreFullError` and drops nothing."""
        ks = _keys(keys)
        with self._lock:
            gone = [k for k in dict.fromkeys(ks) if k in self._index.entries]
            self._append(encode_drops(gone))
            self._index.drop(gone)
            self._compact_if_due()
        return len(gone)

    # -- transfers --------------------------------------------------------------------------
    def offload(self, spec: Any, local_blocks: Any, keys: Sequence[bytes], *,
                timeout: float | None = None) -> Transfer:
        """Write ``spec``'s ``local_blocks[i]`` to the store under ``keys[i]``.

        The entries appear (:meth:`lookup`) only once the transfer is DONE; a failed,
        cancelled or interrupted one publishes nothing. A refused one (bad block ids, a cache
        that does not pair, a journal that cannot take the evictions) evicts nothing either.
        """
        t0, deadline, limit = self._begin(timeout if timeout is not None or isinstance(spec, KVCacheSpec)
                                          else getattr(spec, "timeout", None))
        ks = _keys(keys)
        if len(set(ks)) != len(ks):
            raise DuplicateBlockIdError("a key appears twice in one offload; each key names one row")
        spec, mover = self._check_local(spec)
        pairing = self._pairing(spec)  # everything the plan can refuse is refused before anything is evicted
        blocks = as_block_ids(local_blocks, spec.num_blocks, "local")
        if blocks.shape[0] != len(ks):
            raise BlockCountMismatchError(f"{blocks.shape[0]} local blocks for {len(ks)} keys; give one key per block")
        with self._lock:
            slots, evicted = self._index.reserve(len(ks))
            self._append(encode_drops(evicted))  # cannot: nothing evicted
            self._index.commit(slots, evicted)
            self._compact_if_due()
        if evicted:
            lifecycle.store_event("store_evict", self.path, f"evicted {len(evicted)} least recently used row(s)",
                                  evicted=len(evicted))
        try:
            p = plan(spec, self.spec, blocks, slots, Op.WRITE, coalesce=True, pairing=pairing)
            calls = self._calls(p, mover)
        except BaseException:
            with self._lock:
                self._index.unreserve(slots)
            raise

        local = (spec, blocks) if self._in_place(spec, mover) else None
        source = [(a.address, a.nbytes) for a in spec.allocations] if self._bounces(spec, mover) else None

        def body(job: Job) -> None:
            digests = self._run(job, calls, slots, None, mover, local, source)
            if self.durable:
                try:
                    os.fdatasync(self._slab.fd)
                except OSError as exc:
                    raise StoreError(f"cannot sync the slab {self.path}: {exc.strerror}; nothing was published") \
                        from None
            self._stage("written")
            with self._lock, job.lock:
                if job.cancelled:
                    return
                # Journal first: a full disk raises here and nothing is published (cleanup frees the slots).
                self._append(encode_puts(ks, self._index.generation + 1, slots, digests))
                self._index.put(ks, slots, digests)
                job.published = True  # type: ignore[attr-defined]
                self._compact_if_due()

        def cleanup(job: Job, err: BaseException | None) -> None:
            if not getattr(job, "published", False):
                with self._lock:
                    self._index.unreserve(slots)

        return self._transfer(p, calls, body, cleanup, Op.WRITE, t0, deadline, limit, mover, spec)

    def restore(self, keys: Sequence[bytes], spec: Any, local_blocks: Any, *,
                timeout: float | None = None, in_place: bool = False) -> Transfer:
        """Read the rows stored under ``keys[i]`` into ``spec``'s ``local_blocks[i]``.

        A key not stored raises :class:`~kvxfer.errors.StoreMissError` before any byte
        moves. Every row is checked against its digest right before it is copied (a group of
        rows of about 8 MiB at a time, while they are warm in the CPU caches); a row that fails
        fails the transfer with :class:`~kvxfer.errors.StoreCorruptError`, is not copied, and
        its entry is dropped (the next lookup is a miss). Rows of other groups may have been
        copied by then; they passed their check, and the failed transfer's blocks are the
        caller's to recompute. ``in_place`` (a one-region host cache): read each group into the
        cache and check it there instead (one pass over the page cache, not two); a group with
        a failed row, or whose read was cut short, is zeroed before the transfer ends.
        """
        t0, deadline, limit = self._begin(timeout if timeout is not None or isinstance(spec, KVCacheSpec)
                                          else getattr(spec, "timeout", None))
        ks = _keys(keys)
        spec, mover = self._check_local(spec)
        with self._lock:
            entries = self._index.lookup(ks, touch=True)
            missing = [k for k, e in zip(ks, entries) if e is None]
            if missing:
                raise StoreMissError(f"{len(missing)} of {len(ks)} keys are not in the store", missing)
            got: list[Entry] = entries  # type: ignore[assignment]
            self._index.pin(got)
        try:
            slots = np.fromiter((e.slot for e in got), dtype=np.int64, count=len(got))
            want = np.fromiter((e.digest for e in got), dtype=np.uint64, count=len(got))
            p = plan(spec, self.spec, local_blocks, slots, Op.READ, coalesce=True, pairing=self._pairing(spec))
            calls = self._calls(p, mover)
            local = (spec, as_block_ids(local_blocks, spec.num_blocks, "local")) \
                if in_place and self._in_place(spec, mover) else None
        except BaseException:
            with self._lock:
                self._index.unpin(got)
            raise

        def body(job: Job) -> None:
            try:
                self._run(job, calls, slots, want, mover, local)
            except _Damaged as exc:
                lost = [got[i].key for i in np.flatnonzero(np.isin(slots, exc.slots)).tolist()]
                with self._lock:
                    gone = self._index.drop(lost)  # dropped even when the journal cannot say so:
                    try:  # after a restart the same rows fail their digests again
                        self._append(encode_drops(gone))
                        self._compact_if_due()
                    except StoreError:
                        pass
                lifecycle.store_event("store_corrupt", self.path, f"{len(lost)} row(s) failed their digest and were "
                                      "dropped", dropped=len(lost))
                raise StoreCorruptError(f"{len(lost)} of {len(got)} stored rows failed their digest (a torn "
                                        "write or a damaged slab); they were not copied and were dropped: "
                                        "recompute those blocks", lost) from None

        def cleanup(job: Job, err: BaseException | None) -> None:
            with self._lock:
                self._index.unpin(got)

        return self._transfer(p, calls, body, cleanup, Op.READ, t0, deadline, limit, mover, spec)

    # -- internals --------------------------------------------------------------------------
    def _begin(self, timeout: float | None) -> tuple[float, float, float]:
        if self._closed:
            raise StoreError("the store is closed")
        limit = self.timeout if timeout is None else check_timeout(timeout)
        return time.perf_counter(), Deadline.within(limit), limit

    def _check_local(self, spec: Any) -> tuple[KVCacheSpec, Mover]:
        """The local spec (a :class:`KVCacheSpec`, or an agent's registered one) and the data
        path for it: the agent's backend's file path when it has one for the memory kind
        (:mod:`.paths`), else the store's own ``preadv``/``pwritev``."""
        fp = None
        if not isinstance(spec, KVCacheSpec):
            if not all(hasattr(spec, a) for a in ("_check_open", "spec", "backend")):  # an Agent (not imported: a cycle)
                raise InvalidArgumentError(f"the store moves a KVCacheSpec's or an Agent's cache, got {type(spec).__name__}")
            agent = spec
            agent._check_open()
            spec = agent.spec
            if spec is None:
                raise SpecError("register a KV cache before offloading or restoring")
            fp = agent.backend.file_path()
        kinds = {(a.kind, a.device if a.kind is MemoryKind.VRAM else 0) for a in spec.allocations}
        if len(kinds) != 1:
            raise UnsupportedError("the store moves a cache of one memory kind on one device at a time")
        ((kind, device),) = kinds
        with self._lock:
            mover = self._files.mover(fp, kind)
            if mover is None and (kind is MemoryKind.VRAM or self._stage_host):
                mover = self._staged(spec, kind, device)  # VRAM (no GDS): through the pinned host stage
            elif mover is not None and len(spec.regions) > 1:
                mover = self._staged(spec, kind, device, fp) or mover  # pages gathered: one I/O per row run
        return spec, mover or self._posix

    def _staged(self, spec: KVCacheSpec, kind: MemoryKind, device: int, fp: Any = None) -> Mover | None:
        """The staged path for ``kind`` (under the lock), into ``pwritev`` or the file path
        ``fp``: created once, freed at close; None when ``fp`` takes no stage memory."""
        key = (kind, device, id(fp))
        st = self._stages.get(key)
        if st is None:
            copies = DeviceCopies(device) if kind is MemoryKind.VRAM else HostCopies()
            stride = self.geometry.stride
            unit = max(1, MAX_CALL // stride) * stride
            if fp is None:
                fd = self._slab.fd
                st = Stage(copies, unit, HEADER, stride,
                           lambda w, c, cancelled, hook: run_calls(fd, w, c, cancelled, hook),
                           f"staged-{copies.name}")
            else:
                try:
                    st = Stage(copies, unit, HEADER, stride, self._files.io(fp, kind), f"{fp.name}+stage",
                               register=(fp.register, fp.deregister))
                except UnsupportedError:
                    return None
            self._stages[key] = st
        return st.mover(spec.allocations)

    def _pairing(self, spec: KVCacheSpec) -> Pairing:
        with self._lock:
            hit = self._pairings.get(id(spec))
        if hit is None or not hit.matches(spec, self.spec):
            hit = pair(spec, self.spec)  # refuses, typed, a cache that does not pair with the slab
            with self._lock:
                self._pairings = {k: v for k, v in self._pairings.items() if v._local() is not None}
                self._pairings[id(spec)] = hit
        return hit

    def _calls(self, p: TransferPlan, mover: Mover) -> Calls:
        loc, rem = [], []
        for leg in p.legs:
            la, ra = p.explicit(leg)
            loc.append(la.array)
            rem.append(ra.array)
        la, ra = np.concatenate(loc), np.concatenate(rem)
        off = ra[:, 0].astype(np.int64)
        if off.size and (int(off.min()) < HEADER or int((off + ra[:, 1].astype(np.int64)).max()) > self._slab.size):
            raise StoreError("a planned descriptor leaves the slab")  # the planner's bounds make this unreachable
        g = self.geometry
        # Bridging the padding after a row needs a scratch iovec: only the store's own path can.
        return build_calls(la[:, 0], off, la[:, 1], base=HEADER, stride=g.stride,
                           row_len=g.row_len if mover.bridges else g.stride)

    def _in_place(self, spec: KVCacheSpec, mover: Mover) -> bool:
        """Rows are hashed where a host cache holds them, not in the slab's map, when the cache
        is one region (a row is one run: one hash call); a per-layer cache would stream 160
        cells a row in Python, and staged rows are checked in the slab before they are copied."""
        return MemoryKind.VRAM not in spec.kinds and not mover.staged and len(spec.regions) == 1

    def _bounces(self, spec: KVCacheSpec, mover: Mover) -> bool:
        """An offload of a per-layer host cache on the store's own path goes through bounce
        buffers (:mod:`.bounce`). A one-region cache's rows are already runs: the kernel copies
        them as fast from the cache, and a gather would be one more copy on a 2-core budget."""
        return (mover.bridges and len(spec.regions) > 1 and MemoryKind.VRAM not in spec.kinds
                and bounces(self._slab.mapped))

    def _run(self, job: Job, calls: Calls, slots: np.ndarray, want: np.ndarray | None, mover: Mover,
             local: tuple[KVCacheSpec, np.ndarray] | None = None,
             source: list[tuple[int, int]] | None = None) -> np.ndarray:
        """Move the calls group by group on the worker threads and digest or check the rows
        (:func:`.rungroups.run`); returns the digests (raises ``_Damaged`` for rows that failed)."""
        return run(self, job, calls, slots, want, mover, local, source)

    def _groups(self, calls: Calls, mover: Mover) -> list[tuple[int, int, int, int]]:
        """Groups of whole rows, one task each: runs of calls for the store's own path, cells of
        about :data:`~.fileio.MAX_CALL` bytes for a file path (one post each, gaps and all)."""
        stride = self.geometry.stride
        return groups(calls, HEADER, stride, None if mover.bridges else max(1, MAX_CALL // stride) * stride)

    def _digest_local(self, spec: KVCacheSpec, blocks: np.ndarray) -> np.ndarray:
        """Digests of a host cache's blocks (:mod:`.digest`: the same definition)."""
        return local_row_digests(spec, blocks)

    def _digest_slots(self, sorted_slots: np.ndarray) -> np.ndarray:
        """Digests of these rows as the slab holds them (:mod:`.digest`: kvxfer.integrity's row digest)."""
        return row_digests(self._slab.mapped, sorted_slots)

    def _append(self, records: bytes) -> None:
        """Journal records (under the lock, before the index changes): all of them, or none
        and a typed error (:class:`~kvxfer.errors.StoreFullError` on a full disk)."""
        self._journal.append(records)
        self._jbytes += len(records)

    def _compact_if_due(self) -> None:
        """Compact once the journal is mostly dead records, so a long-running store's index
        file stays proportional to its live entries (under the lock, after the index changed).
        Best effort: on a full disk the journal as appended is complete; tried again later."""
        if self._jbytes > max(self.COMPACT_BYTES, 8 * 64 * len(self._index)):
            self._jbytes = 0
            self._compact()

    def _compact(self) -> bool:
        try:
            fresh = journal.rewrite(self._slab.dir, self._slab.index_name, self.geometry.fingerprint, self.slots,
                                    self._index.live(), self.durable)
        except StoreError as exc:
            lifecycle.store_event("store_compact_failed", self.path, f"journal not compacted: {exc}")
            return False
        self._journal.close()
        self._journal = fresh
        return True

    def _stage(self, name: str) -> None:
        if self._fault is not None:
            self._fault(name)

    def _transfer(self, p: TransferPlan, calls: Calls, body: Callable[[Job], None],
                  cleanup: Callable[[Job, BaseException | None], None], op: Op, t0: float, deadline: float,
                  limit: float, mover: Mover, spec: KVCacheSpec) -> Transfer:
        path = mover.label(op is Op.WRITE)
        posts = len(calls) if mover.bridges else len(self._groups(calls, mover))
        descs = calls.descriptors if mover.bridges else int(calls.iov.shape[0])
        ios = len(calls) if mover.per_run else descs  # NIXL POSIX: one I/O per descriptor
        stats = TransferStats(descs, p.nbytes, posts, time.perf_counter() - t0, path=path, telemetry=[{"ios": ios}],
                              backend="store", op=op.value, peer=self.geometry.fingerprint, mode=p.mode)
        started = time.perf_counter()
        job = Job(self._jobs, body, cleanup, path, keep=spec)  # the spec keeps the local memory alive
        return JobTransfer(ENGINE, [_Post(job)], stats, default_timeout=limit, deadline=deadline, started=started)  # type: ignore[arg-type]

    def close(self) -> None:
        """Wait for jobs in flight, compact the journal and release the slab's lock. The lock
        and every file are released on every path; a compaction a full disk refuses is
        skipped (the journal as appended is complete)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._jobs.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            with self._lock:
                self._compact()
        finally:
            with self._lock:
                _all(self._journal.close, self._files.close, *(st.close for st in self._stages.values()),
                     self._slab.close, self._slab.dir.close)
        lifecycle.store_event("store_close", self.path, f"closed with {len(self._index)} row(s)",
                              entries=len(self._index))

