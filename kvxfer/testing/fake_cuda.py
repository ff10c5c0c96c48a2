"""A stand-in for CUDA so CI (no GPU) can drive :class:`kvxfer.cuda.DevicePath` end to end.

"VRAM" here is host memory (numpy arrays) registered as ``MemoryKind.VRAM``; "opening a
handle" maps nothing (the memory is already addressable in this process) but is counted, so
tests can check that restarts and dead peers unmap; "copying" really moves the bytes with
``ctypes.memmove``, so every test still checks real bytes. With ``hold`` set, copies wait
(their event does not complete) until :meth:`FakeCuda.finish` runs them; a fenced copy then
writes nothing, as the real kernels skip every piece once their gate is closed. What it cannot test is CUDA
itself: the GPU tests do that. Each fake keeps its own proof page (:class:`kvxfer.peers.Page`)
in this process and proves peers with the real verifier, reading that page from this process.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..cuda import blob
from .. import peers
from ..cuda.ipc import Exported
from ..peers import Identity, Page, Proven
from ..memory import Allocation, MemoryKind

__all__ = ["FakeCuda", "FakeProcess"]


def _uuid(device: int) -> bytes:
    return bytes([0xC0, device]) + b"\0" * 14


@dataclass
class FakeProcess:
    pid: int
    is_alive: bool = True
    closed: bool = False
    fd: int = -1

    def alive(self) -> bool:
        return self.is_alive

    def close(self) -> None:
        self.closed = True


@dataclass(eq=False)
class _Mapping:
    local: int
    size: int


@dataclass(eq=False)
class FakeCopy:
    """One fake post: its spans, whether its event completed, whether its gate was closed."""

    spans: list[tuple[int, int, int]]
    done: bool = False
    gated: bool = False
    fused: bool = False  # the fused copy and mm8: digests of what it moved, once done
    digests: Any = None


@dataclass
class FakeCuda:
    """Configurable answers for every question :func:`kvxfer.cuda.decide` asks."""

    boot_id: bytes = b"B" * 16
    pid: int = field(default_factory=lambda: 100000 + int.from_bytes(os.urandom(2), "little"))
    token: bytes | None = None  # None: the token of its own proof page (set it to pose as another process)
    proof: Page = field(default_factory=Page)
    unavailable: str | None = None
    visible: tuple[int, ...] = (0, 1)
    peer_access: bool = True
    fail_open: bool = False
    shift: int = 0  # where "opened" handles appear, relative to the exporter's addresses
    processes: list[FakeProcess] = field(default_factory=list)
    opened: list[_Mapping] = field(default_factory=list)
    copies: int = 0
    hold: bool = False  # copies wait for finish() (an event that has not completed)
    unfused: bool = False  # the fused copy and mm8 cannot serve (copy_mm8 answers None)
    held: list[FakeCopy] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # copy/query/wait/fence/synchronize, in order

    def why_not(self) -> str | None:
        return self.unavailable

    def identity(self) -> Identity:
        return Identity(self.boot_id, self.pid, 1, self.proof.token if self.token is None else self.token,
                        self.proof.address)

    def page(self) -> Page:
        return self.proof

    def prove(self, claim: Identity, what: str) -> Proven:
        # every fake "process" lives in this one: read the claimed page here, with the real verifier
        return peers.prove(claim, what, pid=os.getpid())

    def device_of(self, uuid: bytes) -> int | None:
        d = uuid[1] if uuid[:1] == b"\xc0" else -1
        return d if d in self.visible else None

    def can_access(self, device: int, peer: int) -> bool:
        return device == peer or self.peer_access

    def export(self, allocations: Sequence[Allocation]) -> Exported:
        out = Exported()
        for a in allocations:
            if a.kind is not MemoryKind.VRAM:
                continue
            u = _uuid(a.device)
            if u not in out.devices:
                out.devices.append(u)
            out.handles.append((blob.KIND_LEGACY, out.devices.index(u), a.address, a.nbytes, len(out.chunks), 1))
            out.chunks.append((0, a.nbytes, b"fake-ipc-handle".ljust(64, b"\0")))
            out.allocs.append((a.address, a.nbytes, len(out.handles) - 1))
        return out

    def open(self, exp: blob.Export, handle: int, device: int, access: Sequence[int], proc: Any) -> _Mapping:
        if self.fail_open:
            raise OSError("fake: cudaIpcOpenMemHandle refused the handle")
        rec = exp.handles[handle]
        m = _Mapping(int(rec["base"]) + self.shift, int(rec["size"]))  # host memory here: no real mapping
        self.opened.append(m)
        return m

    def close(self, mapping: Any) -> None:
        self.opened.remove(mapping)

    def peer_process(self, pid: int, started: int) -> FakeProcess:
        p = FakeProcess(pid)
        self.processes.append(p)
        return p

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int, engine: str,
             src_device: int | None, dst_device: int | None) -> FakeCopy:
        self.calls.append("copy")
        h = FakeCopy(list(zip(dst.tolist(), src.tolist(), sizes.tolist())))
        self.copies += 1
        if self.hold:
            self.held.append(h)
        else:
            self._run(h)
        return h

    def copy_mm8(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, device: int,
                 src_device: int | None, dst_device: int | None) -> FakeCopy | None:
        """The fused kernel: the copy, and the digests the tensor-core kernel's CPU model
        (:mod:`kvxfer.cuda.mm8_model`) computes from the bytes it moves."""
        if self.unfused or ((np.asarray(src, np.uint64) | np.asarray(dst, np.uint64)) & np.uint64(15)).any():
            return None  # what the real one answers for a span off a 16-byte boundary
        self.calls.append("copy_mm8")
        h = FakeCopy(list(zip(dst.tolist(), src.tolist(), sizes.tolist())), fused=True)
        self.copies += 1
        if self.hold:
            self.held.append(h)
        else:
            self._run(h)
        return h

    def digests(self, handle: FakeCopy) -> np.ndarray:
        self.calls.append("digests")
        assert handle.done and handle.fused
        return handle.digests

    @staticmethod
    def _run(h: FakeCopy) -> None:
        if h.fused and not h.gated:
            from ..cuda.mm8_model import emulate
            from ..cuda.digest import mm8_table
            from ..integrity.mm8 import finalize

            src = np.array([s for _, s, _ in h.spans], np.uint64)
            ln = np.array([n for _, _, n in h.spans], np.uint64)
            sums = emulate(mm8_table(src, ln), len(h.spans), lambda a, k: np.ctypeslib.as_array(
                (ctypes.c_uint8 * k).from_address(a)).copy())
            h.digests = np.array([int(finalize(sums[i:i + 1].view(np.int64), int(n))[0])
                                  for i, n in enumerate(ln.tolist())], np.int64).view(np.uint64)
        if not h.gated:  # a closed gate: the kernel skips every piece it has not begun
            for d, s, n in h.spans:  # a test double: clarity over speed
                ctypes.memmove(d, s, n)
        h.done = True

    def finish(self) -> None:
        """The GPU gets to the held copies: each runs, or, once fenced, writes nothing."""
        while self.held:
            self._run(self.held.pop(0))

    def query(self, handle: FakeCopy) -> bool:
        self.calls.append("query")
        return handle.done

    def wait(self, handle: FakeCopy, deadline: float) -> bool:
        self.calls.append("wait")
        while not handle.done:  # the real copier looks at its event the same way: no naps
            if time.monotonic() >= deadline:
                return False
        return True

    def fence(self, handle: FakeCopy) -> bool:
        self.calls.append("fence")
        if not handle.done:
            handle.gated = True
        return True

    def synchronize(self, handle: FakeCopy) -> None:
        self.calls.append("synchronize")
        if not handle.done:
            if handle in self.held:
                self.held.remove(handle)
            self._run(handle)

    def sync_all(self) -> None:
        pass

    def kernel_error(self, device: int) -> str | None:
        return None
