"""The read-only view of a store's index (``kvxfer/store/view.py``), against the store itself.

The view is what another process (vLLM's scheduler) knows of a store it must not open, so
at random moments of a random sequence of offloads, discards, LRU evictions and reopenings
(each open and close compacts the journal: a new file renamed over the old, possibly longer
than what the view read last) one view object must name exactly the keys the store's own
index holds.
"""

from __future__ import annotations

import random

import pytest

import kvxfer
from kvxfer.store.view import IndexView, ViewHandle
from store_caches import DIMS, cache, row_bytes


def _open(path, spec) -> kvxfer.Store:
    return kvxfer.Store(path, capacity=16 * (-(-row_bytes(DIMS["aligned"]) // 4096) * 4096), layout=spec)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_view_follows_appends_evictions_and_compactions(tmp_path, seed) -> None:
    rng = random.Random(seed)
    src = cache("row", DIMS["aligned"])
    st = _open(tmp_path, src.spec)
    view = IndexView(ViewHandle.of(st))
    assert view.keys() == set()
    names = [f"p{i}".encode() for i in range(40)]
    seen, evicted, reopened = [], 0, 0
    for step in range(300):
        op = rng.random()
        if op < 0.6:  # 16 slots: enough offloads evict the least recently used
            ks = rng.sample(names, rng.randint(1, 5))
            before = set(st.keys())
            st.offload(src.spec, rng.sample(range(24), len(ks)), ks).wait()
            evicted += bool(before - set(st.keys()) - set(ks))
        elif op < 0.85:
            st.discard(rng.sample(names, 3))
        else:
            st.close()
            st = _open(tmp_path, src.spec)
            reopened += len(st) > 0
        if rng.random() < 0.4:  # looks now and then: several appends and compactions between two
            assert view.keys() == set(st.keys()), f"step {step}"
        seen.append(frozenset(st.keys()))
    assert view.keys() == set(st.keys())
    st.close()
    # Controls: the sequence did evict and compact a non-empty index, and the keys changed
    # all along (a view that stopped reading would have failed the comparison).
    assert evicted and reopened and len(set(seen)) > 20


def test_a_torn_tail_is_not_shown_until_it_is_whole(tmp_path) -> None:
    src = cache("row", DIMS["aligned"])
    with _open(tmp_path, src.spec) as st:
        st.offload(src.spec, [1], [b"a"]).wait()
        handle = ViewHandle.of(st)
        view = IndexView(handle)
        assert view.keys() == {b"a"}
        from kvxfer.store.journal import encode_put

        rec = encode_put(b"b", 99, 5, 7)
        with open(handle.index_path, "ab") as f:  # an append caught half-way
            f.write(rec[:-3])
            f.flush()
            assert view.keys() == {b"a"}
            f.write(rec[-3:])
        assert view.keys() == {b"a", b"b"}
