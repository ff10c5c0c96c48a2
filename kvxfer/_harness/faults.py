"""A fault-injection backend that wraps another one.

It forwards everything to an inner backend and fails on command: a post that never
completes or takes long (to exercise deadlines), a poll that reports the peer gone, a
backend that leaks a foreign exception, an ``add_remote`` that fails half-way. Register it in a test with :func:`install`; it then exists as backend
``"faulty"`` with the option ``inner="loopback"``.

:class:`CorruptingBackend` (backend ``"corrupting"``) damages what a READ delivered, after the
inner transport finished and before the core sees DONE: exactly where a flaky NIC, a GDR
misconfiguration or a reused block would. Kinds: ``flip`` (one bit), ``zero`` (one page),
``swap`` (two blocks' bytes exchanged), ``stale`` (one block keeps what it held before).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .. import Backend, DescriptorList, Op
from ..plugin import RegisterBackend, hookimpl
from ..errors import PeerDisconnectedError
from ..memory import Allocation, MemoryKind
from ..plugin.registry import get_backend_class, plugin_manager, reset_plugins


@dataclass
class Faults:
    """What to break. Counters count down; ``0`` means never."""

    hang_posts: bool = False
    disconnect_on_poll: int = 0
    raise_foreign_on_poll: int = 0
    fail_post: bool = False
    post_delay: float = 0.0  # seconds each post takes (a slow transport inside post)
    add_remote_raises: BaseException | None = None  # raised after the inner backend added the peer
    released: list[Any] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # peer names add_remote was called with
    removed: list[str] = field(default_factory=list)


log = logging.getLogger("kvxfer._harness.faults")

#: What :class:`CorruptingBackend` can do to a delivered READ.
CORRUPTIONS = ("flip", "zero", "swap", "stale")


class FaultyBackend(Backend):
    name = "faulty"

    @property  # type: ignore[override]
    def peers_authenticated(self) -> bool:  # the core sets it on us; the inner backend acts on it
        inner = self.__dict__.get("inner")
        return bool(inner.peers_authenticated) if inner is not None else False

    @peers_authenticated.setter
    def peers_authenticated(self, value: bool) -> None:
        self.inner.peers_authenticated = value

    def __init__(self, agent_name: str, *, inner: str = "loopback", faults: Faults | None = None, **options: Any):
        super().__init__(agent_name)
        self.inner: Backend = get_backend_class(inner)(agent_name, **options)
        self.capabilities = self.inner.capabilities  # type: ignore[misc]
        self.faults = faults or Faults()

    def register(self, allocations: Sequence[Allocation]) -> Any:
        return self.inner.register(allocations)

    def deregister(self, handle: Any) -> None:
        self.inner.deregister(handle)

    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        self.faults.added.append(peer_name)
        self.inner.add_remote(peer_name, blob)
        if self.faults.add_remote_raises is not None:
            raise self.faults.add_remote_raises

    def remove_remote(self, peer: str) -> None:
        self.faults.removed.append(peer)
        self.inner.remove_remote(peer)

    def prepare(self, peer: str | None, descs: DescriptorList) -> Any:
        return self.inner.prepare(peer, descs)

    def release_prepared(self, prepared: Any) -> None:
        self.inner.release_prepared(prepared)

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Any:
        if self.faults.post_delay:
            time.sleep(self.faults.post_delay)
        if self.faults.fail_post:
            raise PeerDisconnectedError("injected: post failed")
        if self.faults.hang_posts:
            return ("hang", None)
        return ("inner", self.inner.post(op, local, local_idx, remote, remote_idx, notification))

    def poll(self, xfer: Any) -> bool:
        f = self.faults
        if f.disconnect_on_poll:
            f.disconnect_on_poll -= 1
            if not f.disconnect_on_poll:
                raise PeerDisconnectedError("injected: peer went away")
        if f.raise_foreign_on_poll:
            f.raise_foreign_on_poll -= 1
            if not f.raise_foreign_on_poll:
                raise OSError("injected: a transport's own exception")
        kind, x = xfer
        return False if kind == "hang" else self.inner.poll(x)

    def release(self, xfer: Any) -> None:
        self.faults.released.append(xfer)
        if xfer[0] == "inner":
            self.inner.release(xfer[1])

    def notify(self, peer: str, message: bytes) -> None:
        self.inner.notify(peer, message)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        return self.inner.drain_notifications()

    def progress(self) -> None:
        self.inner.progress()

    def close(self) -> None:
        self.inner.close()


@dataclass
class Corruption:
    """Which damage, drawn from ``seed``; ``page``: bytes a zeroed page or a swapped block spans.

    ``every``: corrupt one READ in that many (1: all). ``trigger``: a path; READs are damaged
    only while it exists, with the kind it names if it names one (an engine in another
    process is switched on and off that way), and each damage adds a line to
    ``trigger + ".done"``.
    ``done`` counts damaged transfers.
    """

    kind: str | None = None
    seed: int = 0
    page: int = 4096
    every: int = 1
    trigger: str | None = None
    done: int = 0
    seen: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CORRUPTIONS + (None,):
            raise ValueError(f"corruption kind {self.kind!r}; known: {', '.join(CORRUPTIONS)}")


def _span_bytes(addr: int, n: int, kind: Any, device: int) -> np.ndarray:
    """A writable view of ``n`` bytes (host) or a host copy (device) at ``addr``."""
    if kind is MemoryKind.VRAM:
        from ..integrity._gpu import _CudaSpan
        import torch

        return torch.as_tensor(_CudaSpan(addr, n), device=f"cuda:{device}").cpu().numpy()
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=np.uint8)


def _put(addr: int, data: np.ndarray, kind: Any, device: int) -> None:
    if kind is MemoryKind.VRAM:
        from ..integrity._gpu import _CudaSpan
        import torch

        torch.as_tensor(_CudaSpan(addr, data.size), device=f"cuda:{device}").copy_(torch.from_numpy(data))
        torch.cuda.synchronize(device)
    else:
        np.frombuffer((ctypes.c_uint8 * data.size).from_address(addr), dtype=np.uint8)[:] = data


def _triggered(path: str, kind: str | None) -> str | None:
    try:
        with open(path) as f:
            named = f.read().strip()
    except OSError:
        return kind
    return named if named in CORRUPTIONS else kind


class CorruptingBackend(FaultyBackend):
    """Forwards to ``inner`` and damages one span of each finished READ (see :data:`CORRUPTIONS`).

    The damage lands in our own registered destination bytes, between the inner transport's
    completion and the core's DONE, so only an end-to-end check can see it.
    """

    name = "corrupting"

    def __init__(self, agent_name: str, *, inner: str = "loopback",
                 corruption: Corruption | dict[str, Any] | None = None, **options: Any):
        super().__init__(agent_name, inner=inner, **options)
        self.corruption = Corruption(**corruption) if isinstance(corruption, dict) else corruption or Corruption()
        self._lists: dict[int, DescriptorList] = {}

    def prepare(self, peer: str | None, descs: DescriptorList) -> Any:
        h = self.inner.prepare(peer, descs)
        if peer is None:
            self._lists[id(h)] = descs.expand() if descs.strided else descs
        return h

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Any:
        c = self.corruption
        plan = None
        if c.trigger is not None:
            c.kind = _triggered(c.trigger, c.kind)
        if op is Op.READ and c.kind is not None and id(local) in self._lists and (
                c.trigger is None or os.path.exists(c.trigger)):
            c.seen += 1
            if c.seen % c.every == 0:
                d = self._lists[id(local)]
                rows = np.asarray(d.array)[np.asarray(local_idx, dtype=np.int64)]
                plan = self._choose(rows, d.kind)
        return ["inner", self.inner.post(op, local, local_idx, remote, remote_idx, notification), plan]

    def _choose(self, rows: np.ndarray, kind: Any) -> Any:
        """Pick the damage now (``stale`` must see the bytes before the transfer lands)."""
        c = self.corruption
        rng = np.random.default_rng([c.seed, c.seen])
        spans = [(int(a), int(n), int(dv)) for a, n, dv in rows[:, :3].tolist()]
        # Blocks: ``page``-sized pieces of the destination spans (a span may hold many merged rows).
        units = [(a + i * c.page, dv) for a, n, dv in spans for i in range(n // c.page)]
        if c.kind == "flip":
            a, n, dv = spans[int(rng.integers(len(spans)))]
            return ("flip", a + int(rng.integers(n)), int(rng.integers(8)), kind, dv)
        if not units:
            raise ValueError(f"corruption {c.kind!r} needs spans of at least page={c.page} bytes")
        if c.kind == "zero":
            a, dv = units[int(rng.integers(len(units)))]
            return ("zero", a, c.page, kind, dv)
        if c.kind == "swap":
            if len(units) < 2:
                raise ValueError("swap needs two pages in one transfer")
            i, j = rng.choice(len(units), 2, replace=False)
            return ("swap", units[int(i)], units[int(j)], c.page, kind)
        a, dv = units[int(rng.integers(len(units)))]
        return ("stale", a, _span_bytes(a, c.page, kind, dv).copy(), kind, dv)

    def poll(self, xfer: Any) -> bool:
        done = super().poll(xfer[:2])
        if done and len(xfer) > 2 and xfer[2] is not None:
            self._apply(xfer[2])
            self.corruption.done += 1
            log.warning("kvxfer._harness.faults: damaged a delivered READ (%s, %d so far)", xfer[2][0],
                        self.corruption.done)
            if self.corruption.trigger is not None:  # what a test in another process counts
                with open(self.corruption.trigger + ".done", "a") as f:
                    f.write(f"{xfer[2][0]}\n")
            xfer[2] = None
        return done

    def _apply(self, p: tuple[Any, ...]) -> None:
        if p[0] == "flip":
            _, addr, bit, kind, dv = p
            b = _span_bytes(addr, 1, kind, dv).copy()
            b[0] ^= np.uint8(1 << bit)
            _put(addr, b, kind, dv)
        elif p[0] == "zero":
            _, addr, n, kind, dv = p
            _put(addr, np.zeros(n, np.uint8), kind, dv)
        elif p[0] == "swap":
            _, (a, da), (b, db), n, kind = p
            x, y = _span_bytes(a, n, kind, da).copy(), _span_bytes(b, n, kind, db).copy()
            _put(a, y, kind, da)
            _put(b, x, kind, db)
        else:
            _, addr, old, kind, dv = p
            _put(addr, old, kind, dv)

    def release(self, xfer: Any) -> None:
        super().release(xfer[:2])


class _Plugin:
    @hookimpl
    def kvxfer_register_backends(self, register: RegisterBackend) -> None:
        register("faulty", FaultyBackend, summary="fault injection around another backend (tests only)")
        register("corrupting", CorruptingBackend, summary="damages delivered READs (integrity tests only)")


def install() -> None:
    """Make backend ``"faulty"`` available in this process (call :func:`uninstall` after)."""
    reset_plugins()
    plugin_manager().register(_Plugin(), name="faulty")


def uninstall() -> None:
    reset_plugins()
