"""The fence for READs NIXL cannot recall: read into a private landing area, copy when DONE.

A transfer may report its end only once nothing more can land in its destination (the seam's
fence, ``kvxfer/plugin/backend.py``). Over UCX's TCP transport a GET is answered by the
*target's* process (UCX emulates RMA with active messages), and neither NIXL nor UCX can take
it back: releasing the handle calls ``ucp_request_cancel``, which does not stop an RMA request,
and NIXL closes endpoints without UCX's force flag, which waits for what is outstanding. So a
stopped target that resumes still delivers its bytes, after we reported the end.

Here a fenced READ lands in a :class:`Bounce` (DRAM registered for this transfer alone) and
its bytes are copied to the destination only once the transfer is DONE. A cancelled or failed
one never copies; its landing area is kept, with its NIXL handles, until NIXL says the request
is over (:meth:`Quarantine.reap`), or, if that never happens, until the process exits.
``docs/design.md`` section 7 says why this and not a teardown.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

from kvxfer import Allocation

from ._nixl import deregister_memory, register_memory

__all__ = ["Bounce", "Quarantine", "expand", "needs_fence"]

_LOCAL_AGENT = "NIXL_INIT_AGENT"
#: UCX transports (name prefixes) whose GETs complete without the target process: RDMA NICs
#: between hosts; shared memory and cross-memory attach on one host. ``all`` names them all.
_RDMA = ("rc", "ud", "dc", "ib", "all")
_SHARED = ("sm", "shm", "posix", "sysv", "cma", "xpmem", "knem", "all")
#: Landing areas of transfers whose requests never settled before their agent was closed.
_orphans: list[Any] = []


def _rdma_here() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def needs_fence(same_host: bool, tls: str | None = None) -> bool:
    """Whether a GET from such a peer may travel over TCP, which cannot be recalled.

    ``tls`` is ``UCX_TLS`` (default: the environment's). With UCX's default transports only
    a peer on another host, with no RDMA device here, is reached over TCP; an inclusion list
    leaves TCP alone when it names no shared-memory transport (same host) or no RDMA one.
    """
    tls = os.environ.get("UCX_TLS") if tls is None else tls
    names = [t.strip() for t in (tls or "").split(",") if t.strip()]
    if not names or names[0].startswith("^"):
        return not same_host and not _rdma_here()
    rdma = any(n.startswith(_RDMA) for n in names) and _rdma_here()
    if same_host:
        return not rdma and not any(n.startswith(_SHARED) for n in names)
    return not rdma


def expand(descs: np.ndarray) -> np.ndarray:
    """``N x 3`` rows as NIXL indexes them: a strided ``N x 5`` row becomes its ``count`` spans."""
    if descs.shape[1] == 3:
        return descs
    counts = descs[:, 4].astype(np.int64)
    rows = np.repeat(descs[:, :3], counts, axis=0)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    k = (np.arange(int(counts.sum())) - starts).astype(np.uint64)
    rows[:, 0] += k * np.repeat(descs[:, 3], counts)
    return rows


class Bounce:
    """Registered DRAM shaped like a READ's local rows (``N x 3``, as NIXL indexes them), packed."""

    def __init__(self, agent: Any, lock: threading.RLock, rows: np.ndarray) -> None:
        self.rows = np.array(rows, dtype=np.uint64)
        sizes = self.rows[:, 1]
        self.offsets = np.zeros(len(sizes), np.uint64)
        if len(sizes) > 1:
            self.offsets[1:] = np.cumsum(sizes[:-1])
        self.buffer = np.empty(max(1, int(sizes.sum())), np.uint8)
        base = self.buffer.ctypes.data
        self._agent, self._lock = agent, lock
        self._lists = register_memory(agent, lock, [Allocation(base, self.buffer.nbytes)])
        mine = self.rows.copy()
        mine[:, 0] = self.offsets + np.uint64(base)
        mine[:, 2] = 0
        try:
            with lock:
                self.nixl = agent.prep_xfer_dlist(_LOCAL_AGENT, mine, "DRAM")
        except BaseException:
            deregister_memory(agent, lock, self._lists)
            raise

    def deliver(self) -> None:
        """Copy every row to the destination: called once the READ is DONE, never before.
        One ``memmove`` per row: KV rows are pages, and TCP moves them far slower than this."""
        base = self.buffer.ctypes.data
        for addr, n, off in zip(self.rows[:, 0].tolist(), self.rows[:, 1].tolist(), self.offsets.tolist()):
            ctypes.memmove(addr, base + off, n)

    def free(self) -> None:
        """Give the landing area back: only once no request can still write into it."""
        with self._lock:
            h, self.nixl = self.nixl, None
            if h is not None:
                try:
                    self._agent.release_dlist_handle(h)
                except Exception:
                    pass
        deregister_memory(self._agent, self._lock, self._lists)
        self._lists = []


class Quarantine:
    """Landing areas of READs that ended before NIXL finished their requests."""

    def __init__(self) -> None:
        self._held: list[tuple[Bounce, list[Any]]] = []

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, bounce: Bounce, handles: list[Any]) -> None:
        self._held.append((bounce, list(handles)))

    def reap(self, agent: Any) -> None:
        """Free each area whose every request NIXL reports over (DONE or failed)."""
        keep = []
        for bounce, handles in self._held:
            left = []
            for h in handles:
                try:
                    state = agent.check_xfer_state(h)
                except Exception:
                    state = "ERR"
                if state == "PROC":
                    left.append(h)
                    continue
                try:
                    agent.release_xfer_handle(h)
                except Exception:
                    left.append(h)
            if left:
                keep.append((bounce, left))
            else:
                bounce.free()
        self._held = keep

    def orphan(self) -> None:
        """The agent is going away with requests unsettled: keep their memory for good."""
        _orphans.extend(self._held)
        self._held = []
