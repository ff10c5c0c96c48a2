"""The file seam: how a backend serves the store's I/O (host or device memory <-> a file).

A backend that can move bytes between its registered memory and a file returns a
:class:`FilePath` from :meth:`kvxfer.Backend.file_path`; the others inherit ``None`` and the
store uses its own ``preadv``/``pwritev``. The seam is the same shape as the peer one:
memory is what the backend's :meth:`~kvxfer.Backend.register` already registered, the file
is registered once (:meth:`FilePath.register_file`), and a post moves
``local[i] <-> file[offset[i]]`` descriptor pairs. Packing rows, planning, merging runs,
bounds, digests, deadlines and cancellation stay in the core (:mod:`kvxfer.store`), so a
file path is register and transfer only. docs/storage.md, "Data paths", says which exist.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np

from ..errors import UnsupportedError
from ..memory import Allocation, MemoryKind, Op

__all__ = ["FilePath"]


class FilePath(abc.ABC):
    """One backend's data path between its registered memory and files.

    ``name`` is what :attr:`kvxfer.TransferStats.path` reports for a store transfer it
    carried (``"nixl-posix"``, say). ``memory_kinds`` are the local kinds it moves. The
    core calls it from its store worker threads, one post per group of whole rows, and polls
    each post to the end before its rows are published or copied: a path must be safe to
    call from several threads at once (a lock of its own is enough).
    """

    name: str = "file"
    memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.DRAM})

    @abc.abstractmethod
    def register_file(self, fd: int, nbytes: int) -> Any:
        """Register ``nbytes`` of the open file ``fd`` once; returns a handle for posts.

        The core keeps ``fd`` open until :meth:`deregister_file`; the path must not close it.
        """

    @abc.abstractmethod
    def deregister_file(self, handle: Any) -> None: ...

    def register(self, allocations: Sequence[Allocation]) -> Any:
        """Optional: also accept host memory the core owns (the store's row stage, into which it
        gathers a per-layer cache's pages so that a row run is one I/O). Returns a handle for
        :meth:`deregister`. The default refuses, and the core then posts the pages as they are."""
        raise UnsupportedError(f"the {self.name} file path takes only its backend's registrations")

    def deregister(self, handle: Any) -> None:
        """Forget memory given to :meth:`register`."""

    @abc.abstractmethod
    def post(self, op: Op, file: Any, local: np.ndarray, offsets: np.ndarray, kind: MemoryKind) -> Any:
        """Start moving ``local[i]`` (``(address, nbytes, device)`` rows of an ``N x 3``
        ``uint64`` array, inside memory this backend registered) to (``Op.WRITE``) or from
        (``Op.READ``) file offsets ``offsets[i]``. Returns a handle for :meth:`poll`.

        The path refuses, with :class:`~kvxfer.errors.OutOfRegistrationError`, a descriptor
        outside its registered memory or past the registered file's end.
        """

    @abc.abstractmethod
    def poll(self, xfer: Any) -> bool:
        """True when done; False while pending; raises a :class:`~kvxfer.KvxferError` on failure."""

    @abc.abstractmethod
    def release(self, xfer: Any) -> None:
        """Forget a post the core polled to its end (or that failed)."""

    def close(self) -> None:
        """Release what the path holds (the backend calls it when it closes)."""
