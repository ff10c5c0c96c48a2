"""The smallest complete kvxfer backend: agents in one process, host memory, memmove.

It is the worked example of CONTRIBUTING.md: register through the hook, implement the
seam with numpy, let the core do validation, planning, deadlines and notifications' order.
It lists its data paths (:class:`kvxfer.plugin.DataPath`) and :class:`kvxfer.plugin.PathBackend`
posts over them: the core's same-host GPU path (:class:`kvxfer.cuda.DevicePath`) is one row,
memmove the other.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from kvxfer import Allocation, Capabilities, DescriptorList, MemoryKind, Op
from kvxfer.cuda import DevicePath, Spans
from kvxfer.errors import KvxferError, MetadataError, PeerDisconnectedError, UnknownPeerError, UnsupportedError
from kvxfer.plugin import PathBackend, RegisterBackend, hookimpl

_LIVE: dict[bytes, "TinyCopy"] = {}
_TOKEN = 16  # bytes of the blob naming the agent; the device path's export follows them


class Listed:
    """A prepared list: expanded rows, their kind, whose memory it is, the device path's view."""

    def __init__(self, descs: DescriptorList, owner: "TinyCopy", peer: str, device: Spans | None) -> None:
        self.rows, self.kind, self.owner, self.peer, self.device = descs.expand().array, descs.kind, owner, peer, device


class Memmove:
    """The host-memory path: one memmove per pair, done before ``start`` returns."""

    sends_notification = False

    @staticmethod
    def serves(local: Listed, remote: Listed) -> bool:
        return local.kind is remote.kind is MemoryKind.DRAM

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
    # DRAM by memmove; VRAM only where the device path takes the list (prepare refuses the rest).
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}), cross_process=False)

    def __init__(self, agent_name: str, **options: Any) -> None:
        super().__init__(agent_name, **options)
        self._token = secrets.token_bytes(_TOKEN)
        self._peers: dict[str, TinyCopy] = {}
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self._ids = itertools.count()
        self._device = DevicePath()  # loads CUDA only once VRAM is registered
        self.paths = (self._device, Memmove())  # the GPU path is this one row; PathBackend posts over them
        _LIVE[self._token] = self

    def register(self, allocations: Sequence[Allocation]) -> int:
        return self._device.register(allocations)  # host memory needs no pinning; VRAM is exported

    def deregister(self, handle: Any) -> None:
        self._device.deregister(handle)

    def local_metadata(self) -> bytes:
        return self._token + self._device.blob()

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        other = _LIVE.get(bytes(blob[:_TOKEN]))
        if other is None:
            raise PeerDisconnectedError(f"{peer_name} is not alive in this process")
        try:
            self._device.add_peer(peer_name, bytes(blob[_TOKEN:]))
        except KvxferError:
            raise
        except Exception as exc:  # only typed errors leave add_remote
            raise MetadataError(f"bad device export from {peer_name!r}: {exc!r}") from exc
        self._peers[peer_name] = other

    def remove_remote(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self._device.remove_peer(peer)

    def prepare(self, peer: str | None, descs: DescriptorList) -> Listed:
        if peer is not None and peer not in self._peers:
            raise UnknownPeerError(peer)
        device = self._device.prepare(peer, descs)
        if descs.kind is MemoryKind.VRAM and device is None and len(descs):
            raise UnsupportedError("tinycopy moves VRAM only through the device path, which refused this list")
        return Listed(descs, self if peer is None else self._peers[peer], peer or self.agent_name, device)

    def peer_of(self, remote: Listed) -> str:
        return remote.peer  # type: ignore[no-any-return]

    def notify(self, peer: str, message: bytes) -> None:
        self._peers[peer]._inbox[self.agent_name].append(message)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        out, self._inbox = dict(self._inbox), defaultdict(list)
        return out

    def close(self) -> None:
        super().close()
        self._device.close()
        _LIVE.pop(self._token, None)


@hookimpl
def kvxfer_register_backends(register: RegisterBackend) -> None:
    register("tinycopy", TinyCopy, summary="third-party example: same-process memmove")
