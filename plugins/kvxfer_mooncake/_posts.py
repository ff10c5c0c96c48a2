"""How a post runs: submitted at once and polled, or (with a notification) in chunks on a worker.

*Quick* (no notification, at most :data:`QUICK_SPANS` runs, a peer already connected): each
run is its own one-span batch (``batch_transfer_async``), submitted in the caller's thread,
and ``poll`` asks ``transfer_check_status`` of each in turn, which does not block, and copies
out the runs of the batches done so far while the others are on the wire. No thread
hand-off: a one-block READ costs the Mooncake round trip and a ``memmove`` out of the arena;
and no thread spins in Mooncake's synchronous wait (a busy loop) while the copy wants the
core. This binding's status call looks at a batch's first span only, hence one span per
batch; it frees a batch once it answers done or failed, so a batch is never asked again
after that (a second query of a freed batch crashes this release, RELIABILITY.md "Mooncake
backend").

*Chunked* (a notification, or very many runs): one worker runs the post as up to :data:`MAX_CHUNKS` synchronous
batch calls back to back (they release the GIL) and ``poll``, in the caller's thread, copies
each chunk out of the arena as soon as its call returned 0, while the next chunk is on the
wire: the fence's copy overlaps the transfer instead of following it. A notification rides
the last chunk, so it never arrives before the data. ``release`` stops the worker at the next
chunk boundary: chunks not started are never sent.

Either way a READ's bytes reach the destination only from a call or batch that finished with
0, before the end is reported (the fence, :mod:`._bounce`).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import numpy as np

from kvxfer import Op

from ._bounce import Arena

__all__ = ["MAX_CHUNKS", "MIN_CHUNK", "QUICK_SPANS", "Post", "Runs", "chunk_bounds", "run_chunks", "staged"]

#: A post of at most this many runs (and no notification) is submitted at once, one batch per run.
QUICK_SPANS = 1024
_FEW = 8
#: A chunked post is cut at span boundaries into at most this many chunks of at least this size.
MAX_CHUNKS = 8
MIN_CHUNK = 1 << 20
#: What ``batch_transfer_async`` returns when it could not submit (0, or -1 as an unsigned id).
_NOT_SUBMITTED = (0, (1 << 64) - 1)


class Post:
    """One post. ``future``/``bounds``/``results``: a chunked one; ``batches``: a quick one."""

    __slots__ = ("op", "session", "nbytes", "arena", "rows", "offsets", "future", "bounds", "spans", "results",
                 "copied", "out", "stop", "batches", "failed", "peer")

    def __init__(self, op: Op, session: str, nbytes: int, arena: Arena | None = None,
                 rows: np.ndarray | None = None, peer: Any = None) -> None:
        self.op, self.session, self.nbytes, self.arena, self.rows = op, session, nbytes, arena, rows
        self.offsets: list[int] = []  # each span's place in the arena
        self.future: cf.Future[None] | None = None
        self.bounds: list[int] = [0]  # chunk k is runs bounds[k]:bounds[k+1] ...
        self.spans: list[int] = [0]  # ... and spans (rows) spans[k]:spans[k+1]
        self.results: list[int] = []  # appended by the worker, one per finished chunk call
        self.copied = 0  # chunks (chunked) or batches (quick) settled so far
        self.out = 0  # batches (quick) whose runs were copied out of the arena
        self.stop = False
        self.batches: list[int] | None = None
        self.failed: int | None = None  # a quick post's first non-zero status
        self.peer = peer


class Runs:
    """A post's spans in the peer's address order, its contiguous runs merged: what Mooncake moves.

    A per-layer local cache against a packed peer posts one span per page, but the pages of a
    block lie back to back in the peer's row: sorted by remote address they merge into one
    span per row, the arena takes them in that order, and the copy-out scatters the pages to
    their layers (:func:`._bounce.scatter`, one vectorised pass). Mooncake then sees one
    descriptor per row instead of one per page; the local side is never merged (it is the
    arena). Spans already in order and disjoint cost one comparison pass.
    """

    __slots__ = ("local", "offsets", "starts", "remote", "lengths")

    def __init__(self, la: np.ndarray, ra: np.ndarray) -> None:
        if len(la) <= _FEW:  # a few spans: plain lists cost less than numpy's calls
            self._few(la, ra)
            return
        raddr = ra[:, 0].astype(np.int64)
        lens = la[:, 1].astype(np.int64)
        if len(raddr) > 1 and (np.diff(raddr) < 0).any():
            order = np.argsort(raddr, kind="stable")
            la, raddr, lens = la[order], raddr[order], lens[order]
        self.local = la  # rows in arena order
        offs = np.cumsum(lens) - lens
        self.offsets = offs.tolist()  # each span's place in the arena
        head = np.ones(len(raddr), bool)
        head[1:] = raddr[1:] != raddr[:-1] + lens[:-1]
        starts = np.flatnonzero(head)
        self.starts = starts.tolist() + [len(raddr)]  # run r is spans starts[r]:starts[r+1]
        self.remote = raddr[starts].tolist()
        self.lengths = np.add.reduceat(lens, starts).tolist() if len(starts) else []

    def _few(self, la: np.ndarray, ra: np.ndarray) -> None:
        raddr, lens = ra[:, 0].tolist(), la[:, 1].tolist()
        n = len(raddr)
        if any(raddr[i] > raddr[i + 1] for i in range(n - 1)):
            order = sorted(range(n), key=raddr.__getitem__)
            la, raddr, lens = la[order], [raddr[i] for i in order], [lens[i] for i in order]
        self.local = la
        self.offsets, self.starts, self.remote, self.lengths = [], [], [], []
        at = 0
        for i in range(n):
            self.offsets.append(at)
            at += lens[i]
            if i and raddr[i] == raddr[i - 1] + lens[i - 1]:
                self.lengths[-1] += lens[i]
            else:
                self.starts.append(i)
                self.remote.append(raddr[i])
                self.lengths.append(lens[i])
        self.starts.append(n)


def staged(arena: Arena, runs: Runs) -> list[int]:
    """Where each run lands in (or is sent from) the arena: packed in run order."""
    return [arena.base + runs.offsets[i] for i in runs.starts[:-1]]


def chunk_bounds(lengths: list[int]) -> list[int]:
    """Run indexes cutting a post into chunks of about equal bytes (at most ``MAX_CHUNKS``)."""
    n = len(lengths)
    ends = np.cumsum(np.asarray(lengths, np.int64))
    total = int(ends[-1]) if n else 0
    k = max(1, min(MAX_CHUNKS, total // MIN_CHUNK, n))
    if k == 1:
        return [0, n]
    cuts = np.searchsorted(ends, np.arange(1, k) * (total / k), side="left") + 1
    return sorted({0, n, *(int(c) for c in cuts if 0 < c < n)})


def run_chunks(engine: Any, post: Post, local: list[int], remote: list[int], lengths: list[int], code: Any,
               note: Any) -> None:
    """The worker's part: the chunks' calls back to back, stopping at the first failure or
    once ``release`` set ``stop``; each call's result is appended for ``poll``."""
    b = post.bounds
    last = len(b) - 2
    for k in range(last + 1):
        if post.stop:
            return
        lo, hi = b[k], b[k + 1]
        rc = engine.batch_transfer_sync(post.session, local[lo:hi], remote[lo:hi], lengths[lo:hi], code,
                                        note if k == last else None)
        post.results.append(rc)
        if rc != 0:
            return


def submit_quick(engine: Any, post: Post, local: list[int], remote: list[int], lengths: list[int], code: Any) -> None:
    """One one-span batch per span, submitted now; a refused submit fails the post at its poll."""
    post.batches = []
    for s, r, n in zip(local, remote, lengths):
        bid = engine.batch_transfer_async(post.session, [s], [r], [n], code)
        if bid in _NOT_SUBMITTED:
            post.failed = -1
            return
        post.batches.append(bid)


def poll_quick(engine: Any, post: Post) -> int | None:
    """0 once every batch is done, a negative status once one failed, None while pending.
    Each batch is asked until it answers done or failed, never after (it is freed then)."""
    batches = post.batches or []
    while post.failed is None and post.copied < len(batches):
        rc = engine.transfer_check_status(batches[post.copied])
        if rc == 0:
            return None
        if rc != 1:
            post.failed = rc
            break
        post.copied += 1
    return post.failed if post.failed is not None else 0
