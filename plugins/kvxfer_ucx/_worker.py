"""One UCP context and worker: memory keys, endpoints, active messages, requests.

This is the connection layer under the backend: every libucp call except the data path's
GET/PUT/flush goes through here, so the backend's control plane reads as policy, not as
ctypes. Nothing here locks: the backend calls it under its own lock (the worker runs in
``UCS_THREAD_MODE_SERIALIZED``, so any thread may drive it, one at a time).

Every endpoint uses UCX's error mode ``PEER``: UCX then reports a dead peer through the
error callback and completes that endpoint's outstanding requests with an error status,
instead of leaving them pending or, worse, completing them as if the bytes had moved.

:meth:`Worker.spawn` makes another worker on the same context (same registrations and
remote keys, its own receive queue): the backend gives each same-host RMA peer one, because a peer
killed while writing into a shared-memory receive queue blocks that queue for good
(:mod:`kvxfer_ucx._peerworkers`).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

from kvxfer import BackendError, BackendUnavailableError, MetadataError, PeerDisconnectedError
from kvxfer.plugin import Deadline

from . import _libucp as L
from kvxfer.plugin.ucxabi import mmqueue as _stuckslot

from . import _requests

__all__ = ["Worker", "UcxCallError"]

#: Identifies kvxfer's active messages among any others a worker may see.
AM_ID = 0x6B76  # "kv"


class UcxCallError(BackendError):
    """A libucp call failed; ``status`` is its ``ucs_status_t``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _ptr(handle: ctypes.c_void_p, call: str) -> int:
    """The address a libucp call wrote into ``handle``; NULL after success is a UCX bug."""
    if not handle.value:
        raise BackendError(f"ucx backend: {call} succeeded but returned a NULL handle")
    return int(handle.value)


def _rkey_shape(packed: bytes) -> tuple[bytes, list[int], int] | None:
    """Header (MD map and memory type), per-MD key sizes and length of a packed remote key;
    None when the sizes run past the end."""
    if len(packed) < 9:
        return None
    md_map, pos, sizes = int.from_bytes(packed[:8], "little"), 9, []
    for _ in range(bin(md_map).count("1")):
        if pos >= len(packed):
            return None
        sizes.append(packed[pos])
        pos += 1 + packed[pos]
    return (packed[:9], sizes, len(packed)) if pos <= len(packed) else None


class Worker:
    """A UCP context with one worker, created from ``config`` (UCX keys without ``UCX_``).

    ``on_ep_error(ep, status)`` and ``on_am(header, data)`` are called from inside
    :meth:`progress`; exceptions they raise are swallowed (they must never unwind into C).
    """

    def __init__(self, name: str, config: dict[str, str], on_ep_error: Callable[[int, int], None],
                 on_am: Callable[[bytes, bytes], None]) -> None:
        try:
            self.lib = L.load()
        except OSError as exc:
            raise BackendUnavailableError(f"ucx backend: {exc}") from None
        self.ctx = self.worker = 0
        self._owns_ctx = True
        #: ``(address, device, inode)`` of this worker's shared-memory receive queue, if told apart
        self.fifo: tuple[int, str, str] | None = None
        self._on_ep_error, self._on_am_user = on_ep_error, on_am
        self._init_context(name, config)
        self._init_worker()
        self._rkey_shape = self._own_rkey_shape()
        self.version = ".".join(map(str, self.lib.version))

    def spawn(self) -> "Worker":
        """Another worker on this context, with the same callbacks: its own address and
        receive queue, the same memory registrations. Close it before this one."""
        child = Worker.__new__(Worker)
        child.lib, child.ctx, child.worker, child._owns_ctx, child.fifo = self.lib, self.ctx, 0, False, None
        child._on_ep_error, child._on_am_user = self._on_ep_error, self._on_am_user
        wp = L.UcpWorkerParams(field_mask=L.UCP_WORKER_PARAM_FIELD_THREAD_MODE, thread_mode=L.UCS_THREAD_MODE_SERIALIZED)
        worker = ctypes.c_void_p()
        with _stuckslot.CREATING:
            before = _stuckslot.queues()
            child._check("ucp_worker_create", self.lib.ucp_worker_create(self.ctx, ctypes.byref(wp), ctypes.byref(worker)))
            child.fifo = _stuckslot.new_queue(before)
        child.worker = _ptr(worker, "ucp_worker_create")
        try:
            child._init_worker()
        except BaseException:
            child.close()
            raise
        child._rkey_shape, child.version = self._rkey_shape, self.version
        return child

    def _init_worker(self) -> None:
        """Callbacks, the active-message handler and the address of :attr:`worker`."""
        # Callbacks must outlive every call that may invoke them: keep them on the instance.
        self._err_cb = L.ucp_err_handler_cb_t(self._err_trampoline)
        self._am_cb = L.ucp_am_recv_callback_t(self._am_trampoline)
        p = L.UcpAmHandlerParam(field_mask=(L.UCP_AM_HANDLER_PARAM_FIELD_ID | L.UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                                            | L.UCP_AM_HANDLER_PARAM_FIELD_CB | L.UCP_AM_HANDLER_PARAM_FIELD_ARG),
                                id=AM_ID, flags=L.UCP_AM_FLAG_WHOLE_MSG, cb=self._am_cb, arg=None)
        self._check("ucp_worker_set_am_recv_handler", self.lib.ucp_worker_set_am_recv_handler(self.worker, ctypes.byref(p)))
        self.address = self._query_address()
        self.param = L.RequestParam()  # all-zero: no callback, default datatype
        self.param_ref = ctypes.byref(self.param)

    def _check(self, call: str, status: int) -> None:
        if status != L.UCS_OK:
            raise UcxCallError(f"ucx backend: {call} failed: {self.lib.status_string(status)}", status)

    def _init_context(self, name: str, config: dict[str, str]) -> None:
        lib = self.lib
        cfg = ctypes.c_void_p()
        self._check("ucp_config_read", lib.ucp_config_read(None, None, ctypes.byref(cfg)))
        try:
            for key, value in config.items():
                st = lib.ucp_config_modify(cfg, key.encode(), value.encode())
                if st != L.UCS_OK:
                    raise BackendError(f"ucx backend: bad UCX config {key}={value!r}: {lib.status_string(st)}")
            params = L.UcpParams(field_mask=L.UCP_PARAM_FIELD_FEATURES | L.UCP_PARAM_FIELD_NAME
                                 | _requests.UCP_PARAM_FIELD_REQUEST_INIT,
                                 features=L.UCP_FEATURE_RMA | L.UCP_FEATURE_AM, name=name.encode("utf-8", "replace")[:31],
                                 request_init=ctypes.cast(_requests.REQUEST_INIT, ctypes.c_void_p))
            ctx = ctypes.c_void_p()
            self._check("ucp_init", lib.ucp_init_version(L.API_MAJOR, L.API_MINOR, ctypes.byref(params), cfg,
                                                         ctypes.byref(ctx)))
        finally:
            lib.ucp_config_release(cfg)
        self.ctx = _ptr(ctx, "ucp_init")
        _requests.learn_size(lib, self.ctx)  # before the first worker: its request pool starts zeroed
        wp = L.UcpWorkerParams(field_mask=L.UCP_WORKER_PARAM_FIELD_THREAD_MODE, thread_mode=L.UCS_THREAD_MODE_SERIALIZED)
        worker = ctypes.c_void_p()
        with _stuckslot.CREATING:
            before = _stuckslot.queues()
            st = lib.ucp_worker_create(self.ctx, ctypes.byref(wp), ctypes.byref(worker))
            self.fifo = _stuckslot.new_queue(before) if st == L.UCS_OK else None
        if st != L.UCS_OK:
            lib.ucp_cleanup(self.ctx)
            raise BackendError(f"ucx backend: ucp_worker_create failed: {lib.status_string(st)}")
        self.worker = _ptr(worker, "ucp_worker_create")

    def _query_address(self) -> bytes:
        attr = L.UcpWorkerAttr(field_mask=L.UCP_WORKER_ATTR_FIELD_ADDRESS)
        self._check("ucp_worker_query", self.lib.ucp_worker_query(self.worker, ctypes.byref(attr)))
        try:
            return ctypes.string_at(attr.address, attr.address_length)
        finally:
            self.lib.ucp_worker_release_address(self.worker, attr.address)

    # -- callbacks (inside ucp_worker_progress) ----------------------------------------------
    def _err_trampoline(self, arg: int | None, ep: int | None, status: int) -> None:
        try:
            self._on_ep_error(int(ep or 0), int(status))
        except Exception:  # never unwind into C
            pass

    def _am_trampoline(self, arg: int | None, header: int | None, header_len: int, data: int | None, length: int,
                       param: int | None) -> int:
        try:
            if header and 0 < header_len <= 4096 and (data or not length):
                body = ctypes.string_at(data, length) if data and length else b""
                self._on_am_user(ctypes.string_at(header, header_len), body)
        except Exception:  # never unwind into C
            pass
        return L.UCS_OK

    # -- progress and requests ----------------------------------------------------------------
    def progress(self) -> int:
        return int(self.lib.ucp_worker_progress(self.worker))

    def status_string(self, status: int) -> str:
        return self.lib.status_string(status)

    def reap(self, request: int) -> int | None:
        """None while ``request`` is in flight; else free it and return its final status."""
        st = int(self.lib.ucp_request_check_status(request))
        if st == L.UCS_INPROGRESS:
            return None
        self.lib.ucp_request_free(request)
        return st

    def drain(self, requests: list[int], deadline: float, alive: Callable[[], bool]) -> bool:
        """Drive the worker until ``requests`` complete, ``deadline`` passes or ``alive()`` is
        False; then cancel and free whatever is left (UCX completes freed requests itself).
        True when none was still in flight."""
        lib = self.lib
        pending = [r for r in requests if lib.ucp_request_check_status(r) == L.UCS_INPROGRESS]
        while pending and alive() and time.monotonic() < deadline:
            lib.ucp_worker_progress(self.worker)
            pending = [r for r in pending if lib.ucp_request_check_status(r) == L.UCS_INPROGRESS]
        for r in pending:
            lib.ucp_request_cancel(self.worker, r)
        for r in requests:
            lib.ucp_request_free(r)
        requests.clear()
        return not pending

    # -- memory ---------------------------------------------------------------------------------
    def mem_map(self, address: int, nbytes: int) -> tuple[int, bytes]:
        """Register host memory; returns ``(memh, packed rkey)``."""
        lib = self.lib
        p = L.UcpMemMapParams(field_mask=(L.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | L.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                                          | L.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE),
                              address=address, length=nbytes, memory_type=L.UCS_MEMORY_TYPE_HOST)
        memh = ctypes.c_void_p()
        self._check("ucp_mem_map", lib.ucp_mem_map(self.ctx, ctypes.byref(p), ctypes.byref(memh)))
        handle = _ptr(memh, "ucp_mem_map")
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        st = lib.ucp_rkey_pack(self.ctx, handle, ctypes.byref(buf), ctypes.byref(size))
        if st != L.UCS_OK:
            lib.ucp_mem_unmap(self.ctx, handle)
            self._check("ucp_rkey_pack", st)
        try:
            return handle, ctypes.string_at(buf, size.value)
        finally:
            lib.ucp_rkey_buffer_release(buf)

    def mem_unmap(self, memh: int) -> None:
        self.lib.ucp_mem_unmap(self.ctx, memh)

    def _own_rkey_shape(self) -> tuple[bytes, list[int], int]:
        """``(header, per-MD key sizes, length)`` of a key this worker packs for host memory."""
        probe = ctypes.create_string_buffer(64)
        memh, packed = self.mem_map(ctypes.addressof(probe), 64)
        self.mem_unmap(memh)
        shape = _rkey_shape(packed)
        if shape is None:
            raise BackendError("ucx backend: this UCX packs remote keys in an unknown format")
        return shape

    def unpack_rkey(self, ep: int, packed: bytes) -> int:
        """Unpack a peer's remote key. ``ucp_ep_rkey_unpack`` takes no length and trusts the
        bytes, so a key must first have exactly the shape of the ones this worker packs (same
        UCX build and transports on both sides); that stops accidents, not forgery."""
        if _rkey_shape(packed) != self._rkey_shape:
            raise MetadataError("ucx metadata: a remote key does not have the shape this UCX packs (corrupt, or "
                                "packed by a different UCX build or transport set)")
        rk = ctypes.c_void_p()
        st = self.lib.ucp_ep_rkey_unpack(ep, packed, ctypes.byref(rk))
        if st != L.UCS_OK:
            raise UcxCallError(f"ucx metadata: remote key rejected by UCX: {self.lib.status_string(st)}", st)
        return _ptr(rk, "ucp_ep_rkey_unpack")

    def destroy_rkey(self, rkey: int) -> None:
        self.lib.ucp_rkey_destroy(rkey)

    # -- endpoints ------------------------------------------------------------------------------
    def connect(self, worker_address: bytes) -> int:
        """An endpoint to a peer's worker, in error mode PEER with our error callback.

        UCX parses ``worker_address`` without defending itself: only an authenticated blob
        is safe. The one check here (the format version nibble, which UCX asserts on and
        aborts the process for) is a guard against accidents, not against forgery.
        """
        if not worker_address or (worker_address[0] & 0x0F) != (self.address[0] & 0x0F):
            raise MetadataError("ucx metadata: the worker address has an unknown format version")
        buf = ctypes.create_string_buffer(worker_address, len(worker_address))
        p = L.UcpEpParams(field_mask=(L.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | L.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                                      | L.UCP_EP_PARAM_FIELD_ERR_HANDLER),
                          address=ctypes.cast(buf, ctypes.c_void_p), err_mode=L.UCP_ERR_HANDLING_MODE_PEER)
        p.err_handler = L.UcpErrHandler(self._err_cb, None)
        ep = ctypes.c_void_p()
        st = self.lib.ucp_ep_create(self.worker, ctypes.byref(p), ctypes.byref(ep))
        if st != L.UCS_OK:
            raise PeerDisconnectedError(f"ucx backend: cannot reach the peer's worker: {self.lib.status_string(st)}")
        handle = _ptr(ep, "ucp_ep_create")
        # Start wiring up now (without waiting: the peer may live in this thread), so that UCX
        # watches the connection before the first transfer.
        req = self.lib.ucp_ep_flush_nbx(handle, self.param_ref)
        if req and not L.is_err_ptr(req):
            self.lib.ucp_request_free(req)
        return handle

    def close_ep(self, ep: int, force: bool, timeout: float = 0.5) -> None:
        """Close ``ep``: flushed when the peer is alive, forced when it is not; bounded."""
        p = L.RequestParam(op_attr_mask=L.UCP_OP_ATTR_FIELD_FLAGS, flags=L.UCP_EP_CLOSE_FLAG_FORCE if force else 0)
        req = self.lib.ucp_ep_close_nbx(ep, ctypes.byref(p))
        if L.status_of_ptr(req) == L.UCS_INPROGRESS:
            self.drain([req], Deadline.within(timeout), lambda: True)

    def send_am(self, ep: int, header: bytes, body: bytes) -> tuple[int | None, tuple[Any, ...]]:
        """Start an eager active message; returns ``(request or None, buffers to keep alive)``."""
        hdr = ctypes.create_string_buffer(header, len(header))
        data = ctypes.create_string_buffer(body, len(body))
        p = L.RequestParam(op_attr_mask=L.UCP_OP_ATTR_FIELD_FLAGS,
                           flags=L.UCP_AM_SEND_FLAG_EAGER | L.UCP_AM_SEND_FLAG_COPY_HEADER)
        req = self.lib.ucp_am_send_nbx(ep, AM_ID, hdr, len(header), data, len(body), ctypes.byref(p))
        if req and L.is_err_ptr(req):
            st = L.status_of_ptr(req)
            raise UcxCallError(f"ucx backend: ucp_am_send_nbx failed: {self.lib.status_string(st)}", st)
        return (req or None), (hdr, data)

    def close(self) -> None:
        if self.worker:
            self.fifo = None
            self.lib.ucp_worker_destroy(self.worker)
            self.worker = 0
        if self.ctx and self._owns_ctx:
            self.lib.ucp_cleanup(self.ctx)
        self.ctx = 0
