"""The helper's side of :mod:`kvxfer.prove`: the probe a backend's helper runs, and its request.

Split from :mod:`kvxfer.prove` by concern: that module decides *whether* bytes are proven
(helpers, budgets, verdicts); this one is what a helper process does with them, and the
small format naming the peer a probe adds: a little-endian u16 length, the UTF-8 name, then
the blob, read back with the core's bounded reader.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

from . import _wire

__all__ = ["backend_probe", "named", "unnamed"]

_NAME = struct.Struct("<H")


def backend_probe(backend: Any) -> Callable[[bytes], None]:
    """In a helper: the probe that adds, then removes, the peer a :func:`named` request names.

    ``backend`` is built like the one it protects; 64 KiB are registered on it first, since
    the protected backend has memory registered too (what a load touches can depend on it).
    """
    import numpy as np

    from .memory import Allocation

    memory = np.zeros(1 << 16, np.uint8)
    backend.register([Allocation(memory.ctypes.data, memory.nbytes)])

    def probe(data: bytes) -> None:
        name, blob = unnamed(data)
        try:
            backend.add_remote(name, blob)
        finally:
            backend.remove_remote(name)

    probe.memory = memory  # type: ignore[attr-defined]  # kept registered for the helper's life
    return probe


def named(name: str, blob: bytes) -> bytes:
    """A probe request for a backend's ``add_remote(name, blob)``: the name, then the blob."""
    raw = name.encode("utf-8")
    return _NAME.pack(len(raw)) + raw + bytes(blob)


def unnamed(data: bytes) -> tuple[str, bytes]:
    """The inverse of :func:`named`, in the helper."""
    r = _wire.Reader(data, "probe request")
    (n,) = r.unpack(_NAME)
    name = r.take(n).decode("utf-8")  # our own request: the name was validated before it was sent
    return name, r.rest()
