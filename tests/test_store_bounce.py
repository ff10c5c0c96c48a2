"""Offloads beside their reads of the cache: a per-layer host cache through bounce buffers
(kvxfer/store/bounce.py), a one-region cache with its digests beside the writes.

A per-layer cache's pages are gathered into rows by one pool task and written from the
buffers. Checked here against numpy over the logical array and a digest computed here from
the logical rows (``xxhash`` directly, not kvxfer's): the bytes in each slot, the padding
after each row (zeros), the digest on record, and what a failed write, a cancel in flight
and a store reused afterwards leave. Groups are made small (64 KiB) so that a request of
24 rows is several groups, the only case that takes this path.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import xxhash

import kvxfer
from kvxfer.errors import StoreError
from kvxfer.store import bounce, fileio
from kvxfer.store import store as store_mod
from kvxfer.store.slab import HEADER
from store_caches import DIMS, cache, keys, logical, row_bytes

GROUP = 64 << 10


@pytest.fixture
def small_groups(monkeypatch):
    monkeypatch.setattr(fileio, "MAX_CALL", GROUP)
    monkeypatch.setattr(store_mod, "MAX_CALL", GROUP)
    ran: list[int] = []
    real = bounce.offload

    def counted(*a, **k):
        ran.append(len(a[3]))  # the groups
        return real(*a, **k)

    monkeypatch.setattr("kvxfer.store.rungroups.offload", counted)
    return ran


def _rows(X: np.ndarray, blocks: np.ndarray) -> list[bytes]:
    """Block ``b``'s row as the slab holds it: every layer's K then V page, back to back."""
    return [np.ascontiguousarray(X[:, :, b]).tobytes() for b in blocks.tolist()]


@pytest.mark.parametrize("shape", ["aligned", "padded"])
def test_bytes_padding_and_digests(tmp_path, small_groups, shape) -> None:
    dims = DIMS[shape]
    X = logical(dims)
    src = cache("layer", dims, X)
    ids = np.random.default_rng(5).permutation(dims[1])
    with kvxfer.Store(tmp_path, capacity=dims[1] * row_bytes(dims) * 2, layout=src.spec) as st:
        st.offload(src.spec, ids, keys(dims[1])).wait()
        assert small_groups and small_groups[0] > 1  # the bounce path ran, over several groups
        g = st.geometry
        entries = st._index.lookup(keys(dims[1]))
        with open(st.path, "rb") as f:
            slab = f.read()
        for e, row in zip(entries, _rows(X, ids)):
            at = HEADER + e.slot * g.stride
            assert slab[at:at + g.row_len] == row
            assert slab[at + g.row_len:at + g.stride] == bytes(g.stride - g.row_len)  # padding: zeros
            assert e.digest == xxhash.xxh3_64_intdigest(row)
        dst = cache("row", dims)
        n = dims[1] - 4  # the last 4 blocks keep the sentinel
        st.restore(keys(dims[1])[:n], dst.spec, np.arange(n)).wait()
    assert np.array_equal(dst.logical()[:, :, :n], X[:, :, ids[:n]])
    assert dst.untouched(np.arange(n))
    assert np.array_equal(src.logical(), X)  # the source is only read


def test_a_write_that_fails_publishes_nothing_and_the_store_goes_on(tmp_path, small_groups) -> None:
    dims = DIMS["aligned"]
    X = logical(dims)
    src = cache("layer", dims, X)
    ids = np.arange(dims[1])
    with kvxfer.Store(tmp_path, capacity=dims[1] * row_bytes(dims), layout=src.spec) as st:
        calls = []

        def fail(stage: str) -> None:
            if stage == "issue":
                calls.append(stage)
                if len(calls) == 2:
                    raise StoreError("injected: the device failed")

        st._fault = fail
        with pytest.raises(StoreError, match="injected"):
            st.offload(src.spec, ids, keys(dims[1])).wait()
        st._fault = None
        assert not st.lookup(keys(dims[1])).any() and len(st) == 0
        assert len(st._bounce._free) == 1  # the buffers came back
        st.offload(src.spec, ids[::-1], keys(dims[1], "again")).wait()  # the slots were freed
        dst = cache("row", dims)
        st.restore(keys(dims[1], "again"), dst.spec, np.arange(dims[1])).wait()
    assert np.array_equal(dst.logical(), X[:, :, ids[::-1]])


@contextmanager
def _unfenced():
    """The control: ``Job.io`` that neither refuses a cancelled job nor is waited for."""
    yield


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "control-unfenced"])
@pytest.mark.parametrize("kind", ["layer", "row"])
def test_a_cancel_returns_only_once_nothing_reads_the_cache(tmp_path, small_groups, monkeypatch, kind,
                                                            fenced) -> None:
    """What reads the cache beside the writer (a per-layer cache's gathers; a one-region
    cache's digests, handed over right before each write) is made slow (50 ms each) and the
    request is cancelled while the writer issues its first write: one read is then in flight.
    Once ``cancel`` returned, nothing may still read the cache (the engine may reuse it); the
    control, whose reads are outside the fence, shows the check sees one that does."""
    dims = DIMS["aligned"]
    X = logical(dims)
    src = cache(kind, dims, X)
    spans: list[tuple[float, float]] = []
    owner, name = (bounce._Sources, "gather") if kind == "layer" else (store_mod.Store, "_digest_local")
    real = getattr(owner, name)

    def slow(self, *a):
        t0 = time.perf_counter()
        time.sleep(0.05)
        out = real(self, *a)
        spans.append((t0, time.perf_counter()))
        return out

    monkeypatch.setattr(owner, name, slow)
    if not fenced:
        monkeypatch.setattr(fileio.Job, "io", lambda self: _unfenced())
    with kvxfer.Store(tmp_path, capacity=dims[1] * row_bytes(dims), layout=src.spec) as st:
        issuing = threading.Event()
        st._fault = lambda stage: issuing.set() if stage == "issue" else None
        t = st.offload(src.spec, np.arange(dims[1]), keys(dims[1]))
        assert issuing.wait(60)
        time.sleep(0.01)  # a gather or digest is in flight
        t.cancel()
        ended = time.perf_counter()
        t._posts[0].handle.future.exception(timeout=60)  # the job's threads are done
        st._fault = None
        late = [s for s in spans if s[1] > ended]
        if not fenced:
            assert late, "the control saw no read after the cancel: the check cannot fail"
            return
        assert not late and not st.lookup(keys(dims[1])).any()
        monkeypatch.undo()
        st.offload(src.spec, np.arange(dims[1]), keys(dims[1])).wait()
        dst = cache("row", dims)
        st.restore(keys(dims[1]), dst.spec, np.arange(dims[1])).wait()
    assert np.array_equal(dst.logical(), X)
    assert kind == "row" or small_groups  # the per-layer request took the bounce path


def test_a_descriptor_outside_the_cache_is_refused(tmp_path, small_groups, monkeypatch) -> None:
    """A gather reads only the cache's allocations: a source range cut short (as if a plan
    reached past the cache) fails the offload, typed, and publishes nothing. The control:
    the full ranges, the same request, succeeds."""
    dims = DIMS["aligned"]
    src = cache("layer", dims, logical(dims))
    real = bounce.offload

    def short(st, job, calls, todo, mover, cancelled, hook, source, uniq, dig):
        cut = [(a, n - 4096) for a, n in source]  # each allocation's last page is outside
        return real(st, job, calls, todo, mover, cancelled, hook, cut, uniq, dig)

    with kvxfer.Store(tmp_path, capacity=dims[1] * row_bytes(dims), layout=src.spec) as st:
        monkeypatch.setattr("kvxfer.store.rungroups.offload", short)
        with pytest.raises(StoreError, match="leaves the cache"):
            st.offload(src.spec, np.arange(dims[1]), keys(dims[1])).wait()
        assert not st.lookup(keys(dims[1])).any()
        monkeypatch.setattr("kvxfer.store.rungroups.offload", real)
        st.offload(src.spec, np.arange(dims[1]), keys(dims[1])).wait()
        assert st.lookup(keys(dims[1])).all()
