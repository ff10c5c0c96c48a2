"""Deliberately broken backends: the conformance suite must catch each one.

The first four are the loopback backend with one contract violation each; the rest are the
cross-process :mod:`reference_backend` with one of its injectable bugs (a peer must be able
to die mid-transfer, which loopback's cannot). ``tests/test_conformance_mutants.py`` runs the
suite against every mutant in a subprocess and expects the named test to fail.

The subprocess (and the peer processes it starts) find the mutants through a ``kvxfer``
entry point in a temporary ``dist-info`` (:func:`write_dist`): nothing is installed.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import numpy as np

from kvxfer import Op, hookimpl
from kvxfer.plugin.registry import plugin_manager, reset_plugins
from pathlib import Path

from kvxfer.plugin.backend import Backend
from kvxfer.testing import BackendConformance, TwoProcessConformance
from kvxfer_loopback.backend import LoopbackBackend, _host_copy, _Xfer
from reference_backend import BUGS, ReferenceBackend


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

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        json.loads(blob)["token"]  # raises JSONDecodeError / KeyError / TypeError raw
        super().add_remote(peer_name, blob)


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


def _reference_mutant(bug: str) -> type[ReferenceBackend]:
    return type(f"Reference_{bug.replace('-', '_')}", (ReferenceBackend,),
                {"name": f"mutant-{bug}", "bugs": frozenset({bug})})


MUTANTS: dict[str, type[Backend]] = {
    m.name: m for m in (NotifyBeforeCopy, RawBlobError, ReleaseKeepsCopying, IgnoresIndices, ReferenceBackend,
                        *(_reference_mutant(b) for b in sorted(BUGS)))
}


class _Plugin:
    @hookimpl
    def kvxfer_register_backends(self, register: Callable[..., None]) -> None:
        for name, cls in MUTANTS.items():
            register(name, cls, summary="a deliberately broken backend (tests only)")


PLUGIN = _Plugin()


def install() -> None:
    """Register the mutants in this process (a no-op where the entry point already did)."""
    reset_plugins()
    if not plugin_manager().has_plugin("mutants"):
        plugin_manager().register(PLUGIN, name="mutants")


def write_dist(site: Path) -> Path:
    """A ``dist-info`` in ``site`` whose ``kvxfer`` entry point is :data:`PLUGIN`; put ``site``
    and this folder on ``PYTHONPATH`` and every process sees the mutants."""
    info = site / "kvxfer_mutants-0.0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvxfer-mutants\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[kvxfer]\nmutants = conformance_mutants:PLUGIN\n")
    return site


#: The kit's deadlines for these runs. A mutant that never notifies waits out ``notify_timeout``,
#: one that never completes waits out ``timeout``; in-process copies and a local peer take
#: milliseconds, and the unbroken backends pass the same kit with the same deadlines (the
#: controls in test_conformance_mutants.py), so shorter ones still tell broken from right.
DEADLINES = {"timeout": 10.0, "notify_timeout": 2.0}


def suite_for(backend: str) -> type[BackendConformance]:
    return type("TestMutant", (BackendConformance,), {"backend": backend, **DEADLINES})


def two_process_suite_for(backend: str) -> type[TwoProcessConformance]:
    return type("TestMutantProcesses", (TwoProcessConformance,), {"backend": backend, **DEADLINES})
