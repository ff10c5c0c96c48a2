"""The smallest complete kvxfer backend: agents in one process, host memory, memmove.

It is the worked example of CONTRIBUTING.md: register through the hook, implement the
seam with numpy, let the core do validation, planning, deadlines and notifications' order.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
from collections import defaultdict
from typing import Any, Callable, Sequence

import numpy as np

import kvxfer
from kvxfer import Allocation, Backend, Capabilities, DescriptorList, Op
from kvxfer.errors import PeerDisconnectedError, UnknownPeerError

_LIVE: dict[bytes, "TinyCopy"] = {}


class TinyCopy(Backend):
    name = "tinycopy"
    capabilities = Capabilities(cross_process=False)  # DRAM, READ/WRITE, notifications

    def __init__(self, agent_name: str, **options: Any) -> None:
        super().__init__(agent_name, **options)
        self._token = secrets.token_bytes(16)
        self._peers: dict[str, TinyCopy] = {}
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self._ids = itertools.count()
        self._prepared_owner: dict[int, TinyCopy] = {}
        _LIVE[self._token] = self

    def register(self, allocations: Sequence[Allocation]) -> int:
        return next(self._ids)  # host memory needs no pinning here

    def deregister(self, handle: Any) -> None:
        pass

    def local_metadata(self) -> bytes:
        return self._token

    def add_remote(self, peer_name: str, blob: bytes) -> str:
        if blob not in _LIVE:
            raise PeerDisconnectedError(f"{peer_name} is not alive in this process")
        self._peers[peer_name] = _LIVE[blob]
        return peer_name

    def remove_remote(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def prepare(self, peer: str | None, descs: DescriptorList) -> np.ndarray:
        if peer is not None and peer not in self._peers:
            raise UnknownPeerError(peer)
        arr = descs.expand().array
        self._prepared_owner[id(arr)] = self if peer is None else self._peers[peer]
        return arr

    def release_prepared(self, prepared: Any) -> None:
        self._prepared_owner.pop(id(prepared), None)

    def post(self, op: Op, local: np.ndarray, local_idx: np.ndarray, remote: np.ndarray, remote_idx: np.ndarray,
             notification: bytes | None) -> str:
        la, ra = local[local_idx], remote[remote_idx]
        dst, src = (la, ra) if op is Op.READ else (ra, la)
        for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), dst[:, 1].tolist()):
            ctypes.memmove(d, s, n)
        if notification is not None:  # after the copy: the receiver may read on arrival
            self._owner_of(remote)._inbox[self.agent_name].append(notification)
        return "done"

    def _owner_of(self, remote: np.ndarray) -> "TinyCopy":
        return self._prepared_owner[id(remote)]

    def poll(self, xfer: Any) -> bool:
        return True

    def release(self, xfer: Any) -> None:
        pass

    def notify(self, peer: str, message: bytes) -> None:
        self._peers[peer]._inbox[self.agent_name].append(message)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        out, self._inbox = dict(self._inbox), defaultdict(list)
        return out

    def close(self) -> None:
        _LIVE.pop(self._token, None)


@kvxfer.hookimpl
def kvxfer_register_backends(register: Callable[..., None]) -> None:
    register("tinycopy", TinyCopy, summary="third-party example: same-process memmove")
