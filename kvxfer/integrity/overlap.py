"""A verified READ checked while it moves: each part's digests on a worker once its posts landed.

Checked after DONE on the caller's thread, the hash's whole time adds to the transfer's (issue
37: +36 to +53 % for verified DRAM READs). A large verified READ of one geometry is therefore
posted in parts of about :data:`PART_BYTES` (:func:`kvxfer._posting.post_parts`); as each
part's posts complete, one worker thread hashes that part's blocks while later parts still
move (xxhash releases the GIL for large buffers), so only the last part's hash is left once
the data is in. What does not change: DONE is reported only after every part was checked and
matched; a mismatch is the same typed :class:`~kvxfer.errors.IntegrityError`, raised by the
transfer's ``done()`` / ``wait()``; a transfer that ends early (cancelled, failed, timed out)
waits for a hash still reading its destination before it returns, so no worker reads memory
the caller may free next.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from ..errors import IntegrityError, KvxferError

__all__ = ["PART_BYTES", "MAX_PARTS", "Overlapped", "part_bounds"]

#: Bytes per part: large enough that a part's planning and post (~0.1 ms) stay small beside
#: its copy, small enough that the last part's hash (the part not overlapped) is short.
PART_BYTES = 16 << 20
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
    k = min(MAX_PARTS, blocks, nbytes // PART_BYTES)
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
        for f in self._futures:
            if f is not None and not f.cancel():
                try:
                    f.result()
                except BaseException:
                    pass
