"""The device path: VRAM to VRAM between peers of one host, without the transport.

A backend holds one :class:`DevicePath` and calls it at the same points of the seam where it
calls its transport: ``register`` (export IPC handles), ``blob`` (appended to its connection
blob), ``add_peer`` (decide the route, open the peer's handles once), ``prepare`` (check and
translate a list once), ``post``/``poll``/``release`` (one batched copy per post, completion
from a CUDA event: :mod:`kvxfer.cuda.completion`). Where the route is not direct, or a list
cannot be proven to lie inside what the peer exported, ``prepare`` returns ``None`` and the
transport carries the bytes.

Bounds: every span of a remote list is looked up with :class:`~kvxfer.spans.SpanIndex` in
the allocations the peer exported (or, for a peer of this process, in what it registered
right now) and translated to where its handle is mapped here; a span outside them disables
the path for that list. An export is opened only once its exporter has vouched for it: the
exporter's proof page (:mod:`kvxfer.peers`) must list the digest of the very bytes received,
so a forwarded export that was widened, or a handle that claims another process's identity,
is refused with :class:`~kvxfer.errors.IdentityError` before any handle is opened.
Liveness: a pidfd on the peer process; a dead peer turns the next post or poll into
:class:`~kvxfer.errors.PeerDisconnectedError` and unmaps its handles.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import BackendError, IdentityError, MetadataError, PeerDisconnectedError, StalePeerError
from ..memory import Allocation, DescriptorList, MemoryKind, Op
from ..peers import ProofUnavailable
from ..plugin.live import Live
from ..spans import SpanIndex, merge_runs
from . import blob
from .completion import Completion, PathXfer
from .decide import CUDA_IPC, SAME_PROCESS, Capability, DeviceRoute, decide

__all__ = ["DevicePath", "Listed", "DeviceSpans", "PathXfer", "ENGINES", "COPY_ON"]

ENGINES = ("auto", "sm", "ce")
COPY_ON = ("local", "peer")
_live: "Live[DevicePath]" = Live()  # same-process peers (kvxfer.plugin.live)


class Listed(Protocol):
    """A backend's prepared list, as the device path's row looks at it."""

    device: "DeviceSpans | None"  # what DevicePath.prepare returned for it (None: the transport carries it)


@dataclass(eq=False)
class DeviceSpans:
    """A prepared list as the device path sees it: local addresses, lengths, local GPU."""

    addr: np.ndarray
    nbytes: np.ndarray
    device: np.ndarray
    peer: str | None
    epoch: int
    one_device: int = -1  # the GPU of every span when they share one (the usual case), else -1

    def __post_init__(self) -> None:
        if self.device.shape[0] and int(self.device.min()) == int(self.device.max()):
            self.one_device = int(self.device[0])


@dataclass(eq=False)
class _Peer:
    key: str
    route: DeviceRoute
    epoch: int
    export: blob.Export | None = None
    proc: Any = None
    mappings: dict[int, Any] = field(default_factory=dict)  # handle index -> mapping
    index: SpanIndex | None = None
    local_base: np.ndarray | None = None  # per exported allocation: local address of its first byte
    device: np.ndarray | None = None  # per exported allocation: local GPU
    other: "weakref.ReferenceType[DevicePath] | None" = None
    dead: bool = False


class DevicePath(Completion):
    """Same-host VRAM copies for one backend instance. Options (from the backend):

    ``enabled`` turns the path off entirely; ``engine`` picks ``"sm"`` (copy kernel), ``"ce"``
    (copy engines) or ``"auto"`` (the kernel, or the copy engines where it cannot load);
    ``copy_on`` runs the copy on this side's GPU (``"local"``: READ pulls, WRITE pushes; the
    peer's handles are opened in that GPU's context, as UCX's cuda_ipc does) or on the peer's
    GPU (``"peer"``: handles opened where the memory lives).
    """

    def __init__(self, *, enabled: bool = True, engine: str = "auto", copy_on: str = "local",
                 capability: Capability | None = None) -> None:
        if engine not in ENGINES:
            raise BackendError(f"device path engine must be one of {ENGINES}, not {engine!r}")
        if copy_on not in COPY_ON:
            raise BackendError(f"device path copy_on must be one of {COPY_ON}, not {copy_on!r}")
        self.enabled, self.engine, self.copy_on = bool(enabled), engine, copy_on
        self._cap_given = capability
        self._cap: Capability | None = capability
        self.instance = os.urandom(16)
        self._regs: dict[int, tuple[tuple[Allocation, ...], Any]] = {}
        self._next_reg = 0
        self._peers: dict[str, _Peer] = {}
        self._epoch = 0
        self._lock = threading.RLock()
        self._closed = False
        _live[self.instance] = self

    # -- capability ----------------------------------------------------------------------
    @property
    def cap(self) -> Capability:
        if self._cap is None:
            from .capability import cuda_capability

            self._cap = cuda_capability()
        return self._cap

    # -- local memory --------------------------------------------------------------------
    def register(self, allocations: Sequence[Allocation]) -> int:
        """Remember the allocations; export the VRAM ones as IPC handles. Returns a token."""
        allocs = tuple(allocations)
        exported = None
        if self.enabled and any(a.kind is MemoryKind.VRAM for a in allocs) and self.cap.why_not() is None:
            exported = self.cap.export(allocs)
        with self._lock:
            self._next_reg += 1
            self._regs[self._next_reg] = (allocs, exported)
            if exported is not None:
                self._vouch()
            return self._next_reg

    def deregister(self, token: int) -> None:
        with self._lock:
            allocs, exported = self._regs.pop(token, ((), None))
            if exported is not None:
                self._vouch()
        if exported is not None:
            exported.close()

    def _vouch(self) -> None:
        """List the digest of the current export in this process's proof page (and no older one:
        an export from before a deregistration no longer opens)."""
        raw = self.blob()
        if blob.decode(raw).empty:
            self.cap.page().drop(self.instance)
        else:
            self.cap.page().set(self.instance, digests=[blob.digest(raw)])

    def vram(self) -> tuple[Allocation, ...]:
        with self._lock:
            return tuple(a for allocs, _ in self._regs.values() for a in allocs if a.kind is MemoryKind.VRAM)

    def exporting(self) -> bool:
        """Whether any registration was exported (a peer then has handles to open)."""
        with self._lock:
            return any(ex is not None for _, ex in self._regs.values())

    def export_errors(self) -> list[str]:
        return [e for _, ex in self._regs.values() if ex is not None for e in ex.errors]

    def blob(self) -> bytes:
        """This side's export, for the backend's connection blob (identity even when empty)."""
        devices: list[bytes] = []
        handles, chunks, allocs = [], [], []
        with self._lock:
            regs = [ex for _, ex in self._regs.values() if ex is not None]
        for ex in regs:
            dmap = []
            for u in ex.devices:
                if u not in devices:
                    devices.append(u)
                dmap.append(devices.index(u))
            h0, c0 = len(handles), len(chunks)
            handles += [(k, dmap[d], b, s, f + c0, n) for k, d, b, s, f, n in ex.handles]
            chunks += ex.chunks
            allocs += [(a, n, h + h0) for a, n, h in ex.allocs]
        # Without exports there is nothing to open: say who we are, but not where (no boot id).
        ident = self.cap.identity() if devices else dataclasses.replace(self.cap.identity(), boot_id=b"")
        return blob.encode(blob.Export(ident, self.instance, tuple(devices),
                                       np.array(handles, dtype=blob.HANDLE), _chunks(chunks),
                                       np.array(allocs, dtype=blob.ALLOC)))

    # -- peers ---------------------------------------------------------------------------
    def add_peer(self, key: str, peer_blob: bytes) -> DeviceRoute:
        """Decide the route to a peer and open its handles; a known key is replaced (restart)."""
        exp = blob.decode(peer_blob)  # MetadataError on anything malformed
        self.remove_peer(key)
        other = _live.find(exp.instance, exp.identity.token, self.cap.identity().token)
        same = other is not None and other is not self and not other._closed
        local_devices = sorted({a.device for a in self.vram()})
        try:
            route = decide(self.cap.identity(), exp, local_devices, self.cap, enabled=self.enabled,
                           same_process_peer=same)
        except (OSError, BackendError) as exc:  # a CUDA query failed: the transport stays in charge
            route = DeviceRoute(None, f"the device path could not check this peer: {exc}")
        with self._lock:
            self._epoch += 1
            p = _Peer(key, route, self._epoch, export=exp)
        if route.kind == SAME_PROCESS:
            p.other = weakref.ref(other)  # type: ignore[arg-type]
        elif route.kind == CUDA_IPC:
            why = self._vouched(key, exp, bytes(peer_blob))
            if why:
                p.route = DeviceRoute(None, why)
        if p.route.kind == CUDA_IPC:
            try:
                self._open(p, exp, local_devices)
            except (OSError, BackendError, MetadataError) as exc:
                self._close_mappings(p)
                p.route = DeviceRoute(None, f"the peer's handles did not open here: {exc}")
        with self._lock:
            self._peers[key] = p
        return p.route

    def _vouched(self, key: str, exp: blob.Export, raw: bytes) -> str:
        """Raise :class:`IdentityError` unless the exporter itself vouches for these bytes.

        Returns an empty string when it does, else why it could not be asked (ptrace rules,
        or the exporter is gone): the transport then carries the bytes."""
        what = f"device-path export of peer {key!r}"
        try:
            proven = self.cap.prove(exp.identity, what)
        except ProofUnavailable as exc:
            return f"the exporter's identity cannot be proven here: {exc}"
        except PeerDisconnectedError as exc:
            return str(exc)
        if blob.digest(raw) not in proven.digests:
            raise IdentityError(f"{what}: process {exp.identity.pid} does not vouch for this export (it was "
                                "changed on its way, names another process, or predates its latest registration); "
                                "add the peer's fresh metadata")
        return ""

    def _open(self, p: _Peer, exp: blob.Export, local_devices: list[int]) -> None:
        p.proc = self.cap.peer_process(exp.identity.pid, exp.identity.start_time)
        devices = np.asarray(p.route.devices, dtype=np.int64)
        hdev = devices[exp.handles["device"].astype(np.int64)]
        for h in range(exp.handles.shape[0]):
            ctx = local_devices[0] if self.copy_on == "local" and local_devices else int(hdev[h])
            p.mappings[h] = self.cap.open(exp, h, ctx, local_devices, p.proc)
        mapped = np.array([p.mappings[h].local for h in range(exp.handles.shape[0])], dtype=np.uint64)
        sizes = np.array([p.mappings[h].size for h in range(exp.handles.shape[0])], dtype=np.uint64)
        hi = exp.allocs["handle"].astype(np.int64)
        off = exp.allocs["address"] - exp.handles["base"][hi]
        if ((off + exp.allocs["nbytes"]) > sizes[hi]).any():
            raise MetadataError("an exported allocation runs past what its handle mapped")
        p.index = SpanIndex(Allocation(int(a), int(n), MemoryKind.VRAM, 0)
                            for a, n in zip(exp.allocs["address"], exp.allocs["nbytes"]))
        p.local_base = mapped[hi] + off
        p.device = hdev[hi]
        p.route = DeviceRoute(CUDA_IPC, "same host: peer handles opened", p.route.devices)

    def route(self, key: str) -> DeviceRoute | None:
        p = self._peers.get(key)
        return None if p is None else p.route

    def remove_peer(self, key: str) -> None:
        """Forget a peer: wait for copies that may touch its memory, then unmap its handles."""
        with self._lock:
            p = self._peers.pop(key, None)
        if p is not None:
            self._teardown(p, "removed")

    def _teardown(self, p: _Peer, why: str) -> None:
        with self._lock:
            if p.dead:
                return
            p.dead = True
            if p.mappings:
                self.cap.sync_all()
            self._close_mappings(p)
            if p.proc is not None:
                p.proc.close()
                p.proc = None
            p.route = DeviceRoute(None, f"peer {why}")

    def _close_mappings(self, p: _Peer) -> None:
        for m in p.mappings.values():
            self.cap.close(m)
        p.mappings.clear()

    def _alive(self, p: _Peer) -> None:
        if p.dead:
            raise PeerDisconnectedError(f"peer {p.key!r} is gone ({p.route.reason}); add it again once it is back")
        if p.proc is not None and not p.proc.alive():
            self._teardown(p, "process exited")
            raise PeerDisconnectedError(f"peer {p.key!r} exited; its CUDA IPC handles were closed")

    # -- lists ---------------------------------------------------------------------------
    def prepare(self, key: str | None, descs: DescriptorList) -> DeviceSpans | None:
        """Check and translate a VRAM list once; ``None`` means the transport must carry it."""
        if not self.enabled or descs.kind is not MemoryKind.VRAM:
            return None
        flat = descs.expand().array
        addr, n, dev = flat[:, 0], flat[:, 1], flat[:, 2]
        if key is None:
            ok = SpanIndex(self.vram()).find(addr, n, dev, MemoryKind.VRAM) >= 0
            return DeviceSpans(addr.copy(), n.copy(), dev.astype(np.int64), None, 0) if ok.all() else None
        p = self._peers.get(key)
        if p is None or not p.route.direct or p.dead:
            return None
        if p.route.kind == SAME_PROCESS:
            other = p.other() if p.other is not None else None
            if other is None or other._closed:
                return None
            ok = SpanIndex(other.vram()).find(addr, n, dev, MemoryKind.VRAM) >= 0
            return DeviceSpans(addr.copy(), n.copy(), dev.astype(np.int64), key, p.epoch) if ok.all() else None
        assert p.index is not None and p.local_base is not None and p.device is not None
        slot = p.index.find(addr, n, 0, MemoryKind.VRAM)
        if (slot < 0).any():
            return None
        start = np.asarray([a.address for a in p.index.allocations], dtype=np.uint64)
        local = p.local_base[slot] + (addr - start[slot])
        return DeviceSpans(local, n.copy(), p.device[slot].astype(np.int64), key, p.epoch)

    # -- transfers -----------------------------------------------------------------------
    def post(self, op: Op, local: DeviceSpans, li: np.ndarray, remote: DeviceSpans, ri: np.ndarray,
             expect: Any = None) -> PathXfer:
        """One batched copy per GPU pair (usually exactly one) on the copier's private stream.

        ``expect`` (uint64, one mm8 digest per descriptor pair, of the source's bytes) makes it
        a verified post: one launch of the fused kernel copies every descriptor and hashes what
        it moves (kvxfer/cuda/digest.py), and completion compares the two, so the bytes are read
        once; a mismatch is :class:`IntegrityError`. Where the kernel cannot serve (a span off a
        16-byte boundary, descriptors on several GPU pairs) the post is a plain copy and
        ``verified`` stays False: the caller's own check after DONE still runs. ``expect`` may
        also carry its digests as ``values`` and name a mismatch with ``error(bad)`` (the core's
        :class:`kvxfer.integrity.fused.Pieces`: block and member, as the check after DONE does)."""
        p = self._peers.get(remote.peer or "")
        if p is None or p.epoch != remote.epoch:
            raise StalePeerError(f"the list was prepared for {remote.peer!r}, which was removed or re-added since")
        la, ln = local.addr[li], local.nbytes[li]
        ra, rn = remote.addr[ri], remote.nbytes[ri]
        if ln.shape != rn.shape or not (ln == rn).all():
            raise BackendError("paired descriptors differ in length")
        if local.one_device >= 0 and remote.one_device >= 0:
            ld, rd = local.one_device, remote.one_device  # no per-descriptor device work
            groups = [(la, ra, ln, ld, rd) if op is Op.READ else (ra, la, ln, rd, ld)] if ln.shape[0] else []
        elif op is Op.READ:
            groups = _by_device_pair(la, ra, ln, local.device[li], remote.device[ri])
        else:
            groups = _by_device_pair(ra, la, ln, remote.device[ri], local.device[li])
        handles = []
        with self._lock:
            self._alive(p)
            if expect is not None and len(groups) == 1:
                d, s, n, dd, sd = groups[0]
                run_on = (dd if op is Op.READ else sd) if self.copy_on == "local" else (sd if op is Op.READ else dd)
                h = self.cap.copy_mm8(d, s, n, run_on, sd, dd)  # every descriptor its own cell: no merging
                if h is not None:
                    values = np.asarray(getattr(expect, "values", expect), np.uint64).reshape(-1)
                    return PathXfer(p, [h], p.route.kind or "", expect=values, describe=getattr(expect, "error", None))
            for d, s, n, dd, sd in groups:
                d, s, n = merge_runs(d, s, n)
                mine = dd if op is Op.READ else sd
                run_on = mine if self.copy_on == "local" else (sd if op is Op.READ else dd)
                handles.append(self.cap.copy(d, s, n, run_on, self._engine(dd, sd, run_on), sd, dd))
        return PathXfer(p, handles, p.route.kind or "")

    # -- the DataPath row (kvxfer.plugin.datapath): a backend lists this object among its paths --
    sends_notification = False  # the backend sends it once poll() reported the copy done

    @staticmethod
    def serves(local: Listed, remote: Listed) -> bool:
        """Both lists were taken by :meth:`prepare` (a backend keeps its result as ``.device``)."""
        return local.device is not None and remote.device is not None

    def start(self, op: Op, local: Listed, li: np.ndarray, remote: Listed, ri: np.ndarray, peer: str,
              notification: bytes | None, expect: Any = None) -> PathXfer:
        assert local.device is not None and remote.device is not None
        return self.post(op, local.device, li, remote.device, ri, expect)

    @staticmethod
    def kind(x: PathXfer) -> str:
        return x.kind  # CUDA_IPC or SAME_PROCESS

    def _engine(self, dst_dev: int, src_dev: int, run_on: int) -> str:
        eng = self.engine
        if eng == "auto":  # the kernel won or tied everywhere measured (BENCHMARKS.md)
            eng = "sm"
        if eng == "sm" and self.cap.kernel_error(run_on) is not None:
            eng = "ce"
        return eng

    def close(self) -> None:
        if self._closed:
            return
        for key in list(self._peers):
            self.remove_peer(key)
        for token in list(self._regs):
            self.deregister(token)
        self._closed = True
        if self._cap is not None or self._cap_given is not None:
            self.cap.page().drop(self.instance)
        _live.pop(self.instance, None)


def _by_device_pair(dst: np.ndarray, src: np.ndarray, n: np.ndarray, ddev: np.ndarray,
                    sdev: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]]:
    """Split a post by (destination GPU, source GPU); almost always a single group."""
    if ddev.shape[0] == 0:
        return []
    if (ddev == ddev[0]).all() and (sdev == sdev[0]).all():
        return [(dst, src, n, int(ddev[0]), int(sdev[0]))]
    pair = ddev.astype(np.int64) * 65536 + sdev.astype(np.int64)
    out = []
    for v in np.unique(pair):
        m = pair == v
        out.append((dst[m], src[m], n[m], int(v // 65536), int(v % 65536)))
    return out


def _chunks(rows: list[tuple[int, int, bytes]]) -> np.ndarray:
    out = np.zeros(len(rows), dtype=blob.CHUNK)
    for i, (off, size, payload) in enumerate(rows):
        out[i] = (off, size, payload)
    return out

