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
