"""The KV store on host memory: round trips, I/O counts, LRU and pins, keys, one opener.

Real bytes throughout: the source holds a pattern from the logical array ``X``, the
destination a sentinel; results are checked against numpy indexing over ``X``, and blocks
not restored must still hold the sentinel. The crash, corruption and disk-full tests are in
tests/test_store_faults.py.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import (DuplicateBlockIdError, LayoutMismatchError, StoreBusyError, StoreError, StoreFullError,
                           StoreMissError, TransferTimeoutError)
from kvxfer.store.digest import DIGEST_NAME
from store_caches import DIMS, SENTINEL, cache, keys, logical, row_bytes
from store_paths import _via_pool, via  # noqa: F401  (fixtures)


def _store(path, dims, slots: int = 64, **kw) -> kvxfer.Store:
    return kvxfer.Store(path, capacity=slots * (-(-row_bytes(dims) // 4096) * 4096), layout=cache("row", dims).spec,
                        **kw)


@pytest.mark.parametrize("geom", sorted(DIMS))
@pytest.mark.parametrize("src_kind,dst_kind", [("row", "row"), ("layer", "layer"), ("row", "layer"),
                                               ("layer", "row")])
def test_round_trip(tmp_path, geom, src_kind, dst_kind, via) -> None:
    dims = DIMS[geom]
    X = logical(dims)
    src, dst = cache(src_kind, dims, X), cache(dst_kind, dims)
    sblocks, dblocks = [3, 4, 5, 11, 0, 17], [9, 2, 3, 4, 20, 5]
    with _store(tmp_path, dims) as st:
        t = st.offload(via(src), sblocks, keys(6)).wait()
        assert t.stats.nbytes == 6 * row_bytes(dims) and t.stats.path == via.path(True, src_kind)
        assert st.lookup(keys(6)).all() and not st.lookup([b"other"]).any()
        t = st.restore(keys(6), via(dst), dblocks).wait()
        assert t.stats.path == via.path(False, dst_kind)
    got = dst.logical()
    assert np.array_equal(got[:, :, dblocks], X[:, :, sblocks])
    assert dst.untouched(dblocks)
    # Control: the check above sees a wrong block (the sentinel elsewhere is not vacuous).
    assert not np.array_equal(got[:, :, dblocks], X[:, :, sblocks[::-1]])


def test_agents_offload_and_restore_through_a_store(tmp_path) -> None:
    dims = DIMS["aligned"]
    X = logical(dims)
    src, dst = cache("layer", dims, X), cache("row", dims)
    with kvxfer.Agent("a") as a, kvxfer.Agent("b") as b, _store(tmp_path, dims) as st:
        a.register(src.spec)
        b.register(dst.spec)
        a.offload(st, [1, 2], [b"p", b"q"]).wait()
        b.restore(st, [b"q", b"p"], [7, 8]).wait()
    assert np.array_equal(dst.logical()[:, :, [7, 8]], X[:, :, [2, 1]]) and dst.untouched([7, 8])


def _calls(st: kvxfer.Store) -> list[int]:
    """Count the system calls the store issues (the hook runs after each one)."""
    seen: list[int] = []
    st._fault = lambda stage: seen.append(1) if stage == "call" else None
    return seen


@pytest.mark.parametrize("geom", sorted(DIMS))
def test_contiguous_slots_are_one_io_per_request(tmp_path, geom, via) -> None:
    """The store's own path: one system call per run of slots. NIXL POSIX: one post per
    request of this size, one I/O per descriptor (a whole aligned row run is one)."""
    dims = DIMS[geom]
    X = logical(dims)
    src = cache("row", dims, X)
    pad = geom == "padded"
    with _store(tmp_path, dims) as st:
        seen = _calls(st)
        t = st.offload(via(src), [8, 9, 10, 11, 12, 13, 14, 15], keys(8)).wait()
        assert len(seen) == 1 and t.stats.posts == 1  # 8 rows, fresh slots 0..7: one pwritev (one post)
        # Padded rows are a descriptor each (pwritev bridges the padding in one call); an
        # aligned run of rows is one.
        assert t.stats.descriptors == (8 if pad else 1)
        seen.clear()
        layer = cache("layer", dims)
        t = st.restore(keys(8), via(layer), [0, 1, 2, 3, 4, 5, 6, 7]).wait()
        # A per-layer cache: 8 rows x 8 pages gathered by one preadv (64 iovecs).
        assert len(seen) == 1 and t.stats.descriptors == 8 * 2 * dims[0]
        assert np.array_equal(layer.logical()[:, :, :8], X[:, :, 8:16])
        # Control: rows in every other slot cannot merge: one call (one I/O) per row.
        st.discard(keys(8)[1::2])
        seen.clear()
        t = st.restore(keys(8)[::2], via(cache("row", dims)), [0, 1, 2, 3]).wait()
        assert t.stats.descriptors == 4 and len(seen) == t.stats.posts == (4 if via.name == "own" else 1)


def test_a_large_request_splits_over_worker_threads(tmp_path, via) -> None:
    dims = (4, 640, 16, 2, 32)  # 640 rows of 16 KiB in 2 KiB pages: 10 MiB
    X = logical(dims)
    src, dst = cache("layer", dims, X), cache("row", dims)
    ids = np.random.default_rng(3).permutation(640)
    with kvxfer.Store(tmp_path, capacity=640 * 16384, layout=src.spec, threads=3) as st:
        t = st.offload(via(src), ids, keys(640)).wait()
        # One file run of 640 rows x 8 pages = 5120 iovecs: cut every 8 MiB (4096 iovecs) and
        # every IOV_MAX (1024) iovecs, 5 calls shared by the 3 threads (NIXL: one post per 8 MiB).
        assert t.stats.posts == (5 if via.name == "own" else 2) and t.stats.descriptors == 5120
        t = st.restore(keys(640), via(dst), np.arange(640)).wait()
        # Contiguous on both sides: one 10 MiB descriptor, cut at 8 MiB into two calls.
        assert t.stats.descriptors == (1 if via.name == "own" else 2) and t.stats.posts == 2
    assert np.array_equal(dst.logical(), X[:, :, ids])


def test_lru_evicts_and_a_pinned_entry_stays(tmp_path, via) -> None:
    dims = DIMS["aligned"]
    X = logical(dims)
    src = cache("row", dims, X)
    st = _store(tmp_path, dims, slots=4)
    try:
        st.offload(via(src), [0, 1, 2, 3], keys(4)).wait()
        gate, entered = threading.Event(), threading.Event()

        def hold(stage: str) -> None:
            if stage == "call" and not entered.is_set():
                entered.set()
                gate.wait(60)

        st._fault = hold
        dst0 = cache("row", dims)
        pinned = st.restore([b"k0"], via(dst0), [5])  # in flight: k0 pinned
        assert entered.wait(60)
        for i in (1, 2, 3):  # k0 becomes the least recently used entry
            st.restore([f"k{i}".encode()], via(cache("row", dims)), [0]).wait()
        st.offload(via(src), [10], [b"new"]).wait()  # full: evicts the LRU entry that is not pinned
        assert st.lookup([b"k0", b"k1", b"k2", b"k3", b"new"]).tolist() == [True, False, True, True, True]
        with pytest.raises(StoreFullError):  # 1 free slot; k0 pinned, the rest evictable: room for 4, not 5
            st.offload(via(src), [11, 12, 13, 14, 15], keys(5, "x"))
        gate.set()
        pinned.wait()
        assert np.array_equal(dst0.logical()[:, :, 5], X[:, :, 0]) and dst0.untouched([5])
        # Control: unpinned now, k0 is the LRU entry and is the one evicted.
        st._fault = None
        st.offload(via(src), [11], [b"newer"]).wait()
        assert st.lookup([b"k0", b"newer"]).tolist() == [False, True]
        dst = cache("row", dims)
        st.restore([b"new", b"newer"], via(dst), [0, 1]).wait()
        assert np.array_equal(dst.logical()[:, :, [0, 1]], X[:, :, [10, 11]])
    finally:
        st.close()


def test_a_timed_out_offload_publishes_nothing(tmp_path, via) -> None:
    dims = DIMS["aligned"]
    src = cache("row", dims, logical(dims))
    st = _store(tmp_path, dims)
    gate = threading.Event()
    st._fault = lambda stage: gate.wait(60) if stage == "written" else None
    t = st.offload(via(src), [0, 1], [b"a", b"b"])
    with pytest.raises(TransferTimeoutError):
        t.wait(timeout=0.2)
    gate.set()
    st.close()  # waits for the job
    with _store(tmp_path, dims) as st:
        assert not st.lookup([b"a", b"b"]).any() and len(st) == 0
        # Control: the same offload left to finish is published.
        st.offload(via(src), [0, 1], [b"a", b"b"]).wait()
        assert st.lookup([b"a", b"b"]).all()


def test_keys_are_opaque_bounded_bytes(tmp_path) -> None:
    dims = DIMS["aligned"]
    src, dst = cache("row", dims, logical(dims)), cache("row", dims)
    with _store(tmp_path, dims) as st:
        for bad in (["k0"], [b""], [b"x" * 1025]):
            with pytest.raises((StoreError, TypeError)):
                st.offload(src.spec, [0], bad)
        with pytest.raises(TypeError):
            st.offload(src.spec, [0], b"k0")
        with pytest.raises(DuplicateBlockIdError):
            st.offload(src.spec, [0, 1], [b"k", b"k"])
        st.offload(src.spec, [0], [b"../../etc/passwd"]).wait()  # a key is never a path
        assert sorted(p.name for p in tmp_path.iterdir())[0].startswith("slab-")
        with pytest.raises(StoreMissError) as e:
            st.restore([b"../../etc/passwd", b"absent"], dst.spec, [0, 1])
        assert e.value.keys == [b"absent"] and dst.untouched([])
        assert st.prefix([b"../../etc/passwd", b"absent"]) == 1 and len(st) == 1


def test_a_cache_that_does_not_pair_is_refused(tmp_path) -> None:
    dims = DIMS["aligned"]
    with _store(tmp_path, dims) as st:
        other = cache("row", DIMS["padded"], logical(DIMS["padded"]))
        with pytest.raises(LayoutMismatchError):
            st.offload(other.spec, [0], [b"a"])
        assert len(st) == 0 and (st._index.state == 0).all()  # the reservation was returned


def test_a_second_store_on_one_slab_is_refused(tmp_path) -> None:
    dims = DIMS["aligned"]
    st = _store(tmp_path, dims)
    with pytest.raises(StoreBusyError):
        _store(tmp_path, dims)
    st.close()
    _store(tmp_path, dims).close()  # control: once closed, it opens
    with _store(tmp_path, DIMS["padded"]):  # another layout is another slab: both open
        with _store(tmp_path, dims):
            pass


def test_files_are_private(tmp_path) -> None:
    dims = DIMS["aligned"]
    with _store(tmp_path / "s", dims) as st:
        st.offload(cache("row", dims, logical(dims)).spec, [0], [b"a"]).wait()
        modes = {p.name.rsplit(".", 1)[1]: p.stat().st_mode & 0o777 for p in (tmp_path / "s").iterdir()}
    assert modes == {"kv": 0o600, "idx": 0o600, "lock": 0o600}
    assert (tmp_path / "s").stat().st_mode & 0o077 == 0
    assert SENTINEL == 0xAA


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_call", [4096, 1 << 20])
def test_calls_move_exactly_the_descriptors_bytes(tmp_path, seed, max_call) -> None:
    """Random descriptors (runs, gaps, long ones cut at ``max_call``) written with pwritev and
    read back with preadv, against a reference built one descriptor at a time with numpy."""
    from kvxfer.store import fileio

    rng = np.random.default_rng(seed)
    n = 300
    lengths = rng.integers(1, 20000, n)
    gaps = rng.choice([0, 0, 0, 1, 4096, 777], n)  # mostly contiguous runs
    offsets = 4096 + np.cumsum(lengths + gaps) - lengths
    src = rng.integers(0, 256, int(lengths.sum()), dtype=np.uint8)
    at = np.cumsum(lengths) - lengths
    perm = rng.permutation(n)  # descriptors in any order: build_calls sorts by file offset
    size = int(offsets[-1] + lengths[-1])
    expect = np.zeros(size, dtype=np.uint8)
    for i in range(n):
        expect[offsets[i]:offsets[i] + lengths[i]] = src[at[i]:at[i] + lengths[i]]
    c = fileio.build_calls(np.uint64(src.ctypes.data) + at[perm].astype(np.uint64), offsets[perm], lengths[perm],
                           base=4096, stride=4096, row_len=4096, max_call=max_call)
    assert int(c.nbytes.sum()) == int(lengths.sum()) and int(c.nbytes.max()) <= max_call
    assert (((c.offset - 4096) // max_call) == ((c.offset + c.nbytes - 1 - 4096) // max_call)).all()  # on the grid
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, size)
        gs = fileio.groups(c, 4096, 4096)  # groups of calls, as the store runs them
        assert all(g[3] < h[2] for g, h in zip(gs, gs[1:])) and sum(b - a for a, b, _, _ in gs) == len(c)
        for a, b, _, _ in gs:
            part = fileio.Calls(c.iov, c.first[a:b], c.count[a:b], c.offset[a:b], c.nbytes[a:b], 0)
            fileio.run_calls(fd, True, part, lambda: False)
        assert np.array_equal(np.fromfile(tmp_path / "f", dtype=np.uint8), expect)
        back = np.full_like(src, SENTINEL)
        r = fileio.build_calls(np.uint64(back.ctypes.data) + at.astype(np.uint64), offsets, lengths,
                               base=4096, stride=4096, row_len=4096, max_call=max_call)
        fileio.run_calls(fd, False, r, lambda: False)
        assert np.array_equal(back, src)
    finally:
        os.close(fd)


def test_replacing_a_pinned_entry_never_writes_under_the_read(tmp_path, via) -> None:
    dims = DIMS["aligned"]
    X, Y = logical(dims, seed=1), logical(dims, seed=2)
    old, new = cache("row", dims, X), cache("row", dims, Y)
    st = _store(tmp_path, dims, slots=2)
    try:
        st.offload(via(old), [3], [b"k"]).wait()
        gate, entered = threading.Event(), threading.Event()

        def hold(stage: str) -> None:
            if stage == "verified" and not entered.is_set():
                entered.set()
                gate.wait(60)

        st._fault = hold
        first = cache("row", dims)
        t = st.restore([b"k"], via(first), [0])  # k checked, pinned, not yet copied
        assert entered.wait(60)
        st.offload(via(new), [3], [b"k"]).wait()  # replaces k: the other slot
        st.offload(via(new), [4], [b"j"]).wait()  # evicts the new k; the old k's slot stays pinned
        assert st.lookup([b"k", b"j"]).tolist() == [False, True]
        gate.set()
        t.wait()
        st._fault = None
        # The read copied the old row, whole: nothing was written into its slot meanwhile
        # (with the slot freed on replacement, j would have landed there: Y's block 4).
        assert np.array_equal(first.logical()[:, :, 0], X[:, :, 3])
        second = cache("row", dims)
        st.restore([b"j"], via(second), [0]).wait()
        assert np.array_equal(second.logical()[:, :, 0], Y[:, :, 4])
        st.offload(via(new), [5], [b"i"]).wait()  # the old slot is free once the read ended
        assert st.lookup([b"j", b"i"]).all()
    finally:
        st.close()


def test_threads_sharing_one_store(tmp_path, via) -> None:
    """Four threads offload, restore and discard random keys at once; every restore is exact."""
    dims = DIMS["padded"]
    X = logical(dims)
    src = cache("layer", dims, X)
    srcs, dsts = via(src), [cache("row", dims) for _ in range(4)]  # a destination per thread
    given = [via(d) for d in dsts]
    errors: list[BaseException] = []
    with _store(tmp_path, dims, slots=40) as st:

        def worker(w: int) -> None:
            rng = np.random.default_rng(w)
            dst = dsts[w]
            try:
                for r in range(30):
                    blocks = rng.choice(dims[1], 3, replace=False)
                    ks = [f"{w}:{r}:{b}".encode() for b in blocks]
                    st.offload(srcs, blocks, ks).wait()
                    dst.storages[0].view(np.uint8)[...] = SENTINEL
                    try:
                        st.restore(ks, given[w], [0, 1, 2]).wait()
                    except StoreMissError:  # another thread's offload evicted some: a miss, fine
                        continue
                    assert np.array_equal(dst.logical()[:, :, :3], X[:, :, blocks]) and dst.untouched([0, 1, 2])
                    if r % 3 == 0:
                        st.discard(ks[:1])
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert 0 < len(st) <= 40 and int((st._index.state != 0).sum()) == len(st)  # no slot leaked


def test_one_key_restored_into_two_blocks_and_empty_requests(tmp_path, via) -> None:
    dims = DIMS["padded"]
    X = logical(dims)
    src, dst = cache("layer", dims, X), cache("row", dims)
    with _store(tmp_path, dims) as st:
        assert st.offload(via(src), [], []).wait().stats.posts == 0 and len(st) == 0
        st.offload(via(src), [3, 4], [b"a", b"b"]).wait()
        st.restore([b"a", b"a", b"b"], via(dst), [0, 5, 9]).wait()
        assert st.restore([], via(dst), []).wait().stats.nbytes == 0
    assert np.array_equal(dst.logical()[:, :, [0, 5, 9]], X[:, :, [3, 3, 4]]) and dst.untouched([0, 5, 9])


def test_a_durable_store_round_trips_across_a_reopen(tmp_path) -> None:
    dims = DIMS["aligned"]
    X = logical(dims)
    with _store(tmp_path, dims, durable=True) as st:
        st.offload(cache("layer", dims, X).spec, [7, 8], [b"a", b"b"]).wait()
    dst = cache("row", dims)
    with _store(tmp_path, dims, durable=True) as st:
        st.restore([b"b", b"a"], dst.spec, [0, 1]).wait()
    assert np.array_equal(dst.logical()[:, :, [0, 1]], X[:, :, [8, 7]]) and dst.untouched([0, 1])


def test_store_lifecycle_is_logged_for_operators(tmp_path, caplog) -> None:
    """INFO lines on ``kvxfer.store``: created or reopened (rows held), rows evicted, closed."""
    import logging

    dims = DIMS["aligned"]
    src = cache("row", dims, logical(dims))
    caplog.set_level(logging.INFO, logger="kvxfer.store")
    with _store(tmp_path, dims, slots=2) as st:
        st.offload(src.spec, [0, 1], keys(2)).wait()
        assert not [r for r in caplog.records if "evicted" in r.getMessage()]  # control: nothing evicted yet
        st.offload(src.spec, [2], [b"third"]).wait()
    with _store(tmp_path, dims, slots=2):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name == "kvxfer.store"]
    events = [r.kvxfer["event"] for r in caplog.records if r.name == "kvxfer.store"]
    assert events == ["store_open", "store_evict", "store_close", "store_open", "store_close"], lines
    assert "created, 0 of 2 rows" in lines[0] and "evicted 1 least recently used row" in lines[1]
    assert "opened, 2 of 2 rows" in lines[3]


@pytest.mark.parametrize("kind", ["row", "layer"])
def test_stored_digests_are_kvxfer_integrity_row_digests(tmp_path, kind) -> None:
    """The digest on record for a row is what kvxfer.integrity computes for the source block,
    whatever the source's layout (one digest implementation)."""
    from kvxfer.integrity import compute

    dims = DIMS["padded"]
    src = cache(kind, dims, logical(dims))
    with _store(tmp_path, dims) as st:
        st.offload(src.spec, [5, 1, 8], keys(3)).wait()
        got = [st._index.entries[k].digest for k in keys(3)]
    want = compute(src.spec, [5, 1, 8], algorithm="xxh3", rows=True).values[:, 0].tolist()
    assert got == want
    assert compute(src.spec, [1, 5, 8], algorithm="xxh3", rows=True).values[:, 0].tolist() != want  # control


def test_entries_of_another_digest_or_journal_version_are_misses(tmp_path) -> None:
    """A journal of version 1 (no digest field) or a slab header naming another digest: the
    store opens, every old entry is a miss, new offloads work; control: the current format keeps them."""
    import json
    import struct
    import zlib

    dims = DIMS["aligned"]
    X = logical(dims)
    src = cache("row", dims, X)
    with _store(tmp_path, dims) as st:
        st.offload(src.spec, [0, 1], keys(2)).wait()
        idx, slab = st._slab.index_path, st.path
    with _store(tmp_path, dims) as st:  # control: reopened as written, both are there
        assert st.lookup(keys(2)).all()
    raw = open(idx, "rb").read()
    n, _ = struct.unpack_from("<II", raw)
    head = raw[8:8 + 29]  # version 1's header: type, fingerprint, slots
    old = struct.pack("<II", 29, zlib.crc32(head)) + head + raw[8 + n:]
    open(idx, "wb").write(old)
    with _store(tmp_path, dims) as st:
        assert not st.lookup(keys(2)).any() and len(st) == 0
        st.offload(src.spec, [2], [b"new"]).wait()
    with open(slab, "r+b") as f:  # the slab header names another digest
        h = f.read(4096)
        body_len = struct.unpack_from("<I", h, 12)[0]
        d = json.loads(h[16:16 + body_len])
        d["digest"] = "xxh3-64"
        body = json.dumps(d, sort_keys=True).encode()
        f.seek(0)
        f.write((h[:12] + struct.pack("<I", len(body)) + body).ljust(4096, b"\0"))
    with _store(tmp_path, dims) as st:
        assert st.lookup([b"new"]).all()  # the journal is current: the header alone does not drop entries
        dst = cache("row", dims)
        st.restore([b"new"], dst.spec, [0]).wait()
        assert np.array_equal(dst.logical()[:, :, 0], X[:, :, 2])
    with open(slab, "rb") as f:
        assert DIGEST_NAME.encode() in f.read(4096)  # the header was brought up to date


def test_the_nixl_file_path_refuses_memory_and_file_ranges_it_was_not_given(tmp_path) -> None:
    """NIXL POSIX's post checks every descriptor against the backend's registered memory and
    the registered file's size (OutOfRegistrationError); control: an in-bounds post moves bytes."""
    from common import has_nixl
    from kvxfer.errors import OutOfRegistrationError
    from kvxfer.memory import MemoryKind, Op

    if not has_nixl():
        pytest.skip("nixl is not installed: pip install -e '.[nixl]'")
    from kvxfer.store.paths import _wait

    buf = np.arange(8192, dtype=np.uint8) % 251
    other = np.zeros(4096, dtype=np.uint8)  # never registered
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 16384)
    with kvxfer.Agent("files", backend="nixl") as a:
        a.register(kvxfer.spec_from_arrays({"x": buf.reshape(2, 4096)}, dims="BX"))
        fp = a.backend.file_path()
        f = fp.register_file(fd, 16384)
        ok = np.array([[buf.ctypes.data, 4096, 0]], dtype=np.uint64)
        for local, off in ((np.array([[other.ctypes.data, 4096, 0]], dtype=np.uint64), [0]),  # not registered
                           (np.array([[buf.ctypes.data + 4096, 8192, 0]], dtype=np.uint64), [0]),  # runs past it
                           (ok, [16384 - 100])):  # past the file's end
            with pytest.raises(OutOfRegistrationError):
                fp.post(Op.WRITE, f, local, np.array(off, dtype=np.uint64), MemoryKind.DRAM)
        x = fp.post(Op.WRITE, f, ok, np.array([8192], dtype=np.uint64), MemoryKind.DRAM)  # control
        _wait(fp, x, True)
        fp.release(x)
        fp.deregister_file(f)
    data = os.pread(fd, 16384, 0)
    os.close(fd)
    assert data[8192:12288] == buf[:4096].tobytes() and data[:8192] == bytes(8192) and data[12288:] == bytes(4096)
