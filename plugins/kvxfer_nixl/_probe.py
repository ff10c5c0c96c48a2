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
serves every backend of a process with the same options. What runs in the helper is
:mod:`kvxfer_nixl._helper`.
"""

from __future__ import annotations

from typing import Any

from kvxfer.plugin.prover import Prover, named, shared

__all__ = ["prover", "request"]

_TARGET = "kvxfer_nixl._helper:make_probe"


def prover(options: dict[str, Any], timeout: float) -> Prover:
    """The process's prover for backends built with ``options`` (JSON; started on first use)."""
    return shared(_TARGET, options, timeout)


def request(peer_name: str, blob: bytes) -> bytes:
    """What the helper is sent: the peer's name and its blob (both already validated here)."""
    return named(peer_name, blob)
