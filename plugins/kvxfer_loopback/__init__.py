"""kvxfer's in-process loopback backend: real bytes, no network, no GPU required.

It exists so that CPU-only CI exercises the whole core (discovery, planner, agent,
notifications, errors) with real memory copies, and so that plugin authors have a small,
complete example of the seam. It is shaped exactly like a third-party plugin: this module
registers the backend through the ``kvxfer`` entry-point group and imports nothing heavy;
:mod:`kvxfer_loopback.backend` holds the implementation and uses only kvxfer's public API.
"""

from __future__ import annotations

from kvxfer.plugin import RegisterBackend, hookimpl


@hookimpl
def kvxfer_register_backends(register: RegisterBackend) -> None:
    register(
        "loopback",
        "kvxfer_loopback.backend:LoopbackBackend",
        summary="in-process memmove (DRAM) / device copy (CUDA, with torch); for tests and CI",
    )
