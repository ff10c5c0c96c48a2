"""A verified READ checked while it moves, instead of read back from memory after DONE.

Checked after DONE on the caller's thread, the hash's whole time adds to the transfer's (issue
37: +36 to +53 % for verified DRAM READs). Two ways to hide it, used together:

* :class:`Folded`: where the backend copies host bytes itself (loopback), it reports each copy
  (:mod:`kvxfer.plugin.copies`) and the row just copied is hashed while it is in the cache;
  rows no copy covered whole are hashed later.
* :class:`Overlapped`: a large verified READ is posted in parts of about :data:`PART_BYTES`,
  one after another: part ``j + 1`` is posted only once part ``j`` has landed and its check
  went to one worker thread (:data:`WINDOW` parts in flight), so the worker hashes part ``j``
  while the caller's thread posts the next. Over UCX's shared memory (``cma``) that post
  *is* the copy (a system call that releases the GIL), so the caller cannot hash while the
  next part moves: a second thread must (BENCHMARKS.md, issue 37 item 4 on NIXL). When the backend folded part 0's
  rows in its own copy, the rest goes out as one more part: nothing is left to hide.

What does not change: DONE is reported only after every row was checked and matched; a
mismatch is the same typed :class:`~kvxfer.errors.IntegrityError`, raised by the transfer's
``done()`` / ``wait()``; a transfer that ends early (cancelled, failed, timed out) posts no
further part and waits for a hash still reading its destination before it returns, so no
worker reads memory the caller may free next.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..errors import IntegrityError, KvxferError
from .digests import Digests, compare, hash_rows
from .mm8 import _xxh3

__all__ = ["PART_BYTES", "MAX_PARTS", "WINDOW", "Folded", "Overlapped", "Rows", "part_bounds"]

#: Bytes per part, 0 for none: large enough that a part's planning, post and hand-off to the
#: worker (~0.1 ms) stay small beside its copy, small enough that the last part's hash (the one
#: nothing hides) is short. BENCHMARKS.md (issue 37, verified DRAM over NIXL) has the choice.
PART_BYTES = 8 << 20
#: At most this many parts per request (each costs a plan, a post and a hand-off).
MAX_PARTS = 16
#: Parts in flight at once. Two would hide part ``j``'s completion latency (~65 us per part
#: in process) behind part ``j + 1``'s copy, but leave two parts' hashes after the last copy:
#: no better on NIXL here (BENCHMARKS.md, issue 37, verified DRAM over NIXL).
WINDOW = 1

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
    one part (nothing to overlap) when it is smaller than two parts. (Larger parts for rows
    hashed in place, and a last part cut in halves, measured no better: BENCHMARKS.md, issue 37,
    verified DRAM, the tail shared.)"""
    k = min(MAX_PARTS, blocks, nbytes // PART_BYTES) if PART_BYTES > 0 else 1
    if k < 2:
        return [(0, blocks)]
    edges = [blocks * i // k for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


#: Posts part ``j`` (positions ``[a, b)``) for the transfer and returns how many of its posts
#: have not landed yet (0: every one completed inside its post).
PostPart = Callable[[int, int, int], int]


class Overlapped:
    """The check of one transfer in parts, posted one after another, at most :data:`WINDOW`
    in flight.

    ``check_of(a, b)``: the check of positions ``[a, b)``; ``post``: see :data:`PostPart`;
    ``final``: run after every part matched (the folded rows' comparison), or None;
    ``folded(a, b)``: whether the backend already hashed those rows in its copy (then the
    parts left go out as one). :meth:`start` posts the first parts; ``landed(j)`` is called
    once per completed post of part ``j``; when all its posts are in, its check goes to the
    worker and the next part is posted. Calling the object (after DONE) waits for every part
    and raises the first part's error, in part order.
    """

    def __init__(self, bounds: list[tuple[int, int]], check_of: Callable[[int, int], Callable[[], None]],
                 post: PostPart, final: Callable[[], None] | None = None,
                 folded: Callable[[int, int], bool] | None = None) -> None:
        self._bounds = list(bounds)
        self._check_of, self._post, self._final, self._folded = check_of, post, final, folded
        self._left: list[int] = []  # per posted part: its posts not yet landed
        self._flying = 0  # parts posted and not yet landed
        self._checks: dict[int, Callable[[], None]] = {}
        self._futures: dict[int, Future[None]] = {}
        self._ended = False

    @property
    def parts(self) -> int:
        return len(self._bounds)

    def start(self) -> None:
        self._advance()

    def landed(self, part: int) -> None:
        self._left[part] -= 1
        if self._left[part] == 0:
            self._flying -= 1
            self._submit(part)
            self._advance()

    def _advance(self) -> None:
        """Post the next parts while fewer than :data:`WINDOW` are in flight."""
        while len(self._left) < len(self._bounds) and self._flying < WINDOW and not self._ended:
            j = len(self._left)
            a, b = self._bounds[j]
            self._left.append(0)
            self._left[j] = left = self._post(j, a, b)
            if j == 0 and len(self._bounds) > 2 and self._folded is not None and self._folded(a, b):
                self._bounds[1:] = [(b, self._bounds[-1][1])]  # the backend hashes as it copies
            if left:
                self._flying += 1
            else:
                self._submit(j)

    def _submit(self, j: int) -> None:
        check = self._check_of(*self._bounds[j])
        self._checks[j] = check
        self._futures[j] = _worker().submit(check)

    def __call__(self) -> None:
        """Every part checked, else the first error. A part the worker has not started yet is
        checked here (the caller would only wait); a ``shared`` check (:class:`Rows`) is
        joined at once, started or not, so the worker hashes beside the caller as soon as it
        wakes (cancelling it first left the whole last part to the caller whenever the
        worker's wake-up was slower than the caller: BENCHMARKS.md, "Issue 37: verified DRAM,
        the last part shared")."""
        if len(self._futures) != len(self._bounds):  # DONE over a part never posted: no proof of it
            raise IntegrityError(f"{len(self._bounds) - len(self._futures)} of {len(self._bounds)} parts of a "
                                 "verified read were never checked; refused")
        first: BaseException | None = None
        for j in range(len(self._bounds)):
            f = self._futures[j]
            try:
                check = self._checks[j]
                if getattr(check, "shared", False):  # take the rows the worker has not reached, then
                    check()  # its task, if it never started (a wake-up costs tens of us on a VM)
                    if not f.cancel():
                        f.result()
                elif f.cancel():
                    check()
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
        if self._final is not None:
            self._final()

    def settle(self) -> None:
        """The transfer ended early: post nothing more, drop checks not started, wait for one
        still reading."""
        self._ended = True
        running = [f for f in self._futures.values() if not f.cancel()]  # all dropped first
        for f in running:
            try:
                f.result()
            except BaseException:
                pass


class Folded:
    """Row digests taken as the backend copies (:mod:`kvxfer.plugin.copies`): a copy that
    starts at one of our rows and covers it whole has that row hashed at once, in the cache.
    :meth:`part` hashes (on the worker) the rows of a landed part no copy covered; calling the
    object (after DONE) hashes the rows still not hashed and compares them all.

    ``view``: the destination allocation's bytes; ``offs``: each row's offset in it (request
    order); ``n``: a row's bytes; ``base``: the allocation's address; ``check``: the plain
    check (:class:`kvxfer.integrity.verified.PairingCheck`), whose spans and blocks these are.
    """

    __slots__ = ("expect", "spans", "lb", "view", "n", "offs", "at", "got", "seen", "hits", "_h")

    def __init__(self, expect: Digests, spans: object, lb: np.ndarray, view: memoryview, offs: list[int], n: int,
                 base: int) -> None:
        self.expect, self.spans, self.lb, self.view, self.n, self.offs = expect, spans, lb, view, n, offs
        self.at = {base + o: (i, o) for i, o in enumerate(offs)}  # a row's address -> (position, offset)
        self.got = np.zeros(len(offs), dtype=np.uint64)
        self.seen = np.zeros(len(offs), dtype=bool)
        self.hits = 0  # copies that hashed a row
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
            self.hits += 1
            addr += n

    def part(self, a: int, b: int) -> "Rows":
        """The hash of positions ``[a, b)`` once they landed: the rows no copy hashed, one call
        per row (which releases the GIL). They are compared with the rest after DONE, all in one
        numpy comparison (:meth:`__call__`)."""
        if not self.hits:  # no copy hashed a row (NIXL, UCX): every row of the part is left
            return Rows(self, deque(range(a, b)))
        return Rows(self, deque((np.flatnonzero(~self.seen[a:b]) + a).tolist()))

    def __call__(self) -> None:
        import dataclasses

        left = np.flatnonzero(~self.seen)
        if left.size:
            sp = self.spans
            self.got[left] = hash_rows(dataclasses.replace(sp, block=sp.block[left], sub=sp.sub[left]))  # type: ignore[type-var]
        compare(self.expect, self.got[:, None], self.lb)


class Rows:
    """Rows of one landed part still to hash, each taken by whichever thread comes first: the
    worker, and the caller once it has nothing left but waiting (``shared``), so the last
    part's hash, which nothing hides, runs on both cores. Taking is ``deque.popleft``, atomic
    under the GIL: each row is hashed exactly once."""

    __slots__ = ("fold", "left")
    shared = True

    def __init__(self, fold: Folded, left: "deque[int]") -> None:
        self.fold, self.left = fold, left

    def __call__(self) -> None:
        f = self.fold
        h, view, n, offs, got, seen, take = f._h, f.view, f.n, f.offs, f.got, f.seen, self.left.popleft
        while True:
            try:
                i = take()
            except IndexError:
                return
            o = offs[i]
            got[i] = h(view[o:o + n])
            seen[i] = True
