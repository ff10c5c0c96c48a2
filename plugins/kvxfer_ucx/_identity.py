"""Whose memory a UCX blob reaches, and what bounds it there, on both data paths.

A blob's worker address is what UCX follows: over ``posix`` into the receive queue of the
process it names (whose worker then serves software RMA at any address), over ``self`` into
this very worker. Its allocations are a claim. So, before UCX (or the prover's helper) sees
a blob, whatever route the peer will get:

1. The address is read as UCX reads it (:mod:`kvxfer.ucxabi.address`). One that names this
   agent's own worker, names a process of this host while its header claims another host (or
   none), or names any process of this host other than the one its header claims, is an
   :class:`~kvxfer.errors.IdentityError`, as is one that cannot be read exactly: the
   third-process check of :mod:`kvxfer.peers.third`, shared with the NIXL plugin.
2. A header that claims this host is proven as the copy path proves it
   (:func:`kvxfer_ucx._hostpage.read_page`): the named process holds the secret behind the
   blob's digest, and every advertised allocation lies inside the spans it registered *now*.
   The page is read again before and after every transfer on either path, so a peer that
   deregistered since (an agent restarted in the same process, say, whose old blob is
   replayed) moves nothing and ends nothing as DONE. A page that ptrace rules forbid reading
   is not a proof either way (step 1 still holds); ``docs/design.md`` section 8.2 says so.
"""

from __future__ import annotations

import os

from kvxfer import IdentityError
from kvxfer.plugin.identity import third

from ._blob import Blob, Host

__all__ = ["check_reach", "here"]


def here(own_addresses: list[bytes]) -> third.Here:
    """This process's UCX as this agent's own worker addresses show it (its transports, its ids)."""
    return third.here(os.getpid(), own_addresses)


def check_reach(b: Blob, local: bool, mine: third.Here, peer: str) -> None:
    """Raise :class:`IdentityError` unless ``b``'s address reaches, on this host, at most the
    process its header claims (``local``: the header claims this host, boot and PID namespace)."""
    what = f"ucx metadata of {peer!r}"
    reached = third.named(b.worker, mine, what)
    if reached.this_process:
        raise IdentityError(f"{what}: its UCX worker address names this agent's own worker")
    h: Host | None = b.host
    third.only_the_sender(reached, h.pid if h is not None else None, local and h is not None, what)
