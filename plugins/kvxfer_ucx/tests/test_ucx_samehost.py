"""The same-host copy path: batching, partial syscalls, cancellation, errno mapping, and the
proof that decides which process a peer is and which of its memory may be touched.

Every transfer moves real bytes and checks what changed and what must not have.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import hashlib
import json
import mmap
import os
import time
from typing import Any

import numpy as np
import pytest
from ucx_helpers import SENT, descs, drive, pattern

from kvxfer.deadlines import Deadline
from kvxfer import Allocation, Op
from kvxfer.errors import (BackendError, IdentityError, MetadataError, OutOfRegistrationError, PeerDisconnectedError,
                           StalePeerError, TransferCancelledError)
from kvxfer_ucx import _hostpage as HP
from kvxfer_ucx import _samehost as SH
from kvxfer_ucx.backend import UcxBackend

pytestmark = pytest.mark.ucx

Pair = tuple[UcxBackend, UcxBackend, np.ndarray, np.ndarray]


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
def test_copy_path_many_descriptors(copy_pair: Pair, op: Op,
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
def test_copy_path_splits_large_descriptors(copy_pair: Pair,
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
    deadline = Deadline.within(20)
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



def test_copy_path_release_stops_copying() -> None:
    """release() of a running copy returns only once nothing more is written, and later
    polls report the cancellation; a finished prefix stays, the rest keeps its sentinel."""
    n = 96 << 20
    src = pattern(n, 2)
    dst = np.full(n, SENT, dtype=np.uint8)
    a = UcxBackend("prefill")
    b = UcxBackend("decode", copy_chunk=256 << 10, poll_budget=0.0)
    try:
        a.register([Allocation(src.ctypes.data, n)])
        b.register([Allocation(dst.ctypes.data, n)])
        b.add_remote("prefill", a.local_metadata())
        lp = b.prepare(None, descs(dst.ctypes.data, [0], [n]))
        rp = b.prepare("prefill", descs(src.ctypes.data, [0], [n]))
        x = b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None)
        assert not b.poll(x)  # one 256 KiB syscall per poll with a zero budget
        b.release(x)
        snapshot = dst.copy()
        time.sleep(0.05)
        np.testing.assert_array_equal(dst, snapshot)  # nothing moves after release
        moved = int(np.flatnonzero(snapshot != SENT).max(initial=-1)) + 1
        assert 0 < moved < n, "the copy finished before it could be cancelled"
        np.testing.assert_array_equal(snapshot[:moved], src[:moved])
        with pytest.raises(TransferCancelledError):
            b.poll(x)
    finally:
        b.close()
        a.close()


def _tamper(blob: bytes, **host: Any) -> bytes:
    doc = json.loads(blob)
    doc["host"] = None if host.get("none") else {**doc["host"], **host}
    return json.dumps(doc).encode()


def test_copy_path_fallbacks_and_forcing() -> None:
    """Which peers get the copy path, and why not; auto falls back, True refuses. A header
    edited to claim another host, no host or another process, while its worker address still
    names this host's process, is refused on every path (IdentityError): only a peer whose
    address reaches no process of this host (over TCP here) falls back to RMA unproven."""
    a = UcxBackend("prefill")
    net = UcxBackend("prefill", trusted_network=True, tls="self,tcp,posix")
    others: list[UcxBackend] = []
    try:
        blob = a.local_metadata()
        wrong = base64.b64encode(hashlib.sha256(b"someone else").digest()).decode()
        d1 = UcxBackend("d1", same_host_copy=False)
        others.append(d1)
        d1.add_remote("prefill", blob)
        assert d1.peer_path("prefill") == ("ucx-rma", "same_host_copy=False on this agent; RMA bounded by its "
                                                       "registration page")
        refused = {
            "no host": (_tamper(blob, none=True), "claims another host"),
            "other host": (_tamper(blob, boot_id="00000000-dead"), "claims another host"),
            "other pidns": (_tamper(blob, pidns="pid:[1]"), "claims another host"),
            "wrong process": (_tamper(blob, digest=wrong), "token mismatch"),
        }
        for what, (peer_blob, why) in refused.items():
            for mode in (None, False, True):
                b = UcxBackend("d2", same_host_copy=mode)
                others.append(b)
                with pytest.raises(IdentityError, match=why):
                    b.add_remote("prefill", peer_blob)
        # a peer over TCP that says it runs elsewhere: its address names no process of this host
        away = _tamper(net.local_metadata(), boot_id="00000000-dead")
        for mode in (None, True):
            d3 = UcxBackend("d3", same_host_copy=mode, trusted_network=True, tls="self,tcp")
            others.append(d3)
            d3.add_remote("prefill", away)
            path, reason = d3.peer_path("prefill")
            assert path == "ucx-rma" and "another host" in reason, reason
        forced = UcxBackend("d7", same_host_copy=True)
        others.append(forced)
        forced.add_remote("prefill", blob)
        assert forced.peer_path("prefill")[0] == "same-host-copy"
        with pytest.raises(BackendError, match="same_host_copy"):
            UcxBackend("d8", same_host_copy="yes")  # type: ignore[arg-type]
    finally:
        for b in others:
            b.close()
        net.close()
        a.close()


def test_copy_errno_mapping() -> None:
    """ESRCH is a dead peer; EPERM says why and how to fall back; EFAULT names the cause."""
    assert isinstance(SH.map_errno(errno.ESRCH, "read", "p", 7), PeerDisconnectedError)
    eperm = SH.map_errno(errno.EPERM, "read", "p", 7)
    assert type(eperm) is BackendError
    assert "ptrace" in str(eperm) and "Yama" in str(eperm) and "same_host_copy=False" in str(eperm)
    efault = SH.map_errno(errno.EFAULT, "write", "p", 7)
    assert type(efault) is BackendError and "unmapped" in str(efault)


def test_copy_path_unmapped_remote_is_typed_error() -> None:
    """A peer whose registered memory is unmapped under it (without deregistering): EFAULT
    becomes a BackendError, no crash, and no byte of ours changes."""
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
                                {**host, "hostname": "h" * 300}, {**host, "digest": "AAAA"},
                                {**host, "digest": "%%"}, {**host, "page": -1}, {**host, "page": 0},
                                {k: v for k, v in host.items() if k != "digest"}]
        for h in bad_hosts:
            with pytest.raises(MetadataError):
                b.add_remote("x", json.dumps({**good, "host": h}).encode())
        no_host = {k: v for k, v in good.items() if k != "host"}
        with pytest.raises(MetadataError):  # the key is required (null to opt out)
            b.add_remote("x", json.dumps(no_host).encode())
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------
# the proof: a forged or copied blob cannot point the copy path outside registrations

def test_own_identity_in_a_peer_blob_is_refused(copy_pair: Pair) -> None:
    """A blob that carries this agent's own host entry (say, copied from our metadata) is refused."""
    a, b, src, dst = copy_pair
    mine = json.loads(b.local_metadata())["host"]
    forged = json.loads(a.local_metadata())
    forged["host"] = mine
    with pytest.raises(MetadataError, match="own same-host identity"):
        b.add_remote("prefill", json.dumps(forged).encode())
    assert b.peer_path("prefill")[0] == "same-host-copy"  # the genuine peer is still there


def test_forged_allocations_cannot_reach_unregistered_memory() -> None:
    """A hostile peer copies a victim's host entry (the victim here is a third agent in this
    process, and then this very agent) and advertises the victim's *unregistered* secret.
    The proof reads the victim's own registration page: the blob is refused, nothing moves."""
    secret = pattern(1 << 16, 99)
    kept = secret.copy()
    shared = pattern(1 << 16, 98)
    mine = np.full(1 << 16, SENT, dtype=np.uint8)
    victim, attacker, me = UcxBackend("victim"), UcxBackend("attacker"), UcxBackend("me")
    try:
        victim.register([Allocation(shared.ctypes.data, shared.nbytes)])  # the secret is NOT registered
        me.register([Allocation(mine.ctypes.data, mine.nbytes)])
        for host_of in (victim, me):
            forged = json.loads(attacker.local_metadata())
            forged["host"] = json.loads(host_of.local_metadata())["host"]
            forged["allocations"] = [[secret.ctypes.data, secret.nbytes, "AAAA"]]
            with pytest.raises(MetadataError, match="did not register|own same-host identity"):
                me.add_remote("attacker", json.dumps(forged).encode())
        # the victim's registered memory is all a copied host entry can ever reach
        forged = json.loads(attacker.local_metadata())
        forged["host"] = json.loads(victim.local_metadata())["host"]
        forged["allocations"] = [[shared.ctypes.data, shared.nbytes, "AAAA"]]
        me.add_remote("attacker", json.dumps(forged).encode())
        with pytest.raises(OutOfRegistrationError, match="outside"):
            me.prepare("attacker", descs(secret.ctypes.data, [0], [16]))
        np.testing.assert_array_equal(secret, kept)
        assert (mine == SENT).all()
    finally:
        for x in (me, attacker, victim):
            x.close()


@pytest.mark.parametrize("change", ["deregister", "re-register"])
def test_stale_peer_registration_fails_typed(copy_pair: Pair, change: str) -> None:
    """After the peer deregistered (or re-registered) memory, a read through lists prepared
    before fails with StalePeerError instead of returning stale bytes; fresh metadata works."""
    a, b, src, dst = copy_pair
    lp = b.prepare(None, descs(dst.ctypes.data, [0], [4096]))
    rp = b.prepare("prefill", descs(src.ctypes.data, [0], [4096]))
    drive(a, xfer=b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None), owner=b)
    dst[:] = SENT
    a.deregister(1)
    if change == "re-register":
        a.register([Allocation(src.ctypes.data, src.nbytes)])
    with pytest.raises(StalePeerError, match="changed its registered memory"):
        b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None)
    assert (dst == SENT).all()
    if change == "re-register":
        b.add_remote("prefill", a.local_metadata())
        rp = b.prepare("prefill", descs(src.ctypes.data, [0], [4096]))
        drive(a, xfer=b.post(Op.READ, lp, np.arange(1), rp, np.arange(1), None), owner=b)
        np.testing.assert_array_equal(dst[:4096], src[:4096])


def test_page_detects_another_process_behind_the_pid() -> None:
    """If the pid came to hold another process (pid reuse), the token read back differs."""
    lib = SH.libc()
    if lib is None:
        pytest.skip(SH.libc_error() or "no process_vm_readv")
    page = HP.RegistrationPage()
    page.publish([(4096, 8192)])
    got = HP.read_page(lib, os.getpid(), page.address, page.digest, "self")
    assert got.spans.find(np.array([4096], np.uint64), np.array([16], np.uint64), 0, got.spans.allocations[0].kind)[0] == 0
    got.recheck(lib)
    ctypes.memmove(page.address, os.urandom(HP.TOKEN_BYTES), HP.TOKEN_BYTES)  # "another process"
    with pytest.raises(PeerDisconnectedError, match="no longer peer"):
        got.recheck(lib)
