"""The device path behind the NIXL backend's data-path shape (start / poll / cancel).

VRAM between agents of one host moves through the core's :class:`kvxfer.cuda.DevicePath`
(CUDA IPC handles, or direct copies between agents of one process; see
``docs/device-path.md``). The backend keeps the path's state (registrations, peers, lists);
this adapter only gives its transfers the same three calls as the NIXL path, so choosing
between them stays one table in :mod:`kvxfer_nixl.backend`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from kvxfer import Op
from kvxfer.cuda import DevicePath, PathXfer

__all__ = ["DeviceCopies"]


class _Listed(Protocol):
    device: Any  # kvxfer.cuda.Spans, or None where the transport must carry the list


class DeviceCopies:
    """One batched copy per post; the backend sends the notification once it is done."""

    sends_notification = False

    def __init__(self, path: DevicePath) -> None:
        self._path = path

    def start(self, op: Op, local: _Listed, li: np.ndarray, remote: _Listed, ri: np.ndarray, peer: str,
              notification: bytes | None) -> PathXfer:
        return self._path.post(op, local.device, li, remote.device, ri)

    def poll(self, x: PathXfer) -> bool:
        return self._path.poll(x)

    def cancel(self, x: PathXfer) -> None:
        self._path.release(x)  # a copy cannot be aborted: it is waited for (milliseconds)

    @staticmethod
    def kind(x: PathXfer) -> str:
        return x.kind  # "cuda-ipc" or "same-process"
