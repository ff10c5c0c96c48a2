"""UCX moves DRAM only, yet its agents move VRAM: through the core's device path, beside it.

The agent routes a VRAM pair the device path can serve to it (:mod:`kvxfer._routed`); the UCX
backend never sees those lists. CUDA is :class:`kvxfer.testing.fake_cuda.FakeCuda` (host memory
posing as VRAM, copies that really move bytes), so both agents of this process take the device
path's same-process route, as the NIXL device-path tests do on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvxfer
from kvxfer.cuda import SAME_PROCESS, capability
from kvxfer.errors import UnsupportedError
from kvxfer.testing.fake_cuda import FakeCuda
from kvxfer.testing.wait import wait_until

BLOCKS, ROW, SENTINEL = 8, 1024, 0xAA
OPTS: dict[str, Any] = {"prove_metadata": False}  # no helper process: these agents trust each other


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cap = FakeCuda()
    monkeypatch.setitem(capability._cap, "cap", cap)
    return cap


def _vram(mem: np.ndarray) -> kvxfer.KVCacheSpec:
    return kvxfer.spec_from_pointers((mem.ctypes.data, mem.nbytes, 0), num_blocks=BLOCKS, members=[("a", ROW)],
                                     kind="VRAM")


@pytest.mark.parametrize("op", ["read", "write"])
def test_ucx_agents_move_vram_through_the_core_device_path(fake_gpu: FakeCuda, op: str) -> None:
    src = np.random.default_rng(5).integers(0, 256, (BLOCKS, ROW), dtype=np.uint8)
    dst = np.full((BLOCKS, ROW), SENTINEL, np.uint8)
    ref_src, ref_dst = src.copy(), dst.copy()
    li, ri = [0, 5, 6], [3, 1, 7]
    with kvxfer.Agent("p", backend="ucx", **OPTS) as p, kvxfer.Agent("d", backend="ucx", **OPTS) as d:
        if op == "read":  # d pulls p's pattern into its sentinel
            p.register(_vram(src)), d.register(_vram(dst))
        else:  # d pushes its pattern into p's sentinel
            p.register(_vram(dst)), d.register(_vram(src))
        d.add_peer(p.metadata())
        p.add_peer(d.metadata())
        t = d.read("p", li, ri, notify=b"done") if op == "read" else d.write("p", ri, li, notify=b"done")
        t.wait(10)
        assert t.stats.path == SAME_PROCESS  # the device path carried it, not UCX
        got: dict[str, list[bytes]] = {}
        wait_until(lambda: bool(got.update(p.notifications()) or got), what="the notification")
        assert got == {"d": [b"done"]}  # sent by the core once the copy was done
    ref_dst[li] = ref_src[ri]  # either way: source rows ri land in destination rows li
    np.testing.assert_array_equal(dst, ref_dst)  # paired rows moved, every other row kept its sentinel
    np.testing.assert_array_equal(src, ref_src)  # the source did not change


def test_without_the_device_path_ucx_refuses_vram(fake_gpu: FakeCuda) -> None:
    """Control: with the agent's device path off, UCX alone cannot take VRAM, and nothing moves."""
    dst = np.full((BLOCKS, ROW), SENTINEL, np.uint8)
    with kvxfer.Agent("d", backend="ucx", device_copy=False, **OPTS) as d:
        with pytest.raises(UnsupportedError, match="VRAM"):
            d.register(_vram(dst))
    assert (dst == SENTINEL).all()
