"""The same-host device path: VRAM to VRAM through CUDA IPC handles and one batched copy.

Backends (NIXL, or a third-party one) use it through :class:`DevicePath`, which is also the
row a backend adds to its table of data paths (:mod:`kvxfer.plugin.datapath`); see
:mod:`kvxfer.cuda.path` for the calls and ``docs/device-path.md`` for the reasoning. Nothing
here is imported by ``import kvxfer``, and CUDA itself is loaded (through ctypes, no torch)
only when a VRAM allocation is registered or a peer exports one.
"""

from __future__ import annotations

from . import capability as capability  # registers the mm8 kernel with kvxfer.integrity
from . import digest as digest
from .decide import CUDA_IPC, SAME_PROCESS, Capability, DeviceRoute, decide
from .ipc import open_mappings
from .path import COPY_ON, ENGINES, DevicePath, Listed, PathXfer, DeviceSpans

__all__ = ["CUDA_IPC", "SAME_PROCESS", "COPY_ON", "ENGINES", "Capability", "DevicePath", "Listed", "PathXfer",
           "DeviceRoute", "DeviceSpans", "decide", "open_mappings"]

