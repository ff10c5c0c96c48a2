"""The real :class:`~kvxfer.cuda.decide.Capability`: CUDA through ctypes, pidfds for liveness."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..errors import BackendError
from ..integrity import set_mm8_kernel
from ..memory import Allocation
from . import blob, ipc
from ._driver import Cuda, cuda, why_not
from .copy import Copier, CopyHandle
from .. import peers
from ..peers import Identity, Page, ProcessWatch, Proven

__all__ = ["CudaCapability", "cuda_capability", "mm8_cells"]


class CudaCapability:
    """One per process: CUDA entry points, the copier, and a uuid -> ordinal table."""

    def __init__(self) -> None:
        self._c: Cuda | None = None
        self._copier: Copier | None = None
        self._uuids: dict[bytes, int] | None = None

    @property
    def c(self) -> Cuda:
        if self._c is None:
            self._c = cuda()  # probed on first need: DRAM-only agents never load CUDA
            if self._c is None:
                raise BackendError(f"no usable CUDA here: {why_not()}")
            self._copier = Copier(self._c)
        return self._c

    def why_not(self) -> str | None:
        return None if cuda() is not None else why_not()

    def identity(self) -> Identity:
        return peers.here()

    def page(self) -> Page:
        return peers.process_page()

    def prove(self, claim: Identity, what: str) -> Proven:
        return peers.prove(claim, what)

    def device_of(self, uuid: bytes) -> int | None:
        if self._uuids is None:
            self._uuids = {self.c.uuid(d): d for d in range(self.c.device_count)}
        return self._uuids.get(bytes(uuid))

    def can_access(self, device: int, peer: int) -> bool:
        return self.c.can_access_peer(device, peer) and self.c.can_access_peer(peer, device)

    def export(self, allocations: Sequence[Allocation]) -> ipc.Exported:
        return ipc.export(self.c, allocations)

    def open(self, exp: blob.Export, handle: int, device: int, access: Sequence[int],
             proc: ProcessWatch | None) -> ipc.Mapping:
        return ipc.open_handle(self.c, exp, handle, device, access, proc)

    def close(self, mapping: ipc.Mapping) -> None:
        ipc.close_mapping(self.c, mapping)

    def peer_process(self, pid: int, started: int) -> ProcessWatch:
        return ProcessWatch(pid, started, every=0)  # every poll: no byte from a dead peer is trusted

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int, engine: str,
             src_device: int | None, dst_device: int | None) -> CopyHandle:
        self.c  # noqa: B018 (creates the copier)
        assert self._copier is not None
        return self._copier.copy(dst, src, sizes, device, engine=engine, src_device=src_device,
                                 dst_device=dst_device)

    def copy_mm8(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int,
                 src_device: int | None, dst_device: int | None) -> CopyHandle | None:
        """The fused copy and mm8 (one read of the bytes), or None where its kernel cannot serve."""
        from . import digest

        c = self.c  # creates the copier
        assert self._copier is not None
        for other in (src_device, dst_device):
            if other is not None and other != device:
                c.enable_peer(device, other)
        return digest.post(self._copier, device, src, sizes, dst)

    def digests(self, handle: CopyHandle) -> np.ndarray:
        from . import digest

        assert self._copier is not None
        return digest.result(self._copier, handle)

    def query(self, handle: CopyHandle) -> bool:
        assert self._copier is not None
        return self._copier.query(handle)

    def wait(self, handle: CopyHandle, deadline: float) -> bool:
        assert self._copier is not None
        return self._copier.wait(handle, deadline)

    def fence(self, handle: CopyHandle) -> bool:
        assert self._copier is not None
        return self._copier.fence(handle)

    def synchronize(self, handle: CopyHandle) -> None:
        assert self._copier is not None
        self._copier.synchronize(handle)

    def sync_all(self) -> None:
        if self._copier is not None:
            self._copier.sync_all()

    def kernel_error(self, device: int) -> str | None:
        self.c  # noqa: B018 (creates the copier)
        assert self._copier is not None
        return self._copier.kernel_error(device)


_cap: dict[str, Any] = {}
_cap_lock = threading.Lock()


def cuda_capability() -> CudaCapability:
    """The process-wide capability (created on first use: probing CUDA costs a context)."""
    with _cap_lock:
        if "cap" not in _cap:
            _cap["cap"] = CudaCapability()
        return _cap["cap"]  # type: ignore[no-any-return]


def mm8_cells(addr: np.ndarray, lengths: np.ndarray, devices: list[int]) -> np.ndarray | None:
    """``[B, C]`` mm8 digests of cells at ``addr`` ``[B, C]`` (``lengths`` ``[C]``; column ``c``
    on GPU ``devices[c]``) through the process's copier; ``None`` where the kernel cannot serve."""
    from .digest import mm8

    cap = cuda_capability()
    if cap.why_not() is not None:
        return None
    cap.c  # noqa: B018 (creates the copier)
    assert cap._copier is not None
    out = np.empty(addr.shape, np.uint64)
    dev = np.asarray(devices, dtype=np.int64)
    full = np.broadcast_to(np.asarray(lengths, np.uint64)[None, :], addr.shape)
    for g in np.unique(dev).tolist():
        m = dev == g
        got = mm8(cap._copier, int(g), addr[:, m].ravel(), full[:, m].ravel())
        if got is None:
            return None
        out[:, m] = got.reshape(addr.shape[0], -1)
    return out


set_mm8_kernel(mm8_cells)  # VRAM mm8 digests take the kernel once the device path loads
