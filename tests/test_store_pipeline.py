"""The offload pipeline on the store's own path: one writer thread, digests on the pool.

An offload of several groups (:func:`kvxfer.store.fileio.groups`, shrunk here to two rows per
group by lowering ``MAX_CALL``) is written in file order by one thread, while the pool digests
each written group (``kvxfer/store/rungroups.py``, ``_pipeline``). The attacks on that new
surface, each with a control:

* a write that fails mid-pipeline: nothing is published, every slot is freed, and no digest
  task still reads the cache when the failure is reported (control: the pipeline without its
  final wait reports the failure while a digest still runs);
* a cancel in flight: no write is in flight once the cancel returns and none starts after,
  nothing is published (control: a cancel that only sets the flag returns during a write).

Bytes are checked against numpy indexing over the logical array; destinations start as the
sentinel and blocks outside a request keep it.
"""

from __future__ import annotations

import ctypes
import errno
import threading
import time
from typing import Any

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import StoreError
from kvxfer.store import fileio, rungroups
from kvxfer.store.index import RESERVED
from store_caches import DIMS, cache, keys, logical, row_bytes

DIMS_A = DIMS["aligned"]
N = DIMS_A[1]  # 24 blocks: 12 groups of two rows


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileio, "MAX_CALL", 2 * row_bytes(DIMS_A))


def _restored(st: kvxfer.Store, X: np.ndarray, ks: list[bytes], src_blocks: np.ndarray) -> bool:
    dst = cache("row", DIMS_A)
    st.restore(ks, dst.spec, np.arange(len(ks))).wait()
    return bool(np.array_equal(dst.logical()[:, :, :len(ks)], X[:, :, src_blocks]) and dst.untouched(np.arange(len(ks))))


def test_the_pipeline_runs_and_its_digests_are_the_definitions(tmp_path, small_groups) -> None:
    """The pipeline engages (one writer, several groups) and stores the same digests as
    ``kvxfer.integrity`` computes for the source blocks."""
    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    ids = np.random.default_rng(4).permutation(N)
    writers: set[int] = set()
    with kvxfer.Store(tmp_path, capacity=N * row_bytes(DIMS_A), layout=src.spec, threads=4) as st:
        st._fault = lambda stage: writers.add(threading.get_ident()) if stage == "issue" else None
        t = st.offload(src.spec, ids, keys(N)).wait()
        st._fault = None
        assert t.stats.posts == 12 and len(writers) == 1  # twelve calls, one writer thread
        want = kvxfer.integrity.compute(src.spec, ids, algorithm="xxh3", rows=True).values[:, 0].astype(np.uint64)
        got = np.array([e.digest for e in st._index.lookup(keys(N))], dtype=np.uint64)
        assert np.array_equal(got, want)
        assert _restored(st, X, keys(N), ids)


@pytest.mark.parametrize("waits", [True, False], ids=["fixed", "control-no-wait"])
def test_a_write_error_mid_pipeline_publishes_nothing(tmp_path, small_groups, monkeypatch, waits) -> None:
    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    real, calls = fileio._pwritev, [0]

    def failing(fd: int, iov: int, count: int, off: int) -> int:
        calls[0] += 1
        if calls[0] == 4:  # the fourth group's write: the disk fails
            ctypes.set_errno(errno.EIO)
            return -1
        return int(real(fd, iov, count, off))

    running, lock = [0], threading.Lock()

    with kvxfer.Store(tmp_path, capacity=N * row_bytes(DIMS_A), layout=src.spec) as st:
        digest = st._digest_local

        def slow(spec: Any, blocks: np.ndarray) -> np.ndarray:  # a digest that takes a while
            with lock:
                running[0] += 1
            time.sleep(0.05)
            try:
                return digest(spec, blocks)
            finally:
                with lock:
                    running[0] -= 1

        monkeypatch.setattr(st, "_digest_local", slow)
        monkeypatch.setattr(fileio, "_pwritev", failing)
        if not waits:
            monkeypatch.setattr(rungroups, "wait", lambda fs: None)
        t = st.offload(src.spec, np.arange(N), keys(N))
        with pytest.raises(StoreError, match="slab write failed"):
            t.wait()
        at_end = running[0]  # digests still reading the cache when the failure was reported
        t._posts[0].handle.future.exception(timeout=60)
        time.sleep(0.2)  # the control's stray digest tasks end
        if not waits:
            assert at_end > 0
            return
        assert at_end == 0
        assert not st.lookup(keys(N)).any() and len(st) == 0
        assert not (st._index.state == RESERVED).any()  # every reserved slot was freed
        monkeypatch.setattr(fileio, "_pwritev", real)
        st.offload(src.spec, np.arange(N)[::-1], keys(N)).wait()  # the slots are reused
        assert _restored(st, X, keys(N), np.arange(N)[::-1])


@pytest.mark.parametrize("fenced", [True, False], ids=["fixed", "control-flag-only"])
def test_a_cancel_mid_pipeline_writes_nothing_after_and_publishes_nothing(tmp_path, small_groups, monkeypatch,
                                                                         fenced) -> None:
    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    if not fenced:
        monkeypatch.setattr(fileio.Job, "cancel", lambda job: setattr(job, "cancelled", True))
    with kvxfer.Store(tmp_path, capacity=N * row_bytes(DIMS_A), layout=src.spec) as st:
        inflight, issued, third = [0], [0], threading.Event()

        def hook(stage: str) -> None:
            if stage == "issue":
                issued[0] += 1
                inflight[0] += 1
                if issued[0] == 3:
                    third.set()
                    time.sleep(0.1)  # a slow disk: this write is past its cancellation check
            elif stage == "call":
                inflight[0] -= 1

        st._fault = hook
        t = st.offload(src.spec, np.arange(N), keys(N))
        assert third.wait(60)
        t.cancel()
        at_cancel, issued_at_cancel = inflight[0], issued[0]
        assert t.status is kvxfer.Status.CANCELLED
        t._posts[0].handle.future.exception(timeout=60)
        st._fault = None
        if not fenced:
            assert at_cancel == 1  # the cancel returned while a write was still in flight
            return
        assert at_cancel == 0 and issued[0] == issued_at_cancel == 3  # none in flight, none after
        assert not st.lookup(keys(N)).any() and not (st._index.state == RESERVED).any()
        st.offload(src.spec, np.arange(N), keys(N)).wait()
        assert _restored(st, X, keys(N), np.arange(N))


def test_batch_publish_journals_what_per_key_records_would_and_replays(tmp_path) -> None:
    """An offload publishes its keys with one batch encoding (``journal.encode_puts``) and
    ``Index.put``: the journal's put records are byte for byte the per-key ``encode_put`` of
    the published entries, a re-offloaded key replaces its old entry (old slot freed), and a
    reopened store replays the same entries and restores the same bytes."""
    from kvxfer.store import journal

    X = logical(DIMS_A)
    src = cache("row", DIMS_A, X)
    half = N // 2
    ks = keys(N)
    cap = N * row_bytes(DIMS_A)
    with kvxfer.Store(tmp_path, capacity=cap, layout=src.spec) as st:
        st.offload(src.spec, np.arange(half), ks[:half]).wait()
        old = {e.key: e.slot for e in st._index.lookup(ks[:2])}
        st.offload(src.spec, np.arange(half, half + 2), ks[:2]).wait()  # replaces k0, k1
        new = [e.slot for e in st._index.lookup(ks[:2])]
        assert set(new).isdisjoint(old.values()) and (st._index.state[new] == 2).all()
        assert all(st._index.state[s] == 0 for s in old.values())  # the replaced rows' slots are free
        before = st._jbytes
        st.discard([ks[2]])
        assert st._jbytes - before == len(journal.encode_drop(ks[2]))
        st.offload(src.spec, np.arange(half + 2, N), ks[half + 2:]).wait()
        entries = st._index.lookup(ks)
        gone = {2, half, half + 1}  # discarded, and two keys never offloaded
        assert all((e is None) == (i in gone) for i, e in enumerate(entries))
        gens = [e.generation for e in entries if e is not None]
        assert len(set(gens)) == len(gens) and max(gens) == st._index.generation
        recs = sorted((e for e in entries if e is not None), key=lambda e: e.generation)[-(N - half - 2):]
        body = (tmp_path / st._slab.index_name).read_bytes()
        ref = b"".join(journal.encode_put(e.key, e.generation, e.slot, e.digest) for e in recs)
        assert body.endswith(ref)  # the last offload's records, as per-key encoding writes them
        snap = {k: (e.slot, e.generation, e.digest) for k, e in zip(ks, entries) if e is not None}
    with kvxfer.Store(tmp_path, capacity=cap, layout=src.spec) as st:  # replayed (then compacted)
        again = {k: (e.slot, e.generation, e.digest) for k, e in zip(ks, st._index.lookup(ks)) if e is not None}
        assert again == snap
        src_of = np.array([half, half + 1] + list(range(3, half)) + list(range(half + 2, N)))
        live = [ks[0], ks[1]] + ks[3:half] + ks[half + 2:]
        assert _restored(st, X, live, src_of)
