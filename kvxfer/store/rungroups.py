"""How a store request moves its groups of rows and digests or checks them (:meth:`kvxfer.Store._run`).

Split from :mod:`.store` to keep each file to one concern: the store decides *what* moves
(plans, reservations, publishing); this decides *when* a row is hashed or checked relative to
its I/O, which is where a corrupted row is stopped (docs/storage.md, "Digests").
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import StoreCorruptError
from ..geometry._spec import KVCacheSpec
from .bounce import offload
from .fileio import Calls, Job, wipe
from .paths import Hook, Mover

__all__ = ["run"]


class _Damaged(Exception):
    """Rows that failed their digest during a restore (internal: becomes StoreCorruptError)."""

    def __init__(self, slots: np.ndarray) -> None:
        super().__init__(f"{slots.shape[0]} damaged rows")
        self.slots = slots


def run(st: Any, job: Job, calls: Calls, slots: np.ndarray, want: np.ndarray | None, mover: Mover,
        local: tuple[KVCacheSpec, np.ndarray] | None = None,
        source: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
    """Move the calls group by group on the worker threads (:func:`~.fileio.groups`); returns
    the digests. ``local`` (a host cache and its blocks): an offload digests a group's rows
    in the cache while writing them (BENCHMARKS.md, "Issue 37: the digest beside its write";
    a row changed meanwhile fails its digest at restore, a miss); a restore
    reads a group into the cache, then
    checks its rows there while warm, and zeroes the group's memory if any row fails or
    the read is cut short, inside the fence (no unchecked byte stays, none lands after).
    Otherwise a restore (``want``: the digests on record) checks a group's rows in the slab
    right before copying them, an offload digests them in the slab right after writing.

    ``source`` (a per-layer host cache's ``(address, nbytes)`` ranges, on the store's own
    path): an offload of more than one group goes through bounce buffers (:mod:`.bounce`)."""
    if not st._slab.intact():
        raise StoreCorruptError("the slab file was truncated while open; its rows cannot be trusted")
    write = want is None
    uniq, first, inverse = np.unique(slots, return_index=True, return_inverse=True)
    dig = np.zeros(uniq.shape[0], dtype=np.uint64) if write else want[first]  # type: ignore[index]
    order = np.argsort(slots, kind="stable")
    by_slot, out = slots[order], np.zeros(slots.shape[0], dtype=np.uint64)
    bad: list[np.ndarray] = []
    cancelled = lambda: job.cancelled or bool(bad)  # noqa: E731
    hook = st._stage if st._fault is not None else None

    def one(a: int, b: int, lo: int, hi: int) -> None:
        i, j = np.searchsorted(uniq, [lo, hi + 1]).tolist()
        part = Calls(calls.iov, calls.first[a:b], calls.count[a:b], calls.offset[a:b], calls.nbytes[a:b], 0)
        if local is not None:
            k, m = np.searchsorted(by_slot, [lo, hi + 1]).tolist()
            ix = order[k:m]
            if write:  # hashed right after the kernel read the rows, while they are in the CPU caches
                with job.io():
                    mover(True, part, cancelled, hook)
                out[ix] = st._digest_local(local[0], local[1][ix])
                return
            st._stage("reading")
            with job.io():
                try:
                    mover(False, part, cancelled, hook)
                    wrong = st._digest_local(local[0], local[1][ix]) != want[ix]  # type: ignore[index]
                except BaseException:
                    wipe(part)
                    raise
                if wrong.any():
                    bad.append(np.unique(by_slot[k:m][wrong]))
                    wipe(part)
                    return
            st._stage("verified")
            return
        if not write:
            wrong = uniq[i:j][st._digest_slots(uniq[i:j]) != dig[i:j]]
            if wrong.size:
                bad.append(wrong)
                return
            st._stage("verified")
        with job.io():  # the fence: a cancel returns only once this call has ended
            mover(write, part, cancelled, hook)
        if write:
            dig[i:j] = st._digest_slots(uniq[i:j])

    def digest(lo: int, hi: int) -> None:
        """Digest a written group's rows, in the cache (``local``) or in the slab's map."""
        if local is not None:
            k, m = np.searchsorted(by_slot, [lo, hi + 1]).tolist()
            ix = order[k:m]
            out[ix] = st._digest_local(local[0], local[1][ix])
        else:
            i, j = np.searchsorted(uniq, [lo, hi + 1]).tolist()
            dig[i:j] = st._digest_slots(uniq[i:j])

    todo = st._groups(calls, mover)
    if write and mover.bridges and source is not None and len(todo) > 1:
        offload(st, job, calls, todo, mover, cancelled, hook, source, uniq, dig)
        return dig[inverse]
    if write and mover.bridges and len(todo) > 1:
        _pipeline(st, job, calls, todo, mover, cancelled, hook, digest, beside=local is not None)
    else:
        futs = [st._pool.submit(one, *g) for g in todo]
        for f in futs:  # wait for all (no call may outlive the job), then raise the first error
            f.exception()
        if bad:  # the other groups stopped early because of it: report the damage
            raise _Damaged(np.concatenate(bad))
        for f in futs:
            f.result()
    if bad:
        raise _Damaged(np.concatenate(bad))
    return out if local is not None else dig[inverse]


def _pipeline(st: Any, job: Job, calls: Calls, todo: list[tuple[int, int, int, int]], mover: Mover,
              cancelled: Callable[[], bool], hook: Hook, digest: Callable[[int, int], None],
              beside: bool) -> None:
    """An offload on the store's own path: one writer (this thread) writes the groups in file
    order while the pool digests each group. ``beside`` (rows hashed in the cache): a group's
    digest task is handed over right before its write, so the hash and the kernel's copy read
    the same rows at the same time (one fetch from memory serves both) and no digest is left
    to wait for after the last write (BENCHMARKS.md, "Issue 37: the digest beside its write").
    Otherwise (rows hashed in the slab's map) a group is digested once it is written.

    Buffered writes to one file serialise on its inode lock in the kernel: several writer
    threads only spin there, taking the core the digests need (BENCHMARKS.md, "Issue 37:
    store offload"), and one thread already writes at the file's speed. The writer hands a
    group over without waiting, so writes never wait for a hand-off. Every digest task is
    waited for before this returns or raises (a failed or cancelled write publishes nothing),
    and runs inside the job's fence: once a cancel returned, no task reads the cache."""
    hashes: list[Future[None]] = []

    def fenced(lo: int, hi: int) -> None:
        with job.io():  # a cancel returns only once no digest reads the cache (refused after it)
            digest(lo, hi)

    try:
        for a, b, lo, hi in todo:
            part = Calls(calls.iov, calls.first[a:b], calls.count[a:b], calls.offset[a:b], calls.nbytes[a:b], 0)
            if beside:
                hashes.append(st._pool.submit(fenced, lo, hi))
            with job.io():  # the fence, as for any call (refused once cancelled)
                mover(True, part, cancelled, hook)
            if not beside:
                hashes.append(st._pool.submit(fenced, lo, hi))
    finally:
        wait(hashes)
    for f in hashes:
        f.result()
