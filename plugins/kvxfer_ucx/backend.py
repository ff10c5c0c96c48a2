"""The UCX backend: one-sided RMA on libucp through ctypes.

Shape of a transfer (see the package docstring for why this shape won the measurements)::

    post:  one ucp_get_nbx / ucp_put_nbx per (coalesced) descriptor on the data endpoint,
           requests freed at once (fire and forget), then one ucp_ep_flush_nbx
    poll:  ucp_worker_progress; when the flush completes every byte is visible on both
           sides; only then is the notification sent as an active message, so it can never
           overtake the data
    dead peer: a second, tiny endpoint per peer in error mode PEER carries notifications and
           gets UCX's error callback when the peer process dies (TCP reset, or keepalive
           timeout across hosts). The data endpoint stays in mode NONE so that UCX keeps its
           fast shared-memory / CMA paths, which mode PEER gives up (measured: see
           CONTRIBUTING.md).

Same-host peers (the default, ``same_host_copy=None``): when the peer's metadata shows the same
``boot_id``, hostname and PID namespace, and reading a random token from the peer's memory
through ``process_vm_readv`` succeeds at :meth:`UcxBackend.add_remote`, DRAM bytes move with
batched ``process_vm_readv`` / ``process_vm_writev`` (:mod:`kvxfer_ucx._samehost`) instead of
UCX RMA. UCX still carries everything else: the connection, the ``peer``-mode watchdog
endpoint, notifications (sent after the synchronous copy returned, so after the data), and
every cross-host or fallback transfer. A dead peer gives the kernel's ``ESRCH``, mapped to
:class:`~kvxfer.errors.PeerDisconnectedError`, where UCX's CMA would abort this process.

Shape of a same-host transfer: :meth:`post` copies for up to ``inline_budget`` (5 ms, about
25 MB here), so small transfers and their notifications complete inside ``post`` (as NIXL's
``transfer()`` does); each :meth:`poll` then copies for up to ``copy_budget`` (5 ms), in
syscalls of at most ``copy_chunk`` (8 MiB) and 1,024 iovecs, so no call blocks longer than
budget + one chunk (~7 ms) however large the request (a 7 GB request would block ~1.5 s in
one syscall). ``release`` between polls stops the copy at once: nothing is in flight. Why not
a worker thread (``copy_thread=True``, kept as an option): through ``kvxfer.Agent`` it was no
faster on this 2-core VM (0.94 GB: 4.9-5.0 vs 5.6-5.9 GB/s; 2.8 GB: 5.3 vs 5.8 GB/s), a caller
spinning on ``poll`` competes with it for a core, and with it "released" must wait for the
syscall in flight. It does help a caller that posts and then computes for a while before
polling, since bytes then move meanwhile.

Thread model: every libucp call happens under one lock; the worker runs in
``UCS_THREAD_MODE_SERIALIZED`` so any thread may drive it, one at a time.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvxfer import Allocation, Backend, Capabilities, DescriptorList, MemoryKind, Op
from kvxfer.errors import (BackendError, KvxferError, MetadataError, PeerDisconnectedError, StalePeerError,
                           TransferCancelledError, UnknownPeerError, UnsupportedError)

from . import _libucp as L
from . import _samehost as SH
from ._blob import MAX_NAME, _b64, encode_blob, parse_blob

__all__ = ["UcxBackend"]

#: Notifications ride an eager active message; larger payloads belong in KV memory.
MAX_NOTIFICATION = 64 << 10
AM_ID = 0x6B76  # "kv"
#: Every transport the libucx wheel has for host memory, except CMA (see ``cma`` option).
SAFE_TLS = "self,tcp,sysv,posix"
_AM_HEADER = struct.Struct("<4sBxH")  # magic, kind, pad, sender-name length; name follows
_AM_MAGIC = b"KVXN"
_AM_NOTIFY = 1
#: Longest a poll() waits for a same-host copy running on the worker thread (seconds).
_POLL_WAIT = 200e-6

_ERR_MODES = {"none": L.UCP_ERR_HANDLING_MODE_NONE, "peer": L.UCP_ERR_HANDLING_MODE_PEER}


def _ptr(handle: ctypes.c_void_p, call: str) -> int:
    """The address a libucp call wrote into ``handle``; NULL after success is a UCX bug."""
    if not handle.value:
        raise BackendError(f"ucx backend: {call} succeeded but returned a NULL handle")
    return int(handle.value)


@dataclass
class _Reg:
    allocs: tuple[Allocation, ...]
    memhs: list[int]
    rkeys: list[bytes]


@dataclass
class _Peer:
    """A connected peer: its endpoints, unpacked rkeys and registered spans (sorted by start)."""

    name: str
    data_ep: int
    ctrl_ep: int
    starts: np.ndarray  # uint64, sorted
    ends: np.ndarray  # uint64
    rkeys: np.ndarray  # uint64 rkey handles, same order
    failed: int | None = None  # ucs_status from the error callback
    closed: bool = False
    #: pid for the same-host copy path, or None: bytes go through UCX RMA.
    copy_pid: int | None = None
    #: why this peer uses the path it uses (for tests, benchmarks and logs)
    path_reason: str = ""
    #: copy jobs handed to the worker thread, cancelled when the peer is dropped
    jobs: list[SH.CopyJob] = field(default_factory=list)

    @property
    def path(self) -> str:
        return "same-host-copy" if self.copy_pid is not None else "ucx-rma"


@dataclass
class _Local:
    addr: np.ndarray
    nbytes: np.ndarray
    descs: DescriptorList


@dataclass
class _Remote:
    peer: _Peer
    addr: np.ndarray
    nbytes: np.ndarray
    slot: np.ndarray  # index into peer.rkeys
    descs: DescriptorList


@dataclass
class _Xfer:
    peer: _Peer
    flush: int | None  # request pointer, or None when the flush completed in place
    notification: bytes | None
    am: int | None = None
    am_buffers: tuple[Any, ...] = ()
    done: bool = False
    error: KvxferError | None = None
    released: bool = False
    keepalive: list[Any] = field(default_factory=list)
    copy: SH.CopyJob | None = None  # same-host copy still to finish, or None


class UcxBackend(Backend):
    """kvxfer transport on raw UCX (libucp) one-sided RMA. DRAM only.

    Options:

    ``tls``
        value for ``UCX_TLS`` in this context only (e.g. ``"tcp"``); default: every
        host transport except CMA (``SAFE_TLS``).
    ``cma``
        ``True`` adds UCX's CMA transport (single-copy ``process_vm_readv``) between
        processes of one host: about 2x faster here, but UCX 1.21 **aborts this process**
        if the peer dies in the middle of a copy. Default ``False``.
    ``data_err_mode``
        ``"none"`` (default, fast paths) or ``"peer"`` (UCX error handling on the data
        endpoint too; slower on TCP/shm, see CONTRIBUTING.md).
    ``cancel_timeout``
        seconds :meth:`release` keeps driving a still-pending transfer before giving up on
        it. One-sided RMA cannot be recalled, so a cancelled transfer is drained (bounded)
        rather than abandoned with bytes still moving; a dead peer is never waited on.
    ``inline_budget``
        seconds :meth:`post` may keep driving the worker to finish a transfer (and send its
        notification) before returning; default 5 ms. Small transfers then complete inside
        ``post`` as with NIXL's ``transfer()``, so a notification leaves even when the
        caller waits for the peer before polling. Large transfers continue in :meth:`poll`.
    ``ucx_config``
        mapping of extra UCX config keys (without the ``UCX_`` prefix) to values.
    ``same_host_copy``
        ``None`` (default, auto): move DRAM bytes with ``process_vm_readv``/``writev``
        (:mod:`kvxfer_ucx._samehost`) for peers on this host whose identity checks out and
        whose memory we may access (probed at :meth:`add_remote`); UCX RMA otherwise.
        ``True``: the same, but a same-host peer we may not access is an error at
        :meth:`add_remote` instead of a silent fallback. ``False``: never; this backend then
        also does not advertise itself for the fast path nor call ``prctl(PR_SET_PTRACER)``.
        :meth:`peer_path` says which path a peer uses. Security: with the fast path on, this
        process calls ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` so that under Yama
        ``ptrace_scope=1`` any process of the same user may read/write its memory (UCX's own
        CMA needs the same).
    ``copy_thread``
        ``False`` (default): a fast-path copy that does not finish inside :meth:`post`'s
        ``inline_budget`` continues inside :meth:`poll`, at most ``copy_budget`` seconds per
        call (default 5 ms), so it moves only while someone polls, like UCX's software RMA.
        ``True``: it continues on a worker thread, so bytes move while the caller does other
        work; measured no faster for callers that wait (see ``BENCHMARKS.md``).
    ``copy_chunk``
        most bytes one fast-path syscall moves (default 8 MiB, about 2 ms): the granularity at
        which budgets and cancellation are honoured.
    """

    name = "ucx"
    capabilities = Capabilities(
        memory_kinds=frozenset({MemoryKind.DRAM}),
        notifications=True,
        strided_lists=False,
        merges_runs=False,
        cheap_prepare=True,
        max_descriptors=None,
        needs_progress=True,
        cross_process=True,
    )

    def __init__(self, agent_name: str, **options: Any) -> None:
        super().__init__(agent_name, **options)
        known = {"tls", "cma", "data_err_mode", "cancel_timeout", "inline_budget", "ucx_config", "same_host_copy",
                 "copy_thread", "copy_chunk", "copy_budget"}
        unknown = set(options) - known
        if unknown:
            raise BackendError(f"ucx backend: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
        mode = options.get("data_err_mode", "none")
        if mode not in _ERR_MODES:
            raise BackendError(f"ucx backend: data_err_mode must be 'none' or 'peer', got {mode!r}")
        self._data_err_mode = _ERR_MODES[mode]
        self._cancel_timeout = float(options.get("cancel_timeout", 2.0))
        self._inline_budget = float(options.get("inline_budget", 0.005))
        shc = options.get("same_host_copy", None)
        if shc is not None and not isinstance(shc, bool):
            raise BackendError(f"ucx backend: same_host_copy must be None, True or False, got {shc!r}")
        self._same_host_copy: bool | None = shc
        self._copy_thread = bool(options.get("copy_thread", False))
        self._copy_chunk = int(options.get("copy_chunk", SH.DEFAULT_CHUNK))
        self._copy_budget = float(options.get("copy_budget", 0.005))
        if self._copy_chunk <= 0:
            raise BackendError("ucx backend: copy_chunk must be a positive number of bytes")
        if len(agent_name.encode()) > MAX_NAME:
            raise BackendError(f"agent name longer than {MAX_NAME} bytes")
        try:
            self._lib = L.load()
        except OSError as exc:
            from kvxfer.errors import BackendUnavailableError

            raise BackendUnavailableError(f"ucx backend: {exc}") from None
        self._lock = threading.RLock()
        self._closed = False
        self._regs: dict[int, _Reg] = {}
        self._next_reg = 1
        self._bounds = np.zeros((0, 2), dtype=np.uint64)
        self._peers: dict[str, _Peer] = {}
        self._by_ep: dict[int, _Peer] = {}
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self._zombies: list[int] = []  # requests we stopped waiting for; freed at close
        self._sends: list[tuple[int, tuple[Any, ...], _Peer]] = []  # standalone notifications in flight
        self._ctx = self._worker = 0
        config: dict[str, str] = {str(k): str(v) for k, v in dict(options.get("ucx_config") or {}).items()}
        if options.get("tls"):
            config["TLS"] = str(options["tls"])
        elif not options.get("cma", False) and "TLS" not in config:
            # CMA aborts this process when the peer dies mid-copy (UCX 1.21, error mode NONE):
            # left out unless asked for. See the package docstring.
            config["TLS"] = SAFE_TLS
        self._init_context(config)
        # Callbacks must outlive every call that may invoke them: keep them on the instance.
        self._err_cb = L.ucp_err_handler_cb_t(self._on_ep_error)
        self._am_cb = L.ucp_am_recv_callback_t(self._on_am)
        self._set_am_handler()
        self._param = L.RequestParam()  # all-zero: no callback, default datatype
        self._param_ref = ctypes.byref(self._param)
        self._address = self._query_address()
        self._copier: SH.Copier | None = None
        self._libc: SH.Libc | None = None
        self._host: dict[str, Any] | None = None
        self._token = ctypes.create_string_buffer(SH.TOKEN_BYTES)
        if shc is not False:
            self._init_same_host()

    def _init_same_host(self) -> None:
        """Prepare to be a fast-path peer and initiator; any failure just leaves it off.

        The token is random bytes at an address we advertise: a peer that reads them back
        through ``process_vm_readv`` has proven both that ``pid`` is this very process (not a
        reused pid, not another PID namespace) and that it is allowed to access our memory.
        """
        lib = SH.libc()
        ident = SH.host_identity() if lib is not None else None
        if lib is None or ident is None:
            return
        SH.allow_same_user_access(lib)  # harmless when it fails (no Yama)
        self._libc = lib
        ctypes.memmove(self._token, os.urandom(SH.TOKEN_BYTES), SH.TOKEN_BYTES)
        self._host = {**ident, "token": _b64(self._token.raw), "token_addr": ctypes.addressof(self._token)}

    # -- setup --------------------------------------------------------------------------------
    def _init_context(self, config: dict[str, str]) -> None:
        lib = self._lib
        cfg = ctypes.c_void_p()
        lib.check("ucp_config_read", lib.ucp_config_read(None, None, ctypes.byref(cfg)))
        try:
            for key, value in config.items():
                st = lib.ucp_config_modify(cfg, key.removeprefix("UCX_").encode(), value.encode())
                if st != L.UCS_OK:
                    raise BackendError(f"ucx backend: bad UCX config {key}={value!r}: {lib.status_string(st)}")
            params = L.UcpParams(field_mask=L.UCP_PARAM_FIELD_FEATURES | L.UCP_PARAM_FIELD_NAME,
                                 features=L.UCP_FEATURE_RMA | L.UCP_FEATURE_AM,
                                 name=self.agent_name.encode()[:31])
            ctx = ctypes.c_void_p()
            lib.check("ucp_init", lib.ucp_init_version(L.API_MAJOR, L.API_MINOR, ctypes.byref(params), cfg,
                                                       ctypes.byref(ctx)))
        finally:
            lib.ucp_config_release(cfg)
        self._ctx = _ptr(ctx, "ucp_init")
        wp = L.UcpWorkerParams(field_mask=L.UCP_WORKER_PARAM_FIELD_THREAD_MODE, thread_mode=1)  # SERIALIZED
        worker = ctypes.c_void_p()
        st = lib.ucp_worker_create(self._ctx, ctypes.byref(wp), ctypes.byref(worker))
        if st != L.UCS_OK:
            lib.ucp_cleanup(self._ctx)
            raise BackendError(f"ucx backend: ucp_worker_create failed: {lib.status_string(st)}")
        self._worker = _ptr(worker, "ucp_worker_create")

    def _set_am_handler(self) -> None:
        p = L.UcpAmHandlerParam(field_mask=(L.UCP_AM_HANDLER_PARAM_FIELD_ID | L.UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                                            | L.UCP_AM_HANDLER_PARAM_FIELD_CB | L.UCP_AM_HANDLER_PARAM_FIELD_ARG),
                                id=AM_ID, flags=L.UCP_AM_FLAG_WHOLE_MSG, cb=self._am_cb, arg=None)
        self._lib.check("ucp_worker_set_am_recv_handler",
                        self._lib.ucp_worker_set_am_recv_handler(self._worker, ctypes.byref(p)))

    def _query_address(self) -> bytes:
        attr = L.UcpWorkerAttr(field_mask=L.UCP_WORKER_ATTR_FIELD_ADDRESS)
        self._lib.check("ucp_worker_query", self._lib.ucp_worker_query(self._worker, ctypes.byref(attr)))
        try:
            return ctypes.string_at(attr.address, attr.address_length)
        finally:
            self._lib.ucp_worker_release_address(self._worker, attr.address)

    # -- callbacks (run inside ucp_worker_progress, under self._lock) ---------------------------
    def _on_ep_error(self, arg: int | None, ep: int | None, status: int) -> None:
        peer = self._by_ep.get(ep or 0)
        if peer is not None and peer.failed is None:
            peer.failed = int(status)

    def _on_am(self, arg: int | None, header: int | None, header_len: int, data: int | None, length: int,
               param: int | None) -> int:
        try:
            if not header or header_len < _AM_HEADER.size or length > MAX_NOTIFICATION or (length and not data):
                return L.UCS_OK
            raw = ctypes.string_at(header, header_len)
            magic, kind, nlen = _AM_HEADER.unpack_from(raw)
            if magic != _AM_MAGIC or kind != _AM_NOTIFY or _AM_HEADER.size + nlen != header_len:
                return L.UCS_OK
            sender = raw[_AM_HEADER.size:].decode("utf-8", errors="replace")
            self._inbox[sender].append(ctypes.string_at(data, length) if length and data else b"")
        except Exception:  # an exception must never unwind into C
            pass
        return L.UCS_OK

    # -- memory -------------------------------------------------------------------------------
    def register(self, allocations: Sequence[Allocation]) -> int:
        lib = self._lib
        allocs = tuple(allocations)
        for a in allocs:
            if a.kind is not MemoryKind.DRAM:
                raise UnsupportedError(
                    f"ucx backend moves host memory (DRAM) only; got {a.kind.value} at {a.address:#x}. The "
                    "libucx wheel's CUDA transports were not validated through this binding; use the nixl "
                    "backend for GPU memory.")
        memhs: list[int] = []
        rkeys: list[bytes] = []
        with self._lock:
            self._check_open()
            try:
                for a in allocs:
                    p = L.UcpMemMapParams(field_mask=(L.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | L.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                                                      | L.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE),
                                          address=a.address, length=a.nbytes, memory_type=L.UCS_MEMORY_TYPE_HOST)
                    memh = ctypes.c_void_p()
                    lib.check("ucp_mem_map", lib.ucp_mem_map(self._ctx, ctypes.byref(p), ctypes.byref(memh)))
                    memhs.append(_ptr(memh, "ucp_mem_map"))
                    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
                    lib.check("ucp_rkey_pack", lib.ucp_rkey_pack(self._ctx, memh, ctypes.byref(buf), ctypes.byref(size)))
                    rkeys.append(ctypes.string_at(buf, size.value))
                    lib.ucp_rkey_buffer_release(buf)
            except L.UcxStatusError as exc:
                for m in memhs:
                    lib.ucp_mem_unmap(self._ctx, m)
                raise BackendError(f"ucx backend: registering memory failed: {exc}") from None
            h = self._next_reg
            self._next_reg += 1
            self._regs[h] = _Reg(allocs, memhs, rkeys)
            self._rebuild_bounds()
        return h

    def deregister(self, handle: Any) -> None:
        with self._lock:
            reg = self._regs.pop(handle, None)
            if reg is None:
                return
            for m in reg.memhs:
                self._lib.ucp_mem_unmap(self._ctx, m)
            self._rebuild_bounds()

    def _rebuild_bounds(self) -> None:
        rows = [(a.address, a.end) for r in self._regs.values() for a in r.allocs]
        b = np.array(rows, dtype=np.uint64).reshape(-1, 2)
        self._bounds = b[np.argsort(b[:, 0], kind="stable")]

    # -- peers --------------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            allocs = [[a.address, a.nbytes, _b64(rk)] for r in self._regs.values()
                      for a, rk in zip(r.allocs, r.rkeys)]
            return encode_blob(self.agent_name, ".".join(map(str, self._lib.version)), self._address, allocs,
                               self._host)

    def add_remote(self, peer_name: str, blob: bytes) -> str:
        agent, worker, allocs, host = parse_blob(blob)
        if agent != peer_name:
            raise MetadataError(f"ucx metadata names agent {agent!r}, expected {peer_name!r}")
        with self._lock:
            self._check_open()
            copy_pid, why = self._choose_path(peer_name, host)
            if peer_name in self._peers:
                self._drop_peer(self._peers.pop(peer_name))
            addr_buf = ctypes.create_string_buffer(worker, len(worker))
            data_ep = ctrl_ep = 0
            rkeys: list[int] = []
            try:
                data_ep = self._ep_create(addr_buf, self._data_err_mode)
                ctrl_ep = (self._ep_create(addr_buf, L.UCP_ERR_HANDLING_MODE_PEER)
                           if self._data_err_mode == L.UCP_ERR_HANDLING_MODE_NONE else data_ep)
                order = sorted(range(len(allocs)), key=lambda k: allocs[k][0])
                for k in order:
                    rk = ctypes.c_void_p()
                    st = self._lib.ucp_ep_rkey_unpack(data_ep, allocs[k][2], ctypes.byref(rk))
                    if st != L.UCS_OK:
                        raise MetadataError(f"ucx metadata: allocation {k} rkey rejected by UCX: "
                                            f"{self._lib.status_string(st)}")
                    rkeys.append(_ptr(rk, "ucp_ep_rkey_unpack"))
            except BaseException:
                for key in rkeys:
                    self._lib.ucp_rkey_destroy(key)
                for ep in {data_ep, ctrl_ep} - {0}:
                    self._close_ep(ep, force=True)
                raise
            starts = np.array([allocs[k][0] for k in order], dtype=np.uint64)
            ends = starts + np.array([allocs[k][1] for k in order], dtype=np.uint64)
            peer = _Peer(peer_name, data_ep, ctrl_ep, starts, ends, np.array(rkeys, dtype=np.uint64),
                         copy_pid=copy_pid, path_reason=why)
            self._peers[peer_name] = peer
            self._by_ep[data_ep] = peer
            self._by_ep[ctrl_ep] = peer
            # Start wiring the control endpoint up now (without waiting: the peer may be in this
            # thread), so that UCX watches the connection before the first transfer.
            req = self._lib.ucp_ep_flush_nbx(ctrl_ep, self._param_ref)
            if req and not L.is_err_ptr(req):
                self._sends.append((req, (), peer))
        return peer_name

    def _choose_path(self, peer: str, host: dict[str, Any] | None) -> tuple[int | None, str]:
        """``(pid, why)`` for the same-host copy path, or ``(None, why)`` for UCX RMA.

        Same host means equal ``boot_id``, hostname and PID namespace; then we read the
        peer's token through ``process_vm_readv``, which proves in one step that the pid is the
        peer and that ptrace rules let us in. In auto mode any failure falls back to RMA (the
        reason is kept for :meth:`peer_path`); with ``same_host_copy=True`` it raises.
        """
        if self._same_host_copy is False:
            return None, "same_host_copy=False on this agent"
        if self._libc is None or self._host is None:
            return None, f"same-host copy unavailable here ({SH.libc_error() or 'no /proc host identity'})"
        if host is None:
            return None, "peer does not offer same-host copy (older kvxfer, or same_host_copy=False there)"
        mine = self._host
        for key, what in (("boot_id", "host (boot_id)"), ("hostname", "hostname"), ("pidns", "PID namespace")):
            if host[key] != mine[key]:
                return None, f"peer is on another {what}"
        got = ctypes.create_string_buffer(SH.TOKEN_BYTES)
        probe = SH.CopyJob(self._libc, host["pid"], False, np.array([ctypes.addressof(got)], np.uint64),
                           np.array([host["token_addr"]], np.uint64), np.array([SH.TOKEN_BYTES], np.uint64), peer=peer)
        try:
            probe.step(None)
            if got.raw != host["token"]:
                raise BackendError(f"same-host copy: pid {host['pid']} on this host is not the process that sent "
                                   f"peer {peer!r}'s metadata (token mismatch)")
        except KvxferError as exc:
            if self._same_host_copy:
                raise
            return None, f"probe failed, using UCX RMA: {exc}"
        return int(host["pid"]), f"same host, pid {host['pid']} probed"

    def peer_path(self, peer: str) -> tuple[str, str]:
        """``("same-host-copy" | "ucx-rma", reason)`` for a connected peer (tests, benchmarks)."""
        with self._lock:
            p = self._peer(peer)
            return p.path, p.path_reason

    def _ep_create(self, addr_buf: Any, err_mode: int) -> int:
        p = L.UcpEpParams(field_mask=(L.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | L.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE),
                          address=ctypes.cast(addr_buf, ctypes.c_void_p), err_mode=err_mode)
        if err_mode == L.UCP_ERR_HANDLING_MODE_PEER:
            p.field_mask |= L.UCP_EP_PARAM_FIELD_ERR_HANDLER
            p.err_handler = L.UcpErrHandler(self._err_cb, None)
        ep = ctypes.c_void_p()
        st = self._lib.ucp_ep_create(self._worker, ctypes.byref(p), ctypes.byref(ep))
        if st != L.UCS_OK:
            raise PeerDisconnectedError(f"ucx backend: cannot connect to peer: {self._lib.status_string(st)}")
        return _ptr(ep, "ucp_ep_create")

    def _flush_ep(self, ep: int, deadline: float) -> int:
        req = self._lib.ucp_ep_flush_nbx(ep, self._param_ref)
        st = L.status_of_ptr(req)
        while st == L.UCS_INPROGRESS:
            self._lib.ucp_worker_progress(self._worker)
            st = self._lib.ucp_request_check_status(req)
            if st == L.UCS_INPROGRESS and time.monotonic() > deadline:
                self._zombies.append(req)
                return L.UCS_ERR_TIMED_OUT
        if req and not L.is_err_ptr(req):
            self._lib.ucp_request_free(req)
        return st

    def _close_ep(self, ep: int, force: bool) -> None:
        p = L.RequestParam(op_attr_mask=L.UCP_OP_ATTR_FIELD_FLAGS, flags=L.UCP_EP_CLOSE_FLAG_FORCE if force else 0)
        req = self._lib.ucp_ep_close_nbx(ep, ctypes.byref(p))
        if L.status_of_ptr(req) == L.UCS_INPROGRESS:
            deadline = time.monotonic() + 0.5
            while self._lib.ucp_request_check_status(req) == L.UCS_INPROGRESS and time.monotonic() < deadline:
                self._lib.ucp_worker_progress(self._worker)
            if self._lib.ucp_request_check_status(req) == L.UCS_INPROGRESS:
                self._zombies.append(req)
            else:
                self._lib.ucp_request_free(req)

    def _drop_peer(self, peer: _Peer) -> None:
        if peer.closed:
            return
        peer.closed = True
        for job in peer.jobs:  # stop touching the peer's memory before forgetting it
            job.cancel()
        for job in peer.jobs:
            job.wait_idle(self._cancel_timeout)
        peer.jobs.clear()
        for rk in peer.rkeys.tolist():
            self._lib.ucp_rkey_destroy(rk)
        # A dead peer cannot confirm a graceful close: force it. A live one gets a flush first.
        alive = peer.failed is None
        for ep in dict.fromkeys((peer.data_ep, peer.ctrl_ep)):
            self._close_ep(ep, force=not alive or ep == peer.ctrl_ep)
            self._by_ep.pop(ep, None)

    def remove_remote(self, peer: str) -> None:
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is not None:
                self._drop_peer(p)

    def _peer(self, name: str) -> _Peer:
        p = self._peers.get(name)
        if p is None:
            raise UnknownPeerError(f"ucx backend: unknown peer {name!r}; add it with add_remote first")
        return p

    def _raise_if_failed(self, peer: _Peer) -> None:
        if peer.failed is not None:
            raise PeerDisconnectedError(
                f"ucx peer {peer.name!r} disconnected ({self._lib.status_string(peer.failed)}); remove it and add "
                "it again once it is back")

    # -- descriptor lists ---------------------------------------------------------------------
    def prepare(self, peer: str | None, descs: DescriptorList) -> Any:
        if descs.kind is not MemoryKind.DRAM:
            raise UnsupportedError(f"ucx backend moves DRAM only, not {descs.kind.value}")
        arr = descs.expand().array
        addr, n = arr[:, 0], arr[:, 1]
        with self._lock:
            self._check_open()
            if peer is None:
                b = self._bounds
                slot = self._inside(b[:, 0], b[:, 1], addr, n, f"agent {self.agent_name!r} (local)")
                del slot
                return _Local(addr, n, descs)
            p = self._peer(peer)
            slot = self._inside(p.starts, p.ends, addr, n, f"peer {peer!r}")
            return _Remote(p, addr, n, slot, descs)

    @staticmethod
    def _inside(starts: np.ndarray, ends: np.ndarray, addr: np.ndarray, n: np.ndarray, who: str) -> np.ndarray:
        """Index of the registered span holding each descriptor, or a typed error (vectorized).

        A descriptor must lie inside one span: UCX would happily move bytes past a
        registration's end when the peer's memory happens to be mapped there.
        """
        if not len(addr):
            return np.zeros(0, dtype=np.int64)
        if not len(starts):
            raise BackendError(f"ucx backend: {who} has no registered memory")
        pos = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
        p = np.maximum(pos, 0)
        end = addr + n
        ok = (pos >= 0) & (n > 0) & (end >= addr) & (end <= ends[p])
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise BackendError(f"ucx backend: descriptor {i} ({int(addr[i]):#x}, {int(n[i])} bytes) is outside the "
                               f"memory registered by {who}; nothing was moved")
        return p

    # -- transfers ----------------------------------------------------------------------------
    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> _Xfer:
        if not isinstance(local, _Local) or not isinstance(remote, _Remote):
            raise BackendError("ucx backend: post needs a local and a remote list prepared by this backend")
        if notification is not None and len(notification) > MAX_NOTIFICATION:
            raise UnsupportedError(f"ucx notifications are limited to {MAX_NOTIFICATION} bytes")
        li = np.asarray(local_idx, dtype=np.int64)
        ri = np.asarray(remote_idx, dtype=np.int64)
        if li.shape != ri.shape or li.ndim != 1:
            raise BackendError("ucx backend: local and remote index arrays must be 1-D and of equal length")
        if len(li) and (li.min() < 0 or ri.min() < 0 or li.max() >= len(local.addr) or ri.max() >= len(remote.addr)):
            raise BackendError("ucx backend: descriptor index out of range of the prepared list")
        la, ln = local.addr[li], local.nbytes[li]
        ra, rn = remote.addr[ri], remote.nbytes[ri]
        if not np.array_equal(ln, rn):
            i = int(np.flatnonzero(ln != rn)[0])
            raise BackendError(f"ucx backend: pair {i} moves {int(ln[i])} local bytes but {int(rn[i])} remote bytes")
        peer = remote.peer
        with self._lock:
            self._check_open()
            if peer.closed or self._peers.get(peer.name) is not peer:
                raise StalePeerError(f"ucx backend: peer {peer.name!r} was removed or re-added since this list was "
                                     "prepared; prepare it again")
            self._raise_if_failed(peer)
            if peer.copy_pid is not None:
                return self._post_copy(op, peer, la, ra, ln, notification)
            rk = peer.rkeys[remote.slot[ri]]
            fn = self._lib.ucp_get_nbx if op is Op.READ else self._lib.ucp_put_nbx
            self._issue(fn, peer, la.tolist(), ln.tolist(), ra.tolist(), rk.tolist())
            flush = self._lib.ucp_ep_flush_nbx(peer.data_ep, self._param_ref)
            if flush and L.is_err_ptr(flush):
                self._raise_status(peer, L.status_of_ptr(flush), "ucp_ep_flush_nbx")
            x = _Xfer(peer, flush or None, notification)
            # Small transfers usually finish within a few progress calls: finish them here, so
            # the notification leaves even if the caller drains before it polls (as with NIXL,
            # whose transfer() often completes inline). Bounded: never waits on the peer.
            deadline = time.monotonic() + self._inline_budget
            try:
                while not self._advance(x) and peer.failed is None and time.monotonic() < deadline:
                    self._lib.ucp_worker_progress(self._worker)
            except KvxferError as exc:
                x.error = exc
            return x

    def _post_copy(self, op: Op, peer: _Peer, la: np.ndarray, ra: np.ndarray, n: np.ndarray,
                   notification: bytes | None) -> _Xfer:
        """Same-host path: copy up to ``inline_budget`` now, hand the rest on (see class doc).

        The syscalls are synchronous, so once the job finished every byte is in place on
        both sides and the notification (an active message on the data endpoint) may go.
        """
        job = SH.CopyJob(self._libc, peer.copy_pid, op is Op.WRITE, la, ra, n, peer=peer.name,  # type: ignore[arg-type]
                         chunk=self._copy_chunk)
        x = _Xfer(peer, None, notification, copy=job)
        deadline = time.monotonic() + self._inline_budget
        try:
            if not job.step(deadline):
                if self._copy_thread:
                    if self._copier is None:
                        self._copier = SH.Copier()
                    peer.jobs = [j for j in peer.jobs if not j.wait_idle(0)] + [job]
                    self._copier.submit(job)
                return x
            while not self._advance(x) and peer.failed is None and time.monotonic() < deadline:
                self._lib.ucp_worker_progress(self._worker)
        except KvxferError as exc:
            self._note_copy_error(peer, exc)
            x.error = exc
        return x

    def _note_copy_error(self, peer: _Peer, exc: KvxferError) -> None:
        """ESRCH from the kernel is as final as UCX's error callback: mark the peer failed."""
        if isinstance(exc, PeerDisconnectedError) and peer.failed is None:
            peer.failed = L.UCS_ERR_CONNECTION_RESET

    def _issue(self, fn: Any, peer: _Peer, la: list[int], ln: list[int], ra: list[int], rk: list[int]) -> None:
        """The one Python loop per descriptor: a ctypes call each (about a microsecond).

        Requests are freed at once: UCX keeps a freed request until it completes, and the
        flush that follows completes only after every one of them. Error pointers abort.
        """
        ep, param, free, lim = peer.data_ep, self._param_ref, self._lib.ucp_request_free, (1 << 64) + L.UCS_ERR_LAST
        for a, n, r, k in zip(la, ln, ra, rk):
            req = fn(ep, a, n, r, k, param)
            if req:
                if req >= lim:
                    self._raise_status(peer, L.status_of_ptr(req), fn.__name__)
                free(req)

    def _raise_status(self, peer: _Peer | None, status: int, call: str) -> None:
        if peer is not None and status in L.PEER_GONE_STATUSES:
            peer.failed = peer.failed or status
            self._raise_if_failed(peer)
        raise BackendError(f"ucx backend: {call} failed: {self._lib.status_string(status)}")

    def poll(self, xfer: Any) -> bool:
        x: _Xfer = xfer
        if x.error is not None:
            raise x.error
        if x.done:
            return True
        if x.released:
            raise TransferCancelledError("ucx backend: transfer was released")
        with self._lock:
            self._check_open()
            self._lib.ucp_worker_progress(self._worker)
            try:
                return self._advance(x)
            except KvxferError as exc:
                x.error = exc
                raise

    def _advance(self, x: _Xfer) -> bool:
        if x.peer.failed is not None:
            self._raise_if_failed(x.peer)
        if x.copy is not None:
            job = x.copy
            try:
                if job.threaded:
                    # A short sleep on the job instead of returning at once: a caller that
                    # spins on poll() would otherwise take the core the copy thread needs
                    # (measured at the seam: 3.1-4.0 GB/s without this wait, 4.3-5.7 with it).
                    if not job.wait_idle(_POLL_WAIT):
                        return False
                    if job.error is not None:
                        raise job.error
                    if not job.finished:
                        raise TransferCancelledError("ucx backend: same-host copy was cancelled")
                elif not job.step(time.monotonic() + self._copy_budget):
                    return False
            except KvxferError as exc:
                self._note_copy_error(x.peer, exc)
                raise
            x.copy = None
        if x.flush is not None:
            st = self._reap(x.flush)
            if st is None:
                return False
            x.flush = None  # freed: never touch it again, even if it failed
            if st != L.UCS_OK:
                self._raise_status(x.peer, st, "flush")
        if x.notification is not None:
            # The flush completed: the data is visible on both sides, so the notification
            # may go now and can never be seen before the bytes.
            x.am, x.am_buffers = self._send_am(x.peer, x.notification)
            x.notification = None
        if x.am is not None:
            st = self._reap(x.am)
            if st is None:
                return False
            x.am, x.am_buffers = None, ()
            if st != L.UCS_OK:
                self._raise_status(x.peer, st, "notification send")
        x.done = True
        return True

    def _reap(self, request: int) -> int | None:
        """None while ``request`` is in flight; else free it and return its final status."""
        st = int(self._lib.ucp_request_check_status(request))
        if st == L.UCS_INPROGRESS:
            return None
        self._lib.ucp_request_free(request)
        return st

    def release(self, xfer: Any) -> None:
        x: _Xfer = xfer
        if x.released:
            return
        x.released = True
        if x.copy is not None:
            # Between syscalls the copy simply stops; a syscall in flight on the worker thread
            # finishes its chunk (bounded by copy_chunk) before "released" holds.
            x.copy.cancel()
            x.copy.wait_idle(self._cancel_timeout)
            x.copy = None
        with self._lock:
            if self._closed:
                return
            pending = [r for r in (x.flush, x.am) if r is not None]
            if not pending:
                return
            # RMA cannot be recalled: drive the worker (bounded) until the flush settles, so
            # that "released" means "no longer touching memory". A dead peer is not waited on.
            deadline = time.monotonic() + self._cancel_timeout
            for req in pending:
                while (x.peer.failed is None and time.monotonic() < deadline
                       and self._lib.ucp_request_check_status(req) == L.UCS_INPROGRESS):
                    self._lib.ucp_worker_progress(self._worker)
                if self._lib.ucp_request_check_status(req) == L.UCS_INPROGRESS:
                    self._lib.ucp_request_cancel(self._worker, req)
                    self._zombies.append(req)
                else:
                    self._lib.ucp_request_free(req)
            x.flush = x.am = None

    # -- notifications --------------------------------------------------------------------------
    def _send_am(self, peer: _Peer, message: bytes) -> tuple[int | None, tuple[Any, ...]]:
        name = self.agent_name.encode()
        header = ctypes.create_string_buffer(_AM_HEADER.pack(_AM_MAGIC, _AM_NOTIFY, len(name)) + name)
        body = ctypes.create_string_buffer(bytes(message), len(message))
        p = L.RequestParam(op_attr_mask=L.UCP_OP_ATTR_FIELD_FLAGS,
                           flags=L.UCP_AM_SEND_FLAG_EAGER | L.UCP_AM_SEND_FLAG_COPY_HEADER)
        req = self._lib.ucp_am_send_nbx(peer.data_ep, AM_ID, header, len(header) - 1, body, len(message),
                                        ctypes.byref(p))
        if req and L.is_err_ptr(req):
            self._raise_status(peer, L.status_of_ptr(req), "ucp_am_send_nbx")
        return (req or None), (header, body)

    def notify(self, peer: str, message: bytes) -> None:
        if len(message) > MAX_NOTIFICATION:
            raise UnsupportedError(f"ucx notifications are limited to {MAX_NOTIFICATION} bytes")
        with self._lock:
            self._check_open()
            p = self._peer(peer)
            self._raise_if_failed(p)
            req, bufs = self._send_am(p, message)
            if req is not None:
                # Never block here: the peer may need to progress before the send completes
                # (it may even live in this thread). Reaped by progress()/poll().
                self._sends.append((req, bufs, p))

    def _reap_sends(self) -> None:
        keep = []
        for req, bufs, p in self._sends:
            st = self._lib.ucp_request_check_status(req)
            if st == L.UCS_INPROGRESS and p.failed is None and not p.closed:
                keep.append((req, bufs, p))
            elif st == L.UCS_INPROGRESS:
                self._lib.ucp_request_cancel(self._worker, req)
                self._zombies.append(req)
            else:
                self._lib.ucp_request_free(req)
        self._sends = keep

    def drain_notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            if not self._closed:
                self._progress_locked()
            out, self._inbox = dict(self._inbox), defaultdict(list)
        return out

    def progress(self) -> None:
        with self._lock:
            if not self._closed:
                self._progress_locked()

    def _progress_locked(self) -> None:
        for _ in range(64):
            if not self._lib.ucp_worker_progress(self._worker):
                break
        if self._sends:
            self._reap_sends()

    # -- teardown -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            from kvxfer.errors import AgentClosedError

            raise AgentClosedError("ucx backend is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._sends:  # give queued notifications a bounded chance to leave
                deadline = time.monotonic() + 1.0
                while self._sends and time.monotonic() < deadline:
                    self._lib.ucp_worker_progress(self._worker)
                    self._reap_sends()
            for p in list(self._peers.values()):
                self._drop_peer(p)
            if self._copier is not None:
                self._copier.close()
                self._copier = None
            for req, _, _ in self._sends:
                self._zombies.append(req)
            self._sends.clear()
            self._peers.clear()
            for h in list(self._regs):
                self.deregister(h)
            for req in self._zombies:
                self._lib.ucp_request_free(req)
            self._zombies.clear()
            self._closed = True
            self._lib.ucp_worker_destroy(self._worker)
            self._lib.ucp_cleanup(self._ctx)

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            if not getattr(self, "_closed", True) and getattr(self, "_worker", None):
                self.close()
        except Exception:
            pass
