"""The shared conformance suite on Mooncake, in one process and with the peer in another.

Mooncake's ports authenticate nobody, so every agent here opts in with ``trusted_network``;
the suite skips what the backend's capabilities do not claim (notifications).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvxfer.testing import BackendConformance, TwoProcessConformance

pytest.importorskip("mooncake.engine")

OPTIONS: dict[str, Any] = {"trusted_network": True, "progress_timeout": 3}


class TestMooncakeConformance(BackendConformance):
    backend = "mooncake"
    options = OPTIONS


class TestMooncakeTwoProcesses(TwoProcessConformance):
    backend = "mooncake"
    options = OPTIONS
