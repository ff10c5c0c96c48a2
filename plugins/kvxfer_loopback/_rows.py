"""Loopback's two rows of :class:`kvxfer.plugin.DataPath`: a host copy and a torch device copy.

:class:`kvxfer.plugin.PathBackend` holds the post loop; these rows only move bytes. Each
sends the notification itself, at start: it is queued in the receiver's ``_pending`` behind
the copy's CUDA event (none for a host copy, which is done before start returns), and the
receiver hands it out only once the data is visible, in post order. So the receiver never
depends on the initiator polling, as with a real one-sided transport, and the loop's pump is
never needed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer import BackendError, MemoryKind, Op, UnsupportedError
from kvxfer.plugin import copies, install_hint

# The backend and its prepared lists (kvxfer_loopback.backend) are named, not imported: the
# backend imports these rows, and the import-graph test forbids even a type-only circle.
_Prepared = Any
LoopbackBackend = Any

__all__ = ["DeviceCopy", "HostCopy"]


@dataclass
class _Note:
    """A notification waiting for its device copy; the *receiver* releases it when the copy is done."""

    sender: str
    message: bytes
    event: Any = None
    cancelled: bool = False


@dataclass
class _Xfer:
    """A device copy in flight: its event, its note, and the tensors the stream still reads."""

    event: Any = None  # torch.cuda.Event for device copies
    note: _Note | None = None
    done: bool = False
    keepalive: list[Any] = field(default_factory=list)


_DIFFER = "paired descriptors differ in length"


def _pairs(op: Op, local: _Prepared, li: np.ndarray, remote: _Prepared,
           ri: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``(dst, src, lengths)`` of the indexed pairs; refused before any byte moves if a pair's lengths differ."""
    la, ra = local.descs[li], remote.descs[ri]
    n = la[:, 1].tolist()
    if n != ra[:, 1].tolist():
        raise BackendError(_DIFFER)
    return (la, ra, n) if op is Op.READ else (ra, la, n)


class HostCopy:
    """DRAM to DRAM: ``ctypes.memmove`` per descriptor, done before :meth:`start` returns.

    ``peer`` (in :meth:`start`) is the receiving :class:`~kvxfer_loopback.backend.LoopbackBackend`
    itself, as the backend's ``route`` named it."""

    sends_notification = True
    __slots__ = ("backend",)

    def __init__(self, backend: LoopbackBackend) -> None:
        self.backend = backend

    def serves(self, local: _Prepared, remote: _Prepared) -> bool:
        return local.kind is MemoryKind.DRAM and remote.kind is MemoryKind.DRAM

    def start(self, op: Op, local: _Prepared, li: np.ndarray, remote: _Prepared, ri: np.ndarray,
              peer: Any, notification: bytes | None) -> None:
        la, ra = local.descs[li], remote.descs[ri]  # _pairs(), inlined: a small READ's post is the hot path
        n = la[:, 1].tolist()
        if n != ra[:, 1].tolist():
            raise BackendError(_DIFFER)
        dst, src = (la, ra) if op is Op.READ else (ra, la)
        b = self.backend
        seen = copies.watcher(b)  # a verified READ hashes each row while it is in the cache
        memmove = ctypes.memmove
        for d, s, k in zip(dst[:, 0].tolist(), src[:, 0].tolist(), n):  # _host_copy(), inlined
            memmove(d, s, k)
            if seen is not None:
                seen(d, k)
        if notification is not None:
            with peer._inbox_lock:  # the data is already visible; order kept behind earlier notes
                peer._pending.append(_Note(b.agent_name, bytes(notification)))
        return None

    def poll(self, h: None) -> bool:
        return True

    def cancel(self, h: None) -> None:
        pass

    def kind(self, h: None) -> str:
        return "loopback-host"


class DeviceCopy:
    """Any pair with VRAM: torch copies on a private stream, done once its event has fired.

    torch is imported only here, when such a pair is first posted."""

    sends_notification = True

    def __init__(self, backend: LoopbackBackend) -> None:
        self.backend = backend
        self._stream: Any = None

    def serves(self, local: _Prepared, remote: _Prepared) -> bool:
        return True

    def start(self, op: Op, local: _Prepared, li: np.ndarray, remote: _Prepared, ri: np.ndarray,
              peer: Any, notification: bytes | None) -> _Xfer:
        dst, src, _ = _pairs(op, local, li, remote, ri)
        dkind, skind = (local.kind, remote.kind) if op is Op.READ else (remote.kind, local.kind)
        x = _Xfer()
        x.event, x.keepalive = self._copy(dst, dkind, src, skind)
        if notification is not None:
            x.note = _Note(self.backend.agent_name, bytes(notification), x.event)
            with peer._inbox_lock:  # handed out by the receiver once the event has fired
                peer._pending.append(x.note)
        return x

    def _copy(self, dst: np.ndarray, dkind: MemoryKind, src: np.ndarray, skind: MemoryKind) -> tuple[Any, list[Any]]:
        try:
            import torch
        except ImportError:
            raise UnsupportedError(f"VRAM copies in the loopback backend need torch: {install_hint('torch')}") from None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        keep: list[Any] = []
        with torch.cuda.stream(self._stream):
            for (da, n, dd), (sa, _, sd) in zip(dst.tolist(), src.tolist()):
                d = _span_tensor(torch, da, n, dd, dkind)
                s = _span_tensor(torch, sa, n, sd, skind)
                d.copy_(s, non_blocking=True)
                keep += (d, s)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return ev, keep

    def poll(self, h: _Xfer) -> bool:
        if not h.done:
            if not h.event.query():
                return False
            h.done = True
            h.keepalive.clear()
        return True

    def cancel(self, h: _Xfer) -> None:
        if not h.done and h.event is not None:
            # A device copy cannot be recalled once queued: wait for it so no copy outlives
            # the memory it targets, and drop the notification.
            h.event.synchronize()
            if h.note is not None:
                h.note.cancelled = True
        h.keepalive.clear()

    def kind(self, h: _Xfer) -> str:
        return "loopback-device"


def _host_copy(dst: np.ndarray, src: np.ndarray, seen: copies.Watch | None = None) -> None:
    """One memmove per descriptor, as :meth:`HostCopy.start` copies (the tests' mutants copy with
    it); ``seen``: told after each copy."""
    memmove = ctypes.memmove
    for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), dst[:, 1].tolist()):
        memmove(d, s, n)
        if seen is not None:
            seen(d, n)


class _CudaSpan:
    """Just enough of ``__cuda_array_interface__`` for torch to wrap a raw device pointer."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _span_tensor(torch: Any, ptr: int, n: int, device: int, kind: MemoryKind) -> Any:
    if kind is MemoryKind.VRAM:
        return torch.as_tensor(_CudaSpan(ptr, n), device=f"cuda:{device}")
    buf = (ctypes.c_uint8 * n).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)
