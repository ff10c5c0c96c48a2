"""What runs in the prover's helper process for the NIXL backend (see :mod:`kvxfer_nixl._probe`).

The helper holds a :class:`~kvxfer_nixl.backend.NixlBackend` built with the options of the
backend it protects, with memory registered like it, and proves a blob by adding then
removing the peer through that backend: the code the protected process would run.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from kvxfer.plugin.prover import backend_probe

__all__ = ["make_probe"]


def make_probe(**options: Any) -> Callable[[bytes], None]:
    """In the helper: a backend like the one it protects, and the call that adds then removes."""
    from .backend import NixlBackend  # only in the helper: the backend imports _probe, not this

    return backend_probe(NixlBackend(f"kvxfer-probe-{os.getpid()}", prove_metadata=False, **options))
