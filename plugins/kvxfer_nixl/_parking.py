"""Removed peers' NIXL loads, kept for a re-add of the very same bytes.

NIXL 1.5.1 keeps two file descriptors of every ``add_remote_agent`` that it never gives back,
``remove_remote_agent`` included (200 remove and re-add cycles of one peer: 400 descriptors
before, 0 after; RELIABILITY.md, "Descriptors"). A decode that re-adds an unchanged peer
(same process, same registrations, so byte-equal metadata) therefore reuses the load it
already has instead of making another. A parked load is unreachable: every list prepared
for it was released, and a list can only be prepared for a peer that is added. Different
bytes for the name unload it; past :data:`MAX_PARKED` names the oldest is unloaded.
"""

from __future__ import annotations

__all__ = ["MAX_PARKED", "Parking"]

MAX_PARKED = 64


class Parking:
    """Peer name -> (blob bytes, NIXL alias) of loads no added peer uses."""

    def __init__(self) -> None:
        self._loads: dict[str, tuple[bytes, str]] = {}

    def alias_for(self, peer: str, blob: bytes) -> str | None:
        """The parked alias of ``peer`` if it was loaded from exactly ``blob``."""
        got = self._loads.get(peer)
        return got[1] if got is not None and got[0] == blob else None

    def take(self, peer: str) -> str | None:
        """Unpark ``peer``'s load; its alias, if there was one."""
        got = self._loads.pop(peer, None)
        return None if got is None else got[1]

    def park(self, peer: str, blob: bytes, alias: str) -> list[tuple[str, str]]:
        """Keep ``alias``; returns the ``(peer, alias)`` loads to unload now."""
        old = self._loads.pop(peer, None)
        self._loads[peer] = (blob, alias)
        evict = [(peer, old[1])] if old is not None and old[1] != alias else []
        while len(self._loads) > MAX_PARKED:
            name = next(iter(self._loads))
            evict.append((name, self._loads.pop(name)[1]))
        return evict

    def drain(self) -> list[tuple[str, str]]:
        """Every parked load, forgotten here: the caller unloads them."""
        out = [(peer, alias) for peer, (_, alias) in self._loads.items()]
        self._loads.clear()
        return out
