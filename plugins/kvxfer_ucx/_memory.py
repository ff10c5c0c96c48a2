"""What this agent registered: UCX memory handles and remote keys, the span index that local
lists are checked against, and the registration page that same-host peers read.

Every change goes to the page before memory is unmapped, so a same-host peer that checks
the page around its copy never moves bytes from or into memory that is no longer
registered. Callers hold the backend's lock.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvxfer import Allocation, BackendError, MemoryKind, UnsupportedError
from kvxfer.plugin import SpanIndex

from ._blob import MAX_ALLOCATIONS
from ._hostpage import RegistrationPage
from ._worker import UcxCallError, Worker

__all__ = ["Registrations"]


class Registrations:
    def __init__(self, w: Worker) -> None:
        self._w = w
        self._regs: dict[int, tuple[tuple[Allocation, ...], list[int], list[bytes]]] = {}
        self._next = 1
        self.epoch = 0  # bumped by every deregistration: local lists prepared before are stale
        self.spans = SpanIndex()
        self.page = RegistrationPage()

    def register(self, allocations: Sequence[Allocation]) -> int:
        allocs = tuple(allocations)
        for a in allocs:
            if a.kind is not MemoryKind.DRAM:
                raise UnsupportedError(f"ucx backend moves host memory (DRAM) only; got {a.kind.value} at "
                                       f"{a.address:#x}. Use the nixl backend for GPU memory.")
        if sum(len(r[0]) for r in self._regs.values()) + len(allocs) > MAX_ALLOCATIONS:
            raise UnsupportedError(f"ucx backend: at most {MAX_ALLOCATIONS} registered allocations")
        memhs: list[int] = []
        rkeys: list[bytes] = []
        try:
            for a in allocs:
                memh, rkey = self._w.mem_map(a.address, a.nbytes)
                memhs.append(memh)
                rkeys.append(rkey)
        except UcxCallError as exc:
            for m in memhs:
                self._w.mem_unmap(m)
            raise BackendError(f"ucx backend: registering memory failed: {exc}") from None
        h, self._next = self._next, self._next + 1
        self._regs[h] = (allocs, memhs, rkeys)
        self._changed()
        return h

    def deregister(self, handle: Any) -> None:
        reg = self._regs.pop(handle, None)
        if reg is None:
            return
        self.epoch += 1
        self._changed()  # same-host peers see the change before the memory goes
        for m in reg[1]:
            self._w.mem_unmap(m)

    def advertised(self) -> list[tuple[int, int, bytes]]:
        """``(address, nbytes, packed remote key)`` of everything registered, for the blob."""
        return [(a.address, a.nbytes, rk) for allocs, _, rkeys in self._regs.values() for a, rk in zip(allocs, rkeys)]

    def close(self) -> None:
        for h in list(self._regs):
            self.deregister(h)

    def _changed(self) -> None:
        allocs = [a for r in self._regs.values() for a in r[0]]
        self.spans = SpanIndex(allocs)
        self.page.publish((a.address, a.end) for a in allocs)
