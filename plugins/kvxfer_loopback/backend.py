"""Loopback: peers are other agents in this process; a transfer is a memory copy.

Design points:

* Peers find each other through the process-wide registry (:class:`kvxfer.plugin.Live`)
  keyed by a random token carried in the metadata blob beside this process's identity
  (:mod:`kvxfer.plugin.identity`), so a blob from another process, a forged identity or a
  closed agent is rejected with a typed error instead of dereferencing foreign addresses.
* Every prepared list is checked against the memory the owner has registered *now*: the
  check is repeated at post time if either side registered or deregistered since, so a
  write into deregistered memory fails instead of corrupting the heap.
* The post loop is :class:`kvxfer.plugin.PathBackend`'s; this module fills its ``route`` hook
  with the checks above. Bytes move through two rows (:mod:`kvxfer_loopback._rows`):
  host copies are ``ctypes.memmove`` per descriptor (the planner coalesces runs first, since
  this backend declares ``merges_runs=False``); CUDA copies go through torch, imported only
  when VRAM is posted, and complete asynchronously on a private stream. Each row queues the
  notification in the receiver itself, behind its copy, so it never overtakes the data.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvxfer import (Allocation, BackendClosedError, Capabilities, DescriptorList, MemoryKind, MetadataError, Op,
                    PeerDisconnectedError, UnknownPeerError, UnsupportedError)
from kvxfer.plugin import DataPath, Live, PathBackend, SpanIndex, identity as peers, wire

from ._rows import DeviceCopy, HostCopy, _Note
from ._rows import _host_copy, _Xfer  # noqa: F401  (the conformance kit's mutants, tests/conformance_mutants.py)

_LIVE: "Live[LoopbackBackend]" = Live()


def _torch_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@dataclass
class _Prepared:
    owner: "LoopbackBackend"
    descs: np.ndarray  # N x 3 uint64
    kind: MemoryKind
    epoch: int


class LoopbackBackend(PathBackend):
    """Moves bytes between agents of one process."""

    name = "loopback"
    capabilities = Capabilities(
        memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}),
        merges_runs=False,
        cheap_prepare=True,
        cross_process=False,
    )

    def __init__(self, agent_name: str, **options: Any) -> None:
        super().__init__(agent_name, **options)  # the core refuses any option: loopback takes none
        self._token = secrets.token_hex(16)
        self._regs: dict[int, tuple[Allocation, ...]] = {}
        self._ids = itertools.count(1)
        self._bounds = SpanIndex()
        self._epoch = 0
        self._peers: dict[str, LoopbackBackend] = {}
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self._pending: list[_Note] = []  # behind device copies still running, in post order
        self._inbox_lock = threading.Lock()
        self._closed = False
        self._host, self._device = HostCopy(self), DeviceCopy(self)
        self.paths: tuple[DataPath, ...] = (self._host, self._device)
        _LIVE[self._token] = self

    # -- memory ---------------------------------------------------------------------------
    def register(self, allocations: Sequence[Allocation]) -> int:
        h = next(self._ids)
        self._regs[h] = tuple(allocations)
        self._rebuild_bounds()
        return h

    def deregister(self, handle: Any) -> None:
        self._regs.pop(handle, None)
        self._rebuild_bounds()

    def _rebuild_bounds(self) -> None:
        self._bounds = SpanIndex(a for allocs in self._regs.values() for a in allocs)
        self._epoch += 1

    def _check_inside(self, descs: np.ndarray, kind: MemoryKind) -> None:
        """Every span must lie inside one allocation registered here (deregistered memory is not)."""
        self._bounds.check(descs, kind, f"agent {self.agent_name!r}")

    # -- peers ----------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        self._check_open()
        return json.dumps({"token": self._token, "identity": peers.encode(peers.here()).hex()}).encode()

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        doc = wire.keys(wire.load_json(blob, "loopback blob", limit=512), {"token", "identity"},  # ours: ~180 bytes
                        "loopback blob")
        token = wire.text(doc["token"], "loopback blob: token", 64)
        ident = wire.text(doc["identity"], "loopback blob: identity", 2 * peers.IDENTITY.size)
        try:
            claim = peers.decode(bytes.fromhex(ident), "loopback blob")
        except ValueError:
            raise MetadataError("loopback blob: identity is not hex") from None
        if claim.pid != os.getpid():
            raise UnsupportedError("loopback peers must live in the same process; use the nixl or ucx backend "
                                   "between processes")
        peers.check_this_process(claim, f"loopback metadata of {peer_name!r}")
        peer = _LIVE.find(token, claim.token, peers.here().token)
        if peer is None or peer._closed:
            raise PeerDisconnectedError(f"loopback peer {peer_name!r} is gone (closed or restarted)")
        self._peers[peer_name] = peer

    def remove_remote(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def _live_peer(self, name: str) -> "LoopbackBackend":
        peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeerError(f"loopback: unknown peer {name!r}")
        if peer._closed:
            raise PeerDisconnectedError(f"loopback peer {name!r} was closed")
        return peer

    # -- lists and transfers --------------------------------------------------------------
    def prepare(self, peer: str | None, descs: DescriptorList) -> _Prepared:
        self._check_open()
        owner = self if peer is None else self._live_peer(peer)
        arr = descs.expand().array
        owner._check_inside(arr, descs.kind)
        return _Prepared(owner, arr, descs.kind, owner._epoch)

    # -- transfers: PathBackend's loop over the two rows; route() is its one hook ---------
    def route(self, op: Op, local: _Prepared, remote: _Prepared) -> tuple[DataPath, "LoopbackBackend", None]:
        """Refuse a post on a closed backend, to a closed peer, or over a list whose owner's
        registrations changed since it no longer fits (the row checks the pairs' lengths, given
        the indices); a pair with VRAM takes the device row."""
        if self._closed:  # checks inlined: a small READ's post is the hot path (issue 37)
            self._check_open()
        peer = remote.owner
        if peer._closed:
            raise PeerDisconnectedError(f"loopback peer {peer.agent_name!r} was closed")
        for prep in (local, remote):
            if prep.epoch != prep.owner._epoch:  # registrations changed since prepare
                prep.owner._check_inside(prep.descs, prep.kind)
                prep.epoch = prep.owner._epoch
        if local.kind is MemoryKind.DRAM and remote.kind is MemoryKind.DRAM:
            return self._host, peer, None
        return self._device, peer, None

    def data_path(self, xfer: Any) -> str | None:
        return None  # loopback names no path in TransferStats (as before it ran on PathBackend)

    # -- notifications --------------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        p = self._live_peer(peer)
        with p._inbox_lock:  # queued behind earlier transfers' notifications: order is kept
            p._pending.append(_Note(self.agent_name, bytes(message)))

    def drain_notifications(self) -> dict[str, list[bytes]]:
        with self._inbox_lock:
            while self._pending and (self._pending[0].event is None or self._pending[0].event.query()):
                note = self._pending.pop(0)
                if not note.cancelled:
                    self._inbox[note.sender].append(note.message)
            out = dict(self._inbox)
            self._inbox.clear()
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError("loopback backend is closed")

    def close(self) -> None:
        super().close()  # the loop's pump (never started: the rows send their notifications)
        self._closed = True
        self._regs.clear()
        self._rebuild_bounds()
        self._peers.clear()
        _LIVE.pop(self._token, None)

