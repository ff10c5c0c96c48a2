"""What the Mooncake backend refuses and guarantees, each with a control that shows the bad outcome.

* no ``trusted_network``: refused (Mooncake's ports authenticate nobody);
* a remote descriptor outside the peer's blob: refused before any byte moves;
* the fence: a READ from a stopped peer that is released or fails moves nothing into its
  destination afterwards, one span or many (its arena takes what Mooncake still had queued);
* mutated blobs: typed errors only (a campaign in a child process, and at the seam).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from kvxfer import Agent, Allocation, DescriptorList, KvxferError, Op  # noqa: E402
from kvxfer.deadlines import Deadline  # noqa: E402
from kvxfer.testing.lines import Channel  # noqa: E402
from kvxfer.errors import BackendError, MetadataError, OutOfRegistrationError  # noqa: E402
from kvxfer.plugin import identity as peers  # noqa: E402
from kvxfer.testing.mutate import mutate  # noqa: E402
from kvxfer_mooncake import _blob, backend as mb  # noqa: E402

HERE = Path(__file__).parent
SENT = 0xAA
pytestmark = pytest.mark.timeout(120)


def descs(base: int, offsets: list[int], lengths: list[int]) -> DescriptorList:
    return DescriptorList(np.array([[base + o, n, 0] for o, n in zip(offsets, lengths)], dtype=np.uint64))


def wait_done(be: mb.MooncakeBackend, x: Any) -> None:
    while not be.poll(x):
        time.sleep(0.001)


@pytest.fixture
def pair() -> Iterator[tuple[mb.MooncakeBackend, mb.MooncakeBackend, np.ndarray, np.ndarray]]:
    a = mb.MooncakeBackend("prefill", trusted_network=True, progress_timeout=2)
    b = mb.MooncakeBackend("decode", trusted_network=True, progress_timeout=2)
    src = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.full(1 << 16, SENT, np.uint8)
    a.register([Allocation(src.ctypes.data, src.nbytes)])
    b.register([Allocation(dst.ctypes.data, dst.nbytes)])
    try:
        yield a, b, src, dst
    finally:
        b.close()
        a.close()


def test_tcp_needs_trusted_network() -> None:
    with pytest.raises(BackendError, match="trusted_network"):
        Agent("x", backend="mooncake")
    Agent("x", backend="mooncake", trusted_network=True).close()  # control: the opt-in starts it


def test_remote_span_outside_the_blob_is_refused(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's blob names only the first half; a read of the second half is refused, typed.

    Control: with the bound bypassed, Mooncake itself serves the second half (the peer has it
    registered), so the bound in ``prepare`` is what stops it.
    """
    a, b, src, dst = pair
    half = src.nbytes // 2
    b.add_remote("prefill", _blob.encode(a.session, [(src.ctypes.data, half)]))
    local = b.prepare(None, descs(dst.ctypes.data, [0], [4096]))
    with pytest.raises(OutOfRegistrationError):
        b.prepare("prefill", descs(src.ctypes.data, [half], [4096]))
    ok = b.prepare("prefill", descs(src.ctypes.data, [0], [4096]))  # inside: still works
    wait_done(b, b.post(Op.READ, local, np.arange(1), ok, np.arange(1), None))
    np.testing.assert_array_equal(dst[:4096], src[:4096])
    assert (dst[4096:] == SENT).all()

    dst[:] = SENT
    monkeypatch.setattr(mb.SpanIndex, "check", lambda *args, **kw: None)
    bad = b.prepare("prefill", descs(src.ctypes.data, [half], [4096]))
    wait_done(b, b.post(Op.READ, local, np.arange(1), bad, np.arange(1), None))
    np.testing.assert_array_equal(dst[:4096], src[half:half + 4096])  # the bad outcome


@pytest.fixture
def stopped_peer() -> Iterator[tuple[subprocess.Popen[str], bytes]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    p = subprocess.Popen([sys.executable, str(HERE / "mooncake_peer.py"), "16"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        blob = bytes.fromhex(Channel(p).line(60).strip())
        yield p, blob
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


def _read_from_stopped(peer: tuple[subprocess.Popen[str], bytes], release: Any, progress_timeout: float = 1,
                       slices: int = 0, land: Any = None, watch: float = 2) -> tuple[np.ndarray, np.ndarray]:
    """Post a READ from a stopped peer, release it, resume the peer; the destination at the end
    and after. One 16 MiB span, or ``slices`` spans of 384 bytes 4 KiB apart (fenced: a quick
    post, one batch each; unfenced: one batch call). ``land(dst, offsets)``: a control's patch."""
    p, blob = peer
    dst = np.full(16 << 20, SENT, np.uint8)
    offsets, lengths = ([0], [dst.nbytes]) if not slices else ([i << 12 for i in range(slices)], [384] * slices)
    if land is not None:
        land(dst, offsets)
    be = mb.MooncakeBackend("decode", trusted_network=True, progress_timeout=progress_timeout)
    try:
        be.register([Allocation(dst.ctypes.data, dst.nbytes)])
        be.add_remote("peer", blob)
        base = _blob.decode(blob, "peer").regions[0][0]
        local = be.prepare(None, descs(dst.ctypes.data, offsets, lengths))
        remote = be.prepare("peer", descs(base, offsets, lengths))
        os.kill(p.pid, signal.SIGSTOP)  # after add_remote's handshake: stopped mid-READ
        x = be.post(Op.READ, local, np.arange(len(offsets)), remote, np.arange(len(offsets)), None)
        while x.future is not None and not (x.future.running() or x.future.done()):  # in flight, not queued
            time.sleep(0.001)
        time.sleep(0.2)
        release(be, x)  # what the core does on timeout or cancel: after this, nothing may land
        ended = dst.copy()
        os.kill(p.pid, signal.SIGCONT)
        deadline = Deadline.within(watch)  # unfenced, the late bytes land within about 1 s (idle host)
        while time.monotonic() < deadline and np.array_equal(dst, ended):
            time.sleep(0.05)
        return ended, dst.copy()
    finally:
        be.close()


def test_released_read_from_a_stopped_peer_lands_nothing_after(stopped_peer: Any) -> None:
    ended, later = _read_from_stopped(stopped_peer, mb.MooncakeBackend.release)
    np.testing.assert_array_equal(later, ended, err_msg="bytes landed after release() returned")
    assert (ended == SENT).all()


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "control-unfenced"])
def test_queued_spans_of_a_failed_read_never_reach_the_destination(stopped_peer: Any, fenced: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """30 spans from a stopped peer (30 one-span batches; unfenced, one batch call): the call
    fails once the spans on the peer's lanes make no progress, the rest stay queued inside
    Mooncake and are sent when the peer resumes. Fenced, they land in the READ's arena and the destination keeps the sentinel.
    Control: with the arena bypassed (``fence_reads=False``) they land in the destination."""
    assert mb.MooncakeBackend.capabilities.fence is True
    monkeypatch.setattr(mb.MooncakeBackend, "fence_reads", fenced)
    ended, later = _read_from_stopped(stopped_peer, mb.MooncakeBackend.release, slices=30)
    assert (ended == SENT).all(), "the stopped peer answered before the release"
    if fenced:
        np.testing.assert_array_equal(later, ended, err_msg="queued spans landed after the end")
    else:
        assert not np.array_equal(later, ended), "control: queued spans should land after an unfenced end"


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "control-lands-in-destination"])
def test_quick_read_from_a_stopped_peer_lands_nothing_after(stopped_peer: Any, fenced: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick post (4 small spans, submitted at once, no worker): released while the peer is
    stopped, its spans land in the arena once the peer resumes, never in the destination.
    Control: with the spans staged at the destination instead of the arena, they land there
    after the end (the arena is what keeps them out)."""
    from kvxfer_mooncake import _posts

    seen: list[Any] = []
    real_submit = _posts.submit_quick
    monkeypatch.setattr(_posts, "submit_quick", lambda *a: (seen.append(a[1]), real_submit(*a)))

    def land(dst: np.ndarray, offsets: list[int]) -> None:
        if not fenced:
            monkeypatch.setattr(_posts, "staged", lambda arena, lens: [dst.ctypes.data + o for o in offsets])

    ended, later = _read_from_stopped(stopped_peer, mb.MooncakeBackend.release, slices=4, land=land)
    assert len(seen) == 1, "the post should have been a quick one"
    assert (ended == SENT).all(), "the stopped peer answered before the release"
    if fenced:
        np.testing.assert_array_equal(later, ended, err_msg="a quick READ's spans landed after the end")
    else:
        assert not np.array_equal(later, ended), "control: spans staged at the destination land after the end"


@pytest.mark.parametrize("path", ["quick", "chunked"])
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_large_post_moves_exactly_its_spans(op: Op, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 MiB in 40 spans of mixed lengths, shuffled, one pair adjacent: as one batch per run,
    copied out as each is done (quick), or cut into chunks on the worker (chunked, as a post
    with a notification runs): every byte lands where asked and nothing else changes (numpy
    reference)."""
    from kvxfer_mooncake import _posts

    if path == "chunked":
        monkeypatch.setattr(_posts, "QUICK_SPANS", 0)

    a = mb.MooncakeBackend("prefill", trusted_network=True, progress_timeout=2)
    b = mb.MooncakeBackend("decode", trusted_network=True, progress_timeout=2)
    try:
        rng = np.random.default_rng(5)
        src = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
        dst = np.full(8 << 20, SENT, np.uint8)
        a.register([Allocation(src.ctypes.data, src.nbytes)])
        b.register([Allocation(dst.ctypes.data, dst.nbytes)])
        b.add_remote("prefill", a.local_metadata())
        slots = rng.permutation(64)[:40]  # 128 KiB slots, spans up to the slot
        lens = [int(x) for x in rng.integers(1, 129, 40) * 1024]
        offs_d = [int(s) << 17 for s in slots]
        offs_s = [int(s) << 17 for s in rng.permutation(64)[:40]]
        lens[0] = lens[1] = 64 << 10
        offs_d[1] = offs_d[0] + lens[0]  # adjacent in the destination, both inside the first slot
        here_, there = (dst, src) if op is Op.READ else (src, dst)
        loc_offs, rem_offs = (offs_d, offs_s) if op is Op.READ else (offs_s, offs_d)
        mover = b if op is Op.READ else a
        if op is Op.WRITE:
            a.add_remote("decode", b.local_metadata())
        local = mover.prepare(None, descs(here_.ctypes.data, loc_offs, lens))
        remote = mover.prepare("prefill" if op is Op.READ else "decode", descs(there.ctypes.data, rem_offs, lens))
        want = np.full_like(dst, SENT)
        for d, s_, n in zip(offs_d, offs_s, lens):
            want[d:d + n] = src[s_:s_ + n]
        x = mover.post(op, local, np.arange(40), remote, np.arange(40), None)
        if path == "chunked":
            assert len(x.bounds) > 2, "expected a post of several chunks"
        else:
            assert x.batches is not None and len(x.batches) == len(x.spans) - 1
        wait_done(mover, x)
        if path == "chunked":
            assert len(x.results) == len(x.bounds) - 1 and x.copied == len(x.bounds) - 1
        np.testing.assert_array_equal(dst, want)
        assert len(x.bounds) - 1 <= _posts.MAX_CHUNKS
    finally:
        b.close()
        a.close()


def test_control_release_without_waiting_lets_bytes_land(stopped_peer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: unfenced, a release that only drops the future (no wait) reports the end too early."""
    def early(be: mb.MooncakeBackend, x: Any) -> None:
        x.future.cancel()

    monkeypatch.setattr(mb.MooncakeBackend, "fence_reads", False)
    ended, later = _read_from_stopped(stopped_peer, early, progress_timeout=20, watch=6)  # loaded: later
    assert (ended == SENT).all()
    assert not np.array_equal(later, ended), "control: the bytes should land after an early end"


def test_fenced_read_copies_rows_out_in_order(pair: Any) -> None:
    """The arena's copy-out: rows of mixed lengths, out of order, some adjacent, land exactly
    where asked and nowhere else (numpy reference over the logical arrays)."""
    a, b, src, dst = pair
    b.add_remote("prefill", a.local_metadata())
    offs_d, offs_s, lens = [40960, 0, 8192, 12288, 60000], [1000, 30000, 4096, 8192, 50000], [4096, 8192, 4096, 96, 5000]
    local = b.prepare(None, descs(dst.ctypes.data, offs_d, lens))
    remote = b.prepare("prefill", descs(src.ctypes.data, offs_s, lens))
    x = b.post(Op.READ, local, np.arange(5), remote, np.arange(5), None)
    assert x.arena is not None
    wait_done(b, x)
    want = np.full_like(dst, SENT)
    for d, s_, n in zip(offs_d, offs_s, lens):
        want[d:d + n] = src[s_:s_ + n]
    np.testing.assert_array_equal(dst, want)


def test_fuzz_campaign_in_a_child_is_typed_only() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, str(HERE / "mooncake_fuzz.py"), "--count", "400", "--seed", "7"],
                       capture_output=True, text=True, env=env, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]  # a native crash would show here
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["outcomes"].get("untyped", 0) == 0, out
    assert sum(out["outcomes"].values()) == 400 and out["genuine_after"] == "ok", out


def _seam_mutants(be: mb.MooncakeBackend, blob: bytes, n: int) -> tuple[int, list[str]]:
    rng, typed, untyped = random.Random(11), 0, []
    for _ in range(n):
        _, bad = mutate(rng, blob)
        try:
            be.add_remote("p", bad)
            be.remove_remote("p")
        except KvxferError:
            typed += 1
        except Exception as exc:  # noqa: BLE001 - counted
            untyped.append(type(exc).__name__)
    return typed, untyped


def test_mutated_blobs_at_the_seam_raise_metadata_error(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """add_remote itself (no agent guard) refuses mutants typed. Control: a naive parser does not."""
    a, b, _, _ = pair
    typed, untyped = _seam_mutants(b, a.local_metadata(), 300)
    assert untyped == [] and typed > 200
    with pytest.raises(MetadataError):
        b.add_remote("p", b'{"v":1,"session":"127.0.0.1:1","regions":' + b"[" * 100_000 + b"]" * 100_000 + b"}")

    def naive(blob: bytes, who: str) -> _blob.Blob:
        d = json.loads(blob)
        return _blob.Blob(d["session"], tuple((int(x), int(y)) for x, y in d["regions"]),
                          peers.decode(bytes.fromhex(d["identity"])))

    monkeypatch.setattr(mb._blob, "decode", naive)
    _, untyped = _seam_mutants(b, a.local_metadata(), 300)
    assert untyped, "control: an unvalidated parser lets raw exceptions out"


def test_held_arenas_are_never_reused_and_bounded(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that keeps stalling: each READ that ends early holds its arena. A held arena is
    never handed out again, and past ``HELD_LIMIT`` READs are refused (typed) instead of growing
    the process. Control: an arena given back (its call returned) is reused."""
    from kvxfer_mooncake import _bounce

    _, b, _, _ = pair
    arenas = b._arenas
    first = arenas.take(4096)
    arenas.give(first)
    assert arenas.take(4096) is first  # control: a settled arena is reused
    arenas.hold(first)
    second = arenas.take(4096)
    assert second is not first
    arenas.give(second)
    monkeypatch.setattr(_bounce, "HELD_LIMIT", first.nbytes // 2)
    with pytest.raises(BackendError, match="landing areas"):
        arenas.take(4096)


def test_hostile_notifications_are_dropped_not_raised(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone who reaches the port can attach a notification to a batch, naming any sender.
    Malformed ones (not base64, over the size bound, an empty or 300-character name) are
    dropped; the well-formed ones arrive in order, and the receiver's memory is untouched.
    Control: a decoder that trusts the wire raises into ``drain_notifications``."""
    from mooncake.engine import TransferNotify, TransferOpcode

    from kvxfer_mooncake import _notify

    a, b, _, dst = pair
    raw = a._engine  # a client speaking Mooncake directly, not through the plugin

    def send(name: str, msg: str) -> None:
        rc = raw.batch_transfer_sync(b.session, [a._scratch.ctypes.data], [dst.ctypes.data], [1],
                                     TransferOpcode.Read, TransferNotify(name, msg))
        assert rc == 0

    hostile = [("x", "not base64!"), ("x", "A" * (4 * (_notify.MAX_NOTIFICATION // 3) + 8)), ("", "aGk="),
               ("n" * 300, "aGk="), ("x", "aGk")]
    send("prefill", _notify.encode(b"first"))
    for name, msg in hostile:
        send(name, msg)
    send("prefill", _notify.encode(b"second"))
    got: dict[str, list[bytes]] = {}
    deadline = Deadline.within(10)
    while sum(map(len, got.values())) < 2 and time.monotonic() < deadline:
        for k, v in b.drain_notifications().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.01)
    assert got == {"prefill": [b"first", b"second"]}
    assert (dst == SENT).all()

    import base64

    monkeypatch.setattr(mb._notify, "decode", lambda notes: {n.name: [base64.b64decode(n.msg)] for n in notes})
    for name, msg in hostile[:1]:
        send(name, msg)
    with pytest.raises(Exception) as info:
        deadline = Deadline.within(10)
        while time.monotonic() < deadline:
            b.drain_notifications()
            time.sleep(0.01)
    assert not isinstance(info.value, KvxferError), "control: the trusting decoder lets the wire's error out"


_START = ("import logging, sys; logging.getLogger('kvxfer').setLevel(sys.argv[1]); "
          "from kvxfer_mooncake.backend import MooncakeBackend as B; B('x', trusted_network=True).close()")


@pytest.mark.parametrize("level,user,chatty", [("WARNING", None, False), ("DEBUG", None, True),
                                               ("WARNING", "INFO", True)],
                         ids=["warning-quiet", "control-debug-chatty", "control-user-level-kept"])
def test_glog_follows_the_kvxfer_logger(level: str, user: str | None, chatty: bool) -> None:
    """Mooncake's glog prints its INFO lines (engine start, listen ports) only when the kvxfer
    logger is at DEBUG. Controls: at DEBUG they print, and a user's own MC_LOG_LEVEL is kept."""
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if user:
        env["MC_LOG_LEVEL"] = user
    r = subprocess.run([sys.executable, "-c", _START, level], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    infos = [ln for ln in r.stderr.splitlines() if ln.startswith("I") and "transfer_engine" in ln]
    assert bool(infos) is chatty, r.stderr[-2000:]


def test_per_layer_pages_against_packed_rows_go_as_one_span_per_row() -> None:
    """A per-layer local cache against a packed peer: the post names one span per page, in
    layer-major order; Mooncake gets one span per block row (the pages of a row merged after
    sorting by remote address), and the pages land in their layers exactly (numpy reference
    over the logical ``[layer, block]`` pages). Control: pages whose remote side is not
    contiguous stay one span each."""
    from kvxfer_mooncake import _posts

    layers, page, blocks = 6, 1024, 12
    a = mb.MooncakeBackend("prefill", trusted_network=True, progress_timeout=2)
    b = mb.MooncakeBackend("decode", trusted_network=True, progress_timeout=2)
    try:
        src = np.random.default_rng(9).integers(0, 256, (blocks, layers, page), dtype=np.uint8)  # packed rows
        dst = np.full((layers, blocks, page), SENT, np.uint8)  # per-layer arrays, one allocation
        a.register([Allocation(src.ctypes.data, src.nbytes)])
        b.register([Allocation(dst.ctypes.data, dst.nbytes)])
        b.add_remote("prefill", a.local_metadata())
        src_ids, dst_ids = [7, 3, 5, 11, 0], [0, 9, 10, 2, 5]  # no two adjacent on the peer
        pairs = [(l_, s, d) for l_ in range(layers) for s, d in zip(src_ids, dst_ids)]  # layer-major
        loc = [dst[l_, d].ctypes.data - dst.ctypes.data for l_, _, d in pairs]
        rem = [src[s, l_].ctypes.data - src.ctypes.data for l_, s, _ in pairs]
        runs = _posts.Runs(descs(dst.ctypes.data, loc, [page] * len(pairs)).array,
                           descs(src.ctypes.data, rem, [page] * len(pairs)).array)
        assert len(runs.remote) == len(src_ids) and runs.lengths == [layers * page] * len(src_ids)
        local = b.prepare(None, descs(dst.ctypes.data, loc, [page] * len(pairs)))
        remote = b.prepare("prefill", descs(src.ctypes.data, rem, [page] * len(pairs)))
        wait_done(b, b.post(Op.READ, local, np.arange(len(pairs)), remote, np.arange(len(pairs)), None))
        want = np.full_like(dst, SENT)
        want[:, dst_ids] = src[src_ids].transpose(1, 0, 2)
        np.testing.assert_array_equal(dst, want)
        spaced = [2 * page * k for k in range(len(pairs))]  # a peer whose pages never touch
        apart = _posts.Runs(descs(dst.ctypes.data, loc, [page] * len(pairs)).array,
                            descs(src.ctypes.data, spaced, [page] * len(pairs)).array)
        assert len(apart.remote) == len(pairs)  # control: nothing contiguous, nothing merged
    finally:
        b.close()
        a.close()
