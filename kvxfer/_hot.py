"""The hot path: a small READ or WRITE of a shape already posted once, in a few calls.

Layer-wise connectors post dozens of one-block transfers per request, so the fixed Python cost
between :meth:`kvxfer.Agent.read` and the transport's post is what they pay (issue 37: about
110 calls on ``main``). Once a request of a few whole-row blocks has gone the general way
(plan, legs, prepared lists), the agent remembers its shape here: per leg, the prepared lists
and the base of its indices. A later request to the same peer, over the same pairing, with at
most :data:`~kvxfer.planner.FEW_BLOCKS` ids given as lists of ints, is then checked (types,
bounds, duplicates: every call) and posted straight away; anything else, or anything the
checks refuse, returns None and takes the general path, whose typed errors stay the only ones.

What keeps it safe: an entry is only valid for the very spec, peer and pairing objects it was
built from (registering again, a peer's restart or removal replaces one of them); the remote
list is looked up in the peer's own cache on every call, so a list released with the peer is
never posted; the backend's ``post`` checks its lists as on every path. Where the agent's
router (:mod:`kvxfer._routed`) would pass a post on untouched, the transfer talks to the backend
itself; a list that is the device path's, checked on every call, still goes through the router.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import TransferTimeoutError
from .memory import Op
from .pairing import Pairing
from .planner import FEW_BLOCKS, TransferPlan, plan
from .plugin.backend import Backend
from ._routed import Listed, Routed
from ._stats import TransferStats
from .transfer import Transfer, _Post

if TYPE_CHECKING:
    from ._posts import Chunk

#: The agent and its peer record, as this module sees them (kvxfer.agent imports this module).
Agent = Peer = Any

__all__ = ["Shape", "learn"]

_NO_CLEANUP: Any = ()  # a hot post's cleanup: empty, and read only (Transfer._cleanup runs a non-empty one)


class Shape:
    """What a request of this shape posts: per leg ``(local list, key of the remote list in the
    peer's cache, local ids, remote ids, group)`` (ids: None for a leg of several pieces per
    block), and the counts its stats report per block."""

    __slots__ = ("spec", "peer", "pairing", "op", "legs", "local_n", "remote_n", "per_block", "bytes_per_block",
                 "mode", "limit", "notifies", "opname", "direct", "finished", "telemetry", "replan")

    def __init__(self, agent: Agent, peer: Peer, op: Op, p: TransferPlan, chunks: "list[Chunk]") -> None:
        pairing = peer.pairing
        assert isinstance(pairing, Pairing) and agent.spec is not None and peer.spec is not None
        self.spec, self.peer, self.pairing, self.op = agent.spec, peer, pairing, op
        self.local_n, self.remote_n = agent.spec.num_blocks, peer.spec.num_blocks
        n = p.legs[0].blocks
        self.per_block, self.bytes_per_block = p.descriptors // n, p.nbytes // n
        self.mode, self.opname = p.mode, op.value
        caps = agent.backend.capabilities
        self.limit, self.notifies = min(caps.max_descriptors or FEW_BLOCKS, FEW_BLOCKS), caps.notifications
        rkeys = {id(h): k for k, h in peer.prepared.items()}
        # Per leg of whole rows, every block's index into the two prepared lists, made once and
        # read-only: a one-block request takes a slice (a view), a few blocks index it. A leg of
        # several pieces per block (one per layer tensor) adds the block to the pieces' bases.
        self.legs = [(c.local, rkeys[id(c.remote)], _ids(g.lbase, self.local_n, g.dtype),
                      _ids(g.rbase, self.remote_n, g.dtype), g) for c, g in zip(chunks, pairing.groups)]
        # Where the agent's router would hand the post to the backend untouched (neither list is
        # the device path's, kvxfer._routed), the transfer talks to the backend itself: the
        # router's post, poll and release are three calls of every small READ. The remote list
        # is looked up per call, so post() checks it is still not the device path's.
        route = agent._route
        direct = type(route) is Routed and len(chunks) == 1 and chunks[0].local.__class__ is not Listed
        self.direct = route.inner if direct else None
        self.telemetry = type(agent.backend).telemetry is not Backend.telemetry
        self.finished, self.replan = agent._finished, self._replan  # bound once, not per transfer

    def post(self, agent: Agent, local: Any, remote: Any, notify: bytes | None, deadline: float | None) -> Any:
        """The transfer, or None when this request is not of this shape (the general path decides)."""
        t0 = time.perf_counter()
        peer = self.peer
        if agent.spec is not self.spec or agent._peers.get(peer.name) is not peer or peer.pairing is not self.pairing:
            return None  # registered again, or the peer restarted, was removed or re-paired
        if type(local) is not list or type(remote) is not list or (notify is not None and not self.notifies):
            return None
        n = len(local)
        if not 0 < n <= self.limit or len(remote) != n:
            return None
        # Types and bounds on every call: an id past either validated spec never reaches the backend.
        if n == 1:
            lv, rv = local[0], remote[0]
            if type(lv) is not int or type(rv) is not int or not (0 <= lv < self.local_n and 0 <= rv < self.remote_n):
                return None
        else:
            for v in local:
                if type(v) is not int:
                    return None
            for v in remote:
                if type(v) is not int:
                    return None
            if min(local) < 0 or max(local) >= self.local_n or min(remote) < 0 or max(remote) >= self.remote_n:
                return None
            if len(set(local if self.op is Op.READ else remote)) != n:
                return None
        prepared = peer.prepared
        if self.direct is not None:  # one leg over the backend's own lists: the common small READ
            lp, key, lids, rids, g = self.legs[0]
            rp = prepared.get(key)  # the peer's cache first: a list gone with the peer means the general path
            if rp is None:
                return None
            backend = self.direct if rp.__class__ is not Listed else agent._route
            if lids is not None:
                li, ri = (lids[lv:lv + 1], rids[rv:rv + 1]) if n == 1 else (lids[local], rids[remote])
            elif n == 1:
                li, ri = g.lbase + lv, g.rbase + rv
            else:
                li, ri = _pieces(g, local, remote)
            h = backend.post(self.op, lp, li, rp, ri, notify)
            end = time.perf_counter()
            if (end - t0 > agent.timeout) if deadline is None else time.monotonic() > deadline:
                backend.release(h)
                raise self._late(n, agent)
            posts = [_Post(h, False, _NO_CLEANUP)]  # nothing to clean up: no list made for it
        else:
            backend = agent._route
            posts, end = self._post_legs(backend, prepared, local, remote, n, lv if n == 1 else 0,
                                         rv if n == 1 else 0, notify)
            if posts is None:
                return None
            if (end - t0 > agent.timeout) if deadline is None else time.monotonic() > deadline:
                for post in posts:
                    backend.release(post.handle)
                raise self._late(n, agent)
        # Positional: a dataclass called with keywords costs three times as much. The data path
        # is asked of the backend only when someone reads the stats (Transfer.stats). Posting
        # starts at the call (t0): the hot path plans nothing.
        stats = TransferStats(n * self.per_block, n * self.bytes_per_block, len(posts), 0.0, None, None,
                              end - t0, agent.backend_name, self.opname, peer.name, self.mode)
        on_done = None
        if notify is not None and len(posts) > 1:  # several posts end in any order: notify once all are done
            msg, key, route = bytes(notify), peer.name, agent._route
            on_done = lambda: route.notify(key, msg)  # noqa: E731
        t = Transfer.posted(backend, posts, stats, agent.timeout, deadline, t0, self.finished, on_done,
                            (self.replan, local[:], remote[:]), self.telemetry)
        agent._inflight.add(t)
        return t

    def _post_legs(self, backend: Any, prepared: Any, local: list[int], remote: list[int], n: int, lv: int, rv: int,
                   notify: bytes | None) -> tuple[Any, float]:
        """Each leg's post through the agent's router (several legs, or the device path's lists);
        (None, 0.0) when a list is gone with the peer, before anything was posted."""
        rps = [prepared.get(leg[1]) for leg in self.legs]
        if None in rps:
            return None, 0.0
        posts: list[_Post] = []
        last = len(self.legs) - 1
        try:
            for (lp, _, lids, rids, g), rp in zip(self.legs, rps):
                if lids is not None:
                    li, ri = (lids[lv:lv + 1], rids[rv:rv + 1]) if n == 1 else (lids[local], rids[remote])
                elif n == 1:
                    li, ri = g.lbase + lv, g.rbase + rv
                else:
                    li, ri = _pieces(g, local, remote)
                posts.append(_Post(backend.post(self.op, lp, li, rp, ri, notify if not last else None), False, []))
        except BaseException:
            for post in posts:
                backend.release(post.handle)
            raise
        return posts, time.perf_counter()

    def _late(self, n: int, agent: Agent) -> TransferTimeoutError:
        """The deadline counts from the call. Without one given (an Owner gives its own), it is the
        agent's timeout from the call: the clock read for the stats says whether posting ran past
        it, and the Transfer computes the deadline itself only if it is waited on."""
        return TransferTimeoutError(
            f"posting {n * self.per_block} descriptors ran past the {agent.timeout:g} s deadline; nothing "
            "was left in flight. Raise Agent(timeout=...) or move fewer blocks per request.")

    def _replan(self, local: list[int], remote: list[int]) -> TransferPlan:
        """The plan object of a hot transfer, built only when someone reads ``Transfer.plan``."""
        assert self.peer.spec is not None
        return plan(self.spec, self.peer.spec, local, remote, self.op, pairing=self.pairing)


def _ids(bases: np.ndarray, n: int, dtype: type) -> np.ndarray | None:
    if bases.shape[0] != 1:
        return None
    a = np.arange(int(bases[0]), int(bases[0]) + n, dtype=dtype)
    a.flags.writeable = False  # handed to backends as views: nobody may change them
    return a


def _pieces(g: Any, local: list[int], remote: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`kvxfer.planner._legs`'s indices for a leg of several pieces per block."""
    lb, rb = np.array(local, dtype=g.dtype), np.array(remote, dtype=g.dtype)
    if g.member_major:
        return (g.lbase[:, None] + lb[None, :]).reshape(-1), (g.rbase[:, None] + rb[None, :]).reshape(-1)
    return (lb[:, None] + g.lbase[None, :]).reshape(-1), (rb[:, None] + g.rbase[None, :]).reshape(-1)


def learn(agent: Agent, peer: Peer, op: Op, p: TransferPlan, chunks: "list[Chunk]") -> None:
    """Remember ``p``'s shape when it is one the hot path can repeat: whole rows of a checked
    pairing, one post per leg over lists kept in the caches, no integrity check."""
    pairing = peer.pairing
    if (agent.verify or agent._coalesce or not isinstance(pairing, Pairing) or not p.legs
            or len(chunks) != len(p.legs) != len(pairing.groups) or len(chunks) != len(pairing.groups)
            or any(c.cleanup for c in chunks)
            or p.legs[0].blocks <= 0 or p.descriptors % p.legs[0].blocks):
        return
    remote = {id(h) for h in peer.prepared.values()}
    if any(id(c.remote) not in remote for c in chunks) or any(c.local not in agent._local_prepared.values()
                                                                for c in chunks):
        return
    agent._hot[(peer.name, op)] = Shape(agent, peer, op, p, chunks)
