"""What runs in the prover's helper process for the NIXL backend (see :mod:`kvxfer_nixl._probe`).

The helper holds a :class:`~kvxfer_nixl.backend.NixlBackend` built with the options of the
backend it protects, with memory registered like it, and proves a blob by adding then
removing the peer through that backend: the code the protected process would run.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from kvxfer.prove import unnamed

__all__ = ["make_probe"]


def make_probe(**options: Any) -> Callable[[bytes], None]:
    """In the helper: a backend like the one it protects, and the call that adds then removes."""
    from kvxfer import Allocation

    from .backend import NixlBackend  # only in the helper: the backend imports _probe, not this

    backend = NixlBackend(f"kvxfer-probe-{os.getpid()}", prove_metadata=False, **options)
    memory = np.zeros(1 << 16, np.uint8)  # the backend it protects has registered memory too
    backend.register([Allocation(memory.ctypes.data, memory.nbytes)])

    def probe(data: bytes) -> None:
        name, blob = unnamed(data)
        try:
            backend.add_remote(name, blob)
        finally:
            backend.remove_remote(name)

    probe.memory = memory  # type: ignore[attr-defined]  # kept registered for the helper's life
    return probe
