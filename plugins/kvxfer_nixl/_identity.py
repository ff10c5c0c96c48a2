"""Whose memory a NIXL blob reaches: the sender must be the process its worker address names.

UCX reaches a same-host peer's memory through the pid in the peer's worker address (its
cross-memory-attach transport copies with ``process_vm_readv``/``writev`` on that pid). The
worker address is opaque bytes from the network, so a blob can carry genuine metadata with
another pid in it, this very process's included: we would then read and write our own
unregistered memory at whatever addresses the blob's memory sections claim. Checks, before
NIXL (or the prover's helper) sees the blob, each a :class:`~kvxfer.errors.IdentityError`:

1. A worker address naming this process (its pid as UCX writes it, with or without the PID
   namespace flag) is refused unless the blob is genuinely ours: a live backend of this
   process with that instance id, whose own worker address it carries, and sections inside
   what that backend registered.
2. A header that names this process is held to the same test.
3. A header that claims this host is proven (:func:`kvxfer.peers.prove`): the named process
   must hold the secret behind the token, and every memory section must lie inside the spans
   that process published itself. A proof that ptrace rules forbid here is skipped (the
   checks above still hold); see ``docs/design.md`` section 8.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer import peers
from kvxfer.errors import IdentityError, OutOfRegistrationError
from kvxfer.peers import ProofUnavailable

from ._blob import PeerBlob, parse

__all__ = ["check", "names_pid"]

_PID_NS_FLAG = 1 << 31  # set by UCX in a pid it packs from inside a PID namespace


def names_pid(address: bytes, pid: int) -> bool:
    """Whether a UCX worker address holds ``pid`` as a little-endian u32 (PID namespace flag or not)."""
    if len(address) < 4 or pid <= 0:
        return False
    words = np.lib.stride_tricks.sliding_window_view(np.frombuffer(address, np.uint8), 4).astype(np.uint32)
    value = words[:, 0] | (words[:, 1] << 8) | (words[:, 2] << 16) | (words[:, 3] << 24)
    return bool(((value & np.uint32(~_PID_NS_FLAG & 0xFFFFFFFF)) == np.uint32(pid)).any())


def check(parsed: PeerBlob, peer: str, backends: tuple[str, ...], instances: Any) -> None:
    """Raise :class:`IdentityError` unless the blob's sender is who its worker address names."""
    me = peers.here()
    claim = parsed.identity
    what = f"NIXL metadata of {peer!r}"
    in_address = names_pid(parsed.worker_address(), me.pid)
    if in_address or peers.names_this_process(claim):
        why = (f"its UCX worker address holds this process's pid {me.pid}" if in_address
               else f"its header names this process (pid {claim.pid})")
        _genuinely_ours(parsed, peer, backends, instances, f"{what} ({why})")
        return
    if not claim.same_host():
        return
    try:
        proven = peers.prove(claim, what)
    except ProofUnavailable:
        return
    rows = np.array([(a.address, a.nbytes) for a in parsed.allocations()], dtype=np.uint64).reshape(-1, 2)
    if rows.shape[0] and not proven.covers(rows[:, 0], rows[:, 1]).all():
        raise IdentityError(f"{what} advertises memory that process {claim.pid} did not register")


def _genuinely_ours(parsed: PeerBlob, peer: str, backends: tuple[str, ...], instances: Any, what: str) -> None:
    other = instances.get(parsed.instance) if parsed.identity.token == peers.here().token else None
    if other is None or other._closed:
        raise IdentityError(f"{what} names this very process, but no live NIXL agent here sent it")
    own = parse(other.local_metadata(), other.agent_name, backends)
    if parsed.conns != own.conns:
        raise IdentityError(f"{what} carries another worker address than the agent of this process it names")
    try:
        for s in parsed.sections:
            rows = np.array([d[:3] for d in s.descs], dtype=np.uint64).reshape(-1, 3)
            other._memory.check(rows, s.kind, what)
    except OutOfRegistrationError as exc:
        raise IdentityError(f"{what} advertises memory its agent in this process did not register: {exc}") from None
