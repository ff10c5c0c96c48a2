"""The UCX RMA data path: one ``ucp_get_nbx``/``ucp_put_nbx`` per descriptor pair, then a flush.

Every request is kept until its own status has been read: a transfer is complete only when
the flush *and* every GET/PUT completed with ``UCS_OK``. (Freeing a request at once, as
fire-and-forget code does, loses its status: after a peer died, UCX may complete the flush
while the purged GETs it followed carry the error.) The endpoint is in error mode ``PEER``
(see :mod:`kvxfer_ucx._worker`), so a dead peer completes what is outstanding with an error.

One-sided RMA cannot be recalled: :meth:`RmaJob.cancel` drives the worker until the
requests settle (bounded), so that "cancelled" means "no longer touching memory" whenever the
peer is alive to answer.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvxfer import KvxferError

from . import _libucp as L
from ._worker import Worker

__all__ = ["RmaJob"]

#: ``fail(status, call)`` turns a ucs_status into the error to raise (and notes a dead peer).
Fail = Callable[[int, str], KvxferError]


class RmaJob:
    """``local[i] <-> remote[i]`` over one endpoint; ``rkeys[i]`` is the remote key of pair ``i``."""

    def __init__(self, w: Worker, ep: int, read: bool, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray,
                 rkeys: np.ndarray, fail: Fail) -> None:
        self._w, self._fail = w, fail
        self._requests: list[int] = []
        self._flush: int | None = None
        self.error: KvxferError | None = None
        lib = w.lib
        fn = lib.ucp_get_nbx if read else lib.ucp_put_nbx
        param, append, err_floor = w.param_ref, self._requests.append, (1 << 64) + L.UCS_ERR_LAST
        # The one Python loop per descriptor: a ctypes call each. Error pointers stop it; what
        # was already issued stays tracked, for cancel() to settle.
        for a, n, r, k in zip(local.tolist(), nbytes.tolist(), remote.tolist(), rkeys.tolist()):
            req = fn(ep, a, n, r, k, param)
            if req:
                if req >= err_floor:
                    self.error = fail(L.status_of_ptr(req), fn.__name__)
                    return
                append(req)
        flush = lib.ucp_ep_flush_nbx(ep, param)
        if flush and L.is_err_ptr(flush):
            self.error = fail(L.status_of_ptr(flush), "ucp_ep_flush_nbx")
        elif flush:
            self._flush = flush

    def step(self, deadline: float) -> bool:
        """Drive the worker until every request settled or ``deadline`` (monotonic) passed.

        True once every byte moved; raises the transfer's error if any request failed.
        """
        w = self._w
        while self.error is None:
            w.progress()
            if self._flush is not None:
                st = w.reap(self._flush)
                if st is not None:
                    self._flush = None
                    if st != L.UCS_OK:
                        self.error = self._fail(st, "flush")
                        break
            if self._flush is None and self._settle() and self.error is None:
                return True
            if time.monotonic() >= deadline:
                return False
        raise self.error

    def _settle(self) -> bool:
        """Read and free every completed request; True when none is left in flight."""
        lib, bad, left = self._w.lib, L.UCS_OK, []
        for r in self._requests:
            st = int(lib.ucp_request_check_status(r))
            if st == L.UCS_INPROGRESS:
                left.append(r)
                continue
            lib.ucp_request_free(r)
            if st != L.UCS_OK and bad == L.UCS_OK:
                bad = st
        self._requests = left
        if bad != L.UCS_OK:
            self.error = self._fail(bad, "RMA request")
        return not left

    def cancel(self, deadline: float, alive: Callable[[], bool]) -> bool:
        """Settle what is in flight (bounded by ``deadline``; a dead peer is not waited on).
        False if some request was still in flight when it gave up."""
        pending = self._requests + ([self._flush] if self._flush is not None else [])
        self._requests, self._flush = [], None
        return self._w.drain(pending, deadline, alive)
