"""The CUDA runtime and driver, through ctypes: the only native code the device path calls.

Why ctypes and not torch or cuda-python: the path must work in any engine process (torch,
JAX, a C++ host) and ``import kvxfer`` must stay free of them. The runtime already mapped
into the process (torch's, usually) is reused, so one primary context per GPU is shared with
the engine; the driver library ships with the GPU driver itself.

Every call goes through :func:`check`, which turns a CUDA status into :class:`CudaError`
(a :class:`~kvxfer.errors.BackendError`) carrying the runtime's own message.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any

from ..errors import BackendError

__all__ = ["CudaError", "Cuda", "cuda", "why_not", "IPC_HANDLE_BYTES"]

IPC_HANDLE_BYTES = 64
NOT_READY = 600  # cudaErrorNotReady
PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled

c_int, c_uint, c_size_t, c_void_p, c_ulonglong = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p, \
    ctypes.c_ulonglong


class CudaError(BackendError):
    """A CUDA call failed; ``code`` is the runtime or driver status."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class MemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", c_uint)]


class MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", c_int)]


# runtime / driver prototypes: name -> (argtypes, restype int)
_RT: dict[str, list[Any]] = {
    "cudaRuntimeGetVersion": [ctypes.POINTER(c_int)],
    "cudaGetDeviceCount": [ctypes.POINTER(c_int)],
    "cudaGetDevice": [ctypes.POINTER(c_int)],
    "cudaSetDevice": [c_int],
    "cudaFree": [c_void_p],
    "cudaMalloc": [ctypes.POINTER(c_void_p), c_size_t],
    "cudaGetLastError": [],
    "cudaGetErrorString": [c_int],
    "cudaDeviceCanAccessPeer": [ctypes.POINTER(c_int), c_int, c_int],
    "cudaDeviceEnablePeerAccess": [c_int, c_uint],
    "cudaIpcGetMemHandle": [ctypes.POINTER(IpcHandle), c_void_p],
    "cudaIpcOpenMemHandle": [ctypes.POINTER(c_void_p), IpcHandle, c_uint],
    "cudaIpcCloseMemHandle": [c_void_p],
    "cudaStreamCreateWithFlags": [ctypes.POINTER(c_void_p), c_uint],
    "cudaStreamSynchronize": [c_void_p],
    "cudaEventCreateWithFlags": [ctypes.POINTER(c_void_p), c_uint],
    "cudaEventRecord": [c_void_p, c_void_p],
    "cudaEventQuery": [c_void_p],
    "cudaEventSynchronize": [c_void_p],
    "cudaEventDestroy": [c_void_p],
    "cudaMemcpyAsync": [c_void_p, c_void_p, c_size_t, c_int, c_void_p],
    "cudaMemsetAsync": [c_void_p, c_int, c_size_t, c_void_p],
    "cudaHostAlloc": [ctypes.POINTER(c_void_p), c_size_t, c_uint],
    "cudaFreeHost": [c_void_p],
    "cudaHostGetDevicePointer": [ctypes.POINTER(c_void_p), c_void_p, c_uint],
}
_DRV: dict[str, list[Any]] = {
    "cuInit": [c_uint],
    "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
    "cuDeviceGetUuid": [ctypes.c_char_p, c_int],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(c_ulonglong), ctypes.POINTER(c_size_t), c_ulonglong],
    "cuModuleLoadData": [ctypes.POINTER(c_void_p), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(c_void_p), c_void_p, ctypes.c_char_p],
    "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                       ctypes.POINTER(c_void_p), ctypes.POINTER(c_void_p)],
    "cuGetErrorString": [c_int, ctypes.POINTER(ctypes.c_char_p)],
    # virtual memory management (expandable segments)
    "cuMemRetainAllocationHandle": [ctypes.POINTER(c_ulonglong), c_void_p],
    "cuMemRelease": [c_ulonglong],
    "cuMemExportToShareableHandle": [c_void_p, c_ulonglong, c_int, c_ulonglong],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(c_ulonglong), c_void_p, c_int],
    "cuMemAddressReserve": [ctypes.POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong, c_ulonglong],
    "cuMemAddressFree": [c_ulonglong, c_size_t],
    "cuMemMap": [c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong],
    "cuMemUnmap": [c_ulonglong, c_size_t],
    "cuMemSetAccess": [c_ulonglong, c_size_t, ctypes.POINTER(MemAccessDesc), c_size_t],
}


class Cuda:
    """Typed entry points of one CUDA runtime and the driver, plus small helpers."""

    def __init__(self, rt: ctypes.CDLL, drv: ctypes.CDLL) -> None:
        self.rt, self.drv = rt, drv
        for lib, table in ((rt, _RT), (drv, _DRV)):
            for name, args in table.items():
                fn = getattr(lib, name, None)
                if fn is None:
                    continue
                fn.argtypes = args
                fn.restype = ctypes.c_char_p if name == "cudaGetErrorString" else c_int
        v = c_int(0)
        self.check(rt.cudaRuntimeGetVersion(ctypes.byref(v)), "cudaRuntimeGetVersion")
        self.version = v.value
        self.batch = getattr(rt, "cudaMemcpyBatchAsync", None) if self.version >= 12080 else None
        if self.batch is not None:
            self.batch.restype = c_int
        self.check_drv(drv.cuInit(0), "cuInit")
        n = c_int(0)
        self.check(rt.cudaGetDeviceCount(ctypes.byref(n)), "cudaGetDeviceCount")
        self.device_count = n.value
        self._lock = threading.Lock()
        self._peer_enabled: set[tuple[int, int]] = set()

    # -- errors -------------------------------------------------------------------------
    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.rt.cudaGetErrorString(rc)
            self.rt.cudaGetLastError()  # clear a non-sticky error so later calls start clean
            raise CudaError(f"{what} failed: CUDA error {rc} ({(msg or b'?').decode(errors='replace')})", rc)

    def check_drv(self, rc: int, what: str) -> None:
        if rc != 0:
            s = ctypes.c_char_p()
            self.drv.cuGetErrorString(rc, ctypes.byref(s))
            raise CudaError(f"{what} failed: CUDA driver error {rc} ({(s.value or b'?').decode(errors='replace')})",
                            rc)

    # -- devices ------------------------------------------------------------------------
    def current(self) -> int:
        d = c_int(0)
        self.check(self.rt.cudaGetDevice(ctypes.byref(d)), "cudaGetDevice")
        return d.value

    def on(self, device: int) -> "_OnDevice":
        """Context manager: run CUDA calls on ``device``, then restore the caller's device."""
        return _OnDevice(self, device)

    def uuid(self, device: int) -> bytes:
        dev = c_int(0)
        self.check_drv(self.drv.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        buf = ctypes.create_string_buffer(16)
        fn = getattr(self.drv, "cuDeviceGetUuid_v2", None) or self.drv.cuDeviceGetUuid
        fn.argtypes, fn.restype = [ctypes.c_char_p, c_int], c_int
        self.check_drv(fn(buf, dev.value), "cuDeviceGetUuid")
        return buf.raw

    def can_access_peer(self, device: int, peer: int) -> bool:
        if device == peer:
            return True
        ok = c_int(0)
        self.check(self.rt.cudaDeviceCanAccessPeer(ctypes.byref(ok), device, peer), "cudaDeviceCanAccessPeer")
        return bool(ok.value)

    def enable_peer(self, device: int, peer: int) -> None:
        """Let ``device`` reach ``peer`` directly: without it, copies between two GPUs of one
        process were staged through the host and ran at 31 GB/s instead of the link's ~390."""
        if device == peer or (device, peer) in self._peer_enabled:
            return
        with self._lock, self.on(device):
            rc = self.rt.cudaDeviceEnablePeerAccess(peer, 0)
            if rc not in (0, PEER_ALREADY_ENABLED):
                self.check(rc, f"enabling peer access {device} -> {peer}")
            self.rt.cudaGetLastError()
            self._peer_enabled.add((device, peer))

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation (or mapping) holding ``ptr``."""
        base, size = c_ulonglong(0), c_size_t(0)
        self.check_drv(self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                       f"cuMemGetAddressRange({ptr:#x})")
        return int(base.value), int(size.value)


_primed = threading.local()  # per thread: the devices whose primary context cudaSetDevice made current here


class _OnDevice:
    __slots__ = ("c", "device", "prev")

    def __init__(self, c: Cuda, device: int) -> None:
        self.c, self.device, self.prev = c, device, -1

    def __enter__(self) -> None:
        self.prev = self.c.current()
        done = getattr(_primed, "devices", None)
        if done is None:
            done = _primed.devices = set()
        if self.prev == self.device and self.device in done:
            return  # the hot path of a post: one query, no switch
        # Set once per thread and device: it also makes the primary context current on a thread
        # that has none yet, which the driver-API calls (module loading, launches, VMM) need.
        self.c.check(self.c.rt.cudaSetDevice(self.device), f"cudaSetDevice({self.device})")
        done.add(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.prev != self.device and self.prev >= 0:
            self.c.rt.cudaSetDevice(self.prev)


_state: dict[str, Any] = {"cuda": None, "why": None, "probed": False}
_probe_lock = threading.Lock()


def _candidates(stem: str) -> list[str]:
    """Libraries named ``stem`` already mapped here first (torch's), then the usual names."""
    mapped: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "/" in ln}
        mapped = sorted((p for p in paths if os.path.basename(p).startswith(stem + ".so")), reverse=True)
    except OSError:
        pass
    names = [f"{stem}.so.13", f"{stem}.so.12", f"{stem}.so"] if stem == "libcudart" else [f"{stem}.so.1"]
    extra: list[str] = []
    if stem == "libcudart":  # pip's nvidia-cuda-runtime wheels
        for d in (p for p in __import__("sys").path if p.endswith("site-packages")):
            extra += sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so.*")), reverse=True)
            extra += sorted(glob.glob(os.path.join(d, "nvidia", "cuda_runtime", "lib", "libcudart.so.*")),
                            reverse=True)
    return mapped + names + extra


def _load(stem: str) -> ctypes.CDLL:
    errors = []
    for name in _candidates(stem):
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise OSError(f"no {stem} could be loaded ({'; '.join(errors[-2:])})")


def cuda() -> Cuda | None:
    """The process-wide :class:`Cuda`, or ``None`` when no usable CUDA is here (see :func:`why_not`)."""
    if _state["probed"]:
        return _state["cuda"]  # type: ignore[no-any-return]
    with _probe_lock:
        if not _state["probed"]:
            try:
                if os.environ.get("KVXFER_NO_CUDA"):
                    raise RuntimeError("KVXFER_NO_CUDA is set")
                c = Cuda(_load("libcudart"), _load("libcuda"))
                if c.device_count < 1:
                    raise RuntimeError("CUDA sees no device")
                _state["cuda"] = c
            except Exception as exc:  # any failure means: the transport moves the bytes
                _state["why"] = f"{type(exc).__name__}: {exc}"
            _state["probed"] = True
    return _state["cuda"]  # type: ignore[no-any-return]


def why_not() -> str | None:
    """Why :func:`cuda` returned ``None`` (for logs, stats and tests)."""
    cuda()
    return _state["why"]  # type: ignore[no-any-return]
