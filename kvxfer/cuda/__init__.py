"""The same-host device path: VRAM to VRAM through CUDA IPC handles and one batched copy.

Backends (NIXL, UCX, or a third-party one) use it through :class:`DevicePath`; see
:mod:`kvxfer.cuda.path` for the calls and ``docs/device-path.md`` for the reasoning. Nothing
here is imported by ``import kvxfer``, and CUDA itself is loaded (through ctypes, no torch)
only when a VRAM allocation is registered or a peer exports one.

Helpers for backends that keep their own plumbing:

* :func:`export` — allocations -> bytes for the connection blob;
* :func:`open_peer` — a peer's bytes -> a :class:`DevicePath` route with its handles opened.
"""

from __future__ import annotations

from typing import Sequence

from ..memory import Allocation
from .decide import CUDA_IPC, SAME_PROCESS, Capability, Route, decide
from .ipc import open_mappings
from .path import COPY_ON, ENGINES, DevicePath, PathXfer, Spans

__all__ = ["CUDA_IPC", "SAME_PROCESS", "COPY_ON", "ENGINES", "Capability", "DevicePath", "PathXfer", "Route",
           "Spans", "decide", "export", "open_mappings", "open_peer"]


def export(path: DevicePath, allocations: Sequence[Allocation]) -> bytes:
    """Register ``allocations`` with ``path`` (exporting their handles) and return its blob."""
    path.register(allocations)
    return path.blob()


def open_peer(path: DevicePath, key: str, peer_blob: bytes) -> Route:
    """Decide the route to a peer and open its handles (once); see :meth:`DevicePath.add_peer`."""
    return path.add_peer(key, peer_blob)
