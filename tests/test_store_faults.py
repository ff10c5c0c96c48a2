"""The store under faults: SIGKILL mid-offload, torn journal tails, corrupted and missing
slabs, disk full at creation, two processes on one slab, short writes.

Each safety test carries a control that shows the same check fails (or the same data is
found) when the fault is absent. Expected bytes come from numpy over the logical array ``X``
and, for the slab file itself, from the source cache's own row bytes, never from the store.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import StoreBusyError, StoreCorruptError, StoreError, StoreFullError
from kvxfer.store import fileio, journal, rungroups
from kvxfer.store.slab import HEADER
from kvxfer.testing.lines import Channel
from store_caches import DIMS, SENTINEL, cache, keys, logical, row_bytes
from common import has_nixl
from store_paths import Via, _via_pool, via  # noqa: F401  (fixtures)

TESTS = str(Path(__file__).parent)
DIMS_A = DIMS["aligned"]
CAP = 32 * row_bytes(DIMS_A)  # 32 slots (16 KiB rows, no padding)

_CHILD = """
import os, sys, time
sys.path.insert(0, {tests!r})
import kvxfer
from store_caches import DIMS, cache, keys, logical
dims = DIMS["aligned"]
src = cache("layer", dims, logical(dims))
st = kvxfer.Store({path!r}, capacity={cap}, layout=src.spec, threads=1)  # one worker: a held call holds the batch
{setup}{body}
"""


def _child(path: Path, body: str, via: Via | None = None) -> subprocess.Popen[str]:
    """A process holding the store; ``who`` is what it offloads through (``via``'s path)."""
    setup = via.child_setup("who", "src") if via is not None else "who = src.spec\n"
    code = _CHILD.format(tests=TESTS, path=str(path), cap=CAP, setup=setup, body=textwrap.dedent(body))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _until(proc: subprocess.Popen[str], *words: str) -> str:
    try:
        return Channel(proc).until(words, 120)
    except EOFError:
        raise AssertionError(f"child ended (rc={proc.wait()}) before printing {words}") from None


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _open(path: Path) -> kvxfer.Store:
    return kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec)


_OFFLOAD_AND_HANG = """
st.offload(who, [0, 1, 2, 3], keys(4, "a")).wait()
st.discard([b"a1", b"a3"])  # slots 1 and 3 free: batch b lands in two runs, two pwritev calls
def hang(stage):
    if stage == {stage!r}:
        print("HANG", flush=True)
        time.sleep(600)
st._fault = hang
t = st.offload(who, [10, 11, 12, 13], keys(4, "b")).wait()
print("DONE", t.stats.path, flush=True)
time.sleep(600)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", ["call", "written", "control"])
def test_sigkill_mid_offload_leaves_no_entry(tmp_path, stage, via) -> None:
    """``call``: killed after the first of batch b's writes (a torn batch); ``written``: all
    rows written and digested, not yet published; ``control``: killed once the offload was
    DONE, when batch b must be found (restored by this process: a new one for the store)."""
    X = logical(DIMS_A)
    proc = _child(tmp_path, _OFFLOAD_AND_HANG.format(stage=stage), via)
    try:
        done = f"DONE {via.path(True, 'layer')}"  # the child's source is a per-layer cache
        got = _until(proc, "HANG", done)
        assert got == (done if stage == "control" else "HANG")
    finally:
        _kill(proc)
    with _open(tmp_path) as st:  # the dead child's lock is gone with it
        assert st.lookup(keys(4, "a")).tolist() == [True, False, True, False]
        assert st.lookup(keys(4, "b")).all() == (stage == "control")
        assert st.lookup(keys(4, "b")).any() == (stage == "control")
        dst = cache("row", DIMS_A)
        st.restore([b"a0", b"a2"], via(dst), [5, 6]).wait()
        assert np.array_equal(dst.logical()[:, :, [5, 6]], X[:, :, [0, 2]])
        if stage == "control":
            st.restore(keys(4, "b"), via(dst), [7, 8, 9, 10]).wait()
            assert np.array_equal(dst.logical()[:, :, 7:11], X[:, :, 10:14])
        else:  # nothing of the torn batch is left: a new offload works as usual
            st.offload(via(cache("row", DIMS_A, X)), [20, 21, 22, 23], keys(4, "c")).wait()
            st.restore(keys(4, "c"), via(dst), [7, 8, 9, 10]).wait()
            assert np.array_equal(dst.logical()[:, :, 7:11], X[:, :, 20:24])
            assert len(st) == 6 and int((st._index.state != 0).sum()) == 6  # b's reserved slots are free


def _slot_of(path: Path, row: bytes, stride: int = 16384) -> int:
    """Which slot begins with ``row``, found by scanning the file (independent of the index)."""
    raw = np.fromfile(path, dtype=np.uint8)[HEADER:]
    rows = raw[:raw.shape[0] // stride * stride].reshape(-1, stride)[:, :len(row)]
    hit = np.flatnonzero((rows == np.frombuffer(row, dtype=np.uint8)).all(axis=1))
    assert hit.shape[0] == 1
    return int(hit[0])


def _never_served(dst, blocks) -> bool:
    """Each block holds only the sentinel (never read) or only zeros (read into the cache,
    then wiped when its group failed): no byte read from the slab is left unchecked."""
    out = True
    for b in blocks:
        x = np.ascontiguousarray(dst.logical()[:, :, b]).view(np.uint8)
        out &= bool((x == SENTINEL).all() or (x == 0).all())
    return out


@pytest.mark.parametrize("mode", ["checked-first", "in-place", "control-in-place-no-wipe"])
def test_a_corrupted_byte_is_detected_and_never_served(tmp_path, caplog, via, mode, monkeypatch) -> None:
    """By default a restore checks rows in the slab and copies nothing of a failed group;
    ``in_place=True`` reads a group into the (host) cache, checks it there and zeroes the
    group when a row fails (the staged path always checks first). Control: with the wipe
    off, the in-place read leaves the damaged row in the cache, one bit off."""
    in_place, wiped = mode != "checked-first", mode != "control-in-place-no-wipe"
    if not wiped:
        if via.staged:
            pytest.skip("the staged path checks before it copies: there is no wipe to turn off")
        monkeypatch.setattr(rungroups, "wipe", lambda c: None)
    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    with _open(tmp_path) as st:
        st.offload(via(src), [4, 5, 6], keys(3)).wait()
        slab = Path(st.path)
    row2 = src.storages[0][6].tobytes()  # key k2's row as the source cache holds it
    slot = _slot_of(slab, row2)
    stride = len(row2)
    with _open(tmp_path) as st:  # control: intact, the row restores exactly
        dst = cache("row", DIMS_A)
        st.restore(keys(3), via(dst), [0, 1, 2]).wait()
        assert np.array_equal(dst.logical()[:, :, [0, 1, 2]], X[:, :, [4, 5, 6]])
    at = HEADER + slot * stride + 5000
    fd = os.open(slab, os.O_RDWR)  # one flipped bit, written behind the (closed) store's back
    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
    os.close(fd)
    assert _slot_of(slab, row2[:5000]) == slot  # the damage is inside k2's row ...
    with pytest.raises(AssertionError):
        _slot_of(slab, row2)  # ... which no longer matches the source: served, it would be garbage
    caplog.set_level(logging.INFO, logger="kvxfer.store")
    with _open(tmp_path) as st:
        dst = cache("row", DIMS_A)
        with pytest.raises(StoreCorruptError) as e:
            st.restore(keys(3), via(dst), [0, 1, 2], in_place=in_place).wait()
        assert e.value.keys == [b"k2"]
        assert [r.kvxfer["dropped"] for r in caplog.records if getattr(r, "kvxfer", {}).get("event") == "store_corrupt"] == [1]
        if not wiped:  # the control: the damaged row is what the cache would be handed
            got = np.ascontiguousarray(dst.logical()[:, :, 2]).view(np.uint8)
            assert np.count_nonzero(got != np.ascontiguousarray(X[:, :, 6]).view(np.uint8)) == 1
            return
        assert dst.untouched([]) if via.staged or not in_place else _never_served(dst, [0, 1, 2])  # none unchecked
        assert not _never_served(cache("row", DIMS_A, X), [2])  # (the helper's own control)
        assert st.lookup(keys(3)).tolist() == [True, True, False]  # dropped: the next lookup is a miss
        st.restore(keys(2), via(dst), [0, 1]).wait()
        assert np.array_equal(dst.logical()[:, :, [0, 1]], X[:, :, [4, 5]])
        assert dst.untouched([0, 1]) if via.staged or not in_place else \
            dst.untouched([0, 1, 2]) and _never_served(dst, [2])


def test_a_truncated_or_missing_slab_is_a_typed_miss(tmp_path, via) -> None:
    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    st = _open(tmp_path)
    try:
        st.offload(via(src), [0, 1], keys(2)).wait()
        dst = cache("row", DIMS_A)
        st.restore(keys(2), via(dst), [0, 1]).wait()  # control: restores while intact
        os.truncate(st.path, HEADER)
        dst = cache("row", DIMS_A)
        with pytest.raises(StoreCorruptError):  # not SIGBUS, not garbage
            st.restore(keys(2), via(dst), [0, 1]).wait()
        assert dst.untouched([])
    finally:
        st.close()
    with pytest.raises(StoreError, match="shorter"):
        _open(tmp_path)
    os.unlink(next(tmp_path.glob("slab-*.kv")))
    with _open(tmp_path) as st:  # a missing slab: a fresh one, every key a miss
        assert not st.lookup(keys(2)).any() and len(st) == 0


def test_a_torn_journal_tail_is_ignored_and_cut(tmp_path) -> None:
    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    with _open(tmp_path) as st:
        st.offload(src.spec, [0, 1, 2], keys(3)).wait()
        e0 = st._index.entries[b"k0"]
        idx = Path(st._slab.index_path)
    clean = idx.read_bytes()
    rec = journal.encode_put(b"x", e0.generation + 1, e0.slot, e0.digest)  # "x" names k0's row
    with open(idx, "ab") as f:
        f.write(rec[:len(rec) - 3])  # a crash mid-append
    with _open(tmp_path) as st:
        assert st.lookup(keys(3) + [b"x"]).tolist() == [True, True, True, False]
    assert idx.read_bytes() == clean  # the torn tail was cut by the compaction on open
    with open(idx, "ab") as f:  # control: the whole record is replayed
        f.write(rec)
    with _open(tmp_path) as st:
        assert st.lookup([b"x"]).all()
        dst = cache("row", DIMS_A)
        st.restore([b"x"], dst.spec, [3]).wait()
        assert np.array_equal(dst.logical()[:, :, 3], X[:, :, 0])


def _listing(path: Path) -> set[str]:
    return {p.name.split("-", 1)[0] + Path(p.name).suffix for p in path.iterdir()} if path.exists() else set()


def test_disk_full_at_creation_on_a_tiny_file_system(tmp_path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a 1 MiB tmpfs needs root")
    try:
        spec = cache("row", DIMS_A).spec
        with pytest.raises(StoreFullError):
            kvxfer.Store(mnt / "s", capacity=4 << 20, layout=spec)
        assert _listing(mnt / "s") == set()  # no slab, no index, no temporary, no lock file left
        with kvxfer.Store(mnt / "s", capacity=256 << 10, layout=spec) as st:  # control: one that fits
            st.offload(cache("row", DIMS_A, logical(DIMS_A)).spec, [0], [b"a"]).wait()
        assert _listing(mnt / "s") == {"slab.lock", "slab.kv", "slab.idx"}
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("capacity,expect", [(64 << 20, "FULL"), (256 << 10, "OK")])
def test_disk_full_at_creation_under_a_file_size_limit(tmp_path, capacity, expect, via) -> None:
    """RLIMIT_FSIZE makes the preallocation fail with EFBIG; the 256 KiB store is the control,
    and it round-trips a row through the path under test in the same limited process."""
    code = f"""
import resource, signal, sys
sys.path.insert(0, {TESTS!r})
import numpy as np
import kvxfer
from store_caches import DIMS, cache, logical
dims = DIMS["aligned"]
X = logical(dims)
src, dst = cache("row", dims, X), cache("row", dims)
{via.child_setup("who", "src")}{via.child_setup("back", "dst")}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # after the agents: UCX's own files exceed the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    st = kvxfer.Store({str(tmp_path)!r}, capacity={capacity}, layout=src.spec)
except kvxfer.StoreFullError as e:
    print("FULL")
    sys.exit(0)
t = st.offload(who, [3], [b"a"]).wait()
st.restore([b"a"], back, [0]).wait()
st.close()
print("OK", t.stats.path, np.array_equal(dst.logical()[:, :, 0], X[:, :, 3]) and dst.untouched([0]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == (["FULL"] if expect == "FULL" else ["OK", via.write_path, "True"])
    assert _listing(tmp_path) == (set() if expect == "FULL" else {"slab.lock", "slab.kv", "slab.idx"})


@pytest.mark.multiprocess
def test_two_processes_on_one_store_the_second_is_refused(tmp_path) -> None:
    proc = _child(tmp_path, 'print("OPEN", flush=True)\ntime.sleep(600)\n')
    try:
        _until(proc, "OPEN")
        with pytest.raises(StoreBusyError):
            _open(tmp_path)
    finally:
        _kill(proc)
    _open(tmp_path).close()  # control: the holder is gone, the slab opens


def test_a_short_write_resumes_where_it_stopped(tmp_path, monkeypatch) -> None:
    """A pwritev that moves one iovec per call (as a signal or a full pipe can) still writes all."""
    parts = [np.random.default_rng(i).integers(0, 256, 1000 + 37 * i, dtype=np.uint8) for i in range(5)]
    iov = np.array([[p.ctypes.data, p.nbytes] for p in parts], dtype=np.uint64)
    real, seen = fileio._pwritev, []

    def one_at_a_time(fd, ptr, count, off):  # type: ignore[no-untyped-def]
        seen.append(count)
        return real(fd, ptr, 1, off) if count > 1 else real(fd, ptr, count, off)

    monkeypatch.setattr(fileio, "_pwritev", one_at_a_time)
    calls = fileio.Calls(iov, np.array([0]), np.array([5]), np.array([100]),
                         np.array([int(iov[:, 1].sum())]), 5)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fileio.run_calls(fd, True, calls, lambda: False)
    finally:
        os.close(fd)
    data = (tmp_path / "f").read_bytes()
    assert data[100:] == b"".join(p.tobytes() for p in parts) and data[:100] == b"\0" * 100
    assert len(seen) == 5  # control: the short path really ran (one call per iovec)
    assert ctypes.sizeof(ctypes.c_void_p) == 8 and resource.RLIM_INFINITY is not None


def test_the_journal_is_compacted_while_open(tmp_path) -> None:
    """Many puts and drops do not grow the index file without bound; what it says stays right."""
    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    with _open(tmp_path) as st:
        st.COMPACT_BYTES = 2000  # the live-entry term (16 KB here) decides
        idx = Path(st._slab.index_path)
        sizes = []
        for i in range(400):
            st.offload(src.spec, [i % 24, (i + 1) % 24], [b"r%d" % i, b"s%d" % i]).wait()
            st.discard([b"s%d" % i])
            sizes.append(idx.stat().st_size)
        # Appended, never compacted, 400 rounds of records would be ~50 KB; compaction keeps the
        # file under its trigger (8 x 64 bytes per live entry, 32 entries) plus one round.
        assert max(sizes) < 8 * 64 * 32 + 300
        assert any(b < a for a, b in zip(sizes, sizes[1:]))  # it shrank: compactions happened
        assert len(st) == 31  # 32 slots: the oldest r entries were evicted
    with _open(tmp_path) as st:
        assert st.lookup([b"r399", b"r369", b"r368", b"s399"]).tolist() == [True, True, False, False]
        dst = cache("row", DIMS_A)
        st.restore([b"r399"], dst.spec, [0]).wait()
        assert np.array_equal(dst.logical()[:, :, 0], X[:, :, 399 % 24])


@pytest.mark.multiprocess
def test_random_sigkills_never_leave_a_torn_entry(tmp_path, via) -> None:
    """The CI size of ``python -m kvxfer._harness.store_kill`` (RELIABILITY.md has the large run)."""
    from kvxfer._harness.store_kill import campaign

    path = {"own": "pwritev", "nixl": "nixl", "staged": "staged"}[via.name]
    out = campaign(str(tmp_path / "s"), 3, seed=5, path=path)
    assert out["paths"] in ([via.path(True, "layer")], [])  # [] only if every child was killed before its first DONE
    assert out["kills"] == 3 and out["wrong"] == 0 and out["torn_published"] == 0
    assert out["missing_last_done"] == 0
    assert out["present"] > 0 and out["batches_done"] > 0  # control: there was something to lose


def test_random_byte_damage_anywhere_in_a_row_is_detected(tmp_path, via) -> None:
    """200 rows, each damaged at one random byte of its row (a random new value); the bytes
    after the row (slot padding, never restored) are the control: damage there is harmless."""
    dims = DIMS["padded"]  # 2560-byte rows in 4096-byte slots
    X = logical(dims)
    src = cache("row", dims, X)
    rng = np.random.default_rng(11)
    rl = row_bytes(dims)
    detected = harmless = 0
    dst = cache("row", dims)
    to = via(dst)
    with kvxfer.Store(tmp_path, capacity=8 * 4096, layout=src.spec) as st:
        fd = os.open(st.path, os.O_RDWR)
        try:
            for i in range(200):
                b = int(rng.integers(0, dims[1]))
                st.offload(via(src), [b], [b"r"]).wait()
                slot = st._index.entries[b"r"].slot
                pad = i % 4 == 0  # every 4th: damage the padding instead
                at = HEADER + slot * 4096 + int(rng.integers(rl, 4096) if pad else rng.integers(0, rl))
                old = os.pread(fd, 1, at)[0]
                os.pwrite(fd, bytes([(old + int(rng.integers(1, 256))) % 256]), at)
                dst.storages[0].view(np.uint8)[...] = SENTINEL
                try:
                    st.restore([b"r"], to, [0]).wait()
                    harmless += pad
                    assert pad and np.array_equal(dst.logical()[:, :, 0], X[:, :, b])
                except StoreCorruptError:
                    detected += not pad
                    assert not pad and dst.untouched([])
                os.pwrite(fd, bytes([0]) if pad else bytes([old]), at)
                st.discard([b"r"])
        finally:
            os.close(fd)
    assert (detected, harmless) == (150, 50)


@pytest.mark.multiprocess
def test_a_new_process_restores_what_the_other_path_offloaded(tmp_path, via) -> None:
    """A child offloads through ``via``'s path and exits; this process restores through the
    other path: one slab format, whichever path wrote it."""
    if via.own and not has_nixl():
        pytest.skip("nixl is not installed: pip install -e '.[nixl]'")
    other = Via("nixl" if via.own else "own")
    X = logical(DIMS_A)
    proc = _child(tmp_path, 'print("DONE", st.offload(who, [9, 2, 7], keys(3)).wait().stats.path, flush=True)\n'
                  'st.close()\n', via)
    assert _until(proc, f"DONE {via.path(True, 'layer')}") and proc.wait() == 0
    try:
        with _open(tmp_path) as st:
            dst = cache("row", DIMS_A)
            t = st.restore(keys(3)[::-1], other(dst), [0, 1, 2]).wait()
            assert t.stats.path == other.read_path
        assert np.array_equal(dst.logical()[:, :, [0, 1, 2]], X[:, :, [7, 2, 9]]) and dst.untouched([0, 1, 2])
        assert not np.array_equal(dst.logical()[:, :, [0, 1, 2]], X[:, :, [9, 2, 7]])  # control: order matters
    finally:
        other.close()
