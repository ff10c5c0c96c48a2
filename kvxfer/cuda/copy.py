"""Batched copies on a private stream: every descriptor of a post in one call.

Two engines move a post's ``(dst, src, len)`` spans:

* ``"sm"``: one launch of the copy kernel in ``batch_copy.cu`` over a table of pieces (long
  spans cut to at most :data:`PIECE` bytes, finer for small posts, so all SMs share the work). The table travels in a
  pinned slot, so posting never waits for an earlier copy. A post of at most :data:`FEW` spans
  (one block, usually) skips the table: its spans go by value to ``kvxfer_copy_few``, whose
  launch shape is prepared once per shape (the span lengths) and reused, so posting costs one
  launch and one event record.
* ``"ce"``: one ``cudaMemcpyBatchAsync`` (CUDA 12.8+): the copy engines, no SM time taken
  from the engine's own kernels.

Completion is one CUDA event recorded after the copy: :meth:`Copier.query` looks once,
:meth:`Copier.wait` waits on it until a deadline (no naps: a one-block copy ends in ~20 us,
and a nap of even 1 us sleeps the kernel's timer slack, ~50 us). Every event carries a
*gate*, a word of pinned host memory: :meth:`Copier.fence` closes it, so a copy that missed its
deadline writes no piece it had not begun (the fence: nothing lands after a transfer has ended).
One block of each gated launch watches that word and mirrors it into device memory, where the
other blocks read it before each piece (``Gate`` in batch_copy.cu: the GPU reads host memory
about one read at a time, too slowly for every block to read it). The copy engines (``"ce"``) have no gate; their
posts are waited for. Nothing here knows about peers or bounds: callers pass spans they
have already checked.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._driver import NOT_READY, Cuda, CudaError, MemcpyAttributes, MemLocation

__all__ = ["FEW", "PIECE", "Copier", "CopyHandle", "few_shape", "launch_grid", "piece_size", "pieces"]

#: Longest piece one CTA copies: long spans are cut so a few huge ones still use every SM.
PIECE = 1 << 20
#: Shortest piece worth a CTA of its own (one unrolled sweep of 512 threads x 4 x 16 bytes).
MIN_PIECE = 32 << 10
#: Small posts are cut finer, so that even one 4.5 MB row is spread over this many CTAs or so.
TARGET_PIECES = 1024
THREADS = 512  # must match batch_copy.cu
#: Spans a post may have to go by value (``struct Few`` in batch_copy.cu: n, piece, first[FEW+1],
#: dst[FEW], src[FEW], len[FEW], gate, all uint64).
FEW = 16
_FEW_WORDS = 2 + (FEW + 1) + 3 * FEW + 1
_MAX_SHAPES = 1024  # prepared launch shapes kept per device (a serving engine repeats a handful)
_SRC_ACCESS_ORDER_STREAM = 1
_LOC_DEVICE, _LOC_HOST = 1, 2
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_H2D = 1
_HOST_MAPPED = 3  # cudaHostAllocPortable | cudaHostAllocMapped: the watcher reads the gate where it lies
_GATE_WORDS = 3  # struct Gate in batch_copy.cu: host, state, finished
#: A gated launch's extra block (block 0): the watcher that mirrors the host's gate word.
WATCHER = 1
#: Worker blocks of one launch at most: CUDA's grid limit, less the watcher's block.
_MAX_WORKERS = (1 << 31) - 2


def launch_grid(workers: int, gated: bool) -> int:
    """The grid of a launch of ``workers`` worker blocks (at least one, at most
    :data:`_MAX_WORKERS`), plus the watcher where the launch is gated."""
    return max(1, min(workers, _MAX_WORKERS)) + (WATCHER if gated else 0)


def piece_size(total: int) -> int:
    """Piece size for a post of ``total`` bytes: a power of two in [MIN_PIECE, PIECE]."""
    want = max(1, total // TARGET_PIECES)
    return min(PIECE, max(MIN_PIECE, 1 << (want - 1).bit_length()))


def pieces(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, piece: int | None = None) -> np.ndarray:
    """The kernel's table: ``[dst..., src..., len...]`` (uint64) with no piece over ``piece`` bytes."""
    sizes = np.asarray(sizes, dtype=np.uint64)
    dst = np.asarray(dst, dtype=np.uint64)
    src = np.asarray(src, dtype=np.uint64)
    n = sizes.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    longest = int(sizes.max())
    if piece is None:
        piece = piece_size(int(sizes.sum()))
    if longest <= piece:
        return np.concatenate([dst, src, sizes])
    if int(sizes.min()) == longest:  # the common case (whole rows, pages): one broadcast
        off = np.arange(0, longest, piece, dtype=np.uint64)
        ln = np.minimum(np.uint64(longest) - off, np.uint64(piece))
        return np.concatenate([(dst[:, None] + off).ravel(), (src[:, None] + off).ravel(), np.tile(ln, n)])
    k = ((sizes + np.uint64(piece - 1)) // np.uint64(piece)).astype(np.int64)
    rep = np.repeat(np.arange(n), k)
    first = np.cumsum(k) - k
    off = ((np.arange(int(k.sum()), dtype=np.int64) - np.repeat(first, k)) * piece).astype(np.uint64)
    return np.concatenate([dst[rep] + off, src[rep] + off, np.minimum(sizes[rep] - off, np.uint64(piece))])


def few_shape(sizes: np.ndarray) -> tuple[int, np.ndarray]:
    """``(piece, first)`` of a post of at most :data:`FEW` spans: span ``i`` owns pieces
    ``first[i] .. first[i+1]-1``; ``first[-1]`` is the grid."""
    piece = piece_size(int(sizes.sum()))
    counts = (sizes.astype(np.uint64) + np.uint64(piece - 1)) // np.uint64(piece)
    return piece, np.concatenate([np.zeros(1, np.uint64), np.cumsum(counts, dtype=np.uint64)])


@dataclass(eq=False)
class _Slot:
    """A pinned host buffer and a device buffer of one capacity: one post's kernel table."""

    host: int
    dev: int
    cap: int
    view: np.ndarray


@dataclass(eq=False)
class CopyHandle:
    """One enqueued batch: its event, and what must stay alive until the event fires."""

    device: int
    event: int
    slot: _Slot | None = None
    keep: tuple[Any, ...] = ()
    done: bool = False
    spans: int = 0
    engine: str = ""
    gate: int = 0  # host address of this post's gate word (0: no gate, the copy engines)
    fenced: bool = False
    out: Any = None  # an mm8 post's (sums slot, cell lengths): kvxfer.cuda.digest.result reads it


@dataclass(eq=False)
class _Device:
    stream: int
    module: int | None = None
    functions: dict[str, int] = field(default_factory=dict)
    kernel_error: str | None = None
    free_slots: list[_Slot] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    # event -> (host word, device Gate) addresses of its gate; the Gate is [host word's device
    # address, state, finished] (batch_copy.cu), zeroed by each launch that used it
    gates: dict[int, tuple[int, int]] = field(default_factory=dict)
    # the prepared post: launch shapes by span lengths, and one parameter block passed by value
    # (cuLaunchKernel copies it at the call, so it is refilled under a lock and reused)
    shapes: dict[bytes, tuple[int, np.ndarray, int]] = field(default_factory=dict)
    few: np.ndarray = field(default_factory=lambda: np.zeros(_FEW_WORDS, np.uint64))
    few_args: Any = None
    few_lock: threading.Lock = field(default_factory=threading.Lock)


class Copier:
    """Per-device private streams, the copy kernel, table slots and events, for one process."""

    def __init__(self, c: Cuda) -> None:
        self.c = c
        self._devices: dict[int, _Device] = {}
        self._lock = threading.Lock()
        self._pool = threading.Lock()  # slots and events: posted by callers, recycled by pollers

    # -- per-device state ----------------------------------------------------------------
    def _device(self, device: int) -> _Device:
        d = self._devices.get(device)
        if d is not None:
            return d
        with self._lock:
            d = self._devices.get(device)
            if d is None:
                s = ctypes.c_void_p()
                with self.c.on(device):
                    # The batch API refuses the legacy default stream; a private stream also keeps
                    # our copies from serializing behind the engine's kernels.
                    self.c.check(self.c.rt.cudaStreamCreateWithFlags(ctypes.byref(s), _STREAM_NON_BLOCKING),
                                 "cudaStreamCreateWithFlags")
                d = _Device(int(s.value or 0))
                self._devices[device] = d
        return d

    def kernel_error(self, device: int) -> str | None:
        """Why the SM engine cannot run on ``device`` (``None``: it can)."""
        self._function(device)
        return self._device(device).kernel_error

    def _function(self, device: int, name: str = "kvxfer_batch_copy") -> int | None:
        d = self._device(device)
        fn = d.functions.get(name)
        if fn is not None or d.kernel_error is not None:
            return fn
        from ._ptx import PTX

        try:
            with self.c.on(device):
                if d.module is None:
                    mod = ctypes.c_void_p()
                    self.c.check_drv(self.c.drv.cuModuleLoadData(ctypes.byref(mod), PTX.encode() + b"\0"),
                                     "loading the copy kernel")
                    d.module = int(mod.value or 0)
                f = ctypes.c_void_p()
                self.c.check_drv(self.c.drv.cuModuleGetFunction(ctypes.byref(f), d.module, name.encode()),
                                 f"cuModuleGetFunction({name})")
            fn = d.functions[name] = int(f.value or 0)
        except CudaError as exc:
            d.kernel_error = str(exc)
        return fn

    def _event(self, d: _Device) -> int:
        """A recycled (or new) event whose gate is open: each event owns one gate word for life."""
        with self._pool:
            ev = d.events.pop() if d.events else 0
        if not ev:
            e = ctypes.c_void_p()
            self.c.check(self.c.rt.cudaEventCreateWithFlags(ctypes.byref(e), _EVENT_DISABLE_TIMING),
                         "cudaEventCreateWithFlags")
            ev = int(e.value or 0)
            d.gates[ev] = self._gate(d)
        host = d.gates[ev][0]
        if host:
            ctypes.c_uint64.from_address(host).value = 0
        return ev

    def _gate(self, d: _Device) -> tuple[int, int]:
        """A new gate: its host word (open) and its device ``Gate`` (state 0, nothing finished).

        The host allocation holds the word and, after it, the ``Gate``'s first contents, so
        that they go up on the copier's stream, ahead of any launch that uses the gate, without
        waiting for the stream (pinned memory: the upload needs no staging)."""
        h, g, dev = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self.c.check(self.c.rt.cudaHostAlloc(ctypes.byref(h), 8 * (1 + _GATE_WORDS), _HOST_MAPPED), "cudaHostAlloc(gate)")
        self.c.check(self.c.rt.cudaHostGetDevicePointer(ctypes.byref(g), h, 0), "cudaHostGetDevicePointer")
        self.c.check(self.c.rt.cudaMalloc(ctypes.byref(dev), 8 * _GATE_WORDS), "cudaMalloc(gate)")
        host = int(h.value or 0)
        words = (ctypes.c_uint64 * (1 + _GATE_WORDS)).from_address(host)
        words[:] = [0, int(g.value or 0), 0, 0]
        self.c.check(self.c.rt.cudaMemcpyAsync(dev, host + 8, 8 * _GATE_WORDS, _H2D, d.stream), "uploading a gate")
        return host, int(dev.value or 0)

    def _slot(self, d: _Device, nbytes: int) -> _Slot:
        with self._pool:
            for i, s in enumerate(d.free_slots):
                if s.cap >= nbytes:
                    return d.free_slots.pop(i)
        cap = max(1 << 16, 1 << (nbytes - 1).bit_length())
        h, g = ctypes.c_void_p(), ctypes.c_void_p()
        self.c.check(self.c.rt.cudaHostAlloc(ctypes.byref(h), cap, 1), "cudaHostAlloc")  # portable
        try:
            self.c.check(self.c.rt.cudaMalloc(ctypes.byref(g), cap), "cudaMalloc")
        except CudaError:
            self.c.rt.cudaFreeHost(h)
            raise
        view = np.ctypeslib.as_array(ctypes.cast(h, ctypes.POINTER(ctypes.c_uint64)), shape=(cap // 8,))
        return _Slot(int(h.value or 0), int(g.value or 0), cap, view)

    # -- copies --------------------------------------------------------------------------
    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int, *, engine: str = "sm",
             src_device: int | None = None, dst_device: int | None = None) -> CopyHandle:
        """Enqueue ``dst[i] <- src[i]`` (``sizes[i]`` bytes) on ``device``'s stream; returns the handle.

        ``src_device``/``dst_device`` are the GPUs holding each side (``None``: host memory,
        CE engine only); peer access is enabled where they differ from ``device``.
        """
        d = self._device(device)
        for other in (src_device, dst_device):
            if other is not None and other != device:
                self.c.enable_peer(device, other)
        with self.c.on(device):
            ev = self._event(d)  # first: the kernel is handed its gate
            try:
                if engine == "sm":
                    h = self._copy_sm(d, dst, src, sizes, device, d.gates[ev])
                else:
                    h = self._copy_ce(d, dst, src, sizes, device, src_device, dst_device)
            except BaseException:
                with self._pool:
                    d.events.append(ev)
                raise
            h.event = ev
            self.c.check(self.c.rt.cudaEventRecord(ev, d.stream), "cudaEventRecord")
        h.spans = int(sizes.shape[0])
        return h

    def _copy_sm(self, d: _Device, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int,
                 gate: tuple[int, int]) -> CopyHandle:
        fn = self._function(device)
        if fn is None:
            raise CudaError(f"the copy kernel is not available on device {device}: {d.kernel_error}")
        if 0 < sizes.shape[0] <= FEW:
            return self._copy_few(d, dst, src, sizes, device, gate)
        table = pieces(dst, src, sizes)
        n = table.shape[0] // 3
        slot = self._slot(d, table.nbytes)
        try:
            slot.view[: table.shape[0]] = table
            self.c.check(self.c.rt.cudaMemcpyAsync(slot.dev, slot.host, table.nbytes, _H2D, d.stream),
                         "uploading the copy table")
            arg_t, arg_n, arg_g = ctypes.c_ulonglong(slot.dev), ctypes.c_ulonglong(n), ctypes.c_ulonglong(gate[1])
            args = (ctypes.c_void_p * 3)(ctypes.addressof(arg_t), ctypes.addressof(arg_n), ctypes.addressof(arg_g))
            grid = launch_grid(n, bool(gate[1]))
            self.c.check_drv(self.c.drv.cuLaunchKernel(fn, grid, 1, 1, THREADS, 1, 1, 0, d.stream, args, None),
                             "launching the copy kernel")
        except BaseException:
            with self._pool:
                d.free_slots.append(slot)
            raise
        return CopyHandle(device, 0, slot=slot, engine="sm", gate=gate[0])

    def _copy_few(self, d: _Device, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int,
                  gate: tuple[int, int]) -> CopyHandle:
        """The prepared post: no table upload, no slot; the shape is looked up, not recomputed."""
        fn = d.functions.get("kvxfer_copy_few") or self._function(device, "kvxfer_copy_few")
        if fn is None:
            raise CudaError(f"the copy kernel is not available on device {device}: {d.kernel_error}")
        key = sizes.tobytes()
        shape = d.shapes.get(key)
        if shape is None:
            piece, first = few_shape(sizes)
            if len(d.shapes) >= _MAX_SHAPES:
                d.shapes.clear()
            shape = d.shapes[key] = (piece, first, int(first[-1]))
        piece, first, workers = shape
        n = sizes.shape[0]
        with d.few_lock:
            f = d.few
            f[0], f[1] = n, piece
            f[2:3 + n] = first
            f[2 + FEW + 1:2 + FEW + 1 + n] = dst
            f[2 + 2 * FEW + 1:2 + 2 * FEW + 1 + n] = src
            f[2 + 3 * FEW + 1:2 + 3 * FEW + 1 + n] = sizes
            f[_FEW_WORDS - 1] = gate[1]
            if d.few_args is None:
                d.few_args = (ctypes.c_void_p * 1)(f.ctypes.data)
            self.c.check_drv(self.c.drv.cuLaunchKernel(fn, launch_grid(workers, bool(gate[1])), 1, 1, THREADS, 1, 1, 0,
                                                       d.stream, d.few_args, None),
                             "launching the copy kernel")
        return CopyHandle(device, 0, engine="sm", gate=gate[0])

    def _copy_ce(self, d: _Device, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int,
                 src_device: int | None, dst_device: int | None) -> CopyHandle:
        fn = self.c.batch
        if fn is None:
            raise CudaError(f"CUDA runtime {self.c.version} has no cudaMemcpyBatchAsync (needs 12.8+)")
        dst = np.ascontiguousarray(dst, dtype=np.uint64)
        src = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        attr = MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM,
                                MemLocation(_LOC_HOST if src_device is None else _LOC_DEVICE, src_device or 0),
                                MemLocation(_LOC_HOST if dst_device is None else _LOC_DEVICE, dst_device or 0), 0)
        idx = (ctypes.c_size_t * 1)(0)
        args: list[Any] = [ctypes.c_void_p(dst.ctypes.data), ctypes.c_void_p(src.ctypes.data),
                           ctypes.c_void_p(sizes.ctypes.data), ctypes.c_size_t(sizes.shape[0]), ctypes.byref(attr),
                           idx, ctypes.c_size_t(1)]
        if self.c.version < 13000:  # CUDA 13 dropped the failIdx argument
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        args.append(ctypes.c_void_p(d.stream))
        if sizes.shape[0]:
            self.c.check(fn(*args), f"cudaMemcpyBatchAsync of {sizes.shape[0]} spans")
        return CopyHandle(device, 0, keep=(dst, src, sizes), engine="ce")

    def query(self, h: CopyHandle) -> bool:
        """True once the batch has finished (then its slot and event are recycled)."""
        if h.done:
            return True
        rc = self.c.rt.cudaEventQuery(h.event)
        if rc == NOT_READY:
            return False
        self._recycle(h)
        self.c.check(rc, "copy")  # a failed copy surfaces here
        return True

    def wait(self, h: CopyHandle, deadline: float) -> bool:
        """Wait on the batch's event until ``deadline`` (a monotonic reading: the core's
        :class:`~kvxfer.deadlines.Deadline`); True once done, False past the deadline.

        Why looks and no naps: the copy ends microseconds after the post, and ``time.sleep``
        of any length costs the kernel's timer slack (~50 us), which was the device path's
        whole fixed cost. Each look is one ``cudaEventQuery`` (ctypes lets other threads run
        meanwhile); ``cudaEventSynchronize`` is not used because it cannot be bounded."""
        if h.done:
            return True
        query, ev, now = self.c.rt.cudaEventQuery, h.event, time.monotonic
        rc = query(ev)
        while rc == NOT_READY:
            if now() >= deadline:
                return False
            rc = query(ev)
        self._recycle(h)
        self.c.check(rc, "copy")
        return True

    def fence(self, h: CopyHandle) -> bool:
        """Close the batch's gate: its kernel writes no piece it has not begun. True when the
        batch has a gate (the copy engines have none: such a post can only be waited for)."""
        if h.done or not h.gate:
            return h.done
        ctypes.c_uint64.from_address(h.gate).value = 1
        h.fenced = True
        return True

    def synchronize(self, h: CopyHandle) -> None:
        """Block until the batch is done (a copy cannot be aborted; it ends in milliseconds)."""
        if h.done:
            return
        rc = self.c.rt.cudaEventSynchronize(h.event)
        self._recycle(h)
        self.c.check(rc, "copy")

    def _recycle(self, h: CopyHandle) -> None:
        with self._pool:
            if h.done:
                return
            h.done = True
            d = self._devices[h.device]
            d.events.append(h.event)
            if h.slot is not None:
                d.free_slots.append(h.slot)
                h.slot = None
            h.keep = ()

    def sync_all(self) -> None:
        """Wait for every stream of this copier (before unmapping memory copies may touch)."""
        for dev, d in list(self._devices.items()):
            with self.c.on(dev):
                self.c.rt.cudaStreamSynchronize(d.stream)
