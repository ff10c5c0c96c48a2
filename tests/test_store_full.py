"""The store on a real full file system (a small tmpfs mounted by the test), and refused
offloads (issue 30, findings 5 and 6).

The slab is preallocated, so rows never fail for space; the journal grows, and on a full disk
an append fails. Then an offload publishes nothing and frees its slots, an eviction or a
discard changes nothing, a batch cut part way is cut off again, and close still releases the
lock. A refused offload (bad block ids, a cache that does not pair) evicts nothing. Every test
has its control: the same operation with room (or valid) does what the test says did not
happen. Real bytes: rows from the logical array ``X``, a sentinel in the destination.
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import (BackendError, BlockCountMismatchError, BlockIdOutOfRangeError, BlockIdTypeError,
                           LayoutMismatchError, StoreFullError)
from kvxfer.store import journal
from kvxfer.store.index import LIVE, RESERVED
from store_caches import DIMS, cache, keys, logical, row_bytes

DIMS_A = DIMS["aligned"]
SLOTS = 16
CAP = SLOTS * row_bytes(DIMS_A)  # 16 slots of 16 KiB: a 260 KiB slab on a 1 MiB tmpfs
X = logical(DIMS_A)


@pytest.fixture
def mnt(tmp_path) -> Iterator[Path]:
    m = tmp_path / "mnt"
    m.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(m)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"this host does not let the test mount a tmpfs: {r.stderr.strip()}")
    try:
        yield m
    finally:
        subprocess.run(["umount", str(m)], check=True)


def _fill(m: Path, leave: int = 0) -> Path:
    """Take every free page of the file system but ``leave`` bytes' worth."""
    f = m / "filler"
    with open(f, "wb") as out:
        out.write(b"\0" * max(0, os.statvfs(m).f_bavail * 4096 - leave))
    try:
        with open(f, "ab") as out:
            while leave == 0:
                out.write(b"\0" * 4096)
                out.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    return f


def _page_keys(used: int, n: int) -> list[bytes]:
    """``n`` keys whose put records end the journal (``used`` bytes now) on a page boundary,
    so the next append needs a new page of the file system."""
    per = 35  # a put record's frame and fields; the key follows
    rest = (-(used + (n - 1) * (per + 200))) % 4096
    assert per < rest <= per + journal.MAX_KEY
    return [f"{i:03d}".encode().ljust(200, b"k") for i in range(n - 1)] + [b"z" * (rest - per)]


def _open(path: Path) -> kvxfer.Store:
    return kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec)


def _restores(st: kvxfer.Store, ks: list[bytes], blocks: list[int]) -> bool:
    dst = cache("row", DIMS_A)
    st.restore(ks, dst.spec, np.arange(len(ks))).wait()
    return bool(np.array_equal(dst.logical()[:, :, :len(ks)], X[:, :, blocks]) and dst.untouched(np.arange(len(ks))))


def _full_store(m: Path) -> tuple[kvxfer.Store, list[bytes], Path]:
    """Every slot held, the journal ending on a page boundary, and no free page left."""
    st = _open(m / "s")
    ks = _page_keys(os.path.getsize(st._slab.index_path), SLOTS)
    st.offload(cache("row", DIMS_A, X).spec, np.arange(SLOTS), ks).wait()
    assert os.path.getsize(st._slab.index_path) % 4096 == 0
    return st, ks, _fill(m)


def test_on_a_full_disk_an_eviction_and_a_discard_change_nothing(mnt) -> None:
    st, ks, filler = _full_store(mnt)
    try:
        idx = Path(st._slab.index_path)
        before = idx.read_bytes()
        src = cache("row", DIMS_A, X)
        with pytest.raises(StoreFullError):
            st.offload(src.spec, [20], [b"new"])  # needs an eviction the journal cannot take
        with pytest.raises(StoreFullError):
            st.discard(ks[:2])
        assert st.lookup(ks).all() and len(st) == SLOTS and idx.read_bytes() == before
        assert not (st._index.state == RESERVED).any()
        assert _restores(st, ks, list(range(SLOTS)))
        filler.unlink()  # control: with room, the same offload evicts the least recently used entry
        st.offload(src.spec, [20], [b"new"]).wait()
        assert st.lookup([b"new"]).all() and int(st.lookup(ks).sum()) == SLOTS - 1
        assert st.discard(ks[-2:]) == 2 and not st.lookup(ks[-2:]).any()
    finally:
        st.close()


def _legacy_append(self: journal.Journal, records: bytes) -> None:
    view = memoryview(records)
    while view:
        view = view[os.pwrite(self.fd, view, os.fstat(self.fd).st_size):]


@pytest.mark.parametrize("cut", [True, False], ids=["fixed", "control"])
def test_on_a_full_disk_an_offload_publishes_nothing_and_its_batch_is_cut_off(mnt, cut, monkeypatch) -> None:
    """The put batch is larger than the page left: the file system takes part of it. The fix
    cuts that part off again; the control (the append as it was: at the end of the file,
    whatever is there, nothing cut) keeps the failed offload's complete records
    and a torn one, behind which a later offload's records are lost to a replay."""
    st = _open(mnt / "s")
    src = cache("row", DIMS_A, X)
    try:
        st.offload(src.spec, [0, 1], [b"a", b"b"]).wait()
        idx = Path(st._slab.index_path)
        size = idx.stat().st_size
        filler = _fill(mnt)
        if not cut:
            monkeypatch.setattr(journal.Journal, "append", _legacy_append)
        big = [bytes([65 + i]) * 1000 for i in range(8)]  # 8 KiB of records: one page is not enough
        t = st.offload(src.spec, np.arange(2, 10), big)
        with pytest.raises(StoreFullError if cut else BackendError):  # the control: untyped, as it was
            t.wait()
        assert not st.lookup(big).any() and len(st) == 2
        assert int((st._index.state == LIVE).sum()) == 2 and not (st._index.state == RESERVED).any()
        filler.unlink()
        st.offload(src.spec, [10, 11], [b"c", b"d"]).wait()  # reuses the freed slots
        assert _restores(st, [b"a", b"b", b"c", b"d"], [0, 1, 10, 11])
        replayed = {r.key for r in journal.load(str(idx), st.geometry.fingerprint, st.slots) if r.kind == "P"}
        if cut:
            assert idx.stat().st_size > size and replayed == {b"a", b"b", b"c", b"d"}
        else:  # what a restart would have found: the failed offload's rows, and not c and d
            assert replayed & set(big) and not replayed >= {b"c", b"d"}
    finally:
        monkeypatch.undo()
        st.close()


def test_close_on_a_full_disk_releases_the_lock(mnt) -> None:
    st, ks, filler = _full_store(mnt)
    lock = str(mnt / "s" / f"slab-{st.geometry.fingerprint}.lock")

    def locked() -> bool:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    assert locked()  # control: an open store holds it
    st.close()  # its compaction cannot be written: skipped, the journal as appended is complete
    assert not locked()
    with _open(mnt / "s") as st:  # the same process opens it again, on the full disk, with every entry
        assert st.lookup(ks).all() and _restores(st, ks[:3], [0, 1, 2])
        with pytest.raises(StoreFullError):
            st.discard(ks[:1])
    filler.unlink()
    with _open(mnt / "s") as st:  # and with room, compacted, still every entry
        assert st.lookup(ks).all() and st.discard(ks[:1]) == 1


def test_a_journal_that_does_not_fit_at_creation_leaves_nothing(mnt) -> None:
    slab = 4096 + CAP
    filler = _fill(mnt, leave=slab)  # room for the slab, not one page more
    with pytest.raises(StoreFullError):
        _open(mnt / "s")
    assert list((mnt / "s").iterdir()) == []  # no slab, no index, no temporary, no lock file
    filler.unlink()  # control: with room, it is created
    with _open(mnt / "s") as st:
        st.offload(cache("row", DIMS_A, X).spec, [3], [b"a"]).wait()
        assert _restores(st, [b"a"], [3])


def test_a_refused_offload_evicts_nothing(tmp_path) -> None:
    src = cache("row", DIMS_A, X)
    with _open(tmp_path / "s") as st:
        ks = keys(SLOTS)
        st.offload(src.spec, np.arange(SLOTS), ks).wait()
        idx = Path(st._slab.index_path)
        before = idx.read_bytes()
        other = cache("row", DIMS["padded"], logical(DIMS["padded"]))
        for blocks, err, who in [([99], BlockIdOutOfRangeError, src), ([-1], BlockIdOutOfRangeError, src),
                                 ([1.5], BlockIdTypeError, src), ([0, 1], BlockCountMismatchError, src),
                                 ([0], LayoutMismatchError, other)]:
            with pytest.raises(err):
                st.offload(who.spec, blocks, [b"new"])
            assert st.lookup(ks).all() and idx.read_bytes() == before and not (st._index.state == RESERVED).any()
        assert _restores(st, ks, list(range(SLOTS)))
        st.offload(src.spec, [20], [b"new"]).wait()  # control: a valid one evicts the oldest entry
        assert st.lookup(ks).tolist() == [False] + [True] * (SLOTS - 1) and idx.read_bytes() != before
        assert _restores(st, [b"new"], [20])
