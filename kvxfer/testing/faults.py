"""A fault-injection backend that wraps another one.

It forwards everything to an inner backend and fails on command: a post that never
completes or takes long (to exercise deadlines), a poll that reports the peer gone, a
backend that leaks a foreign exception, an ``add_remote`` that fails half-way. Register it in a test with :func:`install`; it then exists as backend
``"faulty"`` with the option ``inner="loopback"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import Backend, DescriptorList, Op, hookimpl
from ..errors import PeerDisconnectedError
from ..memory import Allocation
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
    add_remote_key: Any = None  # returned instead of the inner key when not None
    released: list[Any] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # peer names add_remote was called with
    removed: list[str] = field(default_factory=list)


class FaultyBackend(Backend):
    name = "faulty"

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

    def add_remote(self, peer_name: str, blob: bytes) -> str:
        self.faults.added.append(peer_name)
        key = self.inner.add_remote(peer_name, blob)
        if self.faults.add_remote_raises is not None:
            raise self.faults.add_remote_raises
        return key if self.faults.add_remote_key is None else self.faults.add_remote_key

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


class _Plugin:
    @hookimpl
    def kvxfer_register_backends(self, register: Callable[..., None]) -> None:
        register("faulty", FaultyBackend, summary="fault injection around another backend (tests only)")


def install() -> None:
    """Make backend ``"faulty"`` available in this process (call :func:`uninstall` after)."""
    reset_plugins()
    plugin_manager().register(_Plugin(), name="faulty")


def uninstall() -> None:
    reset_plugins()
