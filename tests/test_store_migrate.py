"""A version-2 journal (page-wise row digests) is migrated at open, each row checked first.

The journal is forged as version 2 wrote it (its header, its digest name, puts carrying the
old digests computed by :func:`kvxfer.store.digest.legacy_row_digests`). Restores are checked
against numpy indexing over the logical source, and blocks not restored keep the sentinel.
The safety test damages one stored row while the store is closed: migration drops it; the
control bypasses the old-digest check and shows the damaged row would then be vouched for.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import kvxfer
from kvxfer.integrity import compute
from kvxfer.store import journal
from kvxfer.store.digest import LEGACY_NAME, legacy_row_digests
from store_caches import DIMS, cache, keys, logical, row_bytes

SRC = [5, 1, 8, 3]
DST = [0, 6, 2, 9]


def _store(path) -> kvxfer.Store:
    dims = DIMS["padded"]
    return kvxfer.Store(path, capacity=16 * (-(-row_bytes(dims) // 4096) * 4096), layout=cache("row", dims).spec)


def _forge_version_2(tmp_path, X: np.ndarray) -> tuple[str, str, int, dict[int, int]]:
    """Offload SRC, then rewrite the journal as version 2 with the old digests; returns the
    journal and slab paths, the row stride and the old digest of each slot."""
    src = cache("layer", DIMS["padded"], X)
    with _store(tmp_path) as st:
        st.offload(src.spec, SRC, keys(4)).wait()
        live = st._index.live()
        old = legacy_row_digests(st._slab.mapped, np.array([r.slot for r in live], np.int64))
        fp, slots, idx, slab, stride = st.geometry.fingerprint, st.slots, st._slab.index_path, st.path, st.geometry.stride
    head = (b"H" + fp.encode().ljust(20, b"\0") + struct.pack("<QH", slots, 2) + LEGACY_NAME.encode().ljust(24, b"\0"))
    body = journal._frame(head) + b"".join(journal.encode_put(r.key, r.generation, r.slot, int(d))
                                          for r, d in zip(live, old.tolist()))
    open(idx, "wb").write(body)
    return idx, slab, stride, {r.slot: int(d) for r, d in zip(live, old.tolist())}


def _restore(st: kvxfer.Store, ks: list[bytes], blocks: list[int]) -> np.ndarray:
    dst = cache("row", DIMS["padded"])
    st.restore(ks, dst.spec, blocks).wait()
    assert dst.untouched(blocks)
    return dst.logical()


def test_a_version_2_journal_is_migrated_and_its_rows_restore(tmp_path) -> None:
    X = logical(DIMS["padded"])
    idx, _, _, _ = _forge_version_2(tmp_path, X)
    src = cache("layer", DIMS["padded"], X)
    with _store(tmp_path) as st:
        assert st.lookup(keys(4)).all()
        got = [st._index.entries[k].digest for k in keys(4)]
        assert got == compute(src.spec, SRC, algorithm="xxh3", rows=True).values[:, 0].tolist()
        out = _restore(st, keys(4), DST)
        assert np.array_equal(out[:, :, DST], X[:, :, SRC])
    r = journal.Reader(st.geometry.fingerprint, st.slots)
    r.feed(open(idx, "rb").read())
    assert r.headed and not r.legacy  # the journal was rewritten as the current version


def _damage(slab: str, stride: int, slot: int) -> None:
    with open(slab, "r+b") as f:
        at = 4096 + slot * stride + 100
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("bypass", [False, True], ids=["checked", "control-unchecked"])
def test_migration_drops_a_row_damaged_while_closed(tmp_path, monkeypatch, bypass: bool) -> None:
    X = logical(DIMS["padded"])
    _, slab, stride, old = _forge_version_2(tmp_path, X)
    _damage(slab, stride, slot=1)  # keys(4)[1]'s row (slots are given in order)
    if bypass:  # the old-digest check off: every row "matches" what the journal says
        import kvxfer.store.migrate as mig

        monkeypatch.setattr(mig, "legacy_row_digests",
                            lambda mapped, slots: np.array([old[s] for s in slots.tolist()], np.uint64))
    with _store(tmp_path) as st:
        ok = [keys(4)[i] for i in (0, 2, 3)]
        assert st.lookup(ok).all()
        out = _restore(st, ok, [DST[i] for i in (0, 2, 3)])
        assert np.array_equal(out[:, :, [DST[i] for i in (0, 2, 3)]], X[:, :, [SRC[i] for i in (0, 2, 3)]])
        if not bypass:
            assert not st.lookup([keys(4)[1]]).any()  # dropped: a miss, never vouched for
        else:  # control: the damaged row got a fresh digest and restores wrong bytes without complaint
            assert st.lookup([keys(4)[1]]).all()
            out = _restore(st, [keys(4)[1]], [DST[1]])
            assert not np.array_equal(out[:, :, DST[1]], X[:, :, SRC[1]])
