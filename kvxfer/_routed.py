"""The agent's seam: the backend and the core's device path side by side, one route per pair.

An :class:`~kvxfer.agent.Agent` keeps one :class:`~kvxfer.cuda.DevicePath` beside its backend
and talks to both through :class:`Routed`, as Mooncake's engine picks a transport per request:
VRAM pairs the device path proves it can serve (peers of this host, handles opened and
vouched for, every span inside what the peer exported) go to it; every other pair goes to the
backend untouched. So no backend wires the device path in, and every backend (UCX, a third
party's) gets it. The device path's export travels in the agent's metadata (its ``device``
field, :mod:`kvxfer.metadata`), not inside the backend's blob.

The hot path stays the backend's: a list the device path did not take is the backend's own
prepared list, and a post over two such lists is the backend's own handle, so a DRAM transfer
costs a type check more (and, for a backend on :class:`~kvxfer.plugin.PathBackend`, whose
posts are :class:`~kvxfer.plugin.Post` too, one identity check). Device-path posts go through
:class:`~kvxfer.plugin.PathBackend`'s loop, whose notification leaves through the backend's
``notify`` once the copy is done.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .errors import KvxferError, MetadataError, UnsupportedError
from .memory import Allocation, DescriptorList, MemoryKind, Op
from .plugin.backend import Backend, Capabilities
from .plugin.pathbackend import PathBackend, Post

if TYPE_CHECKING:  # kvxfer.cuda loads when an agent is made, not on import kvxfer
    from .cuda import DevicePath, DeviceSpans
    from .integrity.fused import Expected

__all__ = ["DEVICE_OPTIONS", "Listed", "Routed", "device_options"]

#: The agent's options for its device path (``Agent(..., device_copy=False)``), not the backend's.
DEVICE_OPTIONS = {"device_copy": "enabled", "device_engine": "engine", "device_copy_on": "copy_on"}


def device_options(options: dict[str, Any]) -> dict[str, Any]:
    """Take the device path's options out of an agent's ``**options`` (the rest go to the backend)."""
    return {DEVICE_OPTIONS[k]: options.pop(k) for k in list(options) if k in DEVICE_OPTIONS}


class Listed:
    """A VRAM list the device path took: its view (``device``), and the backend's list, if any."""

    __slots__ = ("inner", "device", "peer")

    def __init__(self, inner: Any, device: "DeviceSpans", peer: str | None) -> None:
        self.inner, self.device, self.peer = inner, device, peer


class _Device(Post):
    """A device-path post: the backend's posts (a :class:`PathBackend`'s ``Post`` too) are the backend's."""

    __slots__ = ()


class Routed(PathBackend):
    """``backend`` and ``device`` as one seam; the agent calls this instead of the backend."""

    post_type = _Device

    def __init__(self, backend: Backend, device: "DevicePath") -> None:
        self.name = backend.name
        super().__init__(backend.agent_name)
        self.inner, self.device = backend, device
        self.paths = (device,)  # only device-path posts come through the loop (post() below)
        self._regs: dict[int, tuple[Any, int]] = {}
        self._next = 0
        self._vram: bool | None = None  # whether the device path can move VRAM here (asked once)

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        """The backend's, plus VRAM where the device path can move it (CUDA here, path enabled)."""
        caps = self.inner.capabilities
        if MemoryKind.VRAM in caps.memory_kinds or not self._device_vram():
            return caps
        return replace(caps, memory_kinds=caps.memory_kinds | {MemoryKind.VRAM})

    def _device_vram(self) -> bool:
        if self._vram is None:
            self._vram = self.device.enabled and self.device.cap.why_not() is None
        return self._vram

    # -- memory: the backend registers what it can move, the device path exports VRAM ------------
    def register(self, allocations: Sequence[Allocation]) -> int:
        allocs = tuple(allocations)
        mine = self.inner.capabilities.memory_kinds
        theirs = tuple(a for a in allocs if a.kind in mine)
        h = self.inner.register(theirs) if theirs or not allocs else None  # all VRAM: the device path alone
        try:
            token = self.device.register(allocs)
        except BaseException:
            if h is not None:
                self.inner.deregister(h)
            raise
        self._next += 1
        self._regs[self._next] = (h, token)
        return self._next

    def deregister(self, handle: Any) -> None:
        h, token = self._regs.pop(handle, (None, None))
        if token is not None:
            self.device.deregister(token)
        if h is not None:
            self.inner.deregister(h)

    # -- peers -----------------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def device_metadata(self) -> bytes:
        """The device path's export for the agent's metadata; empty while no VRAM is exported
        (a peer then has nothing to open, and this process's CUDA stays unloaded)."""
        return self.device.blob() if self.device.exporting() else b""

    def add_remote(self, peer_name: str, blob: bytes, device: bytes = b"") -> None:
        """The backend first; then the device path's route to the peer (none without an export)."""
        self.inner.add_remote(peer_name, blob)
        try:
            if device:
                self.device.add_peer(peer_name, device)  # a known name is replaced
            else:
                self.device.remove_peer(peer_name)
        except Exception as exc:
            self.device.remove_peer(peer_name)
            if isinstance(exc, KvxferError):
                raise
            raise MetadataError(f"the device path refused {peer_name!r}: {exc}") from exc

    def remove_remote(self, peer: str) -> None:
        self.device.remove_peer(peer)
        self.inner.remove_remote(peer)

    # -- lists -----------------------------------------------------------------------------------
    def prepare(self, peer: str | None, descs: DescriptorList) -> Any:
        """The device path's view where it takes a VRAM list, beside the backend's list if the
        backend moves VRAM too; else the backend's list, unwrapped."""
        spans = self.device.prepare(peer, descs) if descs.kind is MemoryKind.VRAM and len(descs) else None
        if spans is None:
            return self.inner.prepare(peer, descs)  # a backend without VRAM refuses it: typed
        inner = None
        if MemoryKind.VRAM in self.inner.capabilities.memory_kinds:
            try:
                inner = self.inner.prepare(peer, descs)
            except KvxferError:
                pass  # two agents of one process: a transport may refuse, the device path serves it
        return Listed(inner, spans, peer)

    def release_prepared(self, prepared: Any) -> None:
        if prepared.__class__ is Listed:
            prepared.device = None
            if prepared.inner is not None:
                self.inner.release_prepared(prepared.inner)
            prepared.inner = None
            return
        self.inner.release_prepared(prepared)

    # -- transfers -------------------------------------------------------------------------------
    def peer_of(self, remote: Listed) -> str:
        return remote.peer or ""

    def deliver(self, peer: str, message: bytes) -> None:
        self.inner.notify(peer, message)

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None, expect: "Expected | None" = None) -> Any:
        """``expect``: a verified READ's cells (:mod:`kvxfer.integrity.fused`); a pair the device
        path carries is then cut into whole cells and copied and hashed in one pass."""
        if local.__class__ is Listed:
            if remote.__class__ is Listed and local.device is not None and remote.device is not None:
                if expect is not None and op is Op.READ:
                    x = self._post_fused(local, local_idx, remote, remote_idx, notification, expect)
                    if x is not None:
                        return x
                return PathBackend.post(self, op, local, local_idx, remote, remote_idx, notification)
            local = _inner(local)
        if remote.__class__ is Listed:
            remote = _inner(remote)
        return self.inner.post(op, local, local_idx, remote, remote_idx, notification)

    def _post_fused(self, local: Listed, li: np.ndarray, remote: Listed, ri: np.ndarray,
                    notification: bytes | None, expect: "Expected") -> Post | None:
        """One fused post of the pair cut into whole cells, or None where the runs are not whole
        cells (the caller posts a plain copy; the check after DONE covers it)."""
        from .integrity.fused import Pieces

        la, ra = local.device, remote.device
        assert la is not None and ra is not None
        cut = expect.cut(la.addr[li], la.nbytes[li])
        if cut is None:
            return None
        run, off, n, digest, cells = cut
        lr, rr = li[run], ri[run]
        pieces = (type(la)(la.addr[lr] + off, n, la.device[lr], la.peer, la.epoch),
                  type(ra)(ra.addr[rr] + off, n, ra.device[rr], ra.peer, ra.epoch))
        k = np.arange(run.shape[0], dtype=np.int64)
        lo, re = Listed(None, pieces[0], local.peer), Listed(None, pieces[1], remote.peer)
        x = PathBackend.post(self, Op.READ, lo, k, re, k, notification, expect=Pieces(digest, cells, expect))
        if getattr(x.h, "verified", False):  # the fused kernel took it (else a plain copy, checked after DONE)
            expect.cover(cells)
        return x

    def poll(self, xfer: Any) -> bool:
        return PathBackend.poll(self, xfer) if xfer.__class__ is _Device else self.inner.poll(xfer)

    def wait(self, xfer: Any, deadline: float) -> bool | None:
        """A device-path post blocks on its CUDA event; the backend's own, as the backend says."""
        return PathBackend.wait(self, xfer, deadline) if xfer.__class__ is _Device else self.inner.wait(xfer, deadline)

    def release(self, xfer: Any) -> None:
        if xfer.__class__ is _Device:
            PathBackend.release(self, xfer)
        else:
            self.inner.release(xfer)

    def data_path(self, xfer: Any) -> str | None:
        return PathBackend.data_path(self, xfer) if xfer.__class__ is _Device else self.inner.data_path(xfer)

    def telemetry(self, xfer: Any) -> Mapping[str, Any] | None:
        return None if xfer.__class__ is _Device else self.inner.telemetry(xfer)

    def stall_hint(self, peer: str | None) -> str | None:
        return self.inner.stall_hint(peer)

    # -- the rest is the backend's ---------------------------------------------------------------
    def file_path(self) -> Any:
        return self.inner.file_path()

    def notify(self, peer: str, message: bytes) -> None:
        self.inner.notify(peer, message)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        return self.inner.drain_notifications()

    def progress(self) -> None:
        self.inner.progress()

    def close(self) -> None:
        """Device copies end first (they are waited for), then the backend."""
        super().close()
        try:
            self.device.close()
        finally:
            self.inner.close()


def _inner(listed: Listed) -> Any:
    if listed.inner is None:
        raise UnsupportedError("the device path cannot serve this pair and the backend does not move VRAM")
    return listed.inner
