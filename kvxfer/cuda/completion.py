"""The device path's completion: poll, wait with the core's deadline, the fence, cancel, release.

Kept apart from :mod:`kvxfer.cuda.path` (routes, exports, lists, posting) because these are
the calls that decide when a post has ended, and so what may still land: a post ends when its
CUDA events say every batch finished (:meth:`Completion.poll`, or :meth:`Completion.wait`,
which blocks on them until the core's :class:`~kvxfer.deadlines.Deadline`; the core reaches it
through :meth:`kvxfer.plugin.backend.Backend.wait`), or when it is fenced: the gate word every
copy kernel reads before each piece is closed, so nothing the kernel had not begun lands later.
A verified post (the fused kernel) is compared with the source's digests when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..deadlines import Deadline
from ..errors import BackendError, IntegrityError, TransferTimeoutError

__all__ = ["Completion", "PathXfer"]

_GRACE = 0.5  # seconds a cancelled post's running pieces get to finish (a gated kernel ends in microseconds)


@dataclass(eq=False)
class PathXfer:
    """One post on the device path (possibly several batches, one per GPU pair)."""

    peer: Any  # the path's record of the peer (kvxfer.cuda.path._Peer)
    handles: list[Any]
    kind: str  # the route taken: SAME_PROCESS or CUDA_IPC
    done: bool = False
    released: bool = False
    fenced: bool = False
    expect: np.ndarray | None = None  # a verified post: the source's digest of each descriptor
    describe: Any = None  # names a verified post's mismatches (the core's: block and member), or None

    @property
    def verified(self) -> bool:  # completion compares what the fused kernel hashed with expect
        return self.expect is not None


class Completion:
    """The completion half of :class:`kvxfer.cuda.DevicePath` (a base it inherits)."""

    @property
    def cap(self) -> Any:  # DevicePath's: the CUDA capability (kvxfer.cuda.decide.Capability)
        raise NotImplementedError

    def _alive(self, p: Any) -> None:  # DevicePath's: a dead peer is PeerDisconnectedError
        raise NotImplementedError

    def cancel(self, x: PathXfer) -> None:
        """Fence the post, then give the pieces already running a short grace to finish."""
        self._fence(x)
        if not x.done:  # a finished post (every release after DONE) has nothing left to wait for
            grace = Deadline.within(_GRACE)
            for h in x.handles:
                self.cap.wait(h, grace)
        self.release(x)

    def poll(self, x: PathXfer) -> bool:
        if x.done:
            return True
        if x.released:
            raise BackendError("transfer was released")
        for h in x.handles:
            if not self.cap.query(h):
                return False
        self._alive(x.peer)  # bytes from (or to) a process that died meanwhile are not trusted
        x.done = True
        self._compare(x)
        return True

    def _compare(self, x: PathXfer) -> None:
        if x.expect is None:  # not verified; else the digests of what the kernel moved against the source's
            return
        got = self.cap.digests(x.handles[0])
        bad = np.flatnonzero(got != x.expect)
        if bad.shape[0] and x.describe is not None:
            raise x.describe(bad)
        if bad.shape[0]:
            raise IntegrityError(f"{bad.shape[0]} of {got.shape[0]} descriptors of a device-path post arrived with "
                                 f"another mm8 digest than the source's (first: descriptor {int(bad[0])}); the "
                                 "destination holds bytes nobody vouches for", mismatches=int(bad.shape[0]))

    def wait(self, x: PathXfer, deadline: float) -> bool:
        """Block on the post's own events (no naps: kvxfer/cuda/copy.py says why) until done or
        ``deadline`` (the core's Deadline): then the post is fenced, so nothing it had not begun
        lands later, and :class:`TransferTimeoutError` is raised."""
        if x.done:
            return True
        if x.released:
            raise BackendError("transfer was released")
        for h in x.handles:
            if not self.cap.wait(h, deadline):
                self._fence(x)
                raise TransferTimeoutError("the device path's copy did not finish by its deadline; " + (
                    "it was fenced (no piece it had not begun will land)" if x.fenced else
                    "the copy engines cannot be fenced: releasing it waits for it"))
        self._alive(x.peer)  # bytes from (or to) a process that died meanwhile are not trusted
        x.done = True
        self._compare(x)
        return True

    def _fence(self, x: PathXfer) -> None:
        if not (x.done or x.fenced):  # a copy-engine post has no gate: not fenced, release() waits for it
            x.fenced = all([self.cap.fence(h) for h in x.handles])

    def release(self, x: PathXfer) -> None:
        """Forget a post; one still running is waited for, unless fenced (its kernels skip the rest)."""
        if x.released:
            return
        x.released = True
        if x.done:  # its events were recycled when it was seen done
            return
        for h in x.handles:
            if x.fenced:
                continue  # its slot and event stay with it (never recycled while it may run)
            try:
                self.cap.synchronize(h)
            except BackendError:
                pass
