"""What the NIXL backend keeps: peers, prepared lists, registrations, posts, and who is local.

Plain records, so that :mod:`kvxfer_nixl.backend` reads as the control plane alone. Also
here: the process-wide registry that lets a backend recognise a peer living in this process
(its blob carries this process's identity, :mod:`kvxfer.plugin.identity`, and the instance id
of a live backend: :class:`kvxfer.plugin.Live`), and the format of the notice a backend sends
its peers after deregistering memory.
"""

from __future__ import annotations

import atexit
import contextlib
import struct
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer import Allocation, DescriptorList, KvxferError, MemoryKind, OutOfRegistrationError
from kvxfer.plugin import DataPath, Live, SpanIndex

from ._blob import PeerBlob

__all__ = ["Flush", "Prepared", "Registration", "Remote", "Xfer", "extents", "instances", "notice",
           "parse_notice"]

_U64 = (1 << 64) - 1

# A blob names its process (kvxfer.plugin.identity.Identity) and backend instance; a forked
# child starts with none (kvxfer.plugin.live).
instances: "Live[Any]" = Live()


@atexit.register
def _close_left_open() -> None:
    """Close the backends a program left open, before the interpreter tears down: otherwise
    NIXL's agent can be destroyed during finalisation while its own threads still run, and the
    process aborts at exit ("terminate called without an active exception", tests/test_fdlimit.py)."""
    for backend in list(instances.values()):
        with contextlib.suppress(Exception):
            backend.close()

#: Control notification sent to peers after deregistering memory: a fixed prefix, the
#: sender's instance id, its new registration epoch. Never delivered to the user.
_DEREGISTERED = b"\x00kvxfer-nixl:deregistered\x00"
_NOTICE = struct.Struct(f"<{len(_DEREGISTERED)}s16sQ")


def notice(instance: bytes, epoch: int) -> bytes:
    return _NOTICE.pack(_DEREGISTERED, instance, epoch)


def parse_notice(msg: bytes) -> tuple[bytes, int] | None:
    """``(instance, epoch)`` if ``msg`` is a deregistration notice, else None."""
    if len(msg) != _NOTICE.size or not msg.startswith(_DEREGISTERED):
        return None
    _, instance, epoch = _NOTICE.unpack(msg)
    return instance, epoch


def extents(descs: DescriptorList) -> np.ndarray:
    """``(address, nbytes, device)`` spans covering every span of the list (strided rows whole)."""
    a = descs.array
    if not descs.strided:
        return a
    a = a[a[:, 4] > 0]
    n, length, stride = a[:, 4] - np.uint64(1), a[:, 1], a[:, 3]
    wraps = (n > 0) & (stride > (np.uint64(_U64) - length) // np.maximum(n, np.uint64(1)))
    if wraps.any():
        raise OutOfRegistrationError("a strided descriptor row runs past the end of the address space")
    return np.stack([a[:, 0], stride * n + length, a[:, 2]], axis=1)


@dataclass(eq=False)
class Remote:
    name: str  # the peer's agent name
    nixl: str  # the name its metadata is loaded under in NIXL: unique per load
    epoch: int  # the backend's load counter: lists from an older load are stale
    blob: PeerBlob
    memory: SpanIndex  # what the peer registered, from its blob
    local: "weakref.ReferenceType[Any] | None"  # the peer's backend, when in this process
    key: bytes = b""  # the blob it was loaded from: a re-add of the same bytes reuses the load
    stale: str | None = None  # set when the peer announced it deregistered memory
    fence: bool = False  # its READs land in a bounce area first (kvxfer_nixl._bounce)


@dataclass(eq=False)
class Prepared:
    nixl: Any  # NIXL's prepared-list handle (None once released)
    peer: str | None
    epoch: int
    descs: DescriptorList
    gone: str | None = None  # why the list is unusable (its local memory was deregistered)
    rows: Any = None  # the list as N x 3 rows, once a fenced READ needed them (kvxfer_nixl._bounce)


@dataclass(eq=False)
class Registration:
    lists: list[tuple[MemoryKind, Any]]
    allocations: tuple[Allocation, ...]


class Flush:
    """A pseudo-transfer the notify thread polls: progress NIXL until ``until`` passes."""

    until = 0.0


class Xfer:
    """One post: the data path that serves it, and that path's handle."""

    __slots__ = ("path", "h", "rem", "notification", "done", "error", "released", "pumped")

    def __init__(self, path: DataPath, h: Any, rem: Remote, notification: bytes | None) -> None:
        self.path, self.h, self.rem, self.notification = path, h, rem, notification
        self.done = self.released = self.pumped = False
        self.error: KvxferError | None = None
