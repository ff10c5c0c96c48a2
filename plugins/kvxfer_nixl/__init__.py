"""kvxfer's NIXL backend: ``pip install -e '.[nixl]'`` from a checkout, then ``Agent(name, backend="nixl")``.

This module registers the backend and imports nothing heavy: ``nixl`` is imported from
:mod:`kvxfer_nixl.backend` only when an agent first uses it, so ``kvxfer backends`` on a
machine without NIXL lists it as unavailable, with the install command, instead of failing.
It is shaped like any third-party plugin (entry point ``nixl = "kvxfer_nixl"`` in the
``kvxfer`` group) and uses only kvxfer's public API.

How the backend is built, and why: ``plugins/kvxfer_nixl/README.md``.
"""

from __future__ import annotations

from typing import Any

from kvxfer.plugin import RegisterBackend, hookimpl, install_hint

from ._options import OPTIONS

__all__ = ["kvxfer_doctor_checks", "kvxfer_register_backends"]


@hookimpl
def kvxfer_register_backends(register: RegisterBackend) -> None:
    """Offer the ``nixl`` backend; its module is imported only when first used."""
    register(
        "nixl",
        "kvxfer_nixl.backend:NixlBackend",
        requires=("nixl",),
        install=install_hint("nixl"),
        summary="NVIDIA NIXL (UCX: NVLink, RDMA, TCP, shared memory); DRAM and VRAM",
        options=OPTIONS,
    )


@hookimpl
def kvxfer_doctor_checks() -> list[Any]:
    """NIXL's rows of ``kvxfer doctor`` and its metadata prover's (:mod:`kvxfer_nixl._doctor`)."""
    from ._doctor import checks

    return checks()
