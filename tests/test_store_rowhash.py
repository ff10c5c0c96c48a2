"""The store's row digests at one hash call per row, and its transfers' wait (issue 37, item 3).

A row that is one run of host memory (a row-shaped cache, the slab's map) is hashed with one
xxh3 call, its place found once per cache; the value must be ``kvxfer.integrity``'s row digest
and, independently, xxh3 of the row's bytes as numpy or the slab file holds them. A store
transfer's ``wait`` sleeps on its job instead of polling, and keeps its deadlines.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import xxhash

import kvxfer
import kvxfer.store.digest as dg
from kvxfer.errors import TransferTimeoutError
from kvxfer.integrity.cells import Cells, source_spans
from kvxfer.integrity.digests import hash_rows
from kvxfer.store.fileio import ENGINE, JobTransfer
from kvxfer.store.slab import HEADER
from kvxfer.transfer import Transfer
from store_caches import DIMS, cache, keys, logical, row_bytes


def _store(path, dims, slots: int = 32, **kw) -> kvxfer.Store:
    return kvxfer.Store(path, capacity=slots * (-(-row_bytes(dims) // 4096) * 4096), layout=cache("row", dims).spec,
                        **kw)


def _calls(monkeypatch) -> list[int]:
    """Count the xxh3 calls the store's row digest makes."""
    seen: list[int] = []
    real = dg._xxh3()

    def counted(buf):  # type: ignore[no-untyped-def]
        seen.append(len(buf))
        return real(buf)

    monkeypatch.setattr(dg, "_xxh3", lambda: counted)
    return seen


@pytest.mark.parametrize("geom", sorted(DIMS))
def test_row_cache_digests_are_one_call_per_row_and_the_definition(geom, monkeypatch) -> None:
    """Rows of a row cache: one xxh3 call each, over exactly the row's bytes (reference: xxhash
    of numpy's row), equal to the definition's streamed value; control: one flipped byte
    changes that row's digest only."""
    dims = DIMS[geom]
    src = cache("row", dims, logical(dims))
    blocks = np.array([5, 1, 8, 1], dtype=np.int64)
    seen = _calls(monkeypatch)
    got = dg.local_row_digests(src.spec, blocks)
    rows = src.storages[0].reshape(dims[1], -1)
    want = [xxhash.xxh3_64_intdigest(rows[b].tobytes()) for b in blocks.tolist()]
    assert got.tolist() == want and len(seen) == 4 and set(seen) == {rows[0].nbytes}
    spans = source_spans(src.spec, blocks, Cells.pages(src.spec))
    assert hash_rows(spans).tolist() == want  # kvxfer.integrity's row digest, the one definition
    rows.view(np.uint8)[8, 7] ^= 0x01  # control: block 8's row changed
    again = dg.local_row_digests(src.spec, blocks)
    assert (again != got).tolist() == [False, False, True, False]


def test_a_layer_cache_keeps_the_definitions_streamed_path(monkeypatch) -> None:
    """Pages of one row in many arrays are not one run: the definition streams them (no call of
    the per-row path), and the value is xxh3 of the row's pages back to back in cell order."""
    dims = DIMS["aligned"]
    X = logical(dims)
    src = cache("layer", dims, X)
    seen = _calls(monkeypatch)
    got = dg.local_row_digests(src.spec, np.array([3, 0]))
    assert not seen and dg._runs(src.spec) is None and dg._runs(cache("row", dims).spec) is not None
    want = [xxhash.xxh3_64_intdigest(np.ascontiguousarray(X[:, :, b]).tobytes()) for b in (3, 0)]
    assert got.tolist() == want


@pytest.mark.parametrize("geom", sorted(DIMS))
def test_slab_digests_hash_the_file_rows(tmp_path, geom) -> None:
    """The digests on record and those of the slab's map are xxh3 of the row as the file holds
    it (read back with pread, padding excluded); control: a byte flipped in the file changes
    that row's map digest, and the restore refuses it."""
    dims = DIMS[geom]
    src = cache("row", dims, logical(dims))
    with _store(tmp_path, dims) as st:
        st.offload(src.spec, [4, 2, 9], keys(3)).wait()
        slots = np.array([st._index.entries[k].slot for k in keys(3)])
        g = st.geometry
        with open(st.path, "rb") as f:
            raw = [os.pread(f.fileno(), g.row_len, HEADER + s * g.stride) for s in slots.tolist()]
        want = [xxhash.xxh3_64_intdigest(r) for r in raw]
        assert [st._index.entries[k].digest for k in keys(3)] == want
        assert dg.row_digests(st._slab.mapped, slots).tolist() == want
        with open(st.path, "r+b") as f:
            at = HEADER + int(slots[1]) * g.stride + g.row_len - 1  # the row's last byte
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x80]))
        assert (dg.row_digests(st._slab.mapped, slots) != np.array(want, np.uint64)).tolist() == [False, True, False]
        dst = cache("row", dims)
        with pytest.raises(kvxfer.errors.StoreCorruptError):
            st.restore(keys(3), dst.spec, [0, 1, 2]).wait()


def test_block_ids_out_of_range_are_refused_typed() -> None:
    """The per-row path refuses what the definition refuses (no read outside the cache)."""
    dims = DIMS["aligned"]
    src = cache("row", dims, logical(dims))
    with pytest.raises(kvxfer.errors.IntegrityError):
        dg.local_row_digests(src.spec, np.array([0, dims[1]]))
    with pytest.raises(kvxfer.errors.IntegrityError):
        dg.local_row_digests(src.spec, np.array([-1]))


def _polls(monkeypatch) -> list[int]:
    n = [0]
    real = ENGINE.poll

    def poll(job):  # type: ignore[no-untyped-def]
        n[0] += 1
        return real(job)

    monkeypatch.setattr(ENGINE, "poll", poll)
    return n


@pytest.mark.parametrize("control", [False, True])
def test_wait_sleeps_on_the_job_then_polls_once(tmp_path, control, monkeypatch) -> None:
    """A store transfer's wait is woken by its job's end: the caller's thread polls at most
    twice for an offload held 50 ms in its workers (bytes checked after). Control: the core's
    polling wait (the class's override removed) polls many times for the same offload."""
    dims = DIMS["aligned"]
    X = logical(dims)
    src = cache("row", dims, X)
    if control:
        monkeypatch.setattr(JobTransfer, "wait", Transfer.wait)
    with _store(tmp_path, dims) as st:
        gate = threading.Event()
        st._fault = lambda stage: gate.wait(60) if stage == "written" else None
        t = st.offload(src.spec, [3, 7], keys(2))
        assert isinstance(t, JobTransfer)
        threading.Timer(0.05, gate.set).start()
        n = _polls(monkeypatch)
        t.wait()
        assert (n[0] > 2) if control else (n[0] <= 2), n[0]
        st._fault = None
        dst = cache("row", dims)
        st.restore(keys(2), dst.spec, [0, 5]).wait()
        assert np.array_equal(dst.logical()[:, :, [0, 5]], X[:, :, [3, 7]]) and dst.untouched([0, 5])


@pytest.mark.parametrize("control", [False, True])
def test_wait_keeps_the_stores_deadline(tmp_path, control) -> None:
    """wait() with no timeout ends at the store's timeout, cancels, and publishes nothing;
    control: the same offload let through is DONE and published."""
    dims = DIMS["aligned"]
    src = cache("row", dims, logical(dims))
    st = _store(tmp_path, dims, timeout=2.0)  # headroom for the control on a loaded machine
    gate = threading.Event()
    if control:
        gate.set()
    st._fault = lambda stage: gate.wait(60) if stage == "written" else None
    t = st.offload(src.spec, [0, 1], [b"a", b"b"])
    try:
        if control:
            assert t.wait().status is kvxfer.Status.DONE
        else:
            with pytest.raises(TransferTimeoutError):
                t.wait()
            assert t.status is kvxfer.Status.FAILED
    finally:
        gate.set()
        st.close()
    with _store(tmp_path, dims) as st:
        assert st.lookup([b"a", b"b"]).tolist() == [control, control]


@pytest.mark.parametrize("control", [False, True])
def test_a_source_changed_between_write_and_hash_is_a_miss_never_served(tmp_path, control) -> None:
    """An offload hashes a host cache's rows right after writing them: a row the caller changes
    in between is stored with the digest of bytes the slab does not hold, so its restore fails
    typed and leaves the destination as it was (a miss), never the changed or stale bytes
    served. Control: the same offload with the source left alone restores the exact bytes."""
    dims = DIMS["aligned"]
    X = logical(dims)
    src = cache("row", dims, X)
    with _store(tmp_path, dims) as st:
        def change(stage: str) -> None:
            if stage == "call" and not control:  # right after the write, before the hash
                src.storages[0].view(np.uint8)[2, 0, 0, 0, 0, :8] ^= 0xFF

        st._fault = change
        st.offload(src.spec, [2, 6], keys(2)).wait()
        st._fault = None
        dst = cache("row", dims)
        if control:
            st.restore(keys(2), dst.spec, [1, 4]).wait()
            assert np.array_equal(dst.logical()[:, :, [1, 4]], X[:, :, [2, 6]]) and dst.untouched([1, 4])
        else:
            with pytest.raises(kvxfer.errors.StoreCorruptError):
                st.restore(keys(2), dst.spec, [1, 4]).wait()
            assert dst.untouched([]) and not st.lookup(keys(2))[0]
