"""Loopback: peers are other agents in this process; a transfer is a memory copy.

Design points:

* Peers find each other through the process-wide registry (:class:`kvxfer.plugin.Live`)
  keyed by a random token carried in the metadata blob beside this process's identity
  (:mod:`kvxfer.plugin.identity`), so a blob from another process, a forged identity or a
  closed agent is rejected with a typed error instead of dereferencing foreign addresses.
* Every prepared list is checked against the memory the owner has registered *now*: the
  check is repeated at post time if either side registered or deregistered since, so a
  write into deregistered memory fails instead of corrupting the heap.
* Host copies are ``ctypes.memmove`` per descriptor (the planner coalesces runs first, since
  this backend declares ``merges_runs=False``). CUDA copies go through torch, imported only
  when VRAM is registered, and complete asynchronously on a private stream.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import secrets
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvxfer import (Allocation, Backend, BackendClosedError, BackendError, Capabilities, DescriptorList, MemoryKind,
                    MetadataError, Op, PeerDisconnectedError, UnknownPeerError, UnsupportedError)
from kvxfer.plugin import Live, SpanIndex, copies, identity as peers, install_hint, wire

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


@dataclass
class _Note:
    """A notification waiting for its device copy; the *receiver* releases it when the copy is done."""

    sender: str
    message: bytes
    event: Any = None
    cancelled: bool = False


@dataclass
class _Xfer:
    event: Any = None  # torch.cuda.Event for device copies
    note: _Note | None = None
    done: bool = False
    keepalive: list[Any] = field(default_factory=list)


class LoopbackBackend(Backend):
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
        self._stream: Any = None
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

    def post(self, op: Op, local: _Prepared, local_idx: np.ndarray, remote: _Prepared, remote_idx: np.ndarray,
             notification: bytes | None) -> _Xfer:
        self._check_open()
        peer = remote.owner
        if peer._closed:
            raise PeerDisconnectedError(f"loopback peer {peer.agent_name!r} was closed")
        for prep in (local, remote):
            if prep.epoch != prep.owner._epoch:  # registrations changed since prepare
                prep.owner._check_inside(prep.descs, prep.kind)
                prep.epoch = prep.owner._epoch
        la, ra = local.descs[local_idx], remote.descs[remote_idx]
        if not np.array_equal(la[:, 1], ra[:, 1]):
            raise BackendError("paired descriptors differ in length")
        dst, src = (la, ra) if op is Op.READ else (ra, la)
        dkind, skind = (local.kind, remote.kind) if op is Op.READ else (remote.kind, local.kind)
        x = _Xfer()
        if dkind is MemoryKind.DRAM and skind is MemoryKind.DRAM:
            _host_copy(dst, src, copies.watcher(self))
            x.done = True
        else:
            x.event, x.keepalive = self._device_copy(dst, dkind, src, skind)
        if notification is not None:
            # Delivered by the receiver once the data is visible, so the receiver never
            # depends on the initiator polling (as with a real one-sided transport).
            x.note = _Note(self.agent_name, bytes(notification), x.event)
            with peer._inbox_lock:
                peer._pending.append(x.note)
        return x

    def _device_copy(self, dst: np.ndarray, dkind: MemoryKind, src: np.ndarray, skind: MemoryKind) -> tuple[Any, list[Any]]:
        try:
            import torch
        except ImportError:
            raise UnsupportedError(f"VRAM copies in the loopback backend need torch: {install_hint('torch')}") from None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        keep: list[Any] = []
        with torch.cuda.stream(self._stream):
            for (da, n, dd), (sa, _, sd) in zip(dst.tolist(), src.tolist()):
                d = _span_tensor(torch, da, n, dd, dkind)
                s = _span_tensor(torch, sa, n, sd, skind)
                d.copy_(s, non_blocking=True)
                keep += (d, s)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return ev, keep

    def poll(self, xfer: _Xfer) -> bool:
        if not xfer.done:
            if not xfer.event.query():
                return False
            xfer.done = True
            xfer.keepalive.clear()
        return True

    def release(self, xfer: _Xfer) -> None:
        if not xfer.done and xfer.event is not None:
            # A device copy cannot be recalled once queued: wait for it so no copy outlives
            # the memory it targets, and drop the notification.
            xfer.event.synchronize()
            if xfer.note is not None:
                xfer.note.cancelled = True
        xfer.keepalive.clear()

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
        self._closed = True
        self._regs.clear()
        self._rebuild_bounds()
        self._peers.clear()
        _LIVE.pop(self._token, None)


def _host_copy(dst: np.ndarray, src: np.ndarray, seen: copies.Watch | None = None) -> None:
    """``seen``: told after each copy (a verified READ hashes the row while it is in the cache)."""
    memmove = ctypes.memmove
    for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), dst[:, 1].tolist()):
        memmove(d, s, n)
        if seen is not None:
            seen(d, n)


class _CudaSpan:
    """Just enough of ``__cuda_array_interface__`` for torch to wrap a raw device pointer."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _span_tensor(torch: Any, ptr: int, n: int, device: int, kind: MemoryKind) -> Any:
    if kind is MemoryKind.VRAM:
        return torch.as_tensor(_CudaSpan(ptr, n), device=f"cuda:{device}")
    buf = (ctypes.c_uint8 * n).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)
