"""kvxfer.peers: one process identity, proof and watcher, and every backend refusing a forgery with it.

The device path's and NIXL's refusals are in ``tests/test_cuda_identity.py`` and
``plugins/kvxfer_nixl/tests/test_nixl_identity.py``; loopback's and UCX's are here. Each
refusal has a control that replaces the shared check and shows the forgery getting through.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from kvxfer import Agent, peers
from kvxfer.errors import IdentityError, PeerDisconnectedError
from kvxfer.peers import proof
from kvxfer.plugin import Live, identity
from kvxfer.testing.lines import Channel


def test_identity_round_trips_and_names_this_process() -> None:
    me = peers.here()
    assert peers.decode(peers.encode(me)) == me
    assert peers.names_this_process(me) and me.same_host()
    assert me.token == proof.token_of(ctypes.string_at(me.page, 16))  # the page holds the secret
    other = dataclasses.replace(me, pid=me.pid + 1, token=os.urandom(16))
    assert not peers.names_this_process(other)
    assert not dataclasses.replace(me, pidns=me.pidns + 1).same_host()


def test_proof_accepts_the_genuine_page_and_refuses_every_forgery() -> None:
    me = peers.here()
    peers.process_page().set("test", [(4096, 8192)])
    try:
        got = peers.prove(me, "self")
        assert got.covers([4096, 8000], [16, 192]).tolist() == [True, True]
        assert got.covers([4000, 8190], [16, 4]).tolist() == [False, False]
    finally:
        peers.process_page().drop("test")
    with pytest.raises(IdentityError, match="secret"):
        peers.prove(dataclasses.replace(me, token=os.urandom(16)), "forged token")
    with pytest.raises(IdentityError, match="start time"):
        peers.prove(dataclasses.replace(me, start_time=me.start_time + 1), "reused pid")
    with pytest.raises(IdentityError, match="no proof page"):
        peers.prove(dataclasses.replace(me, page=8), "unmapped page")
    with pytest.raises(IdentityError, match="offers no proof page"):
        peers.prove(dataclasses.replace(me, page=0), "no page")


def test_proof_of_a_process_that_is_gone_is_a_disconnect() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import kvxfer.peers as p, sys; i = p.here(); "
                          "sys.stdout.write(p.encode(i).hex() + '\\n'); sys.stdout.flush(); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None
    claim = peers.decode(bytes.fromhex(Channel(p).line(60).strip()))
    assert peers.prove(claim, "child").identity == claim  # another process, proven by reading it
    p.stdin.close()
    p.wait(timeout=30)
    with pytest.raises((PeerDisconnectedError, IdentityError)):
        peers.prove(claim, "child")


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_forked_child_gets_its_own_secret_and_the_parents_is_wiped() -> None:
    parent, page = peers.here(), peers.process_page()  # holding the page keeps its buffer where it is
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child = peers.here()
        os.write(w, child.token + ctypes.string_at(page.address, 16))
        os._exit(0)
    os.close(w)
    got = os.read(r, 32)
    os.waitpid(pid, 0)
    os.close(r)
    assert got[:16] != parent.token and got[16:] == bytes(16)


def test_watcher_sees_exit_even_unreaped_and_reused_pids() -> None:
    for every in (0, 0.001):
        p = subprocess.Popen(["sleep", "30"])
        w = peers.ProcessWatch(p.pid, peers.start_time(p.pid), every=every)
        assert w.alive(force=True)
        p.kill()
        end = time.monotonic() + 30
        while w.alive(force=True):  # the kill lands asynchronously; the child stays a zombie
            assert time.monotonic() < end
        p.wait()
    with pytest.raises(OSError):
        peers.ProcessWatch(os.getpid(), peers.start_time(os.getpid()) + 1)
    assert not peers.ProcessWatch(os.getpid(), 1, strict=False).alive()


# -- each backend refuses a forged identity through kvxfer.peers -------------------------------
@pytest.mark.parametrize("bypass", [False, True], ids=["checked", "control-bypassed"])
def test_loopback_refuses_a_forged_identity(bypass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    with Agent("a", backend="loopback") as a, Agent("b", backend="loopback") as b:
        raw = a.backend.local_metadata()
        doc = json.loads(raw)
        me = peers.decode(bytes.fromhex(doc["identity"]))
        forged = json.dumps({**doc, "identity": peers.encode(dataclasses.replace(me, token=os.urandom(16))).hex()})
        if bypass:
            for face in (peers, identity):  # the core's module and the face a backend calls through
                monkeypatch.setattr(face, "check_this_process", lambda claim, what: None)
            # and the live registry's own token check (the second lock on the same door)
            monkeypatch.setattr(Live, "find", lambda self, key, claimed, expected: self._by_id.get(key))
            b.backend.add_remote("a", forged.encode())
            return
        with pytest.raises(IdentityError):
            b.backend.add_remote("a", forged.encode())
        b.backend.add_remote("a", raw)


@pytest.mark.parametrize("bypass", [False, True], ids=["checked", "control-bypassed"])
def test_ucx_refuses_a_forged_identity(bypass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    ucx = pytest.importorskip("kvxfer_ucx.backend", reason="ucx is not installed")
    import hashlib

    from kvxfer.errors import MetadataError

    a, b = ucx.UcxBackend("prefill"), ucx.UcxBackend("decode", same_host_copy=True)
    try:
        doc = json.loads(a.local_metadata())
        doc["host"]["digest"] = base64.b64encode(hashlib.sha256(b"someone else").digest()).decode()
        if bypass:
            for face in (peers, identity):
                monkeypatch.setattr(face, "holds", lambda secret, digest: True)
            b.add_remote("prefill", json.dumps(doc).encode())
            assert b.peer_path("prefill")[0] == "same-host-copy"
            return
        with pytest.raises(MetadataError, match="token mismatch"):
            b.add_remote("prefill", json.dumps(doc).encode())
    finally:
        b.close()
        a.close()


def test_a_page_caught_mid_update_by_a_descheduled_owner_is_waited_for() -> None:
    """An owner stopped between its two seq bumps (a loaded host) must not get a genuine peer refused."""
    import threading

    page = peers.process_page()
    page.set("slow", [(1 << 20, 2 << 20)])
    head = proof._HEADER
    secret, seq, n, d = head.unpack_from(page._buf, 0)
    head.pack_into(page._buf, 0, secret, seq + 1, n, d)  # odd: "being updated"
    threading.Timer(0.05, lambda: head.pack_into(page._buf, 0, secret, seq, n, d)).start()  # owner resumes
    try:
        got = peers.prove(peers.here(), "self")
        assert got.seq == seq and got.covers([1 << 20], [4096]).all()
    finally:
        page.drop("slow")


def test_a_dropped_watch_closes_its_pidfd() -> None:
    import gc

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        peers.ProcessWatch(os.getpid(), peers.start_time(os.getpid()))
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_a_full_page_says_so_and_keeps_what_it_had() -> None:
    from kvxfer.errors import BackendError

    page = peers.Page(max_spans=4)
    page.set("a", [(4096 * i, 4096 * i + 8) for i in range(1, 4)], digests=[b"d" * 32])
    with pytest.raises(BackendError, match="at most 4"):
        page.set("b", [(1 << 30, (1 << 30) + 8), (2 << 30, (2 << 30) + 8)])
    page.set("c", [(1 << 30, (1 << 30) + 8)])  # the refused entry took no room
    page.drop("c")
    me = dataclasses.replace(peers.here(), token=page.token, page=page.address)
    got = peers.prove(me, "small page")
    assert len(got.spans) == 3 and got.digests == {b"d" * 32}
