"""The NIXL backend's file path: the store's I/O through NIXL's ``POSIX`` plugin (DRAM <-> FILE).

A mixin of :class:`kvxfer_nixl.backend.NixlBackend` offers :meth:`Files.file_path`
(:mod:`kvxfer.plugin.files`). The path runs on a NIXL agent of its own, named after the
backend's with ``/files`` appended, holding only the ``POSIX`` plugin: the peer-facing agent's
metadata, lock and registrations stay exactly as they were (a ``POSIX`` section would
otherwise ride in every blob a peer loads), and file I/O never waits on a peer transfer's
lock. Transfers target that agent's own name, as NIXL's local file I/O requires.

* Memory: what the backend registered (:meth:`NixlBackend.register`), mirrored into the file
  agent the first time a post runs after a registration changed, and the core's stage
  buffers (:meth:`NixlFiles.register`, never the peer agent's); every post is checked
  against those spans, and against the registered file's size.
* The file: registered once by fd (``FILE`` segment ``(0, size, fd)``).
* A post: one ``initialize_xfer`` over the post's descriptors (NIXL does one I/O per
  descriptor, io_uring or aio, so the core's merged runs are what makes it fast).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Sequence

import numpy as np

from kvxfer import Allocation, BackendError, MemoryKind, Op, OutOfRegistrationError
from kvxfer.plugin import SpanIndex
from kvxfer.plugin.files import FilePath

from ._nixl import map_error, nx

__all__ = ["Files", "NixlFiles"]

_log = logging.getLogger("kvxfer.nixl")
_CREATE = threading.Lock()  # two threads' first store transfers must not create two paths


class NixlFiles(FilePath):
    """DRAM <-> file through NIXL ``POSIX`` on a dedicated agent (module docstring)."""

    name = "nixl-posix"
    memory_kinds = frozenset({MemoryKind.DRAM})

    def __init__(self, backend: Any, params: dict[str, str] | None = None) -> None:
        self._backend = backend
        self._name = f"{backend.agent_name}/files"
        self._lock = threading.Lock()
        cfg = nx.nixl_agent_config(enable_prog_thread=False, backends=[])
        try:
            self._agent = nx.nixl_agent(self._name, cfg)
            self._agent.create_backend("POSIX", dict(params or {}))
        except Exception as exc:
            raise map_error(exc, "creating NIXL's POSIX file plugin") from exc
        self._mirrored: dict[int, tuple[Any, Any]] = {}  # id(Registration) -> (it, file-agent handle)
        self._files: dict[object, tuple[int, int, Any]] = {}  # handle token -> fd, size, NIXL registration
        self._own: dict[object, tuple[tuple[Allocation, ...], Any]] = {}  # the core's stage buffers

    def _sync(self) -> None:
        """Mirror the backend's DRAM registrations (under the lock)."""
        regs = {id(r): r for r in self._backend._registrations}
        for rid in [k for k, (r, _) in self._mirrored.items() if regs.get(k) is not r]:
            _, h = self._mirrored.pop(rid)
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(h)
        for rid, r in regs.items():
            if rid in self._mirrored:
                continue
            dram = [a for a in r.allocations if a.kind is MemoryKind.DRAM]
            h = None
            if dram:
                arr = np.array([(a.address, a.nbytes, a.device) for a in dram], dtype=np.uint64)
                try:
                    h = self._agent.register_memory(arr, "DRAM", backends=["POSIX"])
                except Exception as exc:
                    raise map_error(exc, f"registering {len(dram)} DRAM allocation(s) for file I/O") from exc
            self._mirrored[rid] = (r, h)

    def register(self, allocations: Sequence[Allocation]) -> Any:
        """The core's own host buffers (the store's row stage), registered here only."""
        allocs = tuple(allocations)
        if any(a.kind is not MemoryKind.DRAM for a in allocs):
            raise BackendError("NIXL POSIX takes DRAM stage buffers only")
        arr = np.array([(a.address, a.nbytes, a.device) for a in allocs], dtype=np.uint64)
        with self._lock:
            try:
                h = self._agent.register_memory(arr, "DRAM", backends=["POSIX"])
            except Exception as exc:
                raise map_error(exc, f"registering {len(allocs)} stage buffer(s) for file I/O") from exc
            token = object()
            self._own[token] = (allocs, h)
            return token

    def deregister(self, handle: Any) -> None:
        with self._lock:
            entry = self._own.pop(handle, None)
            if entry is not None:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(entry[1])

    def register_file(self, fd: int, nbytes: int) -> Any:
        with self._lock:
            try:
                reg = self._agent.register_memory([(0, int(nbytes), int(fd), "")], "FILE", backends=["POSIX"])
            except Exception as exc:
                raise map_error(exc, f"registering a {nbytes}-byte file for NIXL POSIX") from exc
            token = object()
            self._files[token] = (int(fd), int(nbytes), reg)
            return token

    def deregister_file(self, handle: Any) -> None:
        with self._lock:
            entry = self._files.pop(handle, None)
            if entry is not None:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(entry[2])

    def post(self, op: Op, file: Any, local: np.ndarray, offsets: np.ndarray, kind: MemoryKind) -> Any:
        if kind not in self.memory_kinds:
            raise BackendError(f"NIXL POSIX moves DRAM only, not {kind.value}")
        with self._lock:
            if self._backend._closed:
                raise BackendError(f"NIXL backend of {self._backend.agent_name!r} is closed")
            entry = self._files.get(file)
            if entry is None:
                raise BackendError("post() needs a file registered with this path")
            fd, size, _ = entry
            local = np.ascontiguousarray(local, dtype=np.uint64)
            mine = SpanIndex([*self._backend._memory.allocations, *(a for al, _ in self._own.values() for a in al)])
            mine.check(local, kind, "store descriptors")  # inside the backend's registrations or the stage
            off = np.asarray(offsets, dtype=np.uint64)
            end = off + local[:, 1]
            if off.shape[0] != local.shape[0] or bool(((end > np.uint64(size)) | (end < off)).any()):
                raise OutOfRegistrationError(f"a store descriptor leaves the {size}-byte registered file")
            self._sync()
            remote = np.empty_like(local)
            remote[:, 0], remote[:, 1], remote[:, 2] = off, local[:, 1], np.uint64(fd)
            try:
                h = self._agent.initialize_xfer(op.value, self._agent.get_xfer_descs(local, kind.value),
                                                self._agent.get_xfer_descs(remote, "FILE"), self._name, b"",
                                                backends=["POSIX"])
                state = self._agent.transfer(h)
            except Exception as exc:
                raise map_error(exc, f"posting a file {op.value} of {local.shape[0]} descriptors") from exc
            if state == "ERR":
                self._release(h)
                raise BackendError(f"NIXL POSIX refused a file {op.value} of {local.shape[0]} descriptors")
            return h

    def poll(self, xfer: Any) -> bool:
        with self._lock:
            try:
                state = self._agent.check_xfer_state(xfer)
            except Exception as exc:
                raise map_error(exc, "file transfer failed") from exc
        if state == "ERR":
            raise BackendError("NIXL POSIX reported a failed file transfer")
        return state == "DONE"

    def release(self, xfer: Any) -> None:
        with self._lock:
            self._release(xfer)

    def _release(self, h: Any) -> None:
        try:
            self._agent.release_xfer_handle(h)
        except Exception as exc:  # pragma: no cover - NIXL refuses only handles still in flight
            _log.debug("NIXL kept a file transfer handle: %s", exc)

    def close(self) -> None:
        with self._lock:
            for _, h in self._mirrored.values():
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(h)
            for reg in [r for _, _, r in self._files.values()] + [h for _, h in self._own.values()]:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(reg)
            self._mirrored.clear()
            self._files.clear()
            self._own.clear()


class Files:
    """Mixin: ``file_path()`` for :class:`~kvxfer_nixl.backend.NixlBackend` (lazy, once)."""

    _file_path: NixlFiles | None
    _file_path_error: str | None

    def file_path(self) -> NixlFiles | None:
        """The POSIX file path, created on first use; None where NIXL's POSIX plugin does not load."""
        with _CREATE:
            if getattr(self, "_file_path", None) is None and getattr(self, "_file_path_error", None) is None:
                try:
                    self._file_path = NixlFiles(self)
                except Exception as exc:  # the store falls back to preadv and reports that path
                    self._file_path_error = str(exc)
                    _log.warning("NIXL POSIX is unavailable, store I/O uses preadv/pwritev: %s", exc)
            return getattr(self, "_file_path", None)
