"""Whether two peers may use the device path, and why not: one pure function.

The rule: copy directly only when both sides are provably on this running kernel (same boot
id), every GPU the peer exports is visible here, each pair of GPUs that would copy can reach
each other (peer access), and the peer's handles actually open (checked by the caller right
after this says yes). Anything else leaves the bytes to the transport. The function takes a
:class:`Capability` so CI, which has no GPU, can exercise every branch with a fake one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from . import blob
from ..peers import Identity

__all__ = ["Capability", "DeviceRoute", "SAME_PROCESS", "CUDA_IPC", "decide"]

SAME_PROCESS = "same-process"
CUDA_IPC = "cuda-ipc"


@dataclass(frozen=True)
class DeviceRoute:
    """``kind`` is :data:`SAME_PROCESS`, :data:`CUDA_IPC`, or ``None`` (the transport carries
    the bytes); ``reason`` says why, for stats and logs. ``devices`` maps each device index of
    the peer's export to the local GPU ordinal holding it."""

    kind: str | None
    reason: str
    devices: tuple[int, ...] = ()

    @property
    def direct(self) -> bool:
        return self.kind is not None


class Capability(Protocol):
    """What the device path needs from CUDA and the OS (the real one is in :mod:`.path`)."""

    def why_not(self) -> str | None: ...
    def identity(self) -> Identity: ...
    def page(self) -> Any: ...
    def prove(self, claim: Identity, what: str) -> Any: ...
    def device_of(self, uuid: bytes) -> int | None: ...
    def can_access(self, device: int, peer: int) -> bool: ...
    def export(self, allocations: Sequence[Any]) -> Any: ...
    def open(self, exp: blob.Export, handle: int, device: int, access: Sequence[int], proc: Any) -> Any: ...
    def close(self, mapping: Any) -> None: ...
    def peer_process(self, pid: int, started: int) -> Any: ...
    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int, engine: str,
             src_device: int | None, dst_device: int | None) -> Any: ...
    def copy_mm8(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int,
                 src_device: int | None, dst_device: int | None) -> Any: ...
    def digests(self, handle: Any) -> np.ndarray: ...
    def query(self, handle: Any) -> bool: ...
    def wait(self, handle: Any, deadline: float) -> bool: ...
    def fence(self, handle: Any) -> bool: ...
    def synchronize(self, handle: Any) -> None: ...
    def sync_all(self) -> None: ...
    def kernel_error(self, device: int) -> str | None: ...


def decide(me: Identity, peer: blob.Export, local_devices: Sequence[int], cap: Capability, *, enabled: bool,
           same_process_peer: bool) -> DeviceRoute:
    """The route for a peer, before any handle is opened. ``same_process_peer``: the export
    names this process's token and a device path still alive here."""
    if not enabled:
        return DeviceRoute(None, "device path disabled by option")
    if peer.empty:
        return DeviceRoute(None, "the peer exported no VRAM")
    why = cap.why_not()
    if why:
        return DeviceRoute(None, f"no CUDA here: {why}")
    if same_process_peer:
        return DeviceRoute(SAME_PROCESS, "both agents live in this process")
    if peer.identity.token == me.token or peer.identity.pid == me.pid:
        return DeviceRoute(None, "the export names this process but no live agent here")
    if not me.boot_id or peer.identity.boot_id != me.boot_id:
        return DeviceRoute(None, "the peer runs on another host (boot id differs)")
    devices = []
    for k, uuid in enumerate(peer.devices):
        d = cap.device_of(uuid)
        if d is None:
            return DeviceRoute(None, f"the peer's GPU {uuid.hex()} is not visible in this process")
        devices.append(d)
    used = {devices[int(i)] for i in np.unique(peer.handles["device"])} if peer.handles.shape[0] else set()
    for mine in local_devices:
        for theirs in used:
            if mine != theirs and not cap.can_access(mine, theirs):
                return DeviceRoute(None, f"GPU {mine} cannot access GPU {theirs} directly (no peer access)")
    return DeviceRoute(CUDA_IPC, "same host, handles to be opened", tuple(devices))
