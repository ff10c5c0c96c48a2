"""The NIXL backend against hostile metadata, deregistered and dying peers, huge posts.

Every transfer moves real bytes and checks both what changed and what did not; no test
asserts on time. Fuzzing and the kill matrix run small here; their scripts run them large
(``fuzz_blob.py``, ``kill_matrix.py``; counts in RELIABILITY.md).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import struct
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np
import pytest

from kvxfer.deadlines import Deadline
from kvxfer import Agent, AgentMetadata, DescriptorList, MemoryKind, Op
from kvxfer.errors import MetadataError, OutOfRegistrationError, StalePeerError
from kvxfer.memory import Allocation
from kvxfer.testing import lines
from kvxfer.testing.seam import finish, joined

nb = pytest.importorskip("kvxfer_nixl.backend", reason="nixl is not installed: pip install -e '.[nixl]'")
from kvxfer_nixl import _blob  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the campaign scripts beside this file
import fuzz_blob  # type: ignore[import-not-found]  # noqa: E402
import kill_matrix  # type: ignore[import-not-found]  # noqa: E402

pytestmark = pytest.mark.nixl

SENTINEL = 0xAA
ROWS, ROW = 16, 4096
_LEN = struct.Struct("<Q")


def _pattern(rows: int = ROWS, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, ROW), dtype=np.uint8)


def _rows(arr: np.ndarray) -> DescriptorList:
    return DescriptorList(np.array([[arr.ctypes.data, ROW, 0, ROW, arr.shape[0]]], dtype=np.uint64))


def _wait(be: Any, x: Any, limit: float = 30.0) -> None:
    finish(be, x, limit)


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any, np.ndarray, np.ndarray]]:
    """``a`` holds a patterned source, ``b`` a sentinel destination; b has not added a yet."""
    src, dst = _pattern(), np.full((ROWS, ROW), SENTINEL, np.uint8)
    with joined(nb.NixlBackend("safe-a"), nb.NixlBackend("safe-b"), src, dst, add=False) as (a, b):
        yield a, b, src, dst


def _read_and_check(b: Any, peer: str, src: np.ndarray, dst: np.ndarray, d: list[int], s: list[int]) -> None:
    lp, rp = b.prepare(None, _rows(dst)), b.prepare(peer, _rows(src))
    dst[...] = SENTINEL
    _wait(b, b.post(Op.READ, lp, np.array(d, np.int32), rp, np.array(s, np.int32), None))
    np.testing.assert_array_equal(dst[d], src[s])
    rest = [i for i in range(dst.shape[0]) if i not in d]
    assert (dst[rest] == SENTINEL).all()


# --------------------------------------------------------------------------------------------
# The blob parser
# --------------------------------------------------------------------------------------------
def _split(blob: bytes) -> tuple[bytes, bytes]:
    """(kvxfer header, NIXL metadata)."""
    n = _blob.HEADER.size
    return blob[:n], blob[n:]


def _nixl_md(blob: bytes) -> bytes:
    return _split(blob)[1]


def test_blob_round_trips_exactly(pair: Any) -> None:
    a, _, _, _ = pair
    blob = a.local_metadata()
    parsed = _blob.parse(blob, "safe-a", ("UCX",))
    assert parsed.nixl_metadata("safe-a") == _nixl_md(blob)
    assert [(s.kind, len(s.descs)) for s in parsed.sections] == [(MemoryKind.DRAM, 1)]
    (alloc,) = parsed.allocations()
    assert alloc.nbytes == ROWS * ROW


def _records(md: bytes) -> list[tuple[int, int]]:
    """(offset of the length field, its value) of every record in NIXL metadata."""
    head = _blob.HEADER.pack(_blob.MAGIC, b"", b"", 0)
    reg = fuzz_blob.regions(head + md)
    return [(off - len(head), _LEN.unpack_from(md, off - len(head))[0]) for off in reg.lengths]


def _corruptions(blob: bytes) -> dict[str, bytes]:
    """Targeted corruptions, each refused by the parser (NIXL would misread or half-load most)."""
    head, md = _split(blob)
    parsed = _blob.parse(blob, "safe-a", ("UCX",))
    sec = parsed.sections[0]
    (addr, n, dev, key), = sec.descs

    def rebuilt(**changes: Any) -> bytes:
        return head + dataclasses.replace(parsed, **changes).nixl_metadata("safe-a")

    def with_section(**changes: Any) -> bytes:
        return rebuilt(sections=(dataclasses.replace(sec, **changes),))

    out = {
        "other name": head + parsed.nixl_metadata("safe-x"),
        "non-UTF-8 name": head + parsed.nixl_metadata("safe-a").replace(b"safe-a", b"safe-\xff", 1),
        "trailing byte": blob + b"|",
        "no connection": rebuilt(conns=()),
        "backend twice": rebuilt(conns=parsed.conns * 2),
        "unknown backend only": rebuilt(conns=(("GDS", b"x"),)),
        "memory without its connection": with_section(backend="POSIX"),
        "section twice": rebuilt(sections=(sec, sec)),
        "empty section": with_section(descs=()),
        "descriptor without key": with_section(descs=((addr, n, dev, b""),)),
        "zero-length span": with_section(descs=((addr, 0, dev, key),)),
        "wrapping span": with_section(descs=(((1 << 64) - 8, 16, dev, key),)),
        "device 2**31": with_section(descs=((addr, n, 1 << 31, key),)),
        "span twice": with_section(descs=((addr, n, dev, key), (addr, n, dev, key + b"x"))),
        "UCX address version 15": rebuilt(conns=(("UCX", b"\xff" + parsed.conns[0][1][1:]),)),
        "bad magic": b"KVXNIXL2" + blob[8:],
        "header cut": head[:-1] + md,
        "epoch cut short": blob[:_blob.HEADER.size - 4] + blob[_blob.HEADER.size:],
        "memory type 7": blob.replace(b"t" + _LEN.pack(4) + struct.pack("<I", 0), b"t" + _LEN.pack(4)
                                      + struct.pack("<I", 7), 1),
    }
    for off, value in _records(md):
        for bad in (value + 1, value - 1, 1 << 63, (1 << 64) - 1):
            out[f"length {value} at {off} set to {bad}"] = head + md[:off] + _LEN.pack(bad % (1 << 64)) + md[off + 8:]
        out[f"cut inside the length at {off}"] = head + md[:off + 4]
    return out


def test_every_targeted_corruption_is_refused_and_leaves_no_state(pair: Any) -> None:
    a, b, src, dst = pair
    genuine = a.local_metadata()
    for what, bad in _corruptions(genuine).items():
        loads = b._loads
        with pytest.raises(MetadataError):
            b.add_remote("safe-a", bad)
        assert b._loads == loads and "safe-a" not in b._remotes, f"{what}: partial state left behind"
    b.add_remote("safe-a", genuine)
    _read_and_check(b, "safe-a", src, dst, [0, 5, 6], [3, 3, 9])


@pytest.mark.parametrize("name", ["\ud800", "x\udcff", 7, None, b"safe-a"])
def test_peer_names_that_are_not_unicode_strings_are_metadata_errors(pair: Any, name: Any) -> None:
    a, b, _, _ = pair
    with pytest.raises(MetadataError):
        b.add_remote(name, a.local_metadata())
    assert not b._remotes


def test_a_blob_nixl_refuses_halfway_does_not_block_the_genuine_peer(pair: Any) -> None:
    """NIXL loads the connection, then fails on a remote key it cannot unpack (or crashes on
    it). Such keys are tried in the prover's helper process first, so this process's NIXL
    never sees them; in the helper each load has a name of its own, so the half-load left
    there does not block the genuine peer's proof either."""
    a, b, src, dst = pair
    genuine = a.local_metadata()
    parsed = _blob.parse(genuine, "safe-a", ("UCX",))
    sec = parsed.sections[0]
    (addr, n, dev, key), = sec.descs
    refused = 0
    before = b._prover.stats["refused"]
    # Three keys the parser refuses (no MD, no memory type, cut), one whose frame is fine but
    # names an MD the peer does not have: NIXL connects, then refuses the key (in the helper).
    for bad_key in (bytes(len(key)), b"\xff" * len(key), key[:1], (2).to_bytes(8, "little") + key[8:]):
        bad = _split(genuine)[0] + dataclasses.replace(parsed, sections=(dataclasses.replace(
            sec, descs=((addr, n, dev, bad_key),)),)).nixl_metadata("safe-a")
        loads = b._loads
        try:
            b.add_remote("safe-a", bad)
        except MetadataError:
            refused += 1
            assert b._loads == loads, "a refused blob reached this process's NIXL"
        b.add_remote("safe-a", genuine)  # loads whatever happened before
        _read_and_check(b, "safe-a", src, dst, [1, 2], [15, 0])
    assert refused == 4
    assert b._prover.stats["refused"] > before, "NIXL refused no key: the halfway case was not exercised"


def test_replacing_a_peer_keeps_the_old_one_until_the_new_one_loaded(pair: Any) -> None:
    a, b, src, dst = pair
    b.add_remote("safe-a", a.local_metadata())
    with pytest.raises(MetadataError):
        b.add_remote("safe-a", a.local_metadata()[:-1])
    _read_and_check(b, "safe-a", src, dst, [4], [4])


# --------------------------------------------------------------------------------------------
# Fuzzing through Agent.add_peer, in subprocesses (crashes are counted, not fatal)
# --------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_fuzzed_blobs_never_raise_untyped_errors_nor_block_the_peer() -> None:
    res = fuzz_blob.campaign(1200, seed=int(os.environ.get("KVXFER_FUZZ_SEED", "0")))
    assert res["mutations"] == 1200
    # Some mutations keep the blob valid (a changed key byte, an address): if none is accepted,
    # the victim refused the genuine peer itself and nothing below was exercised.
    assert res["results"].get("accepted", 0) > 0, res["results"]
    assert not res["findings"], res["findings"][:5]  # untyped errors, or the genuine blob refused after
    # UCX's own payloads (worker address, remote keys), which kvxfer cannot parse, crash the
    # prover's helper process at worst, never the victim (RELIABILITY.md).
    assert not res["crashes"], res["crashes"]


# --------------------------------------------------------------------------------------------
# Deregistered peers: no silent stale reads; out-of-registration is named as such
# --------------------------------------------------------------------------------------------
def test_list_outside_the_peers_registered_memory_is_out_of_registration(pair: Any) -> None:
    a, b, src, _ = pair
    b.add_remote("safe-a", a.local_metadata())
    beyond = DescriptorList(np.array([[src.ctypes.data + ROW, ROW, 0, ROW, ROWS]], dtype=np.uint64))
    with pytest.raises(OutOfRegistrationError):
        b.prepare("safe-a", beyond)
    with pytest.raises(OutOfRegistrationError):
        b.prepare(None, beyond)  # not ours either
    wraps = DescriptorList(np.array([[src.ctypes.data, ROW, 0, 1 << 62, 8]], dtype=np.uint64))
    with pytest.raises(OutOfRegistrationError):
        b.prepare("safe-a", wraps)


def test_agent_with_a_spec_beyond_the_nixl_registration_gets_out_of_registration() -> None:
    src, dst = _pattern(), np.full((ROWS, ROW), SENTINEL, np.uint8)
    with Agent("p", backend="nixl") as a, Agent("d", backend="nixl") as b:
        a.register({"layer.0": src})
        b.register({"layer.0": dst})
        md = AgentMetadata.decode(a.metadata())
        doc = json.loads(a.metadata()[8:])
        doc["spec"]["allocations"][0]["address"] += 1 << 20  # the spec lies about where the memory is
        peer = b.add_peer(b"KVXFMETA" + json.dumps(doc).encode())
        assert peer == md.name
        with pytest.raises(OutOfRegistrationError):
            b.read(peer, [0], [0]).wait(20)
        assert (dst == SENTINEL).all()


def test_same_process_peer_that_deregistered_is_stale_until_added_again() -> None:
    src, dst = _pattern(), np.full((ROWS, ROW), SENTINEL, np.uint8)
    with Agent("p", backend="nixl") as a, Agent("d", backend="nixl") as b:
        a.register({"layer.0": src})
        b.register({"layer.0": dst})
        peer = b.add_peer(a.metadata())
        b.read(peer, [2], [3]).wait(20)
        np.testing.assert_array_equal(dst[2], src[3])
        a.deregister()
        with pytest.raises(StalePeerError):
            b.read(peer, [4], [5]).wait(20)
        assert (dst[4] == SENTINEL).all()
        a.register({"layer.0": src})
        b.add_peer(a.metadata())  # a new generation: the fresh memory keys
        b.read(peer, [4], [5]).wait(20)
        np.testing.assert_array_equal(dst[4], src[5])



@pytest.mark.parametrize("hook", [False, True], ids=["control-no-landed", "landed"])
def test_a_read_whose_peer_deregistered_before_done_is_refused(monkeypatch: pytest.MonkeyPatch, hook: bool) -> None:
    """The stale-peer check after the data (``NixlBackend.landed``, PathBackend's hook): a READ
    posted before its peer deregistered is not DONE. Control: without the hook it reports DONE."""
    if not hook:
        from kvxfer.plugin import PathBackend
        monkeypatch.setattr(nb.NixlBackend, "landed", PathBackend.landed)
    src, dst = _pattern(), np.full((ROWS, ROW), SENTINEL, np.uint8)
    with Agent("p", backend="nixl") as a, Agent("d", backend="nixl") as b:
        a.register({"layer.0": src})
        b.register({"layer.0": dst})
        peer = b.add_peer(a.metadata())
        t = b.read(peer, [4], [5])  # posted; not yet polled
        a.deregister()  # marks d's peer stale at once (same process)
        if hook:
            with pytest.raises(StalePeerError, match="may have moved stale bytes"):
                t.wait(20)
        else:
            t.wait(20)  # the bad outcome: DONE for bytes from memory its owner gave up
            np.testing.assert_array_equal(dst[4], src[5])
        assert (np.delete(dst, 4, axis=0) == SENTINEL).all()

_DEREG_PEER = r"""
import base64, sys
import numpy as np
from kvxfer import Agent
from kvxfer.testing import lines
src = np.random.default_rng(5).integers(0, 256, (16, 4096), dtype=np.uint8)

def handle(cmd):
    if cmd["cmd"] == "add_peer":
        agent.add_peer(base64.b64decode(cmd["metadata"]))
    elif cmd["cmd"] == "deregister":
        agent.deregister()
    else:
        raise ValueError(f"unknown command {cmd['cmd']!r}")
    return {"ok": True}

with Agent("remote", backend="nixl") as agent:
    agent.register({"layer.0": src})
    lines.say(sys.stdout, {"metadata": base64.b64encode(agent.metadata()).decode()})
    lines.serve(handle, agent.progress)
"""


@pytest.mark.multiprocess
def test_peer_in_another_process_that_deregistered_is_detected() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _DEREG_PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "NIXL_LOG_LEVEL": "ERROR"})
    ch = lines.Channel(proc)

    def call(cmd: dict[str, Any]) -> None:
        assert ch.ask(cmd, 60)["ok"]

    try:
        md = base64.b64decode(ch.read(60)["metadata"])
        src, dst = _pattern(), np.full((ROWS, ROW), SENTINEL, np.uint8)
        with Agent("local", backend="nixl") as agent:
            agent.register({"layer.0": dst})
            peer = agent.add_peer(md)
            call({"cmd": "add_peer", "metadata": base64.b64encode(agent.metadata()).decode()})
            agent.read(peer, [1], [2]).wait(20)
            np.testing.assert_array_equal(dst[1], src[2])
            call({"cmd": "deregister"})
            end = Deadline.within(60)  # the notice travels asynchronously; reads until then are not caught
            with pytest.raises(StalePeerError):
                while time.monotonic() < end:
                    agent.read(peer, [3], [4]).wait(20)
            with pytest.raises(StalePeerError):  # and it stays stale
                agent.read(peer, [5], [6]).wait(20)
            assert (dst[5] == SENTINEL).all()
    finally:
        ch.send({"cmd": "exit"})
        proc.wait(timeout=30)


def test_local_lists_over_deregistered_memory_are_refused(pair: Any) -> None:
    a, b, src, dst = pair
    b.add_remote("safe-a", a.local_metadata())
    lp, rp = b.prepare(None, _rows(dst)), b.prepare("safe-a", _rows(src))
    (reg,) = b._registrations
    b.deregister(reg)
    with pytest.raises(OutOfRegistrationError):
        b.post(Op.READ, lp, np.array([0], np.int32), rp, np.array([0], np.int32), None)
    assert (dst == SENTINEL).all()


# --------------------------------------------------------------------------------------------
# Huge posts go out in pieces, under the caller's polls
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("notify", [None, b"all-here"])
def test_post_larger_than_one_request_moves_in_pieces(notify: bytes | None) -> None:
    rows = 64
    src, dst = _pattern(rows), np.full((rows, ROW), SENTINEL, np.uint8)
    a = nb.NixlBackend("piece-a", request_descriptors=4, notify_thread=False)
    b = nb.NixlBackend("piece-b")
    try:
        a.register([Allocation(src.ctypes.data, src.nbytes)])
        b.register([Allocation(dst.ctypes.data, dst.nbytes)])
        a.add_remote("piece-b", b.local_metadata())
        b.add_remote("piece-a", a.local_metadata())
        lp, rp = a.prepare(None, _rows(src)), a.prepare("piece-b", _rows(dst))
        order = np.random.default_rng(1).permutation(rows)[:50]
        x = a.post(Op.WRITE, lp, np.arange(50, dtype=np.int32), rp, order.astype(np.int32), notify)
        assert x.h.next == 4, "post() must post the first piece only"
        got: dict[str, list[bytes]] = {}
        end = Deadline.within(30)
        while not a.poll(x):
            assert time.monotonic() < end
            for k, v in b.drain_notifications().items():
                got.setdefault(k, []).extend(v)
                assert (dst[order] == src[:50]).all(), "notification before the data"
        a.release(x)
        np.testing.assert_array_equal(dst[order], src[:50])
        rest = np.setdiff1d(np.arange(rows), order)
        assert (dst[rest] == SENTINEL).all()
        if notify:
            while not got and time.monotonic() < end:
                got = b.drain_notifications()
            assert got == {"piece-a": [notify]}
    finally:
        b.close()
        a.close()


# --------------------------------------------------------------------------------------------
# Dying peers (the kill matrix, small)
# --------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_peer_killed_mid_transfer_gives_done_with_right_bytes_or_a_typed_error() -> None:
    # 2 kills per op, one in each half of the transfer (stratified): each kill restarts a NIXL peer
    # process (about 5 s on CI), and 5 random ones per op cost CI 30 s more. Larger runs:
    # KVXFER_KILL_TRIALS, or kill_matrix.py --trials 100 (RELIABILITY.md).
    res = kill_matrix.run(int(os.environ.get("KVXFER_KILL_TRIALS", "2")))
    assert not kill_matrix.failures(res), kill_matrix.failures(res)
    for op, counts in res["counts"].items():
        assert counts.get("timeout", 0) == 0, f"{op}: a dead peer must be detected, not waited on: {counts}"
