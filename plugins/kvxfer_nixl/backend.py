"""The NIXL backend: kvxfer's seam mapped onto NIXL's prepared-list fast path.

Read the package docstring (:mod:`kvxfer_nixl`) for the choices and the numbers behind them.
This module imports ``nixl``; :mod:`kvxfer_nixl` itself does not, so listing backends on a
machine without NIXL stays cheap and says how to install it.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

import nixl._api as _nx
import nixl._bindings as _nb
from kvxfer import Allocation, Backend, Capabilities, DescriptorList, MemoryKind, Op
from kvxfer.errors import (
    BackendError,
    KvxferError,
    MetadataError,
    PeerDisconnectedError,
    StalePeerError,
    TransferCancelledError,
    UnknownPeerError,
    UnsupportedError,
)

from kvxfer.cuda import DevicePath, blob as _device_blob

__all__ = ["DEFAULT_PROGRESS_THREAD", "NixlBackend"]

#: Default for the ``progress_thread`` option; see the package docstring for the measurement.
DEFAULT_PROGRESS_THREAD = False

_INT32_MAX = np.iinfo(np.int32).max
#: How long the notify thread keeps progressing NIXL after a standalone notification.
_NOTIF_FLUSH_S = 2.0
_LOCAL_AGENT = "NIXL_INIT_AGENT"


def _quiet_nixl_logging() -> None:
    """NIXL's Python logger prints INFO lines to *stdout*; peers speak JSON over stdout.

    Unless the user asked for a level with ``NIXL_LOG_LEVEL``, keep warnings only, and send
    them to stderr so that a process's stdout stays its own.
    """
    log = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        log.setLevel(logging.WARNING)
    for h in log.handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


_quiet_nixl_logging()

# --------------------------------------------------------------------------------------------
# The connection blob: a header naming the process and the backend instance (agents of one
# process progress each other), the device path's export (kvxfer.cuda: VRAM peers of one host
# are reached by direct copies), then NIXL's own metadata.
# --------------------------------------------------------------------------------------------
_MAGIC = b"KVXNIXL2"
_HEADER = struct.Struct("!8s16s16sI")
_process = {"token": os.urandom(16)}
_instances: "weakref.WeakValueDictionary[bytes, NixlBackend]" = weakref.WeakValueDictionary()


def _after_fork_in_child() -> None:
    # A forked child shares no live agents with its parent: forget them, and change the
    # process token so the parent's blobs no longer look local to the child.
    _process["token"] = os.urandom(16)
    _instances.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _map_error(exc: BaseException, action: str, peer: str | None = None) -> KvxferError:
    """Translate a NIXL exception into the kvxfer error a caller can act on."""
    if isinstance(exc, KvxferError):
        return exc
    who = f" peer {peer!r}" if peer else ""
    detail = f"{type(exc).__name__}: {exc}"
    err: KvxferError
    if isinstance(exc, _nb.nixlRemoteDisconnectError):
        err = PeerDisconnectedError(f"{action}:{who or ' the peer'} disconnected ({detail}); "
                                    "add it again once it is back")
    elif isinstance(exc, (_nb.nixlNotFoundError, _nb.nixlNotAllowedError)) and peer:
        err = StalePeerError(f"{action}: NIXL no longer accepts{who} or lists prepared for it ({detail}); "
                             "the peer was removed or restarted: add it again from fresh metadata")
    elif isinstance(exc, _nb.nixlNotSupportedError):
        err = UnsupportedError(f"{action}: not supported by the NIXL backends in use ({detail})")
    elif isinstance(exc, _nb.nixlCancelledError):
        err = TransferCancelledError(f"{action}: cancelled inside NIXL ({detail})")
    elif isinstance(exc, (_nb.nixlInvalidParamError, _nb.nixlMismatchError)):
        err = BackendError(f"{action}: NIXL rejected the request ({detail}); descriptors must lie in registered "
                           "memory of the stated kind, with equal lengths on both sides")
    else:
        err = BackendError(f"{action}: NIXL failed ({detail})")
    err.__cause__ = exc
    return err


def _as_int32(idx: np.ndarray) -> np.ndarray:
    """NIXL takes int32 index arrays (a Python list is 10-15x slower); convert only if needed."""
    if idx.dtype == np.int32 and idx.flags.c_contiguous:
        return idx
    if idx.size and (int(idx.max()) > _INT32_MAX or int(idx.min()) < 0):
        raise UnsupportedError("NIXL indexes prepared lists with int32: a list longer than 2**31-1 descriptors "
                               "cannot be addressed; prepare smaller lists")
    return np.ascontiguousarray(idx, dtype=np.int32)


# --------------------------------------------------------------------------------------------
# Handles
# --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Remote:
    name: str
    epoch: int
    local: "weakref.ReferenceType[NixlBackend] | None"  # the peer's backend, when in this process


@dataclass(eq=False)
class _Prepared:
    """A prepared list: NIXL's handle, plus the device path's checked spans when it applies."""

    handle: Any
    peer: str | None
    epoch: int
    descs: DescriptorList
    device: Any = None  # kvxfer.cuda.Spans: the device path may move this list


@dataclass(eq=False)
class _Registration:
    lists: list[tuple[MemoryKind, Any]]
    allocations: tuple[Allocation, ...]
    device_token: int = 0


@dataclass(eq=False)
class _Xfer:
    """One post. ``handle`` is NIXL's; ``event`` is set instead for a device-path copy."""

    handle: Any
    peer: str
    notification: bytes | None
    event: Any = None
    done: bool = False
    error: KvxferError | None = None
    released: bool = False
    notified: bool = False


class _Pump:
    """Polls transfers that carry a notification until they finish.

    NIXL sends a transfer's notification only when the *initiator* polls the transfer. A
    prefill worker that posts a WRITE and goes back to computing would leave the decode
    worker waiting forever; this thread keeps polling such transfers (sleeping between polls,
    never spinning) so the notification goes out as soon as the data is there. It exists only
    while such a transfer is pending.
    """

    def __init__(self, backend: "NixlBackend") -> None:
        self._backend = weakref.ref(backend)
        self._pending: set[_Xfer] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._flush_until = 0.0

    def add(self, x: _Xfer) -> None:
        with self._cond:
            self._pending.add(x)
            self._start()

    def flush(self, seconds: float) -> None:
        """Keep progressing NIXL for a while: a standalone notification (``genNotif``) leaves
        the worker only when someone progresses it, and a caller that posted and went back to
        work does not."""
        with self._cond:
            self._flush_until = max(self._flush_until, time.monotonic() + seconds)
            self._start()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvxfer-nixl-notify", daemon=True)
            self._thread.start()
        self._cond.notify()

    def discard(self, x: _Xfer) -> None:
        with self._cond:
            self._pending.discard(x)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._pending.clear()
            self._cond.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def _run(self) -> None:
        delay = 20e-6
        while True:
            with self._cond:
                flushing = time.monotonic() < self._flush_until
                if not self._pending and not self._stop and not flushing:
                    self._cond.wait(timeout=1.0)
                    flushing = time.monotonic() < self._flush_until
                if self._stop or not (self._pending or flushing):
                    self._thread = None
                    return
                batch = list(self._pending)
            backend = self._backend()
            if backend is None:
                return
            for x in batch:
                try:
                    finished = backend.poll(x)
                except KvxferError:
                    finished = True  # the error stays on the handle for the caller's poll
                if finished:
                    self.discard(x)
            if flushing:
                try:
                    backend._collect(blocking=False)
                except KvxferError:
                    pass
            del backend
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------
class NixlBackend(Backend):
    """kvxfer backend over NIXL (UCX by default): DRAM and VRAM, READ and WRITE, notifications.

    Options (``kvxfer.Agent(name, backend="nixl", **options)``):

    ``progress_thread`` (default :data:`DEFAULT_PROGRESS_THREAD`)
        run NIXL's progress thread. Off, both sides must drive progress: the initiator does
        it by polling, the target through ``Agent.progress()``/``notifications()``
        (``capabilities.needs_progress`` says so).
    ``backends`` (default ``("UCX",)``)
        NIXL transport plugins to instantiate.
    ``num_threads`` (default 0)
        worker threads for multi-threaded NIXL plugins (UCX's ``num_threads``).
    ``device_copy`` (default True)
        move VRAM through the core's device path (:mod:`kvxfer.cuda`: CUDA IPC handles and one
        batched copy per post) when the peer is on this host, instead of through UCX.
    ``device_engine`` (default ``"auto"``), ``device_copy_on`` (default ``"local"``)
        the device path's copy engine and copying GPU (see :class:`kvxfer.cuda.DevicePath`).
    ``notify_thread`` (default True)
        keep polling notification-carrying transfers in a helper thread (see :class:`_Pump`).
    """

    name = "nixl"

    def __init__(self, agent_name: str, *, progress_thread: bool | None = None,
                 backends: Sequence[str] = ("UCX",), num_threads: int = 0, device_copy: bool = True,
                 device_engine: str = "auto", device_copy_on: str = "local", notify_thread: bool = True) -> None:
        super().__init__(agent_name, progress_thread=progress_thread, backends=tuple(backends),
                         num_threads=num_threads, device_copy=device_copy, device_engine=device_engine,
                         device_copy_on=device_copy_on, notify_thread=notify_thread)
        self._progress_thread = DEFAULT_PROGRESS_THREAD if progress_thread is None else bool(progress_thread)
        self._path = DevicePath(enabled=bool(device_copy), engine=device_engine, copy_on=device_copy_on)
        self._notify_thread = bool(notify_thread)
        self.capabilities = Capabilities(
            memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}),
            ops=frozenset({Op.READ, Op.WRITE}),
            notifications=True,
            strided_lists=True,
            merges_runs=True,
            cheap_prepare=False,
            max_descriptors=None,
            needs_progress=not self._progress_thread,
            cross_process=True,
        )
        cfg = _nx.nixl_agent_config(enable_prog_thread=self._progress_thread, backends=list(backends),
                                    num_threads=int(num_threads))
        try:
            self._agent = _nx.nixl_agent(agent_name, cfg)
        except Exception as exc:
            raise _map_error(exc, f"creating NIXL agent {agent_name!r}") from exc
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise UnsupportedError(f"NIXL plugin(s) {missing} are not available here; "
                                   f"available: {self._agent.get_plugin_list()}")
        # NIXL agents are not thread-safe in the default sync mode; every call goes through
        # this lock (uncontended cost ~0.1 us; the notify thread and the caller share it).
        self._lock = threading.RLock()
        self._id = os.urandom(16)
        self._remotes: dict[str, _Remote] = {}
        self._prepared: "weakref.WeakSet[_Prepared]" = weakref.WeakSet()
        self._registrations: list[_Registration] = []
        self._inbox: dict[str, list[bytes]] = {}
        self._unreleased: list[_Xfer] = []
        self._epoch = 0
        self._pump = _Pump(self)
        self._closed = False
        _instances[self._id] = self

    def __repr__(self) -> str:
        return (f"<NixlBackend {self.agent_name!r} progress_thread={self._progress_thread} "
                f"peers={sorted(self._remotes)}>")

    # -- memory -------------------------------------------------------------------------
    def register(self, allocations: Sequence[Allocation]) -> _Registration:
        """Register every allocation once, one NIXL call per memory kind."""
        self._check_open()
        allocs = tuple(allocations)
        lists: list[tuple[MemoryKind, Any]] = []
        try:
            for kind in (MemoryKind.DRAM, MemoryKind.VRAM):
                group = [a for a in allocs if a.kind is kind]
                if not group:
                    continue
                # Validated here because NIXL logs bad input and returns a confusing TypeError.
                arr = np.array([(a.address, a.nbytes, a.device) for a in group], dtype=np.uint64)
                with self._lock:
                    try:
                        reg = self._agent.register_memory(arr, kind.value)
                    except Exception as exc:
                        hint = (" (VRAM needs a CUDA build of NIXL and a UCX with CUDA support)"
                                if kind is MemoryKind.VRAM else "")
                        raise _map_error(exc, f"registering {len(group)} {kind.value} allocation(s){hint}") from exc
                lists.append((kind, reg))
            others = {a.kind for a in allocs} - {MemoryKind.DRAM, MemoryKind.VRAM}
            if others:
                raise UnsupportedError(f"NIXL backend moves DRAM and VRAM only, not {sorted(map(str, others))}")
        except BaseException:
            for _, reg in lists:
                with self._lock:
                    try:
                        self._agent.deregister_memory(reg)
                    except Exception:
                        pass
            raise
        handle = _Registration(lists, allocs, self._path.register(allocs))
        self._registrations.append(handle)
        return handle

    def deregister(self, handle: Any) -> None:
        if not isinstance(handle, _Registration) or handle not in self._registrations:
            return
        self._registrations.remove(handle)
        self._path.deregister(handle.device_token)
        errors = []
        for _, reg in handle.lists:
            with self._lock:
                try:
                    self._agent.deregister_memory(reg)
                except Exception as exc:
                    errors.append(exc)
        if errors:
            raise _map_error(errors[0], "deregistering memory")

    # -- peers --------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        """Header (process token, instance id) + device-path export + NIXL's agent metadata."""
        self._check_open()
        with self._lock:
            try:
                md = self._agent.get_agent_metadata()
            except Exception as exc:
                raise _map_error(exc, "reading local NIXL metadata") from exc
        dev = self._path.blob()
        return _HEADER.pack(_MAGIC, _process["token"], self._id, len(dev)) + dev + bytes(md)

    def add_remote(self, peer_name: str, blob: bytes) -> str:
        """Load the peer's NIXL metadata; a name already known is removed first (restart)."""
        self._check_open()
        if not isinstance(blob, (bytes, bytearray)) or len(blob) <= _HEADER.size:
            raise MetadataError(f"NIXL connection blob of {peer_name!r} is too short ({len(blob)} bytes)")
        magic, token, inst, dev_len = _HEADER.unpack_from(blob)
        if magic != _MAGIC:
            raise MetadataError(f"peer {peer_name!r} did not send a kvxfer NIXL blob (bad magic {magic!r})")
        if _HEADER.size + dev_len >= len(blob):
            raise MetadataError(f"NIXL connection blob of {peer_name!r} is truncated")
        dev = bytes(blob[_HEADER.size:_HEADER.size + dev_len])
        _device_blob.decode(dev)  # validated before NIXL sees anything
        md = bytes(blob[_HEADER.size + dev_len:])
        if peer_name in self._remotes:
            self.remove_remote(peer_name)
        with self._lock:
            try:
                try:
                    name = self._agent.add_remote_agent(md)
                except _nb.nixlNotAllowedError:
                    # NIXL still knows the name (a restarted peer we never removed).
                    self._agent.remove_remote_agent(peer_name)
                    name = self._agent.add_remote_agent(md)
            except Exception as exc:
                err = _map_error(exc, f"loading NIXL metadata of {peer_name!r}")
                raise MetadataError(str(err)) from exc
        name = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
        if name != peer_name:
            with self._lock:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:
                    pass
            raise MetadataError(f"NIXL metadata names agent {name!r}, but the kvxfer metadata names {peer_name!r}")
        local = None
        if token == _process["token"]:
            other = _instances.get(inst)
            if other is not None and other is not self:
                local = weakref.ref(other)
        self._epoch += 1
        self._remotes[name] = _Remote(name, self._epoch, local)
        self._path.add_peer(name, dev)
        return name

    def remove_remote(self, peer: str) -> None:
        """Disconnect; NIXL invalidates every list prepared for the peer, so we release ours."""
        rem = self._remotes.pop(peer, None)
        if rem is None:
            return
        self._path.remove_peer(peer)
        for p in list(self._prepared):
            if p.peer == peer:
                self.release_prepared(p)
        with self._lock:
            try:
                self._agent.remove_remote_agent(peer)
            except _nb.nixlNotFoundError:
                pass
            except Exception as exc:
                raise _map_error(exc, "removing peer", peer) from exc

    # -- descriptor lists ----------------------------------------------------------------
    def prepare(self, peer: str | None, descs: DescriptorList) -> _Prepared:
        """``prep_xfer_dlist`` once; N x 5 strided rows go to NIXL as they are (much cheaper)."""
        self._check_open()
        if descs.kind not in (MemoryKind.DRAM, MemoryKind.VRAM):
            raise UnsupportedError(f"NIXL backend cannot move {descs.kind} memory")
        if peer is None:
            target, epoch, rem = _LOCAL_AGENT, 0, None
        else:
            rem = self._remotes.get(peer)
            if rem is None:
                raise UnknownPeerError(f"NIXL backend of {self.agent_name!r} has no peer {peer!r}; add it first")
            target, epoch = peer, rem.epoch
        device = self._path.prepare(peer, descs) if descs.kind is MemoryKind.VRAM and len(descs) else None
        handle = None
        if len(descs):
            with self._lock:
                try:
                    handle = self._agent.prep_xfer_dlist(target, descs.array, descs.kind.value)
                except Exception as exc:
                    # Two agents of one process: UCX may refuse, the device path still serves it.
                    if device is None or rem is None:
                        raise _map_error(exc, f"preparing {len(descs)} {descs.kind.value} descriptors", peer) from exc
        p = _Prepared(handle, peer, epoch, descs, device)
        self._prepared.add(p)
        return p

    def release_prepared(self, prepared: Any) -> None:
        if not isinstance(prepared, _Prepared) or prepared.handle is None:
            return
        h, prepared.handle = prepared.handle, None
        self._prepared.discard(prepared)
        if self._closed:
            return
        with self._lock:
            try:
                self._agent.release_dlist_handle(h)
            except Exception:
                pass  # a list NIXL already dropped (peer removed) is gone either way

    # -- transfers ----------------------------------------------------------------------
    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> _Xfer:
        """``make_prepped_xfer`` with int32 indices, then ``transfer``; nothing else on the hot path."""
        self._check_open()
        if not isinstance(local, _Prepared) or not isinstance(remote, _Prepared):
            raise BackendError("post() needs lists returned by this backend's prepare()")
        if local.peer is not None:
            raise BackendError("the local list was prepared for a peer; prepare it with peer=None")
        rem = self._remotes.get(remote.peer or "")
        if rem is None or rem.epoch != remote.epoch:
            raise StalePeerError(f"the remote list was prepared for {remote.peer!r}, which was removed or re-added "
                                 "since; prepare it again")
        li, ri = _as_int32(local_idx), _as_int32(remote_idx)
        if li.shape != ri.shape:
            raise BackendError(f"index arrays differ in length ({li.shape[0]} vs {ri.shape[0]})")
        if local.device is not None and remote.device is not None:
            x = _Xfer(None, rem.name, notification, event=self._path.post(op, local.device, li, remote.device, ri))
            if notification and self._notify_thread:
                self._pump.add(x)
            return x
        if local.handle is None or remote.handle is None:
            raise BackendError("descriptor list was released or is empty")
        with self._lock:
            try:
                h = self._agent.make_prepped_xfer(op.value, local.handle, li, remote.handle, ri, notification or b"")
            except Exception as exc:
                raise _map_error(exc, f"creating a {op.value} of {li.shape[0]} descriptors", rem.name) from exc
            try:
                state = self._agent.transfer(h)
            except Exception as exc:
                self._release_handle(h)
                raise _map_error(exc, f"posting a {op.value} of {li.shape[0]} descriptors", rem.name) from exc
        if state == "ERR":
            self._release_handle(h)
            raise BackendError(f"NIXL refused to post a {op.value} of {li.shape[0]} descriptors to {rem.name!r}")
        x = _Xfer(h, rem.name, notification)
        if notification and self._notify_thread:
            self._pump.add(x)
        return x

    def poll(self, xfer: Any) -> bool:
        """One non-blocking look. Without a progress thread it also progresses same-process peers."""
        x: _Xfer = xfer
        if x.done:
            return True
        if x.error is not None:
            raise x.error
        if x.released:
            raise TransferCancelledError("transfer was released")
        if x.event is not None:
            try:
                finished = self._path.poll(x.event)
            except KvxferError as exc:
                x.error = exc
                raise
        else:
            with self._lock:
                if x.released:  # released by another thread: never touch a freed handle
                    raise TransferCancelledError("transfer was released")
                try:
                    state = self._agent.check_xfer_state(x.handle)
                except Exception as exc:
                    x.error = _map_error(exc, "transfer failed", x.peer)
                    raise x.error from exc
            if state == "ERR":
                x.error = BackendError(f"NIXL reported a failed transfer with {x.peer!r}")
                raise x.error
            finished = state == "DONE"
        if finished:
            if x.event is not None and x.notification and not x.notified:
                self._send_notif(x.peer, x.notification)
                if self._notify_thread:
                    self._pump.flush(_NOTIF_FLUSH_S)
            x.notified = True
            x.done = True
            return True
        if not self._progress_thread:
            self._progress_local_peers()
        return False

    def release(self, xfer: Any) -> None:
        """Forget a transfer; NIXL aborts it if still pending. Never raises."""
        x: _Xfer = xfer
        if x.notification:
            self._pump.discard(x)
        with self._lock:  # the notify thread checks ``released`` under the same lock
            if x.released:
                return
            x.released = True
            if x.event is not None:
                self._path.release(x.event)  # a device copy cannot be aborted; it ends in milliseconds
                return
            if not self._release_handle(x.handle):
                self._unreleased.append(x)

    def data_path(self, xfer: Any) -> str | None:
        """``"cuda-ipc"`` or ``"same-process"`` for device-path copies, else ``"nixl"``."""
        x: _Xfer = xfer
        return x.event.kind if x.event is not None else "nixl"

    def _release_handle(self, h: Any) -> bool:
        with self._lock:
            try:
                self._agent.release_xfer_handle(h)
                return True
            except Exception:
                return False  # NIXL is still aborting it; retried by progress() and close()

    # -- notifications ------------------------------------------------------------------
    def _send_notif(self, peer: str, message: bytes) -> None:
        with self._lock:
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:
                raise _map_error(exc, "sending a notification", peer) from exc

    def notify(self, peer: str, message: bytes) -> None:
        self._check_open()
        if peer not in self._remotes:
            raise UnknownPeerError(f"NIXL backend of {self.agent_name!r} has no peer {peer!r}")
        self._send_notif(peer, bytes(message))
        if self._notify_thread:
            self._pump.flush(_NOTIF_FLUSH_S)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        self._check_open()
        self.progress()
        with self._lock:
            out, self._inbox = self._inbox, {}
        return out

    def _collect(self, blocking: bool = True) -> None:
        if not self._lock.acquire(blocking=blocking):
            return
        try:
            if self._closed:
                return
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:
                raise _map_error(exc, "reading notifications") from exc
            for k, v in new.items():
                key = k.decode() if isinstance(k, (bytes, bytearray)) else str(k)
                self._inbox.setdefault(key, []).extend(bytes(m) for m in v)
        finally:
            self._lock.release()

    def progress(self) -> None:
        """Drive NIXL once (receiving notifications drives the UCX worker) and retry releases."""
        if self._closed:
            return
        self._collect()
        if not self._progress_thread:
            self._progress_local_peers()
        if self._unreleased:
            self._unreleased = [x for x in self._unreleased if not self._release_handle(x.handle)]

    def _progress_local_peers(self) -> None:
        """Progress peers of this process: nobody else drives them when the thread is off.

        Never blocks: a peer busy in another thread is progressing anyway.
        """
        for rem in tuple(self._remotes.values()):
            other = rem.local() if rem.local is not None else None
            if other is not None and not other._closed:
                try:
                    other._collect(blocking=False)
                except KvxferError:
                    pass

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the notify thread, drop peers and registrations, destroy the NIXL agent."""
        if self._closed:
            return
        self._pump.stop()
        for peer in list(self._remotes):
            try:
                self.remove_remote(peer)
            except KvxferError:
                pass
        for p in list(self._prepared):
            self.release_prepared(p)
        for x in self._unreleased:
            self._release_handle(x.handle)
        self._unreleased.clear()
        for reg in list(self._registrations):
            try:
                self.deregister(reg)
            except KvxferError:
                pass
        self._path.close()
        self._closed = True
        _instances.pop(self._id, None)
        with self._lock:
            self._agent = None  # the C++ agent is destroyed with its last reference

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"NIXL backend of {self.agent_name!r} is closed")
