"""The device path's logic on CPU: route decision, bounds, translation, restarts, dead peers.

CUDA is replaced by :class:`kvxfer.testing.fake_cuda.FakeCuda` (host memory posing as VRAM,
``memmove`` as the copy), so every transfer here still moves real bytes and is checked
against a numpy reference. ``tests/test_cuda_gpu.py`` runs the real thing on GPUs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import assert_rows_moved, pattern_rows
from kvxfer import Allocation, DescriptorList, MemoryKind, Op
from kvxfer.cuda import CUDA_IPC, SAME_PROCESS, DevicePath, blob
from kvxfer.cuda.copy import pieces
from kvxfer.errors import MetadataError, PeerDisconnectedError, StalePeerError
from kvxfer.testing.fake_cuda import FakeCuda

ROWS, ROW = 24, 96


class Side:
    """One process's cache (host memory posing as VRAM on ``device``) and its device path."""

    def __init__(self, cap: FakeCuda, device: int = 0, seed: int | None = None, rows: int = ROWS) -> None:
        self.mem = pattern_rows(rows, ROW, seed)
        self.alloc = Allocation(self.mem.ctypes.data, self.mem.nbytes, MemoryKind.VRAM, device)
        self.path = DevicePath(capability=cap)
        self.path.register([self.alloc])
        self.device = device

    def rows(self, n: int | None = None) -> DescriptorList:
        n = self.mem.shape[0] if n is None else n
        return DescriptorList([[self.mem.ctypes.data + i * ROW, ROW, self.device] for i in range(n)], MemoryKind.VRAM)


def pair(**kw: object) -> tuple[FakeCuda, FakeCuda, Side, Side]:
    """Two 'processes' on one host: distinct pids and tokens, one boot id."""
    a, b = FakeCuda(**kw), FakeCuda(**kw)  # type: ignore[arg-type]
    return a, b, Side(a, seed=1), Side(b, device=int(kw.get("device", 0)))  # type: ignore[call-overload]


# -- route decision -----------------------------------------------------------------------
def test_same_host_peer_gets_cuda_ipc_and_opens_each_handle_once() -> None:
    ca, cb, src, dst = pair()
    route = dst.path.add_peer("src", src.path.blob())
    assert route.kind == CUDA_IPC, route.reason
    assert len(cb.opened) == 1 and cb.processes[0].pid == ca.pid


@pytest.mark.parametrize("change,reason", [
    ({"boot_id": b"X" * 16}, "another host"),
    ({"unavailable": "no driver"}, "no CUDA here"),
    ({"visible": (1,)}, "not visible"),
    ({"fail_open": True}, "did not open"),
])
def test_fallback_decision(change: dict[str, object], reason: str) -> None:
    ca = FakeCuda()
    cb = FakeCuda(**change)  # type: ignore[arg-type]
    src, dst = Side(ca, seed=1), Side(cb)
    route = dst.path.add_peer("src", src.path.blob())
    assert route.kind is None and reason in route.reason
    assert cb.opened == []  # nothing left mapped after a refusal
    assert dst.path.prepare("src", src.rows()) is None  # the transport carries the bytes


def test_different_gpus_need_peer_access() -> None:
    ca, cb = FakeCuda(), FakeCuda(peer_access=False)
    src, dst = Side(ca, device=1, seed=1), Side(cb, device=0)
    route = dst.path.add_peer("src", src.path.blob())
    assert route.kind is None and "peer access" in route.reason
    cb.peer_access = True
    assert dst.path.add_peer("src", src.path.blob()).kind == CUDA_IPC


def test_disabled_path_and_dram_only_peers_use_the_transport() -> None:
    cb = FakeCuda()
    off = DevicePath(enabled=False, capability=cb)
    src = Side(FakeCuda(), seed=1)
    assert off.add_peer("src", src.path.blob()).kind is None
    dram = DevicePath(capability=FakeCuda())
    dram.register([Allocation(4096, 4096, MemoryKind.DRAM, 0)])
    assert DevicePath(capability=cb).add_peer("d", dram.blob()).reason == "the peer exported no VRAM"


def test_forged_export_naming_this_process_is_refused() -> None:
    ca = FakeCuda()
    cb = FakeCuda(pid=ca.pid)  # the blob claims to come from this very process
    src, dst = Side(ca, seed=1), Side(cb)
    assert dst.path.add_peer("src", src.path.blob()).kind is None


def test_same_process_route_checks_the_live_registrations() -> None:
    cap = FakeCuda()  # both paths in one "process": the export names our own token
    src, dst = Side(cap, seed=1), Side(cap)
    assert dst.path.add_peer("src", src.path.blob()).kind == SAME_PROCESS
    assert dst.path.prepare("src", src.rows()) is not None
    outside = DescriptorList([[src.alloc.end, ROW, 0]], MemoryKind.VRAM)
    assert dst.path.prepare("src", outside) is None


# -- moving bytes -------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(data=st.data(), op=st.sampled_from([Op.READ, Op.WRITE]))
def test_post_moves_exactly_the_paired_rows(data: st.DataObject, op: Op) -> None:
    ca, cb = FakeCuda(), FakeCuda()
    remote, local = Side(ca, seed=3), Side(cb, seed=4)
    assert local.path.add_peer("r", remote.path.blob()).kind == CUDA_IPC
    n = data.draw(st.integers(0, ROWS))
    li = np.array(data.draw(st.permutations(range(ROWS)))[:n], dtype=np.int32)
    ri = np.array(data.draw(st.permutations(range(ROWS)))[:n], dtype=np.int32)
    lp, rp = local.path.prepare(None, local.rows()), local.path.prepare("r", remote.rows())
    assert lp is not None and rp is not None
    before_l, before_r = local.mem.copy(), remote.mem.copy()
    x = local.path.post(op, lp, li, rp, ri)
    assert local.path.poll(x)
    assert_rows_moved(op, local.mem, remote.mem, before_l, before_r, li, ri)


def test_spans_outside_the_export_disable_the_path_for_that_list() -> None:
    ca, cb, src, dst = pair()
    dst.path.add_peer("src", src.path.blob())
    past_end = DescriptorList([[src.mem.ctypes.data + (ROWS - 1) * ROW, ROW + 1, 0]], MemoryKind.VRAM)
    before = DescriptorList([[src.mem.ctypes.data - ROW, ROW, 0]], MemoryKind.VRAM)
    assert dst.path.prepare("src", past_end) is None
    assert dst.path.prepare("src", before) is None
    assert dst.path.prepare("src", src.rows()) is not None


def test_remote_addresses_are_translated_to_the_mapping() -> None:
    ca, cb, src, dst = pair(shift=4096)  # the handle appears 4 KiB higher here than in the exporter
    dst.path.add_peer("src", src.path.blob())
    rp = dst.path.prepare("src", src.rows(3))
    assert rp is not None
    want = src.mem.ctypes.data + 4096 + np.arange(3, dtype=np.uint64) * ROW
    np.testing.assert_array_equal(rp.addr, want)


# -- lifetimes ----------------------------------------------------------------------------
def test_dead_peer_is_a_typed_error_and_unmaps() -> None:
    ca, cb, src, dst = pair()
    dst.path.add_peer("src", src.path.blob())
    lp, rp = dst.path.prepare(None, dst.rows()), dst.path.prepare("src", src.rows())
    assert lp is not None and rp is not None
    idx = np.arange(4, dtype=np.int32)
    x = dst.path.post(Op.READ, lp, idx, rp, idx)
    cb.processes[0].is_alive = False  # the peer dies while the copy is in flight
    with pytest.raises(PeerDisconnectedError):
        dst.path.poll(x)
    assert cb.opened == [] and cb.processes[0].closed
    with pytest.raises(PeerDisconnectedError):
        dst.path.post(Op.READ, lp, idx, rp, idx)


def test_restart_closes_the_old_handles_and_stales_old_lists() -> None:
    ca, cb, src, dst = pair()
    dst.path.add_peer("src", src.path.blob())
    old = dst.path.prepare("src", src.rows())
    first = list(cb.opened)
    src2 = Side(FakeCuda(), seed=9)  # same name, new process
    assert dst.path.add_peer("src", src2.path.blob()).kind == CUDA_IPC
    assert len(cb.opened) == 1 and cb.opened[0] not in first
    assert cb.processes[0].closed
    lp = dst.path.prepare(None, dst.rows())
    assert lp is not None and old is not None
    idx = np.arange(2, dtype=np.int32)
    with pytest.raises(StalePeerError):
        dst.path.post(Op.READ, lp, idx, old, idx)
    new = dst.path.prepare("src", src2.rows())
    assert new is not None
    assert dst.path.poll(dst.path.post(Op.READ, lp, idx, new, idx))
    np.testing.assert_array_equal(dst.mem[:2], src2.mem[:2])
    dst.path.close()
    assert cb.opened == []


# -- wire format --------------------------------------------------------------------------
def test_blob_round_trip() -> None:
    ca, cb, src, dst = pair()
    e = blob.decode(src.path.blob())
    assert e.identity.pid == ca.pid and e.identity.boot_id == ca.boot_id
    assert e.allocs["address"].tolist() == [src.alloc.address]


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 400), flip=st.integers(0, 400), value=st.integers(0, 255))
def test_corrupt_blob_is_metadata_error_or_valid(cut: int, flip: int, value: int) -> None:
    good = bytearray(Side(FakeCuda(), seed=1).path.blob())
    bad = bytearray(good[: len(good) - cut % len(good)]) if cut else bytearray(good)
    if bad:
        bad[flip % len(bad)] = value
    try:
        e = blob.decode(bytes(bad))
    except MetadataError:
        return
    # whatever decodes must still satisfy the invariants the path relies on
    h = e.handles[e.allocs["handle"].astype(np.int64)]
    assert (e.allocs["address"] >= h["base"]).all()
    assert (e.allocs["address"] + e.allocs["nbytes"] <= h["base"] + h["size"]).all()


def test_allocation_outside_its_handle_is_rejected() -> None:
    e = blob.decode(Side(FakeCuda(), seed=1).path.blob())
    allocs = e.allocs.copy()
    allocs["nbytes"] += 1
    forged = blob.encode(blob.Export(e.identity, e.instance, e.devices, e.handles, e.chunks, allocs))
    with pytest.raises(MetadataError, match="outside its handle"):
        blob.decode(forged)


# -- copy tables and packaging --------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(sizes=st.one_of(st.lists(st.integers(1, 5000), min_size=0, max_size=20),
                       st.tuples(st.integers(1, 5000), st.integers(1, 20)).map(lambda t: [t[0]] * t[1])),
       piece=st.sampled_from([16, 512, 4096]))
def test_pieces_cover_each_span_exactly(sizes: list[int], piece: int) -> None:
    n = np.array(sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64) if sizes else n
    base = 1 << 20
    t = pieces((starts + base).astype(np.uint64), (starts + base + (1 << 30)).astype(np.uint64), n.astype(np.uint64),
               piece)
    m = t.shape[0] // 3
    d, s, ln = t[:m].astype(np.int64) - base, t[m:2 * m].astype(np.int64) - base, t[2 * m:].astype(np.int64)
    np.testing.assert_array_equal(s - d, np.full(m, 1 << 30))
    assert (ln >= 1).all() and (ln <= max(piece, int(n.max()) if sizes and int(n.max()) <= piece else piece)).all()
    cover = np.zeros(int(n.sum()), dtype=np.int64)
    for a, b in zip(d.tolist(), ln.tolist()):  # reference coverage, byte by byte
        cover[a:a + b] += 1
    assert (cover == 1).all()
    span_of = np.searchsorted(starts, d, side="right") - 1  # no piece crosses into the next span
    span_end = np.searchsorted(starts, d + ln - 1, side="right") - 1
    np.testing.assert_array_equal(span_of, span_end)


def test_piece_size_spreads_small_posts_and_caps_large_ones() -> None:
    from kvxfer.cuda.copy import MIN_PIECE, PIECE, piece_size

    assert piece_size(1) == MIN_PIECE
    assert piece_size(7 << 30) == PIECE
    mid = piece_size(256 << 20)
    assert MIN_PIECE <= mid <= PIECE and mid & (mid - 1) == 0


def test_ipc_handle_bytes_keep_embedded_nuls() -> None:
    import ctypes

    from kvxfer.cuda._driver import IpcHandle
    from kvxfer.cuda.ipc import handle_bytes

    raw = bytes([7, 0, 0, 9] + list(range(60)))
    h = IpcHandle()
    ctypes.memmove(ctypes.addressof(h), raw, 64)
    assert handle_bytes(h) == raw


def test_embedded_ptx_was_built_from_the_kernel_source() -> None:
    from kvxfer.cuda import _ptx

    src = os.path.join(os.path.dirname(_ptx.__file__), "batch_copy.cu")
    with open(src, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == _ptx.SOURCE_SHA256, "run: python -m kvxfer.cuda._build"
    assert ".entry kvxfer_batch_copy" in _ptx.PTX


def test_import_kvxfer_loads_neither_the_device_path_nor_torch() -> None:
    code = ("import sys, kvxfer; bad = [m for m in ('torch', 'kvxfer.cuda', 'ctypes.util') if m in sys.modules];"
            "assert not bad[:2], bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_device_path_without_vram_never_loads_cuda() -> None:
    code = ("import sys; from kvxfer.cuda import DevicePath; from kvxfer import Allocation;"
            "p = DevicePath(); p.register([Allocation(4096, 64)]); p.blob(); p.add_peer('x', p.blob());"
            "from kvxfer.cuda import _driver; assert not _driver._state['probed']")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
