"""UCP request objects start zeroed: a fresh one must not carry stale bytes into UCX's error path.

UCX 1.21 answers a software-RMA GET (``ucp_get_req_handler``) with a request whose
``send.datatype`` it never sets. If the reader dies while that reply is still pending, the
failed endpoint's pending queue is purged and the purge deregisters memory according to that
field: on a request object fresh from UCX's pool it holds whatever the heap held, and the
target crashed (SIGSEGV in ``ucp_request_dt_dereg``; RELIABILITY.md, "Peer killed
mid-transfer", reversed). UCX calls the context's ``request_init`` once per new object, with
the address just past its internal header (``sizeof(ucp_request_t)``, which
``ucp_context_query`` reports as ``request_size``): zeroing that header there makes the
datatype "contiguous" and its memory handle NULL, which the purge skips. Recycled objects
keep what UCX itself last wrote, which is always a valid datatype.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["ENABLED", "REQUEST_INIT", "UCP_PARAM_FIELD_REQUEST_INIT", "learn_size"]

UCP_PARAM_FIELD_REQUEST_INIT = 1 << 2
_UCP_ATTR_FIELD_REQUEST_SIZE = 1 << 0
_size = {"header": 0}
#: Off only for the control run that shows the crash (``ucx_kill_matrix.py --reverse --control``).
ENABLED = [True]


class _ContextAttr(ctypes.Structure):
    # field_mask and request_size lead ucp_context_attr_t; the rest is room for what follows
    _fields_ = [("field_mask", ctypes.c_uint64), ("request_size", ctypes.c_size_t), ("_rest", ctypes.c_byte * 512)]


def _zero(user: int | None) -> None:
    n = _size["header"]
    if n and user and ENABLED[0]:
        ctypes.memset(user - n, 0, n)


REQUEST_INIT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_zero)  # lives as long as the module


def learn_size(lib: Any, ctx: ctypes.c_void_p) -> None:
    """Read ``sizeof(ucp_request_t)`` from a new context, before any worker (and pool) exists."""
    if _size["header"]:
        return
    fn = lib.ucp.ucp_context_query
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_ContextAttr)]
    attr = _ContextAttr(field_mask=_UCP_ATTR_FIELD_REQUEST_SIZE)
    if fn(ctx, ctypes.byref(attr)) == 0 and 0 < attr.request_size < 4096:
        _size["header"] = int(attr.request_size)
