"""Exporting registered VRAM as CUDA IPC handles, and opening a peer's handles once.

Two routes, picked per allocation by what the memory is:

* ``cudaMalloc`` memory (PyTorch's default allocator): ``cudaIpcGetMemHandle`` on the base of
  the allocation holding the registered span; the peer maps it with ``cudaIpcOpenMemHandle``.
* VMM memory (PyTorch's expandable segments, ``cuMemCreate`` + ``cuMemMap``): legacy handles
  refuse it. Each mapping's physical allocation is exported as a POSIX file descriptor
  (``cuMemExportToShareableHandle``); the peer copies the descriptor out of the exporter with
  ``pidfd_getfd`` and maps every piece at the same offsets of one reserved range.

Opened handles live in one process-wide table with reference counts: two agents of one
process that add the same peer share its mappings, and the last one to let go unmaps. The
table is keyed by the handle's own bytes and the exporter's proven identity, never by what
a peer claims alone: a second claimant of a process's identity cannot be handed its mappings.
Every mapping's size is read back from the driver, so a peer that overstates a handle's size
cannot make a copy run past what was really mapped.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..memory import Allocation, MemoryKind
from . import blob
from ._driver import IPC_HANDLE_BYTES, Cuda, CudaError, IpcHandle, MemAccessDesc, MemLocation
from ..peers import ProcessWatch, pidfd_getfd

__all__ = ["Exported", "Mapping", "export", "open_handle", "close_mapping", "open_mappings"]

_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_ACCESS_RW = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_LOC_DEVICE = 1
_VA_ALIGN = 2 << 20  # the VMM granularity of current GPUs: every exported piece starts on it


@dataclass
class Exported:
    """What :func:`export` made: records for the blob, and descriptors to close later."""

    devices: list[bytes] = field(default_factory=list)
    handles: list[tuple[Any, ...]] = field(default_factory=list)
    chunks: list[tuple[int, int, bytes]] = field(default_factory=list)
    allocs: list[tuple[int, int, int]] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # allocations that could not be exported, and why

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def handle_bytes(handle: IpcHandle) -> bytes:
    """All 64 bytes of a handle (``handle.reserved`` would stop at the first NUL byte)."""
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)


def export(c: Cuda, allocations: Sequence[Allocation]) -> Exported:
    """Export every VRAM allocation it can; the others are listed in ``errors`` (they fall back)."""
    out = Exported()
    dev_index: dict[int, int] = {}
    by_base: dict[tuple[int, int], int] = {}
    for a in allocations:
        if a.kind is not MemoryKind.VRAM:
            continue
        try:
            if a.device not in dev_index:
                dev_index[a.device] = len(out.devices)
                out.devices.append(c.uuid(a.device))
            with c.on(a.device):
                h = _export_one(c, a, dev_index[a.device], by_base, out)
            out.allocs.append((a.address, a.nbytes, h))
        except (CudaError, OSError) as exc:
            out.errors.append(f"{a.nbytes} bytes at {a.address:#x} on GPU {a.device}: {exc}")
    return out


def _export_one(c: Cuda, a: Allocation, dev: int, by_base: dict[tuple[int, int], int], out: Exported) -> int:
    base, size = c.address_range(a.address)
    key = (a.device, base)
    if key in by_base and a.end <= base + size:
        return by_base[key]
    if a.end <= base + size:
        handle = IpcHandle()
        rc = c.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base))
        if rc == 0:
            by_base[key] = len(out.handles)
            out.handles.append((blob.KIND_LEGACY, dev, base, size, len(out.chunks), 1))
            out.chunks.append((0, size, handle_bytes(handle)))
            return by_base[key]
        c.rt.cudaGetLastError()
    return _export_vmm(c, a, dev, by_base, out)


def _export_vmm(c: Cuda, a: Allocation, dev: int, by_base: dict[tuple[int, int], int], out: Exported) -> int:
    """Walk the VMM mappings under ``a``; export each physical piece as a file descriptor."""
    first_chunk = len(out.chunks)
    start, ptr = -1, a.address
    while ptr < a.end:
        base, size = c.address_range(ptr)
        if start < 0:
            start = base
        g = ctypes.c_ulonglong(0)
        c.check_drv(c.drv.cuMemRetainAllocationHandle(ctypes.byref(g), ctypes.c_void_p(base)),
                    "cuMemRetainAllocationHandle (neither cudaMalloc nor VMM memory?)")
        fd = ctypes.c_int(-1)
        try:
            c.check_drv(c.drv.cuMemExportToShareableHandle(ctypes.byref(fd), g.value, _POSIX_FD, 0),
                        "cuMemExportToShareableHandle (allocated without a POSIX file descriptor handle type?)")
        finally:
            c.drv.cuMemRelease(g.value)
        out.fds.append(fd.value)
        out.chunks.append((base - start, size, int(fd.value).to_bytes(4, "little").ljust(IPC_HANDLE_BYTES, b"\0")))
        ptr = base + size
    out.handles.append((blob.KIND_VMM, dev, start, ptr - start, first_chunk, len(out.chunks) - first_chunk))
    by_base[(a.device, start)] = len(out.handles) - 1
    return len(out.handles) - 1


# --------------------------------------------------------------------------------------------
# The importer side: one process-wide table of opened handles
# --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Mapping:
    """One opened handle: ``local`` is where the peer's ``[base, base+size)`` appears here."""

    key: tuple[Any, ...]
    kind: int
    device: int  # the GPU whose context opened it
    local: int
    size: int
    refs: int = 1
    vmm: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, size, generic handle)


_table: dict[tuple[Any, ...], Mapping] = {}
_table_lock = threading.Lock()


def open_mappings() -> int:
    """How many peer handles this process has mapped now (0 once every peer is gone)."""
    with _table_lock:
        return len(_table)


def handle_key(exp: blob.Export, h: int, device: int) -> tuple[Any, ...]:
    """What two imports must share to share a mapping: the exporter (proven by the caller), the
    handle's span and kind, and every byte of its chunks (IPC handles, or VMM offsets and fds)."""
    rec = exp.handles[h]
    i = exp.identity
    chunks = exp.chunks[int(rec["first"]): int(rec["first"]) + int(rec["count"])]
    return (i.boot_id, i.pid, i.start_time, i.token, int(rec["kind"]), int(rec["base"]), int(rec["size"]), device,
            chunks.tobytes())


def open_handle(c: Cuda, exp: blob.Export, h: int, device: int, access: Sequence[int],
                peer: ProcessWatch | None) -> Mapping:
    """Map handle ``h`` of ``exp`` in GPU ``device``'s context (the one that will run the copies),
    or take another reference to it. ``access``: GPUs that must reach VMM mappings too. The
    caller has proven that ``exp`` is its exporter's own (:meth:`DevicePath.add_peer`)."""
    rec = exp.handles[h]
    key = handle_key(exp, h, device)
    with _table_lock:
        m = _table.get(key)
        if m is not None:
            m.refs += 1
            return m
        chunks = exp.chunks[int(rec["first"]): int(rec["first"]) + int(rec["count"])]
        with c.on(device):
            if int(rec["kind"]) == blob.KIND_LEGACY:
                m = _open_legacy(c, key, chunks[0], int(rec["size"]), device)
            else:
                if peer is None or peer.fd < 0:
                    raise CudaError("VMM handles need the exporter's pidfd")
                m = _open_vmm(c, key, chunks, int(rec["size"]), device, access, peer)
        _table[key] = m
        return m


def _open_legacy(c: Cuda, key: tuple[Any, ...], chunk: np.void, size: int, device: int) -> Mapping:
    handle = IpcHandle()
    ctypes.memmove(ctypes.addressof(handle), bytes(chunk["payload"]), IPC_HANDLE_BYTES)
    ptr = ctypes.c_void_p()
    c.check(c.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), handle, _LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle")
    local = int(ptr.value or 0)
    try:
        base, real = c.address_range(local)
        if base != local or real < size:
            raise CudaError(f"peer handle claims {size} bytes but maps {real} at {base:#x}")
    except CudaError:
        c.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(local))
        raise
    return Mapping(key, blob.KIND_LEGACY, device, local, size)


def _open_vmm(c: Cuda, key: tuple[Any, ...], chunks: np.ndarray, size: int, device: int, access: Sequence[int],
              peer: ProcessWatch) -> Mapping:
    va = ctypes.c_ulonglong(0)
    c.check_drv(c.drv.cuMemAddressReserve(ctypes.byref(va), size, _VA_ALIGN, 0, 0), "cuMemAddressReserve")
    m = Mapping(key, blob.KIND_VMM, device, int(va.value), size)
    try:
        for ch in chunks:
            fd = pidfd_getfd(peer.fd, int.from_bytes(bytes(ch["payload"])[:4], "little", signed=True))
            g = ctypes.c_ulonglong(0)
            try:
                c.check_drv(c.drv.cuMemImportFromShareableHandle(ctypes.byref(g), ctypes.c_void_p(fd), _POSIX_FD),
                            "cuMemImportFromShareableHandle")
            finally:
                os.close(fd)
            off, n = int(ch["offset"]), int(ch["size"])
            rc = c.drv.cuMemMap(m.local + off, n, 0, g.value, 0)
            if rc != 0:
                c.drv.cuMemRelease(g.value)
                c.check_drv(rc, "cuMemMap")
            m.vmm.append((off, n, int(g.value)))
        devs = sorted({device, *access})
        desc = (MemAccessDesc * len(devs))(*[MemAccessDesc(MemLocation(_LOC_DEVICE, d), _ACCESS_RW) for d in devs])
        c.check_drv(c.drv.cuMemSetAccess(m.local, size, desc, len(devs)), "cuMemSetAccess")
    except BaseException:
        _unmap(c, m)
        raise
    return m


def close_mapping(c: Cuda, m: Mapping) -> None:
    """Drop one reference; the last one unmaps. Callers make sure no copy still uses it."""
    with _table_lock:
        m.refs -= 1
        if m.refs > 0:
            return
        _table.pop(m.key, None)
    with c.on(m.device):
        _unmap(c, m)


def _unmap(c: Cuda, m: Mapping) -> None:
    if m.kind == blob.KIND_LEGACY:
        c.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(m.local))
        c.rt.cudaGetLastError()
        return
    for off, n, g in m.vmm:
        c.drv.cuMemUnmap(m.local + off, n)
        c.drv.cuMemRelease(g)
    m.vmm.clear()
    c.drv.cuMemAddressFree(m.local, m.size)
