"""Keep an agent's peers in step with the directory: add arrivals, refresh restarts, drop leavers.

An :class:`~kvxfer.Agent` is not thread-safe, and the watch calls back from its own thread.
So the tracker only *notes* that something changed; :meth:`PeerTracker.sync` applies the
directory's current view to the agent in the caller's thread (before a transfer, or in the
engine's loop). It works on the whole view, not on single events, so an event missed or
repeated during an outage cannot leave the agent wrong: it converges on what the directory
lists. While the store is unreachable the last view stays, so transfers with live peers go on.

One exception to "the directory wins": an *older* generation than the agent holds. Where
records or metadata are signed, the newer one is genuine and the older record an old
incarnation written back, so it is refused (reported once in :attr:`SyncResult.failed`, the
newer peer kept). Unsigned, the held generation may itself be the forgery, and the directory's
view wins, so that one forged write cannot lock a worker out (RELIABILITY.md, defect 13).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import KvxferError, StalePeerError
from .base import Directory
from .entry import Entry, Event

__all__ = ["PeerTracker", "SyncResult"]

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """What one :meth:`PeerTracker.sync` did, by agent name."""

    added: list[str] = field(default_factory=list)
    refreshed: list[str] = field(default_factory=list)  # restarted: old connection dropped, new one added
    removed: list[str] = field(default_factory=list)
    failed: dict[str, KvxferError] = field(default_factory=dict)  # left out: the entry did not add

    def __bool__(self) -> bool:
        return bool(self.added or self.refreshed or self.removed or self.failed)


class PeerTracker:
    """Follow the workers of ``role`` (at ``tp_rank``/``pp_rank``, when given) as peers of ``agent``.

    Peers the agent knew before the tracker started are left alone; the tracker removes only
    peers it added.
    """

    def __init__(self, agent: Any, directory: Directory, *, role: str | None = None, tp_rank: int | None = None,
                 pp_rank: int | None = None, timeout: float | None = None) -> None:
        self.agent, self.directory = agent, directory
        self.role, self.tp_rank, self.pp_rank = role, tp_rank, pp_rank
        self._managed: dict[str, Entry] = {}
        self._failed: dict[str, int] = {}  # name -> generation whose add_peer failed (not retried)
        self._stale: dict[str, int] = {}  # name -> older generation already reported as written back
        self._changed = threading.Event()
        self._changed.set()
        self._sub = directory.watch(self._on_event, role=role)
        directory.snapshot(timeout=timeout)  # wait for the first listing (typed error if unreachable)

    def _on_event(self, event: Event) -> None:
        e = event.entry
        if e.matches(self.role, self.tp_rank, self.pp_rank):
            self._changed.set()

    def _authentic(self) -> bool:
        """Whether a generation the agent holds is its worker's own: records signed with the
        directory's token, or metadata signed with the agent's (no writer without it can forge one)."""
        return self.directory.signed or bool(getattr(self.agent.backend, "peers_authenticated", False))

    def wait_changed(self, timeout: float) -> bool:
        """Block until the directory reported a change since the last :meth:`sync` (or time out)."""
        return self._changed.wait(timeout)

    @property
    def peers(self) -> dict[str, Entry]:
        """Directory entries of the peers this tracker added, by agent name."""
        return dict(self._managed)

    def sync(self) -> SyncResult:
        """Apply the directory's current view to the agent (call from the agent's thread)."""
        self._changed.clear()
        want = {e.name: e for e in self.directory.snapshot(self.role, self.tp_rank, self.pp_rank)
                if e.name != self.agent.name}
        result = SyncResult()
        known = self.agent.peers
        for name in list(self._managed):
            if name not in want:
                del self._managed[name]
                if name in known:
                    try:
                        self.agent.remove_peer(name)
                    except KvxferError as exc:
                        log.warning("dropping peer %s: %s", name, exc)
                result.removed.append(name)
        for name, e in want.items():
            peer = known.get(name)
            if peer is not None and peer.generation == e.generation:
                self._managed.setdefault(name, e)
                continue
            if peer is not None and name not in self._managed:
                continue  # added by someone else: not ours to replace
            if self._failed.get(name) == e.generation:
                continue  # this generation was refused already; a restart gets a new chance
            if peer is not None and e.generation < peer.generation:
                if self._authentic():
                    # Signed, the newer generation is the worker's own: the older record is an old
                    # incarnation's, written back (a replay). Keep the newer peer; report it once.
                    if self._stale.get(name) != e.generation:
                        self._stale[name] = e.generation
                        result.failed[name] = StalePeerError(
                            f"the directory lists generation {e.generation} of {name!r}, older than the "
                            f"{peer.generation} this agent holds: an old record written back; kept the newer one")
                        log.warning("ignoring an older record of peer %s: %s", name, result.failed[name])
                    continue
                # Unsigned, the held generation may be a forgery (a huge generation written
                # before the genuine worker published again). The directory's current view wins;
                # otherwise one write would lock the worker out for good (StalePeerError on each record).
                try:
                    self.agent.remove_peer(name)
                except KvxferError as exc:
                    log.warning("dropping peer %s before re-adding an older generation: %s", name, exc)
            try:
                self.agent.add_peer(e.metadata)
            except KvxferError as exc:  # one bad record must not keep the others out
                result.failed[name] = exc
                self._failed[name] = e.generation
                log.warning("cannot add peer %s from the directory: %s", name, exc)
                continue
            self._failed.pop(name, None)
            self._managed[name] = e
            (result.refreshed if peer is not None else result.added).append(name)
        return result

    def close(self) -> None:
        """Stop following (the peers stay added)."""
        self._sub.cancel()
