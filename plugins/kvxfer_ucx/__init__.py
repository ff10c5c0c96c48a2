"""kvxfer's raw UCX backend: libucp through ctypes, no NIXL.

Install with ``pip install 'kvxfer[ucx]'`` (pulls the ``libucx-cu12`` wheel, which ships
``libucp.so``). Point ``KVXFER_LIBUCP`` at a system ``libucp.so`` to use a UCX built with
verbs::

    agent = kvxfer.Agent("decode", backend="ucx")                        # same host
    agent = kvxfer.Agent("decode", backend="ucx", trusted_network=True)  # also across hosts

Layout: ``backend.py`` is the control plane (connections, liveness, notifications, which
data path a peer gets); ``_samehost.py`` and ``_rma.py`` are the two data paths;
``_hostpage.py`` proves which process a same-host peer is; ``_worker.py`` wraps the UCP
context and worker; ``_blob.py`` is the connection blob; ``_lists.py`` prepared lists.
Why it is built this way, and what each option exposes: ``plugins/kvxfer_ucx/README.md``.

This module does not load UCX: listing backends only looks for ``libucp.so`` on disk.
"""

from __future__ import annotations

from kvxfer.extras import install_hint
from kvxfer.plugin import RegisterBackend, hookimpl

from ._options import OPTIONS

__all__ = ["kvxfer_register_backends"]


def _check() -> str | None:
    from ._libucp import LIBUCP_ENV, find_libucp

    if find_libucp() is None:
        return f"libucp.so not found (no libucx wheel, and {LIBUCP_ENV} is unset or wrong)"
    return None


@hookimpl
def kvxfer_register_backends(register: RegisterBackend) -> None:
    register("ucx", "kvxfer_ucx.backend:UcxBackend", requires=(), install=install_hint("ucx"),
             summary="raw UCX (libucp via ctypes) and same-host process_vm_readv, DRAM, cross-process", check=_check,
             options=OPTIONS)
