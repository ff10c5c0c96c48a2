"""What an :class:`~kvxfer.owner.Owner` knows about one peer as its callers name it (a route).

Kept apart from the owner's loop: a route is plain state (how to fetch the peer's metadata,
the peer's own queue, what it holds against its admission bound) that the loop reads and
writes on its thread, and that submitters read under the owner's lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .errors import (BackendError, HandshakeError, PeerDisconnectedError, StalePeerError, TransferTimeoutError,
                     UnknownPeerError)
from .owned import OwnedFuture, OwnedTransfer

__all__ = ["PeerRoute", "REFRESH_ON"]

#: Failures a peer's restart or death explains: the next transfer fetches its metadata again.
REFRESH_ON = (PeerDisconnectedError, StalePeerError, UnknownPeerError, TransferTimeoutError, BackendError,
              HandshakeError)


@dataclass(eq=False)
class PeerRoute:
    """One peer as callers name it: how to fetch its metadata, its queue, what it holds."""

    key: str
    fetch: Callable[[], bytes] | None = None
    expect: str | None = None
    peer: str | None = None  # the agent's name for it, once added
    fetching: bool = False
    generation: int = 0  # of the handshake in progress; older results are dropped
    queue: deque[OwnedTransfer] = field(default_factory=deque)
    waiters: list[OwnedFuture[str]] = field(default_factory=list)
    held: int = 0  # queued + in flight, for admission (under the owner's lock)

    @property
    def ready(self) -> bool:
        return self.peer is not None and not self.fetching
