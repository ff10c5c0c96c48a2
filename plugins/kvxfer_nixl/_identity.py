"""Whose memory a NIXL blob reaches: the processes its worker address names, exactly.

UCX reaches a same-host peer through what its worker address names: a pid for
cross-memory attach (``process_vm_readv``/``writev`` on it), the owner's receive queue for
shared memory, this very process for the loopback transports. The address is opaque bytes
from the network, so a blob can carry genuine metadata edited to name another process,
this one included: we would then read and write that process's memory at whatever
addresses the blob's memory sections claim. So the address is parsed as this process's UCX
parses it (:mod:`kvxfer.ucxabi.address`) and, before NIXL (or the prover's helper) sees the
blob, each of these is a :class:`~kvxfer.errors.IdentityError`:

1. An address that names this process (its pid, one of its loopback interfaces or worker
   ids), or a header that does, is refused unless the blob is genuinely ours: a live
   backend of this process with that instance id, whose own worker address it carries, and
   sections inside what that backend registered.
2. An address that names any other process of this host must name only the process its
   header claims, and that header must claim this host.
3. A header that claims this host is proven (:func:`kvxfer.peers.prove`): the named process
   must hold the secret behind the token, and every memory section must lie inside the spans
   that process published itself. A proof that ptrace rules forbid here is skipped (the
   checks above still hold); see ``docs/design.md`` section 8.
4. An address that cannot be read exactly (``_ucxaddr.Unreadable``) is refused: what it
   names cannot be told (section 8.2 says why this refuses no genuine peer of UCX 1.23).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer import IdentityError, KvxferError, OutOfRegistrationError
from kvxfer.plugin import identity as peers
from kvxfer.plugin.identity import ProofUnavailable, third

from ._blob import PeerBlob, parse

__all__ = ["check", "here", "named"]

_own: dict[bytes, bytes] = {}  # instance id -> its worker address (fixed for the agent's life)
peers.on_fork(_own.clear)


def here(instances: Any, backends: tuple[str, ...]) -> third.Here:
    """This process's UCX, as its live agents' own worker addresses show it."""
    live = dict(instances.items())
    for gone in set(_own) - set(live):
        _own.pop(gone, None)
    for key, other in live.items():
        if key not in _own:
            try:
                _own[key] = parse(other.local_metadata(), other.agent_name, backends).worker_address()
            except KvxferError:  # closed meanwhile: its interfaces are gone with it
                continue
    return third.here(peers.here().pid, (_own[k] for k, o in live.items() if k in _own and not o._closed))


def named(address: bytes, instances: Any, backends: tuple[str, ...], what: str) -> third.Reach:
    """Whom on this host ``address`` reaches; :class:`IdentityError` when that cannot be told."""
    return third.named(address, here(instances, backends), what)


def check(parsed: PeerBlob, peer: str, backends: tuple[str, ...], instances: Any) -> None:
    """Raise :class:`IdentityError` unless the blob's sender is the only process its address names."""
    me = peers.here()
    claim = parsed.identity
    what = f"NIXL metadata of {peer!r}"
    reached = named(parsed.worker_address(), instances, backends, what)
    in_address = reached.this_process or me.pid in reached.pids
    if in_address or peers.names_this_process(claim):
        why = ("its UCX worker address names this process" if in_address
               else f"its header names this process (pid {claim.pid})")
        _genuinely_ours(parsed, peer, backends, instances, f"{what} ({why})")
        return
    third.only_the_sender(reached, claim.pid, claim.same_host(), what)
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
    other = instances.find(parsed.instance, parsed.identity.token, peers.here().token)
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
