"""The shared conformance suite on Mooncake, in one process and with the peer in another.

Mooncake's ports authenticate nobody, so every agent here opts in with ``trusted_network``;
every case runs: notifications (Mooncake's own) and the stopped-peer fence included.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import pytest

from kvxfer import Agent
from kvxfer.testing import BackendConformance, TwoProcessConformance
from kvxfer.testing.buffers import make_cache
from kvxfer.testing.conformance_base import GEOM

pytest.importorskip("mooncake.engine")

OPTIONS: dict[str, Any] = {"trusted_network": True, "progress_timeout": 3}


class TestMooncakeConformance(BackendConformance):
    """Uncoalesced plans only: they index the lists by block id, the stricter case, and each
    Mooncake engine takes about a second to stop, so both variants would double the run."""

    backend = "mooncake"
    options = OPTIONS

    @pytest.fixture
    def agents(self) -> Iterator[tuple[Agent, Agent]]:
        a = self.make_agent("prefill", coalesce=False)
        b = self.make_agent("decode", coalesce=False)
        try:
            yield a, b
        finally:
            b.close()
            a.close()


class TestMooncakeTwoProcesses(TwoProcessConformance):
    backend = "mooncake"
    options = OPTIONS


class _Unfenced(TwoProcessConformance):
    backend = "mooncake"
    options = OPTIONS


def test_control_unfenced_reads_land_after_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the kit's stopped-peer case: with READs landing straight in the destination
    (``fence_reads=False``, the plugin before the fence: release waits for the running call),
    the spans Mooncake still queues land after the timeout and the case fails. The timeout end
    only: a cancel may beat the worker thread to the call, and then nothing is sent at all."""
    from kvxfer_mooncake.backend import MooncakeBackend

    monkeypatch.setattr(MooncakeBackend, "fence_reads", False)
    with pytest.raises(AssertionError, match="written after it reported"):
        _Unfenced().test_stopped_peer_writes_nothing_after_the_end("timeout")


class _Stoppable(TwoProcessConformance):
    backend = "mooncake"
    options = {**OPTIONS, "progress_timeout": 5}


@pytest.mark.parametrize("op,fenced", [("read", True), ("write", True), ("read", False), ("write", False)],
                         ids=["read", "write", "control-read-unfenced", "control-write-unfenced"])
def test_stopped_peer_times_out_within_the_deadline(op: str, fenced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer stopped (SIGSTOP) mid-transfer: ``wait(1)`` raises ``TransferTimeoutError`` within
    its second plus slack, although Mooncake gives the call ``progress_timeout`` (5 s): ``release``
    holds the arena instead of waiting for the call. A liveness bound, not a speed claim.
    Controls: without the arenas, ``release`` waits for the call and the wait runs past the
    progress timeout (the deadline broken by the transport's own bound)."""
    from kvxfer.errors import TransferTimeoutError
    from kvxfer_mooncake.backend import MooncakeBackend

    monkeypatch.setattr(MooncakeBackend, "fence_reads", fenced)
    monkeypatch.setattr(MooncakeBackend, "snapshot_writes", fenced)
    kit = _Stoppable()
    peer = kit._spawn("packed", seed=41, name="stopped")
    stopped = False
    try:
        with kit.make_agent("local") as agent:
            agent.register(make_cache("packed", num_blocks=16, memory="DRAM", **GEOM).views, replicated=True)
            name = agent.add_peer(peer.metadata)
            agent.read(name, [15], [1]).wait(kit.timeout)  # connected before the peer stops
            os.kill(peer.pid, signal.SIGSTOP)
            stopped = True
            move = agent.read if op == "read" else agent.write
            t = move(name, [0, 1, 2, 3], [0, 1, 2, 3])
            start = time.monotonic()
            with pytest.raises(TransferTimeoutError):
                t.wait(1.0)
            took = time.monotonic() - start
            if fenced:
                assert took < 3.5, f"wait(1) on a stopped peer returned after {took:.1f} s"
            else:
                assert took >= 4.0, f"control: the unfenced release should wait for the call ({took:.1f} s)"
            os.kill(peer.pid, signal.SIGCONT)
            stopped = False
    finally:
        if stopped:
            os.kill(peer.pid, signal.SIGCONT)
        peer.close()
