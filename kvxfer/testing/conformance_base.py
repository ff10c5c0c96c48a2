"""What both conformance classes share: the suite's geometry, capability-driven skips, and
the before/after snapshot every transfer test checks against.

Split from :mod:`kvxfer.testing.conformance` (one process) and
:mod:`kvxfer.testing.conformance_processes` (a peer in another process) so each stays a
readable list of cases; plugin authors import the classes from :mod:`kvxfer.testing`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from .. import Agent, Capabilities, MemoryKind, Op
from .buffers import Cache, expected_after

GEOM = {"num_layers": 5, "page": 384}
SRC_BLOCKS = [7, 3, 4, 5, 11, 0]
DST_BLOCKS = [0, 9, 10, 11, 2, 5]


_CAPS: dict[tuple[str, str], Capabilities] = {}


class _Base:
    backend: str = "loopback"
    options: dict[str, Any] = {}
    memory: str = "DRAM"
    timeout: float = 20.0
    #: How long a notification may lag behind its data (or a standalone notify): a missing
    #: one fails in this time instead of the transfer timeout. Not a speed claim.
    notify_timeout: float = 5.0
    #: Every test of the suite ends within this many seconds, hung or not.
    pytestmark = pytest.mark.timeout(180)
    #: The owner variant: the suite's agents are driven through a :class:`kvxfer.Owner`
    #: (every call on its thread, transfers submitted and completed by it).
    owned: bool = False

    def make_agent(self, name: str, **kw: Any) -> Any:
        """An agent of this backend, or, in the owner variant, one driven by an owner."""
        agent = Agent(name, backend=self.backend, timeout=self.timeout, **{**self.options, **kw})
        if not self.owned:
            return agent
        from .owned_agent import OwnedAgent

        return OwnedAgent(agent)

    @pytest.fixture(autouse=True)
    def _skip_unavailable(self) -> None:
        from ..plugin.registry import available_backends

        status = {s.name: s for s in available_backends()}
        if self.backend not in status:
            pytest.skip(f"backend {self.backend!r} is not installed")
        if not status[self.backend].available:
            pytest.skip(f"backend {self.backend!r} unavailable: {status[self.backend].reason}")
        if self.memory == "VRAM":
            if MemoryKind.VRAM not in self.capabilities().memory_kinds:
                pytest.skip(f"backend {self.backend!r} does not claim VRAM")
            torch = pytest.importorskip("torch")
            if not torch.cuda.is_available():
                pytest.skip("VRAM tests need a CUDA device")

    def capabilities(self) -> Capabilities:
        """What an agent of this backend, with these options, claims (backends may decide per instance)."""
        key = (self.backend, json.dumps(self.options, sort_keys=True, default=str))
        caps = _CAPS.get(key)
        if caps is None:
            with Agent("capabilities-probe", backend=self.backend, **self.options) as probe:
                caps = _CAPS[key] = probe.backend.capabilities
        return caps

    def require(self, *, op: str | None = None, notifications: bool = False, cross_process: bool = False,
                fence: bool = False) -> None:
        """Skip the calling test unless the backend claims what it exercises."""
        caps = self.capabilities()
        if op is not None and Op(op) not in caps.ops:
            pytest.skip(f"backend {self.backend!r} does not claim {op}")
        if notifications and not caps.notifications:
            pytest.skip(f"backend {self.backend!r} does not claim notifications")
        if cross_process and not caps.cross_process:
            pytest.skip(f"backend {self.backend!r} does not claim peers in other processes")
        if fence and not caps.fence:
            pytest.skip(f"backend {self.backend!r} does not claim the fence against a stopped peer (its capabilities "
                        "say fence=False; its README says why)")


class _Snapshot:
    """Destination and source bytes before a transfer, to check what changed and what did not."""

    def __init__(self, src: Cache, dst: Cache):
        self.src, self.dst = src, dst
        self.dst_pages, self.dst_padding, self.src_pages = dst.layer_pages(), dst.padding(), src.layer_pages()

    def check(self, dst_blocks: list[int], src_blocks: list[int]) -> None:
        want = expected_after(self.dst_pages, self.src_pages, dst_blocks, src_blocks)
        got = self.dst.layer_pages()
        moved = np.zeros(got.shape[1], dtype=bool)
        moved[dst_blocks] = True
        np.testing.assert_array_equal(got[:, moved], want[:, moved], err_msg="requested blocks differ from the source")
        np.testing.assert_array_equal(got[:, ~moved], self.dst_pages[:, ~moved],
                                      err_msg="blocks outside the request changed")
        np.testing.assert_array_equal(self.dst.padding(), self.dst_padding, err_msg="row padding changed")
        np.testing.assert_array_equal(self.src.layer_pages(), self.src_pages, err_msg="the source changed")
