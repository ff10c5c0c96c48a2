"""An idle NIXL agent that no peer can reach runs no background progress thread.

The keeper (``background_progress``) wakes about a thousand times a second; it is needed only
once a peer can connect, i.e. once memory is registered *and* the agent's metadata left
(:meth:`kvxfer.Agent.metadata`). An agent made only for the store's ``nixl-posix`` file path
never advertises itself, and its keeper used to take CPU and the GIL from the store's
workers. The tests count the keeper's rounds (:attr:`kvxfer.progress.Pump.steps`), not time;
the control bypasses the gate and shows the same count moving.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvxfer
from kvxfer.deadlines import Deadline

pytestmark = [pytest.mark.nixl]

try:
    import nixl  # noqa: F401
except ImportError:  # pragma: no cover - exercised on machines without nixl
    pytest.skip("nixl is not installed: pip install -e '.[nixl]'", allow_module_level=True)

SENTINEL, BLOCKS, ROW = 0xAA, 16, 8192


def _keeper(agent: kvxfer.Agent) -> Any:
    keeper = agent.backend._keeper  # type: ignore[attr-defined]
    assert keeper is not None, "background_progress is on by default"
    return keeper


def _runs(keeper: Any) -> bool:
    """Whether the keeper runs: its round count moves within a generous bound (not a timing check)."""
    end = Deadline.within(10.0)
    while keeper.steps == 0 and not end.expired():
        time.sleep(0.001)
    return bool(keeper.steps > 0)


def _alive() -> bool:
    return any(t.name == "kvxfer-nixl-progress" and t.is_alive() for t in threading.enumerate())


def _store_round_trip(agent: kvxfer.Agent, src: np.ndarray, tmp_path: Path) -> None:
    """Real bytes through the agent's file path: offload four blocks, restore them into four
    others set to a sentinel; every other block unchanged."""
    orig = src.copy()
    ours, back = np.array([3, 0, 9, 14]), np.array([1, 2, 5, 6])
    spec = kvxfer.spec_from_tensors({"kv": src})
    with kvxfer.Store(tmp_path / "store", capacity=BLOCKS * 16384, layout=spec) as store:
        keys = [b"k%d" % i for i in range(4)]
        assert store.offload(agent, ours, keys).wait().stats.path == "nixl-posix"
        src[back] = SENTINEL
        store.restore(keys, agent, back).wait()
    want = orig.copy()
    want[back] = orig[ours]
    np.testing.assert_array_equal(src, want)


def test_an_agent_never_advertised_runs_no_keeper(tmp_path: Path) -> None:
    src = np.random.default_rng(5).integers(0, 256, (BLOCKS, ROW), dtype=np.uint8)
    with kvxfer.Agent("idle-files", backend="nixl") as agent:
        agent.register({"kv": src})
        keeper = _keeper(agent)
        _store_round_trip(agent, src, tmp_path)
        time.sleep(0.2)  # a keeper would have run ~200 rounds by now
        assert keeper.steps == 0 and not _alive()
        agent.metadata()  # now a peer can connect: the keeper must run (test_nixl_passive reads such a peer)
        assert _runs(keeper)


def test_control_with_the_gate_bypassed_the_keeper_runs_without_metadata(tmp_path: Path) -> None:
    src = np.random.default_rng(5).integers(0, 256, (BLOCKS, ROW), dtype=np.uint8)
    with kvxfer.Agent("idle-files-control", backend="nixl") as agent:
        agent.backend._exported = True  # type: ignore[attr-defined]  # as if the metadata had left
        agent.register({"kv": src})
        keeper = _keeper(agent)
        _store_round_trip(agent, src, tmp_path)
        assert _runs(keeper)
