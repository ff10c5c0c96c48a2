"""The third-process check, once for every backend whose peers send a UCX worker address.

A peer's blob carries two claims about who it is: its header (a host, a pid, a proof page)
and its UCX worker address, which is what UCX actually follows, into the process it names.
A token holder can send a genuine header with an address naming *another* local process (a
third one, or this one), and UCX would then read or write that process's memory. So before
UCX (or the prover's helper) sees a blob, its address is read as UCX reads it
(:mod:`kvxfer.ucxabi.address`) and may name, on this host, at most the process its header
claims; an address that cannot be read exactly is refused too. What a backend does about an
address naming *this* process differs (NIXL allows its own agents here, UCX allows none), so
:func:`named` hands that back and :func:`only_the_sender` checks the rest. Rationale:
``docs/design.md`` section 8.2.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import IdentityError
from ..ucxabi import address as ucxaddr
from .identity import pid_namespace

__all__ = ["Here", "Reach", "here", "named", "only_the_sender"]

Here = ucxaddr.Here
Reach = ucxaddr.Reach


def here(pid: int, own_addresses: Iterable[bytes]) -> Here:
    """This process's UCX as its own agents' worker addresses show it (its transports, its ids)."""
    h = ucxaddr.Here(pid, pid_namespace())
    for a in own_addresses:
        if a:
            h.add(a)
    return h


def named(address: bytes, mine: Here, what: str) -> Reach:
    """Whom on this host ``address`` reaches; :class:`IdentityError` when that cannot be told."""
    if not address:
        return ucxaddr.Reach(frozenset(), False)
    try:
        return ucxaddr.reach(address, mine)
    except ucxaddr.Unreadable as exc:
        raise IdentityError(f"{what}: its UCX worker address cannot be read as UCX reads it ({exc}), so which "
                            "processes of this host it reaches cannot be told") from None


def only_the_sender(reached: Reach, sender_pid: int | None, same_host: bool, what: str) -> None:
    """Raise :class:`IdentityError` if ``reached`` names a process of this host other than the
    sender the header claims (``same_host``: the header claims this host, boot and PID
    namespace; ``sender_pid``: its pid, None if it claims none)."""
    if not reached.pids:
        return
    if not same_host or sender_pid is None:
        raise IdentityError(f"{what}: its UCX worker address names process(es) {sorted(reached.pids)} of this host, "
                            "but its header claims another host")
    others = reached.pids - {sender_pid}
    if others:
        raise IdentityError(f"{what}: its UCX worker address names process(es) {sorted(others)} of this host, not "
                            f"only the sender it claims (pid {sender_pid})")
