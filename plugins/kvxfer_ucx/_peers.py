"""What the UCX backend keeps per connected peer (a posted transfer is the loop's :class:`kvxfer.plugin.Post`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from kvxfer.plugin import Post, SpanIndex

from ._hostpage import PeerPage, ProcessWatch
from ._worker import Worker

__all__ = ["COPY", "RMA", "Peer"]

#: The two data paths' names (``peer_path``, ``TransferStats.path``).
COPY, RMA = "same-host-copy", "ucx-rma"


@dataclass(eq=False)
class Peer:
    name: str
    ep: int
    spans: SpanIndex  # the allocations its blob advertises
    rkeys: np.ndarray  # unpacked remote key per allocation (RMA path only)
    page: PeerPage | None  # set: the same-host path, with the proof it rests on
    reason: str
    watch: ProcessWatch | None  # set when its metadata says it runs on this host
    failed: int | None = None  # ucs_status once the peer is known dead
    closed: bool = False  # removed or replaced
    connected: bool = True  # endpoint still open
    why: str = ""  # why it counts as failed, when the status alone does not say
    w: Worker | None = None  # the worker its endpoint lives on (RMA peers: a worker of their own)
    xfers: "weakref.WeakSet[Post]" = field(default_factory=weakref.WeakSet)  # posted, maybe in flight
    bound: PeerPage | None = None  # the page its registrations are proven by, on either path (same host)

    @property
    def path(self) -> str:
        return COPY if self.page is not None else RMA

