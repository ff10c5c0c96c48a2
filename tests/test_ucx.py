"""The raw UCX backend: struct layouts, seam-level byte moves, bounds, dead peers, conformance.

Every transfer moves real bytes: sources hold a seeded pattern, destinations the sentinel
0xAA, and each test checks both what changed and what must not have. Everything is skipped
cleanly when libucp is not installed.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from kvxfer import Allocation, DescriptorList, MemoryKind, Op
from kvxfer.errors import (BackendError, MetadataError, PeerDisconnectedError, StalePeerError, UnknownPeerError,
                           UnsupportedError)

pytestmark = pytest.mark.ucx

L = pytest.importorskip("kvxfer_ucx._libucp")
if L.find_libucp() is None:
    pytest.skip("libucp.so not found (pip install 'kvxfer[ucx]')", allow_module_level=True)

from kvxfer_ucx import _samehost as SH  # noqa: E402
from kvxfer_ucx.backend import UcxBackend  # noqa: E402

HERE = Path(__file__).parent
PEER = str(HERE / "ucx_peer.py")
SENT = 0xAA


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def descs(base: int, offsets: list[int] | np.ndarray, sizes: list[int] | np.ndarray) -> DescriptorList:
    o, s = np.asarray(offsets, dtype=np.uint64), np.asarray(sizes, dtype=np.uint64)
    return DescriptorList(np.stack([base + o, s, np.zeros_like(o)], 1))


def drive(*backends: UcxBackend, xfer: Any, owner: UcxBackend, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not owner.poll(xfer):
        for b in backends:
            b.progress()
        assert time.monotonic() < deadline, "transfer did not finish"
    owner.release(xfer)


# ---------------------------------------------------------------------------------------------
# struct layouts against the installed headers

LAYOUT_C = r"""
#include <stdio.h>
#include <stddef.h>
#include <ucp/api/ucp.h>
#define F(T, f) printf("%s %s %zu\n", #T, #f, offsetof(T, f));
int main(void) {
F(ucp_params_t, features) F(ucp_params_t, request_init) F(ucp_params_t, mt_workers_shared)
F(ucp_params_t, estimated_num_eps) F(ucp_params_t, name) F(ucp_params_t, node_local_id)
F(ucp_worker_params_t, thread_mode) F(ucp_worker_params_t, cpu_mask) F(ucp_worker_params_t, events)
F(ucp_worker_params_t, user_data) F(ucp_worker_params_t, event_fd) F(ucp_worker_params_t, flags)
F(ucp_worker_params_t, name) F(ucp_worker_params_t, am_alignment) F(ucp_worker_params_t, client_id)
F(ucp_worker_attr_t, thread_mode) F(ucp_worker_attr_t, address_flags) F(ucp_worker_attr_t, address)
F(ucp_worker_attr_t, address_length) F(ucp_worker_attr_t, max_am_header) F(ucp_worker_attr_t, name)
F(ucp_worker_attr_t, max_debug_string)
F(ucp_ep_params_t, address) F(ucp_ep_params_t, err_mode) F(ucp_ep_params_t, err_handler)
F(ucp_ep_params_t, user_data) F(ucp_ep_params_t, flags) F(ucp_ep_params_t, sockaddr)
F(ucp_ep_params_t, conn_request) F(ucp_ep_params_t, name) F(ucp_ep_params_t, local_sockaddr)
F(ucp_mem_map_params_t, address) F(ucp_mem_map_params_t, length) F(ucp_mem_map_params_t, flags)
F(ucp_mem_map_params_t, prot) F(ucp_mem_map_params_t, memory_type) F(ucp_mem_map_params_t, exported_memh_buffer)
F(ucp_request_param_t, flags) F(ucp_request_param_t, request) F(ucp_request_param_t, cb)
F(ucp_request_param_t, datatype) F(ucp_request_param_t, user_data) F(ucp_request_param_t, reply_buffer)
F(ucp_request_param_t, memory_type) F(ucp_request_param_t, recv_info) F(ucp_request_param_t, memh)
F(ucp_am_handler_param_t, id) F(ucp_am_handler_param_t, flags) F(ucp_am_handler_param_t, cb)
F(ucp_am_handler_param_t, arg) F(ucp_am_recv_param_t, reply_ep)
printf("size ucp_request_param_t %zu\n", sizeof(ucp_request_param_t));
return 0; }
"""

STRUCTS = {"ucp_params_t": L.UcpParams, "ucp_worker_params_t": L.UcpWorkerParams,
           "ucp_worker_attr_t": L.UcpWorkerAttr, "ucp_ep_params_t": L.UcpEpParams,
           "ucp_mem_map_params_t": L.UcpMemMapParams, "ucp_request_param_t": L.RequestParam,
           "ucp_am_handler_param_t": L.UcpAmHandlerParam, "ucp_am_recv_param_t": L.UcpAmRecvParam}


def test_struct_layouts_match_installed_headers(tmp_path: Path) -> None:
    """Compile offsetof() against the wheel's own headers: a wrong offset would corrupt memory."""
    include = Path(L.find_libucp()).parent.parent / "include"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (include / "ucp" / "api" / "ucp.h").exists():
        pytest.skip("needs a C compiler and the UCX headers shipped in the libucx wheel")
    src = tmp_path / "layout.c"
    src.write_text(LAYOUT_C)
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{include}", str(src), "-o", str(exe)], check=True, capture_output=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    checked = 0
    for line in lines:
        a, b, c = line.split()
        if a == "size":
            assert ctypes.sizeof(STRUCTS[b]) >= int(c), f"{b} smaller than the library's"
            continue
        assert getattr(STRUCTS[a], b).offset == int(c), f"{a}.{b}: ctypes {getattr(STRUCTS[a], b).offset} != C {c}"
        checked += 1
    assert checked > 40


def test_plugin_lists_ucx_without_loading_it() -> None:
    code = ("import sys, kvxfer; s = {b.name: b for b in kvxfer.available_backends()}; "
            "assert s['ucx'].available, s['ucx'].reason; "
            "assert 'kvxfer_ucx.backend' not in sys.modules; "
            "lib = sys.modules.get('kvxfer_ucx._libucp'); assert lib is None or lib._LIB is None")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_libucp_is_reported_with_install_hint() -> None:
    env = dict(os.environ, KVXFER_LIBUCP="/nonexistent/libucp.so")
    code = ("import kvxfer; s = {b.name: b for b in kvxfer.available_backends()}['ucx']; "
            "assert not s.available and 'libucp' in s.reason and 'kvxfer[ucx]' in s.install, s")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---------------------------------------------------------------------------------------------
# one process, two backends

PATHS = {"copy": None, "rma": False}  # same_host_copy option per path
PATH_NAMES = {"copy": "same-host-copy", "rma": "ucx-rma"}


@pytest.fixture(params=["copy", "rma"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]]:
    """Two backends in this process, on the same-host copy path or on UCX RMA."""
    opt = PATHS[request.param]
    a, b = UcxBackend("prefill", same_host_copy=opt), UcxBackend("decode", same_host_copy=opt)
    src = pattern(64 * 1024, 1)
    dst = np.full(64 * 1024, SENT, dtype=np.uint8)
    a.register([Allocation(src.ctypes.data, src.nbytes)])
    b.register([Allocation(dst.ctypes.data, dst.nbytes)])
    b.add_remote("prefill", a.local_metadata())
    a.add_remote("decode", b.local_metadata())
    assert b.peer_path("prefill")[0] == a.peer_path("decode")[0] == PATH_NAMES[request.param]
    try:
        yield a, b, src, dst
    finally:
        b.close()
        a.close()


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_moves_exact_bytes(pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray], op: Op) -> None:
    a, b, src, dst = pair
    before = src.copy()
    # decode is the initiator: READ pulls from prefill's src, WRITE pushes its own dst... so
    # for WRITE we make prefill the initiator and write src into decode's dst.
    offs, sizes, doffs = [0, 8192, 30000], [4096, 100, 5000], [1024, 40000, 20000]
    if op is Op.READ:
        lp = b.prepare(None, descs(dst.ctypes.data, doffs, sizes))
        rp = b.prepare("prefill", descs(src.ctypes.data, offs, sizes))
        idx = np.arange(3)
        drive(a, xfer=b.post(op, lp, idx, rp, idx, None), owner=b)
    else:
        lp = a.prepare(None, descs(src.ctypes.data, offs, sizes))
        rp = a.prepare("decode", descs(dst.ctypes.data, doffs, sizes))
        idx = np.arange(3)
        drive(b, xfer=a.post(op, lp, idx, rp, idx, None), owner=a)
    expected = np.full_like(dst, SENT)
    for o, s, d in zip(offs, sizes, doffs):
        expected[d:d + s] = src[o:o + s]
    np.testing.assert_array_equal(dst, expected)  # moved bytes, and nothing else touched
    np.testing.assert_array_equal(src, before)  # source untouched


def test_index_arrays_pick_and_permute(pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]) -> None:
    a, b, src, dst = pair
    n = 16
    lp = b.prepare(None, descs(dst.ctypes.data, np.arange(n) * 4096, [4096] * n))
    rp = b.prepare("prefill", descs(src.ctypes.data, np.arange(n) * 4096, [4096] * n))
    li, ri = np.array([0, 5, 9], np.int32), np.array([15, 2, 9], np.int32)
    drive(a, xfer=b.post(Op.READ, lp, li, rp, ri, None), owner=b)
    expected = np.full_like(dst, SENT)
    for l_, r_ in zip(li, ri):
        expected[l_ * 4096:(l_ + 1) * 4096] = src[r_ * 4096:(r_ + 1) * 4096]
    np.testing.assert_array_equal(dst, expected)


def test_notification_arrives_after_data(pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]) -> None:
    a, b, src, dst = pair
    lp = a.prepare(None, descs(src.ctypes.data, [0], [65536]))
    rp = a.prepare("decode", descs(dst.ctypes.data, [0], [65536]))
    x = a.post(Op.WRITE, lp, np.arange(1), rp, np.arange(1), b"req-7 done")
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    done = False
    while not got:
        done = done or a.poll(x)
        for peer, msgs in b.drain_notifications().items():
            assert peer == "prefill"
            # The moment a notification is seen, every byte must already be there.
            np.testing.assert_array_equal(dst, src)
            got += msgs
        assert time.monotonic() < deadline
    assert got == [b"req-7 done"]
    a.release(x)


def test_standalone_notify(pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]) -> None:
    a, b, _, _ = pair
    b.notify("prefill", b"hello")
    b.notify("prefill", b"")
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        b.progress()  # the sender drives its own sends
        got += a.drain_notifications().get("decode", [])
    assert got == [b"hello", b""]


def test_out_of_bounds_descriptors_rejected(pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]) -> None:
    a, b, src, dst = pair
    base, n = src.ctypes.data, src.nbytes
    for offs, sizes in ([n - 10], [11]), ([0, n], [1, 1]), ([0], [n + 1]):
        with pytest.raises(BackendError, match="outside"):
            b.prepare("prefill", descs(base, offs, sizes))
    with pytest.raises(BackendError, match="outside"):
        b.prepare("prefill", DescriptorList(np.array([[base - 1, 2, 0]], dtype=np.uint64)))
    with pytest.raises(BackendError, match="outside"):  # wraps around 2**64
        b.prepare("prefill", DescriptorList(np.array([[base + 8, (1 << 64) - 4, 0]], dtype=np.uint64)))
    with pytest.raises(BackendError, match="outside"):  # local side too
        b.prepare(None, descs(dst.ctypes.data, [dst.nbytes - 1], [2]))
    assert (dst == SENT).all()


def test_mismatched_lengths_and_bad_indices(pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]) -> None:
    a, b, src, dst = pair
    lp = b.prepare(None, descs(dst.ctypes.data, [0], [10]))
    rp = b.prepare("prefill", descs(src.ctypes.data, [0], [20]))
    with pytest.raises(BackendError, match="local bytes"):
        b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None)
    with pytest.raises(BackendError, match="out of range"):
        b.post(Op.READ, lp, np.array([1]), rp, np.array([0]), None)
    assert (dst == SENT).all()


def test_vram_is_unsupported() -> None:
    b = UcxBackend("x")
    try:
        with pytest.raises(UnsupportedError, match="DRAM"):
            b.register([Allocation(0x10000, 4096, MemoryKind.VRAM, 0)])
        with pytest.raises(UnsupportedError):
            b.prepare(None, DescriptorList(np.zeros((1, 3), np.uint64) + 1, MemoryKind.VRAM))
    finally:
        b.close()


def test_metadata_is_validated() -> None:
    b = UcxBackend("x")
    try:
        good = json.loads(b.local_metadata())
        bad_docs: list[Any] = [b"not json", b"[]", {**good, "magic": "nixl"}, {**good, "version": 99},
                               {**good, "extra": 1}, {**good, "worker": "%%%"}, {**good, "worker": ""},
                               {**good, "allocations": [[1, 0, "AAAA"]]},
                               {**good, "allocations": [[(1 << 64) - 1, 2, "AAAA"]]},
                               {**good, "allocations": [[True, 1, "AAAA"]]},
                               {**good, "allocations": [[1, 1]]}, {**good, "allocations": [[1, 1, "A" * 200000]]},
                               b"x" * (17 << 20)]
        for doc in bad_docs:
            blob = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
            with pytest.raises(MetadataError):
                b.add_remote("x", blob)
        with pytest.raises(MetadataError, match="expected"):
            b.add_remote("someone-else", b.local_metadata())
    finally:
        b.close()


def test_unknown_and_stale_peers(pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]) -> None:
    a, b, src, dst = pair
    with pytest.raises(UnknownPeerError):
        b.prepare("nobody", descs(src.ctypes.data, [0], [1]))
    lp = b.prepare(None, descs(dst.ctypes.data, [0], [8]))
    rp = b.prepare("prefill", descs(src.ctypes.data, [0], [8]))
    b.add_remote("prefill", a.local_metadata())  # re-added: old prepared lists are stale
    with pytest.raises(StalePeerError):
        b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None)
    rp = b.prepare("prefill", descs(src.ctypes.data, [0], [8]))
    drive(a, xfer=b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None), owner=b)
    np.testing.assert_array_equal(dst[:8], src[:8])
    assert (dst[8:] == SENT).all()


# ---------------------------------------------------------------------------------------------
# the same-host copy path (process_vm_readv / process_vm_writev)

@pytest.fixture
def copy_pair() -> Iterator[tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]]:
    """prefill holds a 4 MiB pattern, decode 4 MiB of sentinel; both on the copy path."""
    a, b = UcxBackend("prefill"), UcxBackend("decode", copy_chunk=64 << 10)
    src = pattern(4 << 20, 11)
    dst = np.full(4 << 20, SENT, dtype=np.uint8)
    a.register([Allocation(src.ctypes.data, src.nbytes)])
    b.register([Allocation(dst.ctypes.data, dst.nbytes)])
    b.add_remote("prefill", a.local_metadata())
    a.add_remote("decode", b.local_metadata())
    assert b.peer_path("prefill")[0] == "same-host-copy", b.peer_path("prefill")
    try:
        yield a, b, src, dst
    finally:
        b.close()
        a.close()


def scattered(n: int, seed: int, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` non-overlapping (src offset, dst offset, size) triples, sizes 1..300, shuffled."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 301, n).astype(np.uint64)
    slot = span // n
    assert slot >= 301
    so = rng.permutation(n).astype(np.uint64) * np.uint64(slot)
    do = rng.permutation(n).astype(np.uint64) * np.uint64(slot) + np.uint64(3)
    return so, do, sizes


def expected_scatter(dst_before: np.ndarray, src: np.ndarray, so: np.ndarray, do: np.ndarray,
                     sizes: np.ndarray) -> np.ndarray:
    want = dst_before.copy()
    for s_, d_, n_ in zip(so.tolist(), do.tolist(), sizes.tolist()):  # test oracle, not the code under test
        want[d_:d_ + n_] = src[s_:s_ + n_]
    return want


class CallLog:
    """Wraps CopyJob._call: records iovec counts; optionally forces partial transfers."""

    def __init__(self, partial: bool = False) -> None:
        self.counts: list[int] = []
        self.short = 0
        self.partial = partial
        self.real = SH.CopyJob._call

    def __call__(self, job: SH.CopyJob, liov: int, lcnt: int, riov: int, rcnt: int) -> int:
        assert lcnt == rcnt and 0 < lcnt <= SH.IOV_MAX
        self.counts.append(lcnt)
        if not self.partial:
            return self.real(job, liov, lcnt, riov, rcnt)
        # Hand the kernel at most 3 iovecs, the last one cut in half: a short count that ends
        # inside an iovec, which the job must resume from exactly.
        k = min(lcnt, 3)
        lv = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * k)).from_address(liov)).reshape(k, 2).copy()
        rv = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * k)).from_address(riov)).reshape(k, 2).copy()
        if lv[-1, 1] > 1:
            lv[-1, 1] //= 2
            rv[-1, 1] = lv[-1, 1]
        self.short += 1
        return self.real(job, lv.ctypes.data, k, rv.ctypes.data, k)


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
@pytest.mark.parametrize("partial", [False, True], ids=["batched", "forced-partial"])
def test_copy_path_many_descriptors(copy_pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray], op: Op,
                                    partial: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 scattered descriptors (> IOV_MAX): several syscalls of at most 1,024 iovecs; with
    forced short counts (also inside an iovec) every byte still lands exactly once."""
    a, b, src, dst = copy_pair
    b._copy_chunk = SH.DEFAULT_CHUNK  # so that IOV_MAX, not the byte chunk, bounds each batch
    log = CallLog(partial)
    monkeypatch.setattr(SH.CopyJob, "_call", lambda job, *args: log(job, *args))
    so, do, sizes = scattered(3000, 4, src.nbytes)
    before_src, before_dst = src.copy(), dst.copy()
    idx = np.arange(len(sizes))
    if op is Op.READ:  # decode pulls prefill's src into its dst
        lp = b.prepare(None, descs(dst.ctypes.data, do, sizes))
        rp = b.prepare("prefill", descs(src.ctypes.data, so, sizes))
        drive(a, xfer=b.post(op, lp, idx, rp, idx, None), owner=b)
    else:  # prefill pushes its src into decode's dst
        lp = a.prepare(None, descs(src.ctypes.data, so, sizes))
        rp = a.prepare("decode", descs(dst.ctypes.data, do, sizes))
        drive(b, xfer=a.post(op, lp, idx, rp, idx, None), owner=a)
    np.testing.assert_array_equal(dst, expected_scatter(before_dst, src, so, do, sizes))
    np.testing.assert_array_equal(src, before_src)
    if partial:
        assert log.short > 1 and max(log.counts) > 3  # the job kept offering full batches
    else:
        assert len(log.counts) >= 3 and max(log.counts) == SH.IOV_MAX


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_copy_path_splits_large_descriptors(copy_pair: tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray],
                                            op: Op) -> None:
    """One 3 MiB descriptor with copy_chunk=64 KiB: split into pieces, same bytes, with a
    notification that the target sees only after all of them."""
    a, b, src, dst = copy_pair
    n, so, do = 3 << 20, 4093, 517
    if op is Op.READ:
        lp = b.prepare(None, descs(dst.ctypes.data, [do], [n]))
        rp = b.prepare("prefill", descs(src.ctypes.data, [so], [n]))
        x, owner, target, sender = b.post(op, lp, np.arange(1), rp, np.arange(1), b"big"), b, a, "decode"
    else:
        a2 = UcxBackend("prefill2", copy_chunk=64 << 10)
        a2.register([Allocation(src.ctypes.data, src.nbytes)])
        a2.add_remote("decode", b.local_metadata())
        b.add_remote("prefill2", a2.local_metadata())
        lp = a2.prepare(None, descs(src.ctypes.data, [so], [n]))
        rp = a2.prepare("decode", descs(dst.ctypes.data, [do], [n]))
        x, owner, target, sender = a2.post(op, lp, np.arange(1), rp, np.arange(1), b"big"), a2, b, "prefill2"
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    done = False
    while not (done and got):
        done = done or owner.poll(x)
        msgs = target.drain_notifications().get(sender, [])
        if msgs:
            np.testing.assert_array_equal(dst[do:do + n], src[so:so + n])  # data before notification
            got += msgs
        assert time.monotonic() < deadline
    owner.release(x)
    assert got == [b"big"]
    assert (dst[:do] == SENT).all() and (dst[do + n:] == SENT).all()
    if op is Op.WRITE:
        b.remove_remote("prefill2")
        a2.close()


@pytest.mark.parametrize("thread", [True, False], ids=["thread", "poll"])
def test_copy_path_release_stops_copying(thread: bool) -> None:
    """release() of a running copy returns only once nothing more is written, and later
    polls report the cancellation; a finished prefix stays, the rest keeps its sentinel."""
    n = 96 << 20
    src = pattern(n, 2)
    dst = np.full(n, SENT, dtype=np.uint8)
    a = UcxBackend("prefill")
    b = UcxBackend("decode", copy_chunk=256 << 10, copy_thread=thread, inline_budget=0.0, copy_budget=0.0)
    try:
        a.register([Allocation(src.ctypes.data, n)])
        b.register([Allocation(dst.ctypes.data, n)])
        b.add_remote("prefill", a.local_metadata())
        lp = b.prepare(None, descs(dst.ctypes.data, [0], [n]))
        rp = b.prepare("prefill", descs(src.ctypes.data, [0], [n]))
        x = b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None)
        if not thread:
            assert not b.poll(x)  # one 256 KiB syscall per poll with a zero budget
        b.release(x)
        snapshot = dst.copy()
        time.sleep(0.05)
        np.testing.assert_array_equal(dst, snapshot)  # nothing moves after release
        moved = int(np.flatnonzero(snapshot != SENT).max(initial=-1)) + 1
        assert moved < n, "the copy finished before it could be cancelled"
        np.testing.assert_array_equal(snapshot[:moved], src[:moved])
        with pytest.raises(Exception):
            b.poll(x)
    finally:
        b.close()
        a.close()


def _tamper(blob: bytes, **host: Any) -> bytes:
    doc = json.loads(blob)
    doc["host"] = None if host.get("none") else {**doc["host"], **host}
    return json.dumps(doc).encode()


def test_copy_path_fallbacks_and_forcing() -> None:
    """Which peers get the copy path, and why not; auto falls back, True refuses."""
    a = UcxBackend("prefill")
    others: list[UcxBackend] = []
    try:
        blob = a.local_metadata()
        token = base64.b64encode(b"\0" * SH.TOKEN_BYTES).decode()
        cases = {
            "off here": (UcxBackend("d1", same_host_copy=False), blob, "same_host_copy=False"),
            "off there": (UcxBackend("d2"), _tamper(blob, none=True), "does not offer"),
            "other host": (UcxBackend("d3"), _tamper(blob, boot_id="00000000-dead"), "another host"),
            "other pidns": (UcxBackend("d4"), _tamper(blob, pidns="pid:[1]"), "PID namespace"),
            "wrong process": (UcxBackend("d5"), _tamper(blob, token=token), "token mismatch"),
        }
        v1 = json.loads(blob)
        del v1["host"]
        v1["version"] = 1
        cases["version-1 blob"] = (UcxBackend("d6"), json.dumps(v1).encode(), "does not offer")
        for what, (b, peer_blob, why) in cases.items():
            others.append(b)
            b.add_remote("prefill", peer_blob)
            path, reason = b.peer_path("prefill")
            assert path == "ucx-rma" and why in reason, (what, reason)
        # forced on: a same-host peer that fails the probe is an error, not a silent fallback
        forced = UcxBackend("d7", same_host_copy=True)
        others.append(forced)
        with pytest.raises(BackendError, match="token mismatch"):
            forced.add_remote("prefill", _tamper(blob, token=token))
        forced.add_remote("prefill", _tamper(blob, boot_id="elsewhere"))  # other host: RMA is the only way
        assert forced.peer_path("prefill")[0] == "ucx-rma"
        forced.add_remote("prefill", blob)
        assert forced.peer_path("prefill")[0] == "same-host-copy"
        with pytest.raises(BackendError, match="same_host_copy"):
            UcxBackend("d8", same_host_copy="yes")
    finally:
        for b in others:
            b.close()
        a.close()


def test_copy_errno_mapping() -> None:
    """ESRCH is a dead peer; EPERM says why and how to fall back; EFAULT names the cause."""
    import errno

    assert isinstance(SH.map_errno(errno.ESRCH, "read", "p", 7), PeerDisconnectedError)
    eperm = SH.map_errno(errno.EPERM, "read", "p", 7)
    assert type(eperm) is BackendError
    assert "ptrace" in str(eperm) and "Yama" in str(eperm) and "same_host_copy=False" in str(eperm)
    efault = SH.map_errno(errno.EFAULT, "write", "p", 7)
    assert type(efault) is BackendError and "unmapped" in str(efault)


def test_copy_path_unmapped_remote_is_typed_error() -> None:
    """A peer advertising memory it no longer maps: EFAULT becomes BackendError, no crash."""
    import mmap

    m = mmap.mmap(-1, 1 << 20)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    a, b = UcxBackend("prefill"), UcxBackend("decode")
    dst = np.full(1 << 20, SENT, dtype=np.uint8)
    try:
        a.register([Allocation(base, 1 << 20)])
        b.register([Allocation(dst.ctypes.data, dst.nbytes)])
        b.add_remote("prefill", a.local_metadata())
        lp = b.prepare(None, descs(dst.ctypes.data, [0], [4096]))
        rp = b.prepare("prefill", descs(base, [0], [4096]))
        a.deregister(1)
        import gc

        gc.collect()
        m.close()  # only possible once no buffer export remains
    except BufferError:
        pytest.skip("mmap still exported")
    try:
        x = b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None)
        with pytest.raises(BackendError, match="unmapped"):
            b.poll(x)
        b.release(x)
        assert (dst == SENT).all()
    finally:
        b.close()
        a.close()


def test_host_metadata_is_validated() -> None:
    b = UcxBackend("x")
    try:
        good = json.loads(b.local_metadata())
        host = good["host"]
        bad_hosts: list[Any] = [[], {**host, "extra": 1}, {**host, "pid": 0}, {**host, "pid": True},
                                {**host, "pid": 1 << 40}, {**host, "boot_id": ""}, {**host, "boot_id": 5},
                                {**host, "hostname": "h" * 300}, {**host, "token": "AAAA"},
                                {**host, "token": "%%"}, {**host, "token_addr": -1}, {**host, "token_addr": 0}]
        for h in bad_hosts:
            with pytest.raises(MetadataError):
                b.add_remote("x", json.dumps({**good, "host": h}).encode())
        no_host = {k: v for k, v in good.items() if k != "host"}
        with pytest.raises(MetadataError):  # version 2 requires the key (null to opt out)
            b.add_remote("x", json.dumps(no_host).encode())
        with pytest.raises(MetadataError):  # version 1 must not carry it
            b.add_remote("x", json.dumps({**good, "version": 1}).encode())
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# two processes

class Peer:
    """tests/ucx_peer.py in a subprocess."""

    def __init__(self, name: str, nbytes: int, fill: str, *options: str) -> None:
        self.proc = subprocess.Popen([sys.executable, PEER, name, str(nbytes), fill, *options],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        self.blob, self.address = base64.b64decode(hello["meta"]), int(hello["address"])

    def _read(self, progress: UcxBackend | None = None) -> dict[str, Any]:
        """One reply line; meanwhile drive ``progress`` (software RMA needs the target to)."""
        assert self.proc.stdout is not None
        if progress is not None:
            deadline = time.monotonic() + 30
            while not select.select([self.proc.stdout], [], [], 0.001)[0]:
                progress.progress()
                assert time.monotonic() < deadline, "peer did not answer"
        line = self.proc.stdout.readline()
        assert line, "peer process exited"
        return json.loads(line)

    def cmd(self, progress: UcxBackend | None = None, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read(progress)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd(cmd="exit")
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", ["copy", "rma"])
def test_two_processes_read_write_notify(path: str) -> None:
    n = 1 << 20
    opt = PATHS[path]
    peer = Peer("prefill", n, "5", *([] if opt is None else [f"same_host_copy={int(opt)}"]))
    local = UcxBackend("decode", same_host_copy=opt)
    try:
        dst = np.full(n, SENT, dtype=np.uint8)
        local.register([Allocation(dst.ctypes.data, n)])
        local.add_remote("prefill", peer.blob)
        assert local.peer_path("prefill")[0] == PATH_NAMES[path], local.peer_path("prefill")
        assert peer.cmd(local, cmd="add", name="decode", blob=base64.b64encode(local.local_metadata()).decode())["ok"]
        src = pattern(n, 5)
        # READ two spans (one of them misaligned) from the other process
        lp = local.prepare(None, descs(dst.ctypes.data, [0, 300001], [65536, 4097]))
        rp = local.prepare("prefill", descs(peer.address, [131072, 7], [65536, 4097]))
        idx = np.arange(2)
        drive(xfer=local.post(Op.READ, lp, idx, rp, idx, b"read-done"), owner=local)
        expected = np.full(n, SENT, dtype=np.uint8)
        expected[0:65536] = src[131072:131072 + 65536]
        expected[300001:300001 + 4097] = src[7:7 + 4097]
        np.testing.assert_array_equal(dst, expected)
        # WRITE back into the peer, with a notification the peer sees only after the data
        dst[:] = pattern(n, 6)
        lp = local.prepare(None, descs(dst.ctypes.data, [1000], [200000]))
        rp = local.prepare("prefill", descs(peer.address, [500000], [200000]))
        drive(xfer=local.post(Op.WRITE, lp, np.arange(1), rp, np.arange(1), b"write-done"), owner=local)
        remote = np.frombuffer(base64.b64decode(peer.cmd(cmd="dump")["data"]), dtype=np.uint8)
        want = src.copy()
        want[500000:700000] = dst[1000:201000]
        np.testing.assert_array_equal(remote, want)
        notes = peer.cmd(cmd="notifs")["notifs"]
        assert [base64.b64decode(m) for m in notes["decode"]] == [b"read-done", b"write-done"]
        # and the other direction: the peer initiates a WRITE into us
        dst[:] = SENT
        assert peer.cmd(local, cmd="write", peer="decode", pairs=[[64, dst.ctypes.data + 10, 1000]],
                        notify=base64.b64encode(b"pushed").decode())["ok"]
        deadline = time.monotonic() + 10
        got: dict[str, list[bytes]] = {}
        while not got and time.monotonic() < deadline:
            got = local.drain_notifications()
        assert got == {"prefill": [b"pushed"]}
        expected = np.full(n, SENT, dtype=np.uint8)
        expected[10:1010] = src[64:1064]
        np.testing.assert_array_equal(dst, expected)
    finally:
        peer.close()
        local.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("path,options", [("copy", {}), ("copy", {"copy_thread": True}), ("rma", {})],
                         ids=["copy-poll", "copy-thread", "rma"])
@pytest.mark.parametrize("when", ["idle", "mid-transfer"])
def test_killed_peer_is_reported_within_deadline(when: str, path: str, options: dict[str, Any]) -> None:
    """SIGKILL the peer: a typed PeerDisconnectedError, and this process survives (the
    same-host copy gets ESRCH from the kernel, where UCX's CMA would abort us)."""
    n = 64 << 20
    peer = Peer("prefill", n, "3")
    local = UcxBackend("decode", same_host_copy=PATHS[path], copy_chunk=1 << 20, **options)
    try:
        dst = np.full(n, SENT, dtype=np.uint8)
        local.register([Allocation(dst.ctypes.data, n)])
        local.add_remote("prefill", peer.blob)
        assert local.peer_path("prefill")[0] == PATH_NAMES[path]
        rows = 64
        lp = local.prepare(None, descs(dst.ctypes.data, np.arange(rows) << 20, [1 << 20] * rows))
        rp = local.prepare("prefill", descs(peer.address, np.arange(rows) << 20, [1 << 20] * rows))
        idx = np.arange(rows)
        if when == "idle":
            peer.proc.send_signal(signal.SIGKILL)
            peer.proc.wait()
            x = None
        else:
            x = local.post(Op.READ, lp, idx, rp, idx, b"never")
            peer.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 15
        with pytest.raises(PeerDisconnectedError):
            while True:
                if x is None:
                    x = local.post(Op.READ, lp, idx, rp, idx, None)
                if local.poll(x):  # a transfer that beat the kill is fine; post again
                    local.release(x)
                    x = None
                local.progress()
                assert time.monotonic() < deadline, "dead peer was not reported"
        if x is not None:
            local.release(x)  # returns at once for a dead peer
        with pytest.raises(PeerDisconnectedError):
            local.notify("prefill", b"x")
        local.remove_remote("prefill")
        with pytest.raises(UnknownPeerError):
            local.prepare("prefill", descs(peer.address, [0], [1]))
        # nothing outside the requested rows was touched
        assert (dst[rows << 20:] == SENT).all()
    finally:
        peer.proc.kill()
        peer.proc.wait()
        local.close()


# ---------------------------------------------------------------------------------------------
# the shared conformance suite

try:
    from kvxfer.testing import BackendConformance, TwoProcessConformance
except ImportError:  # pragma: no cover - older core
    BackendConformance = TwoProcessConformance = None  # type: ignore[assignment,misc]

if BackendConformance is not None:

    class TestUcxConformance(BackendConformance):
        """Both agents in one process, defaults: the same-host copy path (pid == our own).
        ``Transfer.wait`` polls only the initiator; the copy path needs no target progress."""

        backend = "ucx"
        options: dict[str, Any] = {}

    class TestUcxConformanceCma(BackendConformance):
        """One process over UCX itself: CMA is one-sided too, and within one process a peer
        cannot die on its own, so CMA's abort-on-dead-peer cannot happen here."""

        backend = "ucx"
        options: dict[str, Any] = {"cma": True, "same_host_copy": False}


    class TestUcxTwoProcesses(TwoProcessConformance):
        """Defaults: the same-host copy path."""

        backend = "ucx"
        options: dict[str, Any] = {}

    class TestUcxTwoProcessesCopyThread(TwoProcessConformance):
        """Same-host copy finished by the worker thread."""

        backend = "ucx"
        options: dict[str, Any] = {"copy_thread": True}

    class TestUcxTwoProcessesRma(TwoProcessConformance):
        """Fast path off: UCX RMA (shm/TCP) as for peers on other hosts."""

        backend = "ucx"
        options: dict[str, Any] = {"same_host_copy": False}
