"""Deliberately broken backends: the conformance suite must catch each one.

Each mutant is the loopback backend with one contract violation that a plugin author could
plausibly write. ``tests/test_conformance_mutants.py`` runs the suite against every mutant
in a subprocess and expects the named test to fail.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import numpy as np

from kvxfer import Op, hookimpl
from kvxfer.plugin.registry import plugin_manager, reset_plugins
from kvxfer.testing import BackendConformance
from kvxfer_loopback.backend import LoopbackBackend, _host_copy, _Xfer


class NotifyBeforeCopy(LoopbackBackend):
    """Sends the notification at post and copies only when the initiator polls."""

    name = "mutant-notify-early"

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Any:
        if notification is not None:
            self.notify(self._name_of(remote.owner), notification)
        la, ra = local.descs[local_idx], remote.descs[remote_idx]
        dst, src = (la, ra) if op is Op.READ else (ra, la)
        return ("deferred", dst, src)

    def _name_of(self, owner: LoopbackBackend) -> str:
        return next(k for k, v in self._peers.items() if v is owner)

    def poll(self, xfer: Any) -> bool:
        if isinstance(xfer, tuple):
            _host_copy(xfer[1], xfer[2])
            return True
        return super().poll(xfer)

    def release(self, xfer: Any) -> None:
        if not isinstance(xfer, tuple):
            super().release(xfer)


class RawBlobError(LoopbackBackend):
    """Parses the peer's blob without catching anything."""

    name = "mutant-raw-blob"

    def add_remote(self, peer_name: str, blob: bytes) -> str:
        json.loads(blob)["token"]  # raises JSONDecodeError / KeyError / TypeError raw
        return super().add_remote(peer_name, blob)


class ReleaseKeepsCopying(LoopbackBackend):
    """Copies from a thread, slowly, and ``release`` does not stop it."""

    name = "mutant-release-ignored"

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Any:
        la, ra = local.descs[local_idx], remote.descs[remote_idx]
        dst, src = (la, ra) if op is Op.READ else (ra, la)
        x = _Xfer()
        done = threading.Event()

        def copy() -> None:
            for i in range(dst.shape[0]):
                time.sleep(0.002)
                _host_copy(dst[i:i + 1], src[i:i + 1])
            done.set()

        threading.Thread(target=copy, daemon=True).start()
        x.keepalive = [done]
        return x

    def poll(self, xfer: Any) -> bool:
        return bool(xfer.keepalive[0].is_set())

    def release(self, xfer: Any) -> None:
        pass


class IgnoresIndices(LoopbackBackend):
    """Copies the first ``n`` descriptors of each list instead of the indexed ones."""

    name = "mutant-ignores-indices"

    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Any:
        n = np.arange(local_idx.shape[0])
        return super().post(op, local, n, remote, n, notification)


MUTANTS: dict[str, type[LoopbackBackend]] = {
    m.name: m for m in (NotifyBeforeCopy, RawBlobError, ReleaseKeepsCopying, IgnoresIndices)
}


class _Plugin:
    @hookimpl
    def kvxfer_register_backends(self, register: Callable[..., None]) -> None:
        for name, cls in MUTANTS.items():
            register(name, cls, summary="a deliberately broken backend (tests only)")


def install() -> None:
    reset_plugins()
    plugin_manager().register(_Plugin(), name="mutants")


def suite_for(backend: str) -> type[BackendConformance]:
    return type("TestMutant", (BackendConformance,), {"backend": backend})
