"""The conformance cases whose peer lives in another process (``python -m kvxfer.testing.peer``).

A backend that claims ``cross_process`` must move bytes, deliver notifications and report a
killed peer across a real process boundary; :class:`TwoProcessConformance` is skipped for
one that does not. Import it from :mod:`kvxfer.testing`.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from .. import Agent
from ..errors import KvxferError, PeerDisconnectedError, TransferTimeoutError
from .buffers import SENTINEL, expected_after, make_cache
from .conformance_base import DST_BLOCKS, GEOM, SRC_BLOCKS, _Base
from .peer import PeerProcess, spawn_args


class TwoProcessConformance(_Base):
    """The peer lives in another process (``python -m kvxfer.testing.peer``)."""

    peer_timeout: float = 60.0
    peer_args: tuple[str, ...] = ()  # extra ``kvxfer.testing.peer`` arguments, e.g. ("--cuda-device", "1")
    peer_env: dict[str, str] = {}

    def _spawn(self, cache: str, seed: int | None, name: str = "remote") -> "_PeerProcess":
        return _PeerProcess(self.backend, self.options, self.memory, cache, seed, name, self.peer_timeout,
                            self.peer_args, self.peer_env)

    @pytest.fixture(autouse=True)
    def _skip_same_process_only(self, _skip_unavailable: None) -> None:
        self.require(cross_process=True)

    @pytest.mark.parametrize("remote_kind,local_kind", [("packed", "packed"), ("packed", "layers")])
    def test_read_from_other_process(self, remote_kind: str, local_kind: str) -> None:
        peer = self._spawn(remote_kind, seed=7)
        try:
            dst = make_cache(local_kind, num_blocks=16, memory=self.memory, **GEOM)
            with Agent("local", backend=self.backend, timeout=self.timeout, **self.options) as agent:
                agent.register(dst.views, replicated=True)
                before = dst.layer_pages()
                name = agent.add_peer(peer.metadata)
                agent.read(name, DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
                src_pages = peer.pages()
                want = expected_after(before, src_pages, DST_BLOCKS, SRC_BLOCKS)
                np.testing.assert_array_equal(dst.layer_pages(), want)
        finally:
            peer.close()

    def test_write_with_notification(self) -> None:
        """The initiator never polls while the peer waits: the notification must still come."""
        self.require(op="WRITE", notifications=True)
        peer = self._spawn("packed", seed=None)  # remote holds the sentinel
        try:
            src = make_cache("layers", num_blocks=12, memory=self.memory, seed=5, **GEOM)
            with Agent("local", backend=self.backend, timeout=self.timeout, **self.options) as agent:
                agent.register(src.views, replicated=True)
                name = agent.add_peer(peer.metadata)
                peer.call({"cmd": "add_peer", "metadata": base64.b64encode(agent.metadata()).decode()})
                before = peer.pages()
                t = agent.write(name, SRC_BLOCKS, DST_BLOCKS, notify=b"pushed")
                notes = peer.call({"cmd": "notifications", "timeout": self.timeout, "count": 1})["notifications"]
                assert {k: [base64.b64decode(m) for m in v] for k, v in notes.items()} == {"local": [b"pushed"]}
                after = peer.pages()  # read only after the notification: data must be visible
                np.testing.assert_array_equal(after, expected_after(before, src.layer_pages(), DST_BLOCKS, SRC_BLOCKS))
                assert (peer.padding() == SENTINEL).all()
                t.wait(self.timeout)
        finally:
            peer.close()

    def test_standalone_notify_reaches_a_busy_peer(self) -> None:
        """A notification must leave even while the sender does nothing but wait on a pipe."""
        peer = self._spawn("packed", seed=None)
        try:
            cache = make_cache("packed", num_blocks=4, memory=self.memory, **GEOM)
            with Agent("local", backend=self.backend, timeout=self.timeout, **self.options) as agent:
                agent.register(cache.views, replicated=True)
                name = agent.add_peer(peer.metadata)
                peer.call({"cmd": "add_peer", "metadata": base64.b64encode(agent.metadata()).decode()})
                agent.notify(name, b"ready")
                notes = peer.call({"cmd": "notifications", "timeout": self.timeout, "count": 1})["notifications"]
                assert {k: [base64.b64decode(m) for m in v] for k, v in notes.items()} == {"local": [b"ready"]}
        finally:
            peer.close()

    def test_dead_peer_is_reported_not_waited_on(self) -> None:
        peer = self._spawn("packed", seed=3)
        dst = make_cache("packed", num_blocks=16, memory=self.memory, **GEOM)
        with Agent("local", backend=self.backend, timeout=self.timeout, **self.options) as agent:
            agent.register(dst.views, replicated=True)
            name = agent.add_peer(peer.metadata)
            agent.read(name, DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
            peer.kill()
            with pytest.raises(KvxferError) as info:
                for _ in range(50):  # the first posts after a kill may still succeed on some transports
                    agent.read(name, DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
            assert not isinstance(info.value, TransferTimeoutError), "a dead peer must be detected, not timed out"
            assert isinstance(info.value, PeerDisconnectedError), f"expected PeerDisconnectedError, got {info.value!r}"


class _PeerProcess(PeerProcess):
    """The suite's peer: 12 blocks of the suite's geometry, rows padded with 32 spare bytes."""

    def __init__(self, backend: str, options: dict[str, Any], memory: str, cache: str, seed: int | None, name: str,
                 timeout: float, extra: tuple[str, ...] = (), env: dict[str, str] | None = None):
        super().__init__(spawn_args(backend, name=name, cache=cache, memory=memory, blocks=12,
                                    layers=GEOM["num_layers"], page=GEOM["page"], pad=32, options=options,
                                    replicated=True, seed=seed) + list(extra), timeout=timeout, env=env)

    def pages(self) -> np.ndarray:
        raw = base64.b64decode(self.call({"cmd": "pages"})["pages"])
        return np.frombuffer(raw, np.uint8).reshape(GEOM["num_layers"], 12, GEOM["page"])

    def padding(self) -> np.ndarray:
        return np.frombuffer(base64.b64decode(self.call({"cmd": "pages"})["padding"]), np.uint8)
