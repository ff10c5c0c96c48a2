"""A verified READ checked while it moves, instead of read back from memory after DONE.

Checked after DONE on the caller's thread, the hash's whole time adds to the transfer's (issue
37: +36 to +53 % for verified DRAM READs). Two ways to hide it:

* :class:`Folded`: where the backend copies host bytes itself (loopback), it reports each copy
  (:mod:`kvxfer.plugin.copies`) and the row just copied is hashed while it is in the cache;
  rows no copy covered whole are hashed after DONE as before. On by default.
* :class:`Overlapped`: a large verified READ is posted in parts of :data:`PART_BYTES`
  (:func:`kvxfer._posting.post_parts`); as each part's posts complete, one worker thread hashes
  its blocks while later parts still move. Off by default (``PART_BYTES = 0``): on the 2-core
  machine of BENCHMARKS.md the worker's hash slowed the copy beside it more than it hid.

What does not change: DONE is reported only after every row was checked and matched; a
mismatch is the same typed :class:`~kvxfer.errors.IntegrityError`, raised by the transfer's
``done()`` / ``wait()``; a transfer that ends early (cancelled, failed, timed out) waits for a
hash still reading its destination before it returns, so no worker reads memory the caller
may free next.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..errors import IntegrityError, KvxferError
from .digests import Digests, compare, hash_rows
from .mm8 import _xxh3

__all__ = ["PART_BYTES", "MAX_PARTS", "Folded", "Overlapped", "part_bounds"]

#: Bytes per part, 0 for none: large enough that a part's planning and post (~0.1 ms) stay
#: small beside its copy, small enough that the last part's hash (not overlapped) is short.
#: 16 << 20 turns parts on (``bench_integrity.py --parts``).
PART_BYTES = 0
#: At most this many parts per request (each costs a plan and a post).
MAX_PARTS = 16

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _worker() -> ThreadPoolExecutor:
    """One hashing thread for every agent of the process: the caller's thread moves, it checks."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(1, thread_name_prefix="kvxfer-verify")
    return _pool


def part_bounds(blocks: int, nbytes: int) -> list[tuple[int, int]]:
    """Positions ``[a, b)`` of each part of a request of ``blocks`` blocks and ``nbytes`` bytes;
    one part (nothing to overlap) when it is smaller than two parts."""
    k = min(MAX_PARTS, blocks, nbytes // PART_BYTES) if PART_BYTES > 0 else 1
    if k < 2:
        return [(0, blocks)]
    edges = [blocks * i // k for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


class Overlapped:
    """The check of one transfer in parts. ``landed(j)`` is called once per completed post of
    part ``j``; when all its posts are in, its check goes to the worker. Calling the object
    (after DONE) waits for every part and raises the first part's error, in part order."""

    def __init__(self, checks: list[Callable[[], None]]) -> None:
        self._checks = checks
        self._left = [0] * len(checks)  # posts of each part not yet landed
        self._futures: list[Future[None] | None] = [None] * len(checks)

    def expect(self, part: int) -> None:
        """One more post carries part ``part`` (called while posting)."""
        self._left[part] += 1

    def landed(self, part: int) -> None:
        self._left[part] -= 1
        if self._left[part] == 0 and self._futures[part] is None:
            self._futures[part] = _worker().submit(self._checks[part])

    def __call__(self) -> None:
        """Every part checked (one a worker never got, here), else the first error."""
        first: BaseException | None = None
        for j, f in enumerate(self._futures):
            try:
                if f is None:
                    self._checks[j]()
                else:
                    f.result()
            except KvxferError as exc:
                first = first or exc
            except Exception as exc:  # a check that broke is no proof: the transfer fails, typed
                err = IntegrityError(f"the digest check of part {j} failed: {exc!r}")
                err.__cause__ = exc
                first = first or err
        if first is not None:
            raise first

    def settle(self) -> None:
        """The transfer ended early: drop checks not started, wait for one still reading."""
        running = [f for f in self._futures if f is not None and not f.cancel()]  # all dropped first
        for f in running:
            try:
                f.result()
            except BaseException:
                pass


class Folded:
    """Row digests taken as the backend copies (:mod:`kvxfer.plugin.copies`): a copy that
    starts at one of our rows and covers it whole has that row hashed at once, in the cache.
    Calling the object (after DONE) hashes the rows no copy covered and compares them all.

    ``view``: the destination allocation's bytes; ``offs``: each row's offset in it (request
    order); ``n``: a row's bytes; ``base``: the allocation's address; ``check``: the plain
    check (:class:`kvxfer.integrity.verified.PairingCheck`), whose spans and blocks these are.
    """

    __slots__ = ("expect", "spans", "lb", "view", "n", "at", "got", "seen", "_h")

    def __init__(self, expect: Digests, spans: object, lb: np.ndarray, view: memoryview, offs: list[int], n: int,
                 base: int) -> None:
        self.expect, self.spans, self.lb, self.view, self.n = expect, spans, lb, view, n
        self.at = {base + o: (i, o) for i, o in enumerate(offs)}  # a row's address -> (position, offset)
        self.got = np.zeros(len(offs), dtype=np.uint64)
        self.seen = np.zeros(len(offs), dtype=bool)
        self._h = _xxh3()

    def copied(self, addr: int, nbytes: int) -> None:
        """``nbytes`` landed at ``addr``: hash each of our rows the copy covers whole."""
        n, end = self.n, addr + nbytes
        while addr + n <= end:
            hit = self.at.get(addr)
            if hit is None:  # not where a row starts (a piece of a row): hashed after DONE
                return
            i, o = hit
            self.got[i] = self._h(self.view[o:o + n])
            self.seen[i] = True
            addr += n

    def __call__(self) -> None:
        import dataclasses

        left = np.flatnonzero(~self.seen)
        if left.size:
            sp = self.spans
            self.got[left] = hash_rows(dataclasses.replace(sp, block=sp.block[left], sub=sp.sub[left]))  # type: ignore[type-var]
        compare(self.expect, self.got[:, None], self.lb)
