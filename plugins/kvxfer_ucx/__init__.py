"""kvxfer's raw UCX backend: one-sided RMA on libucp through ctypes, no NIXL.

Install with ``pip install 'kvxfer[ucx]'`` (pulls the ``libucx-cu12`` wheel, which ships
``libucp.so``). Point ``KVXFER_LIBUCP`` at a system ``libucp.so`` to use a UCX built with
verbs (the wheel has tcp, shared memory, CMA and CUDA transports only)::

    agent = kvxfer.Agent("decode", backend="ucx")            # safe default
    agent = kvxfer.Agent("decode", backend="ucx", cma=True)  # faster, see below

Why this binding (measured on a 2-core VM, two processes, one READ of 100-300 rows of
4.5 MiB DRAM; commands and full table in ``benchmarks/UCX_RESULTS.md``):

* one-sided RMA on libucp via ctypes (this backend) with CMA: 5.27 GB/s, 1.01x the raw NIXL
  fast path (5.21 GB/s); it is the only way to do RMA from Python (ucxx has no RMA API);
* the same without CMA (the default, below): 3.62 GB/s, 0.69x NIXL;
* a two-sided request protocol on ucxx (one tag send per row into pre-posted receives):
  2.79 GB/s, and it needs the target's Python to answer every request;
* UCX error mode ``peer`` on the data endpoint: 0.56 GB/s: UCX 1.21 then falls back to
  software-emulated RMA over TCP, for every transport setting we tried.

So the data endpoint stays in error mode ``none`` and a second endpoint per peer, in mode
``peer`` and carrying only notifications, gets UCX's error callback when the peer dies
(measured: a SIGKILLed peer gives :class:`~kvxfer.errors.PeerDisconnectedError` in 15-20 ms).
CMA, however, **aborts the reading/writing process** when the peer dies in the middle of a
copy (UCX 1.21 treats the failed ``process_vm_readv`` as fatal in mode ``none``). That breaks
the rule that a dead peer is reported, never fatal, so CMA is off by default: the default
moves host bytes through shared memory (software RMA) or TCP, and
``cma=True`` opts into the single-copy path for deployments that restart both sides together.

Notifications are active messages sent only after the transfer's ``ucp_ep_flush_nbx``
completed, so they never overtake the data. Capabilities: DRAM only (registering VRAM raises
:class:`~kvxfer.errors.UnsupportedError`), ``merges_runs=False`` (the planner coalesces),
``cheap_prepare=True``, ``cross_process=True``, ``needs_progress=True``. Per descriptor the
backend makes one ctypes call (about 1 us), so 1,563 packed rows cost ~2 ms to post.

This module does not load UCX: listing backends only looks for ``libucp.so`` on disk.
"""

from __future__ import annotations

from typing import Callable

from kvxfer.hookspecs import hookimpl

__all__ = ["kvxfer_register_backends"]


def _check() -> str | None:
    from ._libucp import LIBUCP_ENV, find_libucp

    if find_libucp() is None:
        return f"libucp.so not found (no libucx wheel, and {LIBUCP_ENV} is unset or wrong)"
    return None


@hookimpl
def kvxfer_register_backends(register: Callable[..., None]) -> None:
    register("ucx", "kvxfer_ucx.backend:UcxBackend", requires=(), install="pip install 'kvxfer[ucx]'",
             summary="raw UCX one-sided RMA (libucp via ctypes), DRAM, cross-process", check=_check)
