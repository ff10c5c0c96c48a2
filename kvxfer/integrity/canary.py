"""A canary at connect: read one block whose bytes both sides know, before any request needs the path.

The source fills a block it sets aside with a pattern derived from its agent name
(:func:`fill`); the destination, right after ``add_peer``, reads it into a scratch block of
its own and compares digests of what arrived against digests of the pattern it computes
itself (:func:`check`, or ``Agent.add_peer(md, canary=(local, remote))``). Nothing needs to
travel besides the metadata, and a path that moves wrong bytes (a GDR misconfiguration, a
broken transport) is refused before a request depends on it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..errors import IntegrityError
from ..geometry import KVCacheSpec
from ..memory import MemoryKind
from .cells import Cells, local_spans
from .digests import Digests, _mm8_rows, default_algorithm, verify
from .mm8 import _splitmix, _xxh3

__all__ = ["fill", "check", "pattern"]


def pattern(peer: str, member: str, size: int) -> np.ndarray:
    """The canary bytes of one member page: keyed by agent and member, so nothing else matches."""
    key = np.uint64(int.from_bytes(hashlib.blake2b(f"{peer}\0{member}".encode(), digest_size=8).digest(), "little"))
    words = _splitmix(np.arange(-(-size // 8), dtype=np.uint64) ^ key)
    return words.view(np.uint8)[:size]


def _write(spec: KVCacheSpec, block: int, name: str, data: np.ndarray) -> None:
    import ctypes

    for r in spec.regions:
        for m in r.members:
            if m.name != name:
                continue
            a = spec.allocations[r.allocation]
            addr = a.address + r.offset + block * r.block_stride + m.offset
            if a.kind is MemoryKind.VRAM:
                import torch

                from ._gpu import _CudaSpan

                torch.as_tensor(_CudaSpan(addr, data.size), device=f"cuda:{a.device}").copy_(torch.from_numpy(data))
                torch.cuda.synchronize(a.device)
            else:
                ctypes.memmove(addr, data.ctypes.data, data.size)


def fill(agent: Any, block: int) -> None:
    """Source: write the canary pattern into ``block`` of our registered cache."""
    spec = agent.spec
    if spec is None or not 0 <= block < spec.num_blocks:
        raise IntegrityError(f"canary block {block} is not a block of this agent's cache")
    for m in spec.members:
        _write(spec, block, m.name, pattern(agent.name, m.name, m.size))


def expected(peer: str, spec: KVCacheSpec, remote_block: int, members: list[str], algorithm: str) -> Digests:
    """Digests of the canary a genuine ``peer`` holds in ``remote_block`` (from the pattern alone)."""
    by = {m.name: m for m in spec.members}
    pages = [pattern(peer, n, by[n].size) for n in members]
    if algorithm == "mm8":
        vals = [int(_mm8_rows(p[None]).view(np.uint64)[0]) for p in pages]
    else:
        h = _xxh3()
        vals = [h(p.tobytes()) for p in pages]
    cells = Cells(tuple(members), np.zeros(len(members), np.int64), np.array([by[n].size for n in members], np.int64))
    return Digests(algorithm, np.array([remote_block], np.int64), cells, np.array([vals], np.uint64))


def check(agent: Any, peer: str, *, local_block: int, remote_block: int, timeout: float | None = None) -> None:
    """Destination: read the peer's canary into ``local_block`` (scratch) and verify it."""
    p = agent.peers.get(peer)
    if p is None or p.spec is None or agent.spec is None:
        raise IntegrityError(f"canary: peer {peer!r} and this agent must both have registered a cache")
    names = {m.name for m in agent.spec.members}
    members = [m.name for m in p.spec.members if m.name in names]
    algo = default_algorithm(agent.spec)
    exp = expected(peer, p.spec, remote_block, members, algo)
    agent.read(peer, [local_block], [remote_block]).wait(timeout)
    try:
        verify(exp, local_spans(agent.spec, [local_block], exp.cells), np.array([local_block]))
    except IntegrityError as e:
        raise IntegrityError(f"canary from {peer!r} arrived wrong, so this path moves wrong bytes: {e}",
                             block=e.block, remote_block=e.remote_block, member=e.member,
                             mismatches=e.mismatches) from None
