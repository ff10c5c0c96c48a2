"""Loading peer metadata in a helper process first (:mod:`kvxfer.prove`), for the NIXL backend.

NIXL hands a peer's worker address and remote keys to UCX as they are, and a corrupt one can
crash the process inside ``add_remote_agent``. With ``prove_metadata=True`` (the default)
the backend asks a :class:`kvxfer.prove.Prover` to load the rebuilt metadata in a helper
process with a NIXL agent of the same configuration, and loads it here only if the helper
survived. One helper serves every backend of a process with the same configuration.

:func:`make_probe` runs in the helper. Each load there gets a name of its own, because a
load NIXL refuses half-way keeps its name taken (``plugins/kvxfer_nixl/README.md``).
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from typing import Callable, Sequence

from kvxfer.deadlines import check_timeout
from kvxfer.prove import Prover

__all__ = ["make_probe", "prover"]

_TARGET = "kvxfer_nixl._probe:make_probe"
_HEAD = b"nixlSerDes|Agent"
_LEN = struct.Struct("<Q")
_provers: dict[tuple[tuple[str, ...], int, float], Prover] = {}
_lock = threading.Lock()


def prover(backends: Sequence[str], num_threads: int, timeout: float) -> Prover:
    """The process's prover for NIXL agents of this configuration (started on first use)."""
    key = (tuple(backends), int(num_threads), check_timeout(timeout, "prove_timeout"))
    with _lock:
        p = _provers.get(key)
        if p is None:
            p = _provers[key] = Prover(_TARGET, {"backends": list(key[0]), "num_threads": key[1]}, timeout=key[2],
                                       log=os.environ.get("KVXFER_PROVE_LOG") or None)
        return p


def make_probe(backends: Sequence[str], num_threads: int = 0) -> Callable[[bytes], None]:
    """In the helper: a NIXL agent like the backend's, and the call that loads then unloads."""
    from ._nixl import nx

    cfg = nx.nixl_agent_config(enable_prog_thread=False, backends=list(backends), num_threads=int(num_threads))
    agent = nx.nixl_agent(f"kvxfer-probe-{os.getpid()}", cfg)
    names = itertools.count(1)

    def probe(md: bytes) -> None:
        if not md.startswith(_HEAD) or len(md) < len(_HEAD) + _LEN.size:
            raise ValueError("not NIXL metadata")
        (n,) = _LEN.unpack_from(md, len(_HEAD))
        rest = md[len(_HEAD) + _LEN.size + n + 1:]
        name = f"probe#{next(names)}".encode()
        loaded = agent.add_remote_agent(_HEAD + _LEN.pack(len(name)) + name + b"|" + rest)
        try:
            agent.remove_remote_agent(loaded.decode() if isinstance(loaded, bytes) else loaded)
        except Exception:
            pass  # loaded, which is what was to be proven

    return probe
