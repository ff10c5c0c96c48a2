"""The shared conformance suite on Mooncake, in one process and with the peer in another.

Mooncake's ports authenticate nobody, so every agent here opts in with ``trusted_network``;
the suite skips what the backend's capabilities do not claim (notifications).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from kvxfer import Agent
from kvxfer.testing import BackendConformance, TwoProcessConformance

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
