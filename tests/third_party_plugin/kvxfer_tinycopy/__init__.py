"""The smallest complete kvxfer backend: agents in one process, host memory, memmove.

It is the worked example of CONTRIBUTING.md: register through the hook, implement the
seam with numpy, let the core do validation, planning, deadlines and notifications' order.
A peer is another agent of this process, found in :class:`kvxfer.plugin.Live`. It lists
its one data path (:class:`kvxfer.plugin.DataPath`), memmove, and
:class:`kvxfer.plugin.PathBackend` posts over it. VRAM is not its business: the agent routes
VRAM pairs between its agents to the core's device path, beside it.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from kvxfer import (Allocation, Capabilities, DescriptorList, MemoryKind, Op, PeerDisconnectedError, UnknownPeerError,
                    UnsupportedError)
from kvxfer.plugin import Live, PathBackend, RegisterBackend, hookimpl, identity

_LIVE: "Live[TinyCopy]" = Live()  # the agents of this process, by their blob's first bytes
_TOKEN = 16  # the blob: bytes naming the agent, then this process's identity token


class Listed:
    """A prepared list: expanded rows, whose memory it is, which peer it names."""

    def __init__(self, descs: DescriptorList, owner: "TinyCopy", peer: str) -> None:
        self.rows, self.owner, self.peer = descs.expand().array, owner, peer


class Memmove:
    """The host-memory path: one memmove per pair, done before ``start`` returns."""

    sends_notification = False

    @staticmethod
    def serves(local: Listed, remote: Listed) -> bool:
        return True  # prepare() took only host memory

    @staticmethod
    def start(op: Op, local: Listed, li: np.ndarray, remote: Listed, ri: np.ndarray, peer: str,
              notification: bytes | None) -> str:
        la, ra = local.rows[li], remote.rows[ri]
        dst, src = (la, ra) if op is Op.READ else (ra, la)
        for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), dst[:, 1].tolist()):
            ctypes.memmove(d, s, n)
        return "memmove"

    @staticmethod
    def poll(h: str) -> bool:
        return True

    @staticmethod
    def cancel(h: str) -> None:
        pass

    @staticmethod
    def kind(h: str) -> str:
        return "memmove"


class TinyCopy(PathBackend):
    name = "tinycopy"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.DRAM}), cross_process=False)

    def __init__(self, agent_name: str, **options: Any) -> None:
        super().__init__(agent_name, **options)
        self._token = secrets.token_bytes(_TOKEN)
        self._peers: dict[str, TinyCopy] = {}
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self._ids = itertools.count()
        self.paths = (Memmove(),)  # PathBackend posts over these rows
        _LIVE[self._token] = self

    def register(self, allocations: Sequence[Allocation]) -> int:
        return next(self._ids)  # host memory needs no pinning

    def deregister(self, handle: Any) -> None:
        pass

    def local_metadata(self) -> bytes:
        return self._token + identity.here().token

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        # an agent's name alone is no proof: the blob must also carry this process's token
        other = _LIVE.find(bytes(blob[:_TOKEN]), bytes(blob[_TOKEN:]), identity.here().token)
        if other is None:
            raise PeerDisconnectedError(f"{peer_name} is not alive in this process")
        self._peers[peer_name] = other

    def remove_remote(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def prepare(self, peer: str | None, descs: DescriptorList) -> Listed:
        if peer is not None and peer not in self._peers:
            raise UnknownPeerError(peer)
        if descs.kind is not MemoryKind.DRAM:
            raise UnsupportedError(f"tinycopy moves host memory only, not {descs.kind.value}")
        return Listed(descs, self if peer is None else self._peers[peer], peer or self.agent_name)

    def peer_of(self, remote: Listed) -> str:
        return remote.peer  # type: ignore[no-any-return]

    def notify(self, peer: str, message: bytes) -> None:
        self._peers[peer]._inbox[self.agent_name].append(message)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        out, self._inbox = dict(self._inbox), defaultdict(list)
        return out

    def close(self) -> None:
        super().close()
        _LIVE.pop(self._token, None)


@hookimpl
def kvxfer_register_backends(register: RegisterBackend) -> None:
    register("tinycopy", TinyCopy, summary="third-party example: same-process memmove")
