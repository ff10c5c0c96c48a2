"""Posting one plan: prepare its lists, post each chunk, and hand back the transfer.

Kept out of :mod:`kvxfer.agent` (the agent decides *what* to post; this is *how*): the lists a
plan needs come from the caches (:mod:`kvxfer._posts`), every post is undone if a later one
fails or the deadline passes meanwhile, and a notification goes out once all the data is in.
A request the hot path can repeat is remembered here (:func:`kvxfer._hot.learn`).
"""

from __future__ import annotations

import time
from typing import Any

from . import _hot
from .errors import TransferTimeoutError
from .integrity.fused import Expected
from .integrity.overlap import Overlapped, part_bounds
from .memory import MemoryKind, Op
from .planner import TransferPlan
from .plugin import copies
from ._legs import SpecLeg
from ._posts import Chunk, Preparer, plan_chunks
from .transfer import Transfer, TransferStats, _Post

#: The agent and its peer record, as this module sees them (kvxfer.agent imports this module).
Agent = Peer = Any

__all__ = ["post", "post_parts"]


def post(agent: Agent, op: Op, peer: Peer, p: TransferPlan, notify: bytes | None, t0: float,
         deadline: float, planned: float = 0.0, verify: Any = None, learn: bool = False) -> Transfer:
    """Prepare and post one plan; ``plan_seconds`` is ``planned`` plus the time since ``t0``.
    ``learn``: a request the hot path may repeat (:func:`kvxfer._hot.learn` decides)."""
    fused = Expected.of(verify) if verify is not None and op is Op.READ else None
    if fused is not None:  # VRAM mm8 cells: the device path copies and checks them in one pass
        return _post(agent, op, peer, p, notify, t0, deadline, planned, verify, learn, fused)
    if verify is not None and hasattr(verify, "part") and op is Op.READ and not copies.reports(agent.backend) \
            and not _on_device(verify):
        bounds = part_bounds(int(verify.lb.shape[0]), p.nbytes)
        if len(bounds) > 1:
            return post_parts(agent, op, peer, p, notify, t0, deadline, planned, verify, bounds)
    fold = verify.folder() if verify is not None and hasattr(verify, "folder") and op is Op.READ else None
    if fold is not None:  # the backend may hash rows as it copies them (kvxfer.plugin.copies)
        verify = fold
        with copies.watching(agent.backend, fold.copied):
            return _post(agent, op, peer, p, notify, t0, deadline, planned, verify, learn)
    return _post(agent, op, peer, p, notify, t0, deadline, planned, verify, learn)


def _on_device(check: Any) -> bool:
    """Whether the check's cells lie in VRAM: there one kernel hashes the whole request after DONE
    (~0.7 ms for 537 MB on an H100), and parts only add a post, a wait and a launch each (a
    verified VRAM READ of rows took 7-9 ms in 16 parts, BENCHMARKS.md, "The gate's watcher")."""
    spans = getattr(check, "spans", None)
    return spans is not None and MemoryKind.VRAM in spans.kinds()


def _post(agent: Agent, op: Op, peer: Peer, p: TransferPlan, notify: bytes | None, t0: float,
          deadline: float, planned: float, verify: Any, learn: bool, fused: Expected | None = None) -> Transfer:
    chunks: list[Chunk] = []
    posts: list[_Post] = []
    try:
        plan_chunks(agent._route, p, peer.name, agent._local_prepared, peer.prepared, chunks)
        stats = TransferStats(p.descriptors, p.nbytes, len(chunks), planned + time.perf_counter() - t0,
                              backend=agent.backend_name, op=op.value, peer=peer.name, mode=p.mode)
        single = len(chunks) == 1
        started = time.perf_counter()
        _check_deadline(agent, deadline, p, "planning")
        for lp, li, rp, ri, cleanup in chunks:
            note = bytes(notify) if (notify is not None and single) else None
            handle = (agent._route.post(op, lp, li, rp, ri, note) if fused is None
                      else agent._route.post(op, lp, li, rp, ri, note, expect=fused))
            posts.append(_Post(handle, cleanup=cleanup))
            _check_deadline(agent, deadline, p, "posting")
    except BaseException:
        for post in posts:
            agent._route.release(post.handle)
        for _, _, _, _, cleanup in chunks:
            for fn in cleanup:
                fn()
        raise
    if fused is not None and fused.complete():  # every cell is compared as its post completes
        verify = None
    if learn and (peer.name, op) not in agent._hot:
        _hot.learn(agent, peer, op, p, chunks)
    stats.post_seconds = time.perf_counter() - started
    if posts:
        stats.path = agent._route.data_path(posts[0].handle)
    if not chunks and notify is not None:
        single = False
    on_done = None
    if notify is not None and not single:
        # Several posts may complete in any order: notify only once all data is visible.
        msg, key = bytes(notify), peer.name
        on_done = lambda: agent._route.notify(key, msg)  # noqa: E731
    t = Transfer(agent._route, posts, stats, default_timeout=agent.timeout, deadline=deadline, on_done=on_done,
                 started=started, on_finish=agent._finished, plan=p, verify=verify)
    agent._inflight.add(t)
    return t


def post_parts(agent: Agent, op: Op, peer: Peer, p: TransferPlan, notify: bytes | None, t0: float,
               deadline: float, planned: float, check: Any, bounds: list[tuple[int, int]]) -> Transfer:
    """A verified READ in parts posted one after another, each checked on a worker once it
    landed while the next one moves (:mod:`kvxfer.integrity.overlap`). ``p`` (the whole
    request, planned and validated before anything moved) stays the transfer's plan; each part's
    posts are cut from it when its turn comes (:func:`_slicer`), or, where they cannot be, the
    part is planned again for its own blocks. The transfer polls ``posts``, the
    list each part's posts join (part ``j + 1`` is posted from the poll that saw ``j`` land)."""
    lb, rb = check.lb, check.expect.blocks
    route, backend = agent._route, agent.backend
    fold = check.folder()  # rows hashed in the backend's own copy where it makes one (loopback)
    posts: list[_Post] = []
    stats = TransferStats(p.descriptors, p.nbytes, 0, 0.0, backend=agent.backend_name, op=op.value, peer=peer.name,
                          mode=p.mode)

    sliced = _slicer(agent, peer, p, int(lb.shape[0]))

    def post_part(j: int, a: int, b: int) -> int:
        mine: list[Chunk] = []
        left, n = 0, 0
        try:
            if sliced is not None:
                sliced(a, b, mine)
            else:
                q = agent._plan(peer, lb[a:b], rb[a:b], op)
                plan_chunks(route, q, peer.name, agent._local_prepared, peer.prepared, mine)
            watch = fold is not None and (j == 0 or fold.hits > 0)  # a backend that folded none of part 0 never will
            for lp, li, rp, ri, cleanup in mine:
                if watch:
                    with copies.watching(backend, fold.copied):
                        handle = route.post(op, lp, li, rp, ri, None)
                else:
                    handle = route.post(op, lp, li, rp, ri, None)
                post = _Post(handle, False, cleanup, j)
                posts.append(post)  # the transfer releases it (and its lists) from here on
                n += 1
                stats.posts += 1
                if route.poll(handle):  # done inside post (a copy kvxfer ran, or UCX's cma)
                    post.done = True
                else:
                    left += 1
        except BaseException:
            # Lists of chunks not posted go with the last posted one (released after its
            # handle), or now when none of this part was posted.
            rest = [fn for _, _, _, _, cleanup in mine[n:] for fn in cleanup]
            if n:
                posts[-1].cleanup.extend(rest)
            else:
                for fn in rest:
                    fn()
            raise
        return left

    parts = Overlapped(bounds, fold.part if fold is not None else check.part, post_part, final=fold,
                       folded=(lambda a, b: bool(fold.seen[a:b].all())) if fold is not None else None)
    started = time.perf_counter()
    stats.plan_seconds = planned + started - t0
    try:
        _check_deadline(agent, deadline, p, "planning")
        parts.start()
    except BaseException:
        parts.settle()
        for post in posts:
            route.release(post.handle)
            for fn in post.cleanup:
                fn()
        raise
    stats.post_seconds = time.perf_counter() - started
    on_done = None
    if notify is not None:  # notify once all data is visible
        msg, key = bytes(notify), peer.name
        on_done = lambda: route.notify(key, msg)  # noqa: E731
    t = Transfer(route, posts, stats, default_timeout=agent.timeout, deadline=deadline, on_done=on_done,
                 started=started, on_finish=agent._finished, plan=p, verify=parts, parts=parts,
                 path_of=posts[0].handle if posts else None)
    agent._inflight.add(t)
    return t


def _slicer(agent: Agent, peer: Peer, p: TransferPlan, blocks: int) -> Any:
    """The posts of positions ``[a, b)`` cut from the whole request's plan ``p`` (planned and
    validated once), or None where a part must be planned on its own.

    Only legs of kept lists (:class:`~kvxfer._legs.SpecLeg` over the specs' cached prepared
    lists) are cut: their indices are in request order, block by block (``[blocks, pieces]``)
    or piece by piece (``[pieces, blocks]``, :func:`kvxfer.planner._legs`), so a part's rows
    of them are what planning the part alone gives. A list prepared for this transfer alone, a
    coalesced (explicit) leg or a leg of other blocks is planned per part as before."""
    route = agent._route
    legs = []
    for leg in p.legs:
        if type(leg) is not SpecLeg or leg.blocks != blocks:
            return None
        lists = Preparer(route, p, peer.name, agent._local_prepared, peer.prepared)
        try:
            lp, li, rp, ri = leg.prepare(lists)
        except BaseException:
            for fn in lists.cleanup:
                fn()
            raise
        k = int(leg.sizes.shape[0])
        if lists.cleanup or li is not leg.local_idx or ri is not leg.remote_idx or li.shape[0] != blocks * k:
            for fn in lists.cleanup:
                fn()
            return None
        shape = (k, blocks) if leg.member_major else (blocks, k)
        legs.append((lp, li.reshape(shape), rp, ri.reshape(shape), leg.member_major))
    limit = route.capabilities.max_descriptors

    def cut(a: int, b: int, out: list[Chunk]) -> None:
        for lp, li, rp, ri, member_major in legs:
            if member_major:
                lj, rj = li[:, a:b].reshape(-1), ri[:, a:b].reshape(-1)
            else:
                lj, rj = li[a:b].reshape(-1), ri[a:b].reshape(-1)
            n = lj.shape[0]
            if n == 0:
                continue
            step = limit if limit and n > limit else n
            for s in range(0, n, step):
                out.append(Chunk(lp, lj[s:s + step], rp, rj[s:s + step], []))
    return cut


def _check_deadline(agent: Agent, deadline: float, p: TransferPlan, what: str) -> None:
    late = time.monotonic() - deadline
    if late > 0:
        raise TransferTimeoutError(
            f"{what} {p.descriptors} descriptors ran {late:.3g} s past the {agent.timeout:g} s deadline; "
            "nothing was left in flight. Raise Agent(timeout=...) or move fewer blocks per request.")
