"""What runs in the prover's helper process for the UCX backend (:mod:`kvxfer.prove`).

A corrupt UCX worker address can crash the process that unpacks it, and whether it does
depends on the process (one mutated address crashed a fuzz child about once in many runs).
The helper holds a :class:`~kvxfer_ucx.backend.UcxBackend` with memory registered, built
with the protected backend's options, and hands UCX what its parent is about to: on the RMA
route the worker address and every remote key (a whole ``add_remote``), on the same-host
copy route the worker address alone (the parent has already proven the peer's identity,
which a helper need not redo). The route is the request's first byte.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from kvxfer.prove import unnamed

__all__ = ["make_probe"]


def make_probe(**options: Any) -> Callable[[bytes], None]:
    from kvxfer import Allocation

    from ._blob import parse_blob
    from .backend import ROUTE_COPY, UcxBackend  # only in the helper; the backend never imports this module

    backend = UcxBackend(f"kvxfer-probe-{os.getpid()}", **{**options, "same_host_copy": False,
                                                            "prove_metadata": False})
    memory = np.zeros(1 << 16, np.uint8)
    backend.register([Allocation(memory.ctypes.data, memory.nbytes)])

    def probe(data: bytes) -> None:
        name, routed = unnamed(data)
        route, blob = routed[:1], routed[1:]
        if route == ROUTE_COPY:
            ep = backend._w.connect(parse_blob(blob).worker)
            backend._w.close_ep(ep, force=True)
            return
        try:
            backend.add_remote(name, blob)
        finally:
            backend.remove_remote(name)

    probe.memory = memory  # type: ignore[attr-defined]  # kept registered for the helper's life
    return probe
