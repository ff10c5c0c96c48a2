"""Loading peer metadata in a helper process first (:mod:`kvxfer.prove`), for the NIXL backend.

NIXL hands a peer's worker address and remote keys to UCX as they are, and a corrupt one can
crash the process inside ``add_remote_agent``. With ``prove_metadata=True`` (the default)
the backend asks a :class:`kvxfer.prove.Prover` to add the peer in a helper process first,
and adds it here only if the helper survived.

Whether UCX crashes on a corrupt key depends on more than the bytes: on which libraries the
process has loaded (CUDA's among them) and on how its NIXL agent is configured. So the helper
is as much like the backend as it can be: it runs a :class:`~kvxfer_nixl.backend.NixlBackend`
built with the same options, with memory registered, and proves a blob by calling that
backend's ``add_remote`` then ``remove_remote``, the same code this process runs. One helper
serves every backend of a process with the same options.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from typing import Any, Callable

import numpy as np

from kvxfer.deadlines import check_timeout
from kvxfer.prove import Prover

__all__ = ["make_probe", "prover", "request"]

_TARGET = "kvxfer_nixl._probe:make_probe"
_NAME = struct.Struct("<H")
_provers: dict[tuple[str, float], Prover] = {}
_lock = threading.Lock()


def prover(options: dict[str, Any], timeout: float) -> Prover:
    """The process's prover for backends built with ``options`` (JSON; started on first use)."""
    key = (json.dumps(options, sort_keys=True), check_timeout(timeout, "prove_timeout"))
    with _lock:
        p = _provers.get(key)
        if p is None:
            p = _provers[key] = Prover(_TARGET, options, timeout=key[1],
                                       log=os.environ.get("KVXFER_PROVE_LOG") or None)
        return p


def request(peer_name: str, blob: bytes) -> bytes:
    """What the helper is sent: the peer's name and its blob (both already validated here)."""
    name = peer_name.encode("utf-8")
    return _NAME.pack(len(name)) + name + bytes(blob)


def make_probe(**options: Any) -> Callable[[bytes], None]:
    """In the helper: a backend like the one it protects, and the call that adds then removes."""
    from kvxfer import Allocation

    from .backend import NixlBackend

    backend = NixlBackend(f"kvxfer-probe-{os.getpid()}", prove_metadata=False, **options)
    memory = np.zeros(1 << 16, np.uint8)  # the backend it protects has registered memory too
    backend.register([Allocation(memory.ctypes.data, memory.nbytes)])

    def probe(data: bytes) -> None:
        (n,) = _NAME.unpack_from(data)
        name = data[_NAME.size:_NAME.size + n].decode("utf-8")
        try:
            backend.add_remote(name, data[_NAME.size + n:])
        finally:
            backend.remove_remote(name)

    probe.memory = memory  # type: ignore[attr-defined]  # kept registered for the helper's life
    return probe
