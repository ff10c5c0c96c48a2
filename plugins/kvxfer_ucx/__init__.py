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
:func:`diagnostics` (what ``kvxfer doctor`` shows) loads it when called.
"""

from __future__ import annotations

from typing import Any

from kvxfer.plugin import RegisterBackend, hookimpl, install_hint

from ._options import OPTIONS

__all__ = ["diagnostics", "kvxfer_register_backends"]


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


@hookimpl
def kvxfer_doctor_checks(gpus: int) -> list[Any]:
    """UCX's rows of ``kvxfer doctor`` (:mod:`kvxfer_ucx._doctor`)."""
    from ._doctor import check_ptrace, check_ucx

    return check_ucx(gpus, diagnostics()) + check_ptrace()


def diagnostics() -> dict[str, Any]:
    """What an operator needs to know of this plugin's UCX, for ``kvxfer doctor``.

    ``path`` of the ``libucp.so`` it would load (None: not found, with ``env``, the variable
    that points at one), the ``version`` loaded (None if it does not load, ``error`` says why),
    and whether the stuck-slot skip (:mod:`kvxfer.ucxabi.mmqueue`) is on with that version:
    it is validated against the receive-queue layout of ``validated`` releases only, and off
    on any other, where a killed peer can wedge an agent's receive queue again.
    """
    from kvxfer.plugin.ucxabi import mmqueue as _stuckslot

    from . import _libucp

    out: dict[str, Any] = {"path": _libucp.find_libucp(), "env": _libucp.LIBUCP_ENV, "version": None, "error": None,
                           "stuck_slot_skip": False,
                           "validated": [".".join(map(str, v)) for v in sorted(_stuckslot.LAYOUT_VERSIONS)]}
    if out["path"] is None:
        out["error"] = "libucp.so not found"
        return out
    try:
        version = _libucp.load().version
    except (OSError, RuntimeError, AttributeError) as exc:
        out["error"] = f"libucp does not load: {exc}"
        return out
    out["version"] = ".".join(map(str, version))
    out["stuck_slot_skip"] = tuple(version[:2]) in _stuckslot.LAYOUT_VERSIONS and bool(_stuckslot.ENABLED[0])
    return out
