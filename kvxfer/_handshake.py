"""How an :class:`~kvxfer.owner.Owner` reaches a route's peer: fetch its metadata, then add it.

Kept out of the owner's loop module: the fetch is the only blocking call for a peer, so it runs
on a thread of its own, and its result comes back to the loop as an op (``"fetched"``) that is
applied on the loop's thread like any other. A stopped peer thus holds only its own queue.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import HandshakeError, KvxferError, MetadataError
from ._routes import PeerRoute
from .transfer import Status

__all__ = ["start", "fetched"]


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` (and what it was raised from) without tracebacks: their frames hold the fetched
    metadata (``add_peer``'s argument), which would live as long as any transfer's error."""
    e: BaseException | None = exc
    for _ in range(8):
        if e is None:
            break
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def start(owner: Any, route: PeerRoute) -> None:
    """Fetch on a thread of its own: a peer that does not answer holds nobody else."""
    if route.fetch is None:
        return
    route.fetching = True
    route.generation += 1
    gen, fetch = route.generation, route.fetch

    def run() -> None:
        try:
            md, err = fetch(), None
        except BaseException as exc:
            md, err = None, exc
        with owner._lock:
            owner._inbox.append(("fetched", route, gen, md, err))
            owner._kick()

    threading.Thread(target=run, name=f"kvxfer-fetch:{route.key}", daemon=True).start()


def fetched(owner: Any, route: PeerRoute, gen: int, md: bytes | None, err: BaseException | None) -> None:
    """On the loop: add the fetched peer, or fail the route's queue with the typed error."""
    if gen != route.generation:
        return
    route.fetching = False
    if err is None:
        try:
            assert md is not None
            name = owner.agent.add_peer(md, timeout=owner.add_peer_timeout)
            if route.expect is not None and name != route.expect:
                raise MetadataError(f"route {route.key!r} serves agent {name!r}, not {route.expect!r}")
            route.peer = name
        except BaseException as exc:
            err = _without_frames(exc)
        md = None
    if err is not None:
        if not isinstance(err, KvxferError):
            err = HandshakeError(f"fetching metadata of {route.key!r} failed: {type(err).__name__}: {err}")
        route.peer = None
        while route.queue:
            owner._end(route.queue.popleft(), err)
    for w in route.waiters:
        w._finish(Status.DONE, route.peer) if err is None else w._finish(Status.FAILED, None, err)
    route.waiters.clear()
