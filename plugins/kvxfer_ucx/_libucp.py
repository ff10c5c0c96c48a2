"""ctypes bindings for the slice of libucp that the UCX backend uses.

Why ctypes and not a compiled extension: the backend must install from a plain wheel next to
the ``libucx-cu12`` wheel (which ships ``libucp.so`` but no Python API for RMA), and the calls
we make per transfer are few and coarse (one per coalesced descriptor, one flush). A C
extension would save a little per descriptor and cost a build toolchain.

Struct layouts follow the UCX 1.21 headers shipped inside the wheel (``libucx/include``);
1.22 only appends fields to :class:`RequestParam`, which we carry as zeroed padding so the
struct is at least as large as the library expects. Every field the library reads is selected
by a ``field_mask`` bit, so unused fields stay zero. ``tests/test_ucx_backend.py`` beside this
package compiles a C program against the installed headers (when a compiler and the headers
exist) and checks every offset here against ``offsetof``.

Nothing here is imported by ``kvxfer_ucx/__init__``: listing backends must not dlopen UCX.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, Union, c_char, c_char_p, c_int, c_int8, c_size_t, c_uint,
                    c_uint32, c_uint64, c_void_p)

#: ``ucs_status_t`` is a *packed* enum (``UCS_S_PACKED``): one signed byte in registers and
#: structs. Declaring it ``int`` reads garbage in the upper bytes.
c_status = c_int8
from typing import Any

__all__ = ["find_libucp", "load", "Lib", "is_err_ptr", "status_of_ptr"]

# ---------------------------------------------------------------------------------------------
# Constants (ucp.h / ucs/type/status.h of UCX 1.21; unchanged in 1.22).

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_CANCELED = -16
UCS_ERR_UNREACHABLE = -6
UCS_ERR_TIMED_OUT = -20
UCS_ERR_NOT_CONNECTED = -24
UCS_ERR_CONNECTION_RESET = -25
UCS_ERR_ENDPOINT_TIMEOUT = -80
UCS_ERR_LAST = -100
UCS_ERR_IO_ERROR = -3

#: Statuses that mean "the other side is gone", as opposed to a local misuse.
PEER_GONE_STATUSES = frozenset({UCS_ERR_UNREACHABLE, UCS_ERR_NOT_CONNECTED, UCS_ERR_CONNECTION_RESET,
                                UCS_ERR_ENDPOINT_TIMEOUT, UCS_ERR_IO_ERROR, UCS_ERR_TIMED_OUT}
                               | set(range(-89, -39)))  # link and endpoint failure ranges

UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_AM = 1 << 6

UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCS_THREAD_MODE_SERIALIZED = 1

UCP_WORKER_ATTR_FIELD_ADDRESS = 1 << 1

UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4
UCS_MEMORY_TYPE_HOST = 0

UCP_OP_ATTR_FIELD_FLAGS = 1 << 4

UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0
UCP_AM_HANDLER_PARAM_FIELD_FLAGS = 1 << 1
UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2
UCP_AM_HANDLER_PARAM_FIELD_ARG = 1 << 3
UCP_AM_FLAG_WHOLE_MSG = 1 << 0
UCP_AM_SEND_FLAG_EAGER = 1 << 1
UCP_AM_SEND_FLAG_COPY_HEADER = 1 << 3

#: The API level whose struct layouts this module mirrors. Passed to ``ucp_init_version``.
API_MAJOR, API_MINOR = 1, 18

# ---------------------------------------------------------------------------------------------
# Structs (x86_64 / aarch64 LP64).

ucp_err_handler_cb_t = CFUNCTYPE(None, c_void_p, c_void_p, c_status)  # (arg, ep, status)
ucp_send_nbx_callback_t = CFUNCTYPE(None, c_void_p, c_status, c_void_p)  # (request, status, user_data)
# (arg, header, header_length, data, length, const ucp_am_recv_param_t *) -> ucs_status_t
ucp_am_recv_callback_t = CFUNCTYPE(c_status, c_void_p, c_void_p, c_size_t, c_void_p, c_size_t, c_void_p)


class UcpParams(Structure):
    _fields_ = [("field_mask", c_uint64), ("features", c_uint64), ("request_size", c_size_t),
                ("request_init", c_void_p), ("request_cleanup", c_void_p), ("tag_sender_mask", c_uint64),
                ("mt_workers_shared", c_int), ("estimated_num_eps", c_size_t),
                ("estimated_num_ppn", c_size_t), ("name", c_char_p), ("node_local_id", c_size_t)]


class UcpWorkerParams(Structure):
    _fields_ = [("field_mask", c_uint64), ("thread_mode", c_int), ("cpu_mask", c_uint64 * 16),
                ("events", c_uint), ("user_data", c_void_p), ("event_fd", c_int), ("flags", c_uint64),
                ("name", c_char_p), ("am_alignment", c_size_t), ("client_id", c_uint64)]


class UcpWorkerAttr(Structure):
    _fields_ = [("field_mask", c_uint64), ("thread_mode", c_int), ("address_flags", c_uint32),
                ("address", c_void_p), ("address_length", c_size_t), ("max_am_header", c_size_t),
                ("name", c_char * 32), ("max_debug_string", c_size_t)]


class UcpErrHandler(Structure):
    _fields_ = [("cb", ucp_err_handler_cb_t), ("arg", c_void_p)]


class UcsSockAddr(Structure):
    _fields_ = [("addr", c_void_p), ("addrlen", c_uint32)]


class UcpEpParams(Structure):
    _fields_ = [("field_mask", c_uint64), ("address", c_void_p), ("err_mode", c_int),
                ("err_handler", UcpErrHandler), ("user_data", c_void_p), ("flags", c_uint),
                ("sockaddr", UcsSockAddr), ("conn_request", c_void_p), ("name", c_char_p),
                ("local_sockaddr", UcsSockAddr)]


class UcpMemMapParams(Structure):
    _fields_ = [("field_mask", c_uint64), ("address", c_void_p), ("length", c_size_t), ("flags", c_uint),
                ("prot", c_uint), ("memory_type", c_int), ("exported_memh_buffer", c_void_p)]


class _RequestCb(Union):
    _fields_ = [("send", ucp_send_nbx_callback_t), ("raw", c_void_p)]


class RequestParam(Structure):
    _fields_ = [("op_attr_mask", c_uint32), ("flags", c_uint32), ("request", c_void_p), ("cb", _RequestCb),
                ("datatype", c_uint64), ("user_data", c_void_p), ("reply_buffer", c_void_p),
                ("memory_type", c_int), ("recv_info", c_void_p), ("memh", c_void_p),
                # UCX 1.22 appends remote_datatype, remote, remote_count: zeroed padding here.
                ("_pad_1_22", c_uint64 * 3)]


class UcpAmHandlerParam(Structure):
    _fields_ = [("field_mask", c_uint64), ("id", c_uint), ("flags", c_uint32),
                ("cb", ucp_am_recv_callback_t), ("arg", c_void_p)]


class UcpAmRecvParam(Structure):
    _fields_ = [("recv_attr", c_uint64), ("reply_ep", c_void_p)]


# ---------------------------------------------------------------------------------------------
# Finding and loading the library.

LIBUCP_ENV = "KVXFER_LIBUCP"


def find_libucp() -> str | None:
    """Path of the ``libucp.so`` to use, without loading it.

    ``KVXFER_LIBUCP`` wins (a system UCX built with verbs, for RDMA); then the ``libucx``
    wheel's ``lib`` folder. Found on disk only: the plugin's availability check must not
    dlopen anything.
    """
    env = os.environ.get(LIBUCP_ENV)
    if env:
        return env if os.path.isfile(env) else None
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "lib", "libucp.so*")))
        if hits:
            return hits[0]
    return None


def status_of_ptr(ptr: int | None) -> int:
    """Decode a ``ucs_status_ptr_t``: NULL is OK, small negative values are errors, else a request."""
    if not ptr:
        return UCS_OK
    signed = ptr - (1 << 64) if ptr >= (1 << 63) else ptr
    if UCS_ERR_LAST <= signed < 0:
        return signed
    return UCS_INPROGRESS


def is_err_ptr(ptr: int) -> bool:
    return ptr >= (1 << 64) + UCS_ERR_LAST


class Lib:
    """The loaded library with typed function prototypes and a few checked helpers."""

    def __init__(self, path: str):
        self.path = path
        # RTLD_LOCAL: nixl bundles its own UCX; two copies must not interpose on each other.
        # The wheel's libucp has an $ORIGIN rpath, so libucs/libuct load from the same folder.
        self.ucp = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        ucs_path = os.path.join(os.path.dirname(path), "libucs.so.0")
        self.ucs = ctypes.CDLL(ucs_path if os.path.exists(ucs_path) else "libucs.so.0",
                               mode=os.RTLD_LOCAL | os.RTLD_NOW)
        u = self.ucp
        P, vp, st, i = POINTER, c_void_p, c_size_t, c_status
        self._proto("ucp_get_version", None, [P(c_uint), P(c_uint), P(c_uint)])
        self._proto("ucp_config_read", i, [c_char_p, c_char_p, P(vp)])
        self._proto("ucp_config_modify", i, [vp, c_char_p, c_char_p])
        self._proto("ucp_config_release", None, [vp])
        self._proto("ucp_init_version", i, [c_uint, c_uint, P(UcpParams), vp, P(vp)])
        self._proto("ucp_cleanup", None, [vp])
        self._proto("ucp_worker_create", i, [vp, P(UcpWorkerParams), P(vp)])
        self._proto("ucp_worker_destroy", None, [vp])
        self._proto("ucp_worker_query", i, [vp, P(UcpWorkerAttr)])
        self._proto("ucp_worker_release_address", None, [vp, vp])
        self._proto("ucp_worker_progress", c_uint, [vp])
        self._proto("ucp_worker_set_am_recv_handler", i, [vp, P(UcpAmHandlerParam)])
        self._proto("ucp_ep_create", i, [vp, P(UcpEpParams), P(vp)])
        self._proto("ucp_ep_close_nbx", vp, [vp, P(RequestParam)])
        self._proto("ucp_ep_flush_nbx", vp, [vp, P(RequestParam)])
        self._proto("ucp_mem_map", i, [vp, P(UcpMemMapParams), P(vp)])
        self._proto("ucp_mem_unmap", i, [vp, vp])
        self._proto("ucp_rkey_pack", i, [vp, vp, P(vp), P(st)])
        self._proto("ucp_rkey_buffer_release", None, [vp])
        self._proto("ucp_ep_rkey_unpack", i, [vp, vp, P(vp)])
        self._proto("ucp_rkey_destroy", None, [vp])
        self._proto("ucp_put_nbx", vp, [vp, vp, st, c_uint64, vp, P(RequestParam)])
        self._proto("ucp_get_nbx", vp, [vp, vp, st, c_uint64, vp, P(RequestParam)])
        self._proto("ucp_am_send_nbx", vp, [vp, c_uint, vp, st, vp, st, P(RequestParam)])
        self._proto("ucp_request_check_status", i, [vp])
        self._proto("ucp_request_cancel", None, [vp, vp])
        self._proto("ucp_request_free", None, [vp])
        self.ucs.ucs_status_string.restype = c_char_p
        self.ucs.ucs_status_string.argtypes = [c_status]
        maj, mnr, rel = c_uint(), c_uint(), c_uint()
        u.ucp_get_version(ctypes.byref(maj), ctypes.byref(mnr), ctypes.byref(rel))
        self.version = (maj.value, mnr.value, rel.value)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names _proto did not bind: tells type checkers that the bound
        # ucp_* prototypes exist, and fails loudly for anything else.
        raise AttributeError(f"libucp prototype {name!r} was not declared")

    def _proto(self, name: str, restype: Any, argtypes: list[Any]) -> None:
        fn = getattr(self.ucp, name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(self, name, fn)

    def status_string(self, status: int) -> str:
        raw = self.ucs.ucs_status_string(status)
        return raw.decode(errors="replace") if raw else f"status {status}"


_LIB: Lib | None = None


def _quiet_native_logs() -> None:
    """Keep UCX's native logger to fatal lines unless the user set ``UCX_LOG_LEVEL``.

    A dead peer otherwise makes UCX print its own error lines on stderr beside the typed
    error the backend raises for the same failure (issue 33). UCX reads the variable when
    libucs loads, so this runs just before the first load.
    """
    if not os.environ.get("UCX_LOG_LEVEL"):
        os.environ["UCX_LOG_LEVEL"] = "fatal"


def load() -> Lib:
    """Load libucp once per process (raises OSError/RuntimeError if it cannot)."""
    global _LIB
    if _LIB is None:
        _quiet_native_logs()
        path = find_libucp()
        if path is None:
            raise OSError("libucp.so not found: install the libucx wheel (pip install 'kvxfer[ucx]') "
                          f"or point {LIBUCP_ENV} at a system libucp.so")
        _LIB = Lib(path)
    return _LIB
