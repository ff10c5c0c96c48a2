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

@pytest.fixture
def pair() -> Iterator[tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]]:
    a, b = UcxBackend("prefill"), UcxBackend("decode")
    src = pattern(64 * 1024, 1)
    dst = np.full(64 * 1024, SENT, dtype=np.uint8)
    a.register([Allocation(src.ctypes.data, src.nbytes)])
    b.register([Allocation(dst.ctypes.data, dst.nbytes)])
    b.add_remote("prefill", a.local_metadata())
    a.add_remote("decode", b.local_metadata())
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
def test_two_processes_read_write_notify() -> None:
    n = 1 << 20
    peer = Peer("prefill", n, "5")
    local = UcxBackend("decode")
    try:
        dst = np.full(n, SENT, dtype=np.uint8)
        local.register([Allocation(dst.ctypes.data, n)])
        local.add_remote("prefill", peer.blob)
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
@pytest.mark.parametrize("when", ["idle", "mid-transfer"])
def test_killed_peer_is_reported_within_deadline(when: str) -> None:
    n = 64 << 20
    peer = Peer("prefill", n, "3")
    local = UcxBackend("decode")
    try:
        dst = np.full(n, SENT, dtype=np.uint8)
        local.register([Allocation(dst.ctypes.data, n)])
        local.add_remote("prefill", peer.blob)
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
        """Both agents in one process. ``Transfer.wait`` polls only the initiator, so the
        target must not need progress: CMA is truly one-sided, and within one process a peer
        cannot die on its own, so CMA's abort-on-dead-peer cannot happen here."""

        backend = "ucx"
        options: dict[str, Any] = {"cma": True}


    class TestUcxTwoProcesses(TwoProcessConformance):
        backend = "ucx"
        options: dict[str, Any] = {}
