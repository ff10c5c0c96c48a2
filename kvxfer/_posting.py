"""Posting one plan: prepare its lists, post each chunk, and hand back the transfer.

Kept out of :mod:`kvxfer.agent` (the agent decides *what* to post; this is *how*): the lists a
plan needs come from the caches (:mod:`kvxfer.posts`), every post is undone if a later one
fails or the deadline passes meanwhile, and a notification goes out once all the data is in.
A request the hot path can repeat is remembered here (:func:`kvxfer._hot.learn`).
"""

from __future__ import annotations

import time
from typing import Any

from . import _hot
from .errors import TransferTimeoutError
from .memory import Op
from .planner import TransferPlan
from .posts import Chunk, plan_chunks
from .transfer import Transfer, TransferStats, _Post

#: The agent and its peer record, as this module sees them (kvxfer.agent imports this module).
Agent = Peer = Any

__all__ = ["post"]


def post(agent: Agent, op: Op, peer: Peer, p: TransferPlan, notify: bytes | None, t0: float,
         deadline: float, planned: float = 0.0, verify: Any = None, learn: bool = False) -> Transfer:
    """Prepare and post one plan; ``plan_seconds`` is ``planned`` plus the time since ``t0``.
    ``learn``: a request the hot path may repeat (:func:`kvxfer._hot.learn` decides)."""
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
            handle = agent._route.post(op, lp, li, rp, ri, bytes(notify) if (notify is not None and single) else None)
            posts.append(_Post(handle, cleanup=cleanup))
            _check_deadline(agent, deadline, p, "posting")
    except BaseException:
        for post in posts:
            agent._route.release(post.handle)
        for _, _, _, _, cleanup in chunks:
            for fn in cleanup:
                fn()
        raise
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


def _check_deadline(agent: Agent, deadline: float, p: TransferPlan, what: str) -> None:
    late = time.monotonic() - deadline
    if late > 0:
        raise TransferTimeoutError(
            f"{what} {p.descriptors} descriptors ran {late:.3g} s past the {agent.timeout:g} s deadline; "
            "nothing was left in flight. Raise Agent(timeout=...) or move fewer blocks per request.")
