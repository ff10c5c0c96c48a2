"""Which integrity check (if any) a read gets: the glue between the agent and kvxfer.integrity.

Kept out of :mod:`kvxfer.agent` so the agent only asks "verify this read?" and the rules live
in one place: no digests and verification off means no check; digests given (or the agent's
``verify=True``) mean a check fitted to the pairing, built and validated before posting.
"""

from __future__ import annotations

from typing import Any, Mapping

from .integrity.verified import gather_check, pairing_check, require
from .pairing import Pairing

__all__ = ["for_read", "for_many", "canary", "digest", "cells_for"]


def digest(agent: Any, blocks: Any, cells: Any, algorithm: str, rows: bool) -> Any:
    from .errors import SpecError
    from .integrity import compute
    from .planner import as_block_ids

    if agent.spec is None:
        raise SpecError("register a KV cache before digesting it")
    from .errors import InvalidArgumentError
    from .integrity.cells import Cells

    if cells is not None and not isinstance(cells, Cells):
        raise InvalidArgumentError(f"cells must be None or kvxfer.integrity Cells (Agent.cells_for), got "
                                   f"{type(cells).__name__}")
    if not isinstance(algorithm, str):
        raise InvalidArgumentError(f"algorithm must be a string ('auto'), got {type(algorithm).__name__}")
    return compute(agent.spec, as_block_ids(blocks, agent.spec.num_blocks, "digest"), cells=cells,
                   algorithm=algorithm, rows=rows)


def cells_for(agent: Any, peers: tuple[str, ...]) -> dict[str, Any]:
    from .errors import SpecError
    from .integrity import cells_for as cells
    from .pairing import cached_gather

    if agent.spec is None:
        raise SpecError("register a KV cache before asking what to digest")
    specs = {n: agent._peer(n).spec for n in peers}
    g = cached_gather(agent.spec, specs)
    return {n: cells(g, n, agent.spec, specs[n]) for n in g.tables}


def canary(agent: Any, name: str, blocks: tuple[int, int], timeout: float | None) -> None:
    """Check the peer's canary; a peer whose canary arrives wrong is dropped again."""
    from .integrity.canary import check

    try:
        local, remote = blocks
        check(agent, name, local_block=int(local), remote_block=int(remote), timeout=timeout)
    except BaseException:
        if name in agent.peers:
            agent.remove_peer(name)
        raise


def for_read(agent: Any, peer: Any, local_blocks: Any, remote_blocks: Any, expect: Any) -> Any:
    if expect is None and not agent.verify:
        return None
    if not isinstance(expect, (list, tuple)):
        expect = require(expect, peer.name)
    pairing = agent._pairing(peer)
    if isinstance(pairing, Pairing):
        return pairing_check(agent.spec, expect, local_blocks, remote_blocks, peer.name)
    return gather_check(pairing, agent.spec, peer.spec, expect, local_blocks, remote_blocks, peer.name)


def for_many(agent: Any, peers: Mapping[str, Any], gather: Any, plans: Mapping[str, Any], local_blocks: Any,
             remote_blocks: Mapping[str, Any], expect: Mapping[str, Any] | None) -> dict[str, Any]:
    if expect is None and not agent.verify:
        return {}
    expect = expect or {}
    out = {}
    for n in plans:
        e = require(expect.get(n), n)
        if len(plans) == 1 and isinstance(agent._pairing(peers[n]), Pairing):
            out[n] = pairing_check(agent.spec, e, local_blocks, remote_blocks[n], n)
        else:
            out[n] = gather_check(gather, agent.spec, peers[n].spec, e, local_blocks, remote_blocks[n], n)
    return out
