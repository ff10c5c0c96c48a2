"""A third-party backend gets the same-host GPU path without wiring it: the core routes to it.

``tests/third_party_plugin`` (tinycopy, CONTRIBUTING's worked example) has one data path,
memmove, and moves host memory only. The agent's seam (:class:`kvxfer._routed.Routed`: the
backend and :class:`kvxfer.cuda.DevicePath` side by side, as an agent builds it) sends VRAM
pairs to the device path. CUDA is :class:`kvxfer.testing.fake_cuda.FakeCuda` (host memory
posing as VRAM, copies that really move bytes), installed as the process-wide capability, so
both sides of this process get the device path's same-process route.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from common import SENTINEL, assert_rows_moved, pattern_rows
from kvxfer import Allocation, DescriptorList, MemoryKind, Op, _routed
from kvxfer._routed import Routed
from kvxfer.cuda import SAME_PROCESS, DevicePath, capability
from kvxfer.errors import StalePeerError, UnsupportedError
from kvxfer.plugin import Post
from kvxfer.testing.fake_cuda import FakeCuda
from kvxfer.testing.wait import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent / "third_party_plugin"))
from kvxfer_tinycopy import TinyCopy  # noqa: E402

ROWS, ROW = 12, 64


class Side:
    def __init__(self, name: str, kind: MemoryKind, seed: int | None, backend: type[TinyCopy] = TinyCopy) -> None:
        self.mem = pattern_rows(ROWS, ROW, seed)
        self.kind = kind
        self.b = Routed(backend(name), DevicePath())  # what an Agent holds
        self.b.register([Allocation(self.mem.ctypes.data, self.mem.nbytes, kind, 0)])

    def rows(self) -> DescriptorList:
        return DescriptorList([[self.mem.ctypes.data + i * ROW, ROW, 0] for i in range(ROWS)], self.kind)


def _pair(kind: MemoryKind, backend: type[TinyCopy] = TinyCopy) -> tuple[Side, Side]:
    a, b = Side("a", kind, None, backend), Side("b", kind, 7, backend)
    a.b.add_remote("b", b.b.local_metadata(), b.b.device_metadata())
    b.b.add_remote("a", a.b.local_metadata(), a.b.device_metadata())
    return a, b


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cap = FakeCuda()
    monkeypatch.setitem(capability._cap, "cap", cap)
    return cap


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_vram_moves_through_the_device_path_row(fake_gpu: FakeCuda, op: Op) -> None:
    a, b = _pair(MemoryKind.VRAM)
    if op is Op.WRITE:  # a writes its pattern into b's sentinel
        a.mem[:] = np.random.default_rng(3).integers(0, 256, a.mem.shape, dtype=np.uint8)
        b.mem[:] = SENTINEL
    before_a, before_b = a.mem.copy(), b.mem.copy()
    li, ri = np.array([0, 5, 6, 11], np.int64), np.array([9, 2, 3, 0], np.int64)
    lp, rp = a.b.prepare(None, a.rows()), a.b.prepare("b", b.rows())
    x = a.b.post(op, lp, li, rp, ri, b"done")
    wait_until(lambda: a.b.poll(x), what="the transfer", interval=0)
    assert a.b.data_path(x) == SAME_PROCESS  # the core's device path served it, not memmove
    assert_rows_moved(op, a.mem, b.mem, before_a, before_b, li, ri)
    assert b.b.drain_notifications() == {"a": [b"done"]}
    a.b.release(x)


def test_dram_still_takes_memmove(fake_gpu: FakeCuda) -> None:
    a, b = _pair(MemoryKind.DRAM)
    before_b = b.mem.copy()
    x = a.b.post(Op.READ, a.b.prepare(None, a.rows()), np.arange(3), a.b.prepare("b", b.rows()), np.arange(3), None)
    wait_until(lambda: a.b.poll(x), what="the transfer", interval=0)
    assert a.b.data_path(x) == "memmove"
    np.testing.assert_array_equal(a.mem[:3], before_b[:3])
    assert (a.mem[3:] == SENTINEL).all()


def test_without_cuda_vram_is_refused_not_memmoved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: where the device path cannot take a VRAM list, the backend refuses it: nothing moves."""
    monkeypatch.setitem(capability._cap, "cap", FakeCuda(unavailable="no driver"))
    a, b = _pair(MemoryKind.VRAM)
    assert a.b.device_metadata() == b.b.device_metadata() == b""  # nothing exported without CUDA
    with pytest.raises(UnsupportedError, match="host memory only"):
        a.b.prepare("b", b.rows())
    assert (a.mem == SENTINEL).all()


class _Refusing(TinyCopy):
    """tinycopy whose ``landed`` hook refuses DONE, as NIXL's does for a peer that deregistered meanwhile."""

    def landed(self, x: Post) -> None:
        raise StalePeerError(f"{x.peer!r} deregistered memory during the transfer")


@pytest.mark.parametrize("claimed", [False, True], ids=["own-hooks", "control-router-claims-it"])
def test_the_router_hands_a_path_backends_posts_back_to_it(fake_gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch,
                                                          claimed: bool) -> None:
    """Routed is a PathBackend too: it must finish only its device posts, so the backend's own
    ``landed`` (NIXL's stale-peer check) judges the backend's posts. Control: a router that
    takes every :class:`Post` for its own reports DONE for a post the backend refuses."""
    if claimed:
        monkeypatch.setattr(_routed, "_Device", Post)
    a, b = _pair(MemoryKind.DRAM, _Refusing)
    before_a, before_b = a.mem.copy(), b.mem.copy()
    li, ri = np.array([1, 4], np.int64), np.array([8, 0], np.int64)
    x = a.b.post(Op.READ, a.b.prepare(None, a.rows()), li, a.b.prepare("b", b.rows()), ri, None)
    assert_rows_moved(Op.READ, a.mem, b.mem, before_a, before_b, li, ri)  # memmove ran in start()
    if claimed:
        assert a.b.poll(x)  # the bad outcome: DONE, the backend's hook never asked
    else:
        with pytest.raises(StalePeerError, match="deregistered"):
            a.b.poll(x)
    a.b.release(x)
