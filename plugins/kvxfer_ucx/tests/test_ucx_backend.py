"""The UCX backend at the seam: struct layouts, byte moves on both paths, bounds, peers, conformance.

Every transfer moves real bytes: sources hold a seeded pattern, destinations the sentinel
0xAA, and each test checks both what changed and what must not have. The whole folder is
skipped when libucp is not installed (see conftest.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ucx_helpers import SENT, descs, drive

from kvxfer.deadlines import Deadline
from kvxfer import Allocation, DescriptorList, MemoryKind, Op
from kvxfer.errors import (BackendError, MetadataError, OutOfRegistrationError, StalePeerError, UnknownPeerError,
                           UnsupportedError)
from kvxfer_ucx import _libucp as L
from kvxfer_ucx.backend import UcxBackend

pytestmark = pytest.mark.ucx

Pair = tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]

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
    include = Path(str(L.find_libucp())).parent.parent / "include"
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
    code = ("import kvxfer; from kvxfer.extras import install_hint; "
            "s = {b.name: b for b in kvxfer.available_backends()}['ucx']; "
            "assert not s.available and 'libucp' in s.reason and s.install == install_hint('ucx'), s; "
            "assert s.install.startswith(\"pip install 'libucx-cu12\"), s")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)



# ---------------------------------------------------------------------------------------------
# one process, two backends

@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_moves_exact_bytes(pair: Pair, op: Op) -> None:
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


def test_index_arrays_pick_and_permute(pair: Pair) -> None:
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


def test_notification_arrives_after_data(pair: Pair) -> None:
    a, b, src, dst = pair
    lp = a.prepare(None, descs(src.ctypes.data, [0], [65536]))
    rp = a.prepare("decode", descs(dst.ctypes.data, [0], [65536]))
    x = a.post(Op.WRITE, lp, np.arange(1), rp, np.arange(1), b"req-7 done")
    got: list[bytes] = []
    deadline = Deadline.within(20)
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


def test_standalone_notify(pair: Pair) -> None:
    a, b, _, _ = pair
    b.notify("prefill", b"hello")
    b.notify("prefill", b"")
    got: list[bytes] = []
    deadline = Deadline.within(10)
    while len(got) < 2 and time.monotonic() < deadline:
        b.progress()  # the sender drives its own sends
        got += a.drain_notifications().get("decode", [])
    assert got == [b"hello", b""]


def test_out_of_bounds_descriptors_rejected(pair: Pair) -> None:
    """Anything leaving a registration (either side, wrapping, strided rows) is an
    OutOfRegistrationError at prepare, before any byte moves."""
    a, b, src, dst = pair
    base, n = src.ctypes.data, src.nbytes
    for offs, sizes in ([n - 10], [11]), ([0, n], [1, 1]), ([0], [n + 1]):
        with pytest.raises(OutOfRegistrationError, match="outside"):
            b.prepare("prefill", descs(base, offs, sizes))
    with pytest.raises(OutOfRegistrationError, match="outside"):
        b.prepare("prefill", DescriptorList(np.array([[base - 1, 2, 0]], dtype=np.uint64)))
    with pytest.raises(OutOfRegistrationError, match="outside"):  # wraps around 2**64
        b.prepare("prefill", DescriptorList(np.array([[base + 8, (1 << 64) - 4, 0]], dtype=np.uint64)))
    with pytest.raises(OutOfRegistrationError, match="outside"):  # local side too
        b.prepare(None, descs(dst.ctypes.data, [dst.nbytes - 1], [2]))
    strided = [[base, 1024, 0, 4096, n // 4096 + 1],  # the last span is past the end
               [base, 1024, 0, (1 << 63), 3],  # stride * (count - 1) wraps
               [base, 64, 0, 128, 1 << 40]]  # a huge count: rejected without expanding it
    for row in strided:
        with pytest.raises(OutOfRegistrationError, match="leaves the registered"):
            b.prepare("prefill", DescriptorList(np.array([row], dtype=np.uint64)))
    assert (dst == SENT).all()


def test_strided_lists_are_resolved_lazily(pair: Pair) -> None:
    """A strided row of 2**30 spans prepares in O(1) memory; posts resolve only what they move."""
    a, b, src, dst = pair
    huge = DescriptorList(np.array([[src.ctypes.data, 16, 0, 0, 1 << 30]], dtype=np.uint64))  # stride 0: same span
    rp = b.prepare("prefill", huge)
    assert rp.size == 1 << 30
    rows = DescriptorList(np.array([[src.ctypes.data, 256, 0, 1024, 64]], dtype=np.uint64))  # 64 spans
    lp = b.prepare(None, DescriptorList(np.array([[dst.ctypes.data, 256, 0, 256, 64]], dtype=np.uint64)))
    rp = b.prepare("prefill", rows)
    li, ri = np.array([0, 7, 63]), np.array([63, 1, 30])
    drive(a, xfer=b.post(Op.READ, lp, li, rp, ri, None), owner=b)
    expected = np.full_like(dst, SENT)
    for l_, r_ in zip(li, ri):
        expected[l_ * 256:(l_ + 1) * 256] = src[r_ * 1024:r_ * 1024 + 256]
    np.testing.assert_array_equal(dst, expected)


def test_mismatched_lengths_and_bad_indices(pair: Pair) -> None:
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
    """Strict blob parsing: every malformed input is a MetadataError, nothing else escapes."""
    b = UcxBackend("x")
    try:
        good = json.loads(b.local_metadata())
        rk = good["allocations"][0][2] if good["allocations"] else "AAAA"
        nested = b"[" * 100_000 + b"]" * 100_000
        bad_docs: list[Any] = [b"not json", b"[]", b"\xff\xfe", nested, b'{"magic": NaN}',
                               {**good, "magic": "nixl"}, {**good, "version": 2}, {**good, "version": True},
                               {**good, "extra": 1}, {**good, "worker": "%%%"}, {**good, "worker": ""},
                               {**good, "agent": ["x"]}, {**good, "agent": "\udc80"}, {**good, "ucx": 5},
                               {**good, "allocations": [[1, 0, rk]]}, {**good, "allocations": {}},
                               {**good, "allocations": [[(1 << 64) - 1, 2, rk]]},
                               {**good, "allocations": [[True, 1, rk]]}, {**good, "allocations": [[1.5, 1, rk]]},
                               {**good, "allocations": [[1, 1]]}, {**good, "allocations": [[1, 1, "A" * 200000]]},
                               {**good, "allocations": [[4096, 100, rk], [4000, 10, rk]]},  # unsorted
                               {**good, "allocations": [[4096, 100, rk], [4100, 10, rk]]},  # overlapping
                               {**good, "allocations": [[1, 1, rk]] * 5000},
                               b'{"magic": "kvxfer-ucx", "magic": "kvxfer-ucx"}', b"x" * (5 << 20)]
        for doc in bad_docs:
            blob = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
            with pytest.raises(MetadataError):
                b.add_remote("x", blob)
        with pytest.raises(MetadataError, match="expected"):
            b.add_remote("someone-else", b.local_metadata())
        with pytest.raises(MetadataError):
            b.add_remote("x", "not bytes")  # type: ignore[arg-type]
    finally:
        b.close()


def test_failed_add_remote_leaves_the_known_peer_intact(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejected blob for a known peer changes nothing, whether it fails before or after
    native resources were created: the old lists and connection keep working."""
    from kvxfer_ucx._worker import UcxCallError, Worker

    a, b, src, dst = pair
    lp = b.prepare(None, descs(dst.ctypes.data, [0], [64]))
    rp = b.prepare("prefill", descs(src.ctypes.data, [0], [64]))
    peers, eps = dict(b._peers), dict(b._by_ep)
    doc = json.loads(a.local_metadata())
    with pytest.raises(MetadataError):  # fails in validation
        b.add_remote("prefill", json.dumps({**doc, "version": 1}).encode())

    def refuse(self: Worker, ep: int, packed: bytes) -> int:
        raise UcxCallError("ucx metadata: remote key rejected by UCX: test", -5)

    # fails after the endpoint (and, on the RMA path, the peer's own worker) was created
    monkeypatch.setattr(Worker, "unpack_rkey", refuse)
    monkeypatch.setattr(b, "_same_host_copy", False)  # the RMA path unpacks remote keys, the copy path none
    with pytest.raises(MetadataError, match="remote key"):
        b.add_remote("prefill", a.local_metadata())
    monkeypatch.undo()
    assert b._peers == peers and b._by_ep == eps
    drive(a, xfer=b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None), owner=b)
    np.testing.assert_array_equal(dst[:64], src[:64])
    assert (dst[64:] == SENT).all()


def test_unknown_and_stale_peers(pair: Pair) -> None:
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
# the shared conformance suite

from kvxfer.testing import BackendConformance, TwoProcessConformance  # noqa: E402


class TestUcxConformance(BackendConformance):
    """Both agents in one process, defaults: the same-host copy path (the pid is our own).

    There is no in-process RMA variant: UCX's software RMA needs the *target's* worker
    progressed, and the in-process suite drives only the initiator (the seam tests above
    cover RMA in one process by driving both)."""

    backend = "ucx"
    options: dict[str, Any] = {}


class TestUcxTwoProcesses(TwoProcessConformance):
    """Defaults: the same-host copy path."""

    backend = "ucx"
    options: dict[str, Any] = {}


class TestUcxTwoProcessesRma(TwoProcessConformance):
    """Copy path off: UCX RMA over shared memory."""

    backend = "ucx"
    options: dict[str, Any] = {"same_host_copy": False}


class TestUcxTwoProcessesTcp(TwoProcessConformance):
    """UCX RMA over TCP, as between hosts (needs trusted_network=True)."""

    backend = "ucx"
    options: dict[str, Any] = {"same_host_copy": False, "trusted_network": True, "tls": "self,tcp"}


class TestUcxConformanceOwner(BackendConformance):
    """The same-host copy path with every agent driven through kvxfer.Owner."""

    backend = "ucx"
    options: dict[str, Any] = {}
    owned = True


class TestUcxTwoProcessesOwner(TwoProcessConformance):
    backend = "ucx"
    options: dict[str, Any] = {}
    owned = True
