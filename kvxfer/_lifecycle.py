"""What an agent tells a fleet operator about its memory and its peers.

INFO lines on the ``kvxfer.agent`` logger for the events an operator follows across a fleet
(memory registered or dropped, a peer added with the path and pairing mode it will use, a
peer that restarted, a peer removed), each with the facts under the record's ``kvxfer``
attribute for :class:`kvxfer.observe.JsonFormatter`. Transfers are logged by
:mod:`kvxfer.observe`, not here. Also the refusal for a peer the agent does not know,
written so that metadata pasted where a name belongs gives a short message and a hint.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

# The agent and its peers are typed loosely (``Any``) on purpose: agent.py imports this module,
# and a type-only import back would be an import circle all the same.
Agent = Peer = KVCacheSpec = Any

__all__ = ["registered", "deregistered", "peer_added", "peer_restarted", "peer_removed", "store_event",
           "unknown_peer_message"]

log = logging.getLogger("kvxfer.agent")
store_log = logging.getLogger("kvxfer.store")


def _info(message: str, **facts: Any) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(message, extra={"kvxfer": facts})


def store_event(event: str, path: str, message: str, **facts: Any) -> None:
    """A store's lifecycle (opened, rows evicted, damaged rows dropped, closed) on ``kvxfer.store``."""
    if store_log.isEnabledFor(logging.INFO):
        store_log.info(f"store {path}: {message}", extra={"kvxfer": {"event": event, "store": path, **facts}})


def _describe(spec: KVCacheSpec) -> str:
    kinds = sorted({a.kind.value for a in spec.allocations})
    n = sum(a.nbytes for a in spec.allocations)
    size = f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
    return f"{len(spec.regions)} region(s), {len(spec.allocations)} allocation(s), {size} of {'+'.join(kinds)}"


def registered(agent: Agent, spec: KVCacheSpec) -> None:
    _info(f"agent {agent.name!r} registered {_describe(spec)} with backend {agent.backend_name!r} "
          f"(generation {agent.generation})", event="register", agent=agent.name, backend=agent.backend_name,
          generation=agent.generation, regions=len(spec.regions),
          nbytes=sum(a.nbytes for a in spec.allocations))


def deregistered(agent: Agent) -> None:
    _info(f"agent {agent.name!r} deregistered its KV cache", event="deregister", agent=agent.name)


def peer_added(agent: Agent, peer: Peer) -> None:
    """The path the bytes will take (the backend's, or the device path) and how blocks pair."""
    mode = _mode(peer)
    where = _path(agent, peer)
    _info(f"agent {agent.name!r} added peer {peer.name!r} (generation {peer.generation}) over "
          f"{agent.backend_name}{f' ({where})' if where else ''}; pairing {mode}"
          f"{' as a source (add_source)' if peer.source else ''}",
          event="add_peer", agent=agent.name, peer=peer.name, generation=peer.generation,
          backend=agent.backend_name, path=where, pairing=mode, source=peer.source)


def peer_restarted(agent: Agent, old: Peer, generation: int) -> None:
    _info(f"agent {agent.name!r}: peer {old.name!r} restarted (generation {old.generation} -> {generation}); "
          "its connection and prepared lists are dropped", event="peer_restart", agent=agent.name,
          peer=old.name, old_generation=old.generation, generation=generation)


def peer_removed(agent: Agent, peer: Peer) -> None:
    _info(f"agent {agent.name!r} removed peer {peer.name!r}", event="remove_peer", agent=agent.name,
          peer=peer.name, generation=peer.generation)


def _path(agent: Agent, peer: Peer) -> str | None:
    """The backend's word on the path to ``peer``, where it has one (``peer_path``)."""
    ask = getattr(agent.backend, "peer_path", None)
    if not callable(ask):
        return None
    try:
        where = ask(peer.name)
    except Exception:  # a log line must never fail add_peer
        return None
    if isinstance(where, tuple):
        return ": ".join(str(w) for w in where if w)
    return str(where) if where else None


def _mode(peer: Peer) -> str:
    """``whole-row``, ``split`` or ``mixed`` once both caches are known; else why not yet."""
    pairing = peer.pairing
    if pairing is None:
        return "not yet known (a cache is not registered on both sides)"
    mode = getattr(pairing, "mode", None)
    return str(mode() if callable(mode) else mode) if mode is not None else type(pairing).__name__


def unknown_peer_message(name: object, known: Mapping[str, object]) -> str:
    """Why ``name`` names no peer: short, even when it is a whole metadata blob."""
    listed = ", ".join(sorted(known)) or "none"
    if isinstance(name, (bytes, bytearray, memoryview)):
        return (f"a peer is named by the str add_peer() returned, not by its metadata ({len(name)} bytes); "
                f"call peer = agent.add_peer(metadata) and pass peer (known peers: {listed})")
    if not isinstance(name, str):
        return f"a peer is named by a str, got {type(name).__name__} (known peers: {listed})"
    shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
    return f"unknown peer {shown}; add it with add_peer(metadata) first (known peers: {listed})"
