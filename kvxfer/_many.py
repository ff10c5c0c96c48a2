"""One request over several peers (:meth:`Agent.read_many` / :meth:`Agent.write_many`).

Kept beside the agent rather than in it: planning a gather and charging each part its share
of the planning is one concern, and the agent's module stays about its own state.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from .deadlines import Deadline
from . import _checks
from .errors import InvalidArgumentError, SpecError, UnsupportedError
from ._group import TransferGroup
from .memory import Op
from .pairing import Pairing
from .planner import plan_gather
from .pairing import cached_gather
from .transfer import Transfer

__all__ = ["post_many"]


def post_many(agent: Any, op: Op, local_blocks: Any, remote_blocks: Mapping[str, Any],
              notify: bytes | None, expect: Mapping[str, Any] | None) -> TransferGroup:
    """Plan every peer's part of one request, then post them; a failed post cancels the rest."""
    t0 = time.perf_counter()
    deadline = Deadline.within(agent.timeout)
    if op not in agent.backend.capabilities.ops:
        raise UnsupportedError(f"backend {agent.backend_name!r} does not support {op.value}")
    if notify is not None and not isinstance(notify, (bytes, bytearray)):
        raise InvalidArgumentError(f"notify must be bytes (notify=b\"req-17\"), got {type(notify).__name__}")
    if not isinstance(remote_blocks, Mapping) or not remote_blocks:
        raise InvalidArgumentError("remote_blocks must map each peer's name to its block ids")
    if agent.spec is None:
        raise SpecError("register a KV cache before transferring")
    peers = {n: agent._peer(n) for n in remote_blocks}
    specs = {}
    for n, peer in peers.items():
        if peer.spec is None:
            raise SpecError(f"peer {n!r} registered no KV cache")
        specs[n] = peer.spec
    g = cached_gather(agent.spec, specs)
    only = next(iter(g.tables)) if len(g.tables) == 1 and not g.missing else None
    if only is not None and isinstance(agent._pairing(peers[only]), Pairing):  # same geometry: whole rows
        plans = {only: agent._plan(peers[only], local_blocks, remote_blocks[only], op)}
    else:
        plans = plan_gather(g, agent.spec, specs, local_blocks, remote_blocks, op)
    # Planning the gather is one step for all parts: each part is charged its share (by
    # descriptors) plus its own list preparation, never the posting of the parts before it.
    shared = time.perf_counter() - t0
    total = sum(p.descriptors for p in plans.values())
    checks = _checks.for_many(agent, peers, g, plans, local_blocks, remote_blocks, expect) if op is Op.READ else {}
    parts: dict[str, Transfer] = {}
    try:
        for n, p in plans.items():
            share = shared * (p.descriptors / total if total else 1 / len(plans))
            parts[n] = agent._post(op, peers[n], p, notify, time.perf_counter(), deadline, share, checks.get(n))
    except BaseException:
        for t in parts.values():
            t.cancel()
        raise
    unread = [n for n in peers if n not in plans]
    if notify is not None:
        for n in unread:
            agent.backend.notify(peers[n].name, bytes(notify))
    return TransferGroup(parts, unread, agent.timeout, started=t0)
