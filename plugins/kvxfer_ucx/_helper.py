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

from kvxfer.plugin.prover import backend_probe, named, unnamed

__all__ = ["make_probe"]


def make_probe(**options: Any) -> Callable[[bytes], None]:
    from ._blob import parse_blob
    from .backend import ROUTE_COPY, UcxBackend  # only in the helper; the backend never imports this module

    backend = UcxBackend(f"kvxfer-probe-{os.getpid()}", **{**options, "same_host_copy": False,
                                                            "prove_metadata": False})
    whole = backend_probe(backend)

    def probe(data: bytes) -> None:
        name, routed = unnamed(data)
        route, blob = routed[:1], routed[1:]
        if route == ROUTE_COPY:  # the worker address alone
            ep = backend._w.connect(parse_blob(blob).worker)
            backend._w.close_ep(ep, force=True)
        else:
            whole(named(name, blob))

    return probe
