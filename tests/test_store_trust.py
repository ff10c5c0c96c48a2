"""The store trusts only what it made (issue 30, finding 4), and reads its files bounded
(finding 7).

* A directory another uid made first (a shared ``/dev/shm/kv``) holding that uid's slab and
  journal, rows under the victim's keys with matching digests: refused, typed. Control: with
  the trust check removed, the victim's restore ends DONE with the attacker's bytes.
* A directory of ours that others may write: refused; control: the same directory 0700 opens.
* Symlinks planted at the temporary names and at the files' names: never followed. Control:
  the creation as it was (predictable name, ``O_CREAT|O_TRUNC``) truncates the linked file.
* A crafted slab header (deep JSON, numbers that would make a 1 GiB message) is a short
  typed error; the journal is replayed a chunk at a time.

Real bytes: victim rows from the logical array ``X``, the attacker's from another one, the
destination a sentinel; expectations are numpy indexing, never the store's arithmetic.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import StoreError, StorePermissionError
from kvxfer.store import dirs, journal
from kvxfer.store.slab import HEADER, geometry
from kvxfer.store.view import IndexView, ViewHandle
from kvxfer.testing.other_uid import as_user, attacker
from store_caches import DIMS, SENTINEL, cache, keys, logical, row_bytes

DIMS_A = DIMS["aligned"]
CAP = 8 * row_bytes(DIMS_A)
N = 4


def _fp() -> str:
    return geometry(cache("row", DIMS_A).spec).fingerprint


def _attackers_files(staging: Path) -> dict[str, bytes]:
    """A slab and journal holding the attacker's rows (another pattern) under the victim's keys."""
    evil = cache("row", DIMS_A, logical(DIMS_A, seed=666))
    with kvxfer.Store(staging, capacity=CAP, layout=evil.spec) as st:
        st.offload(evil.spec, np.arange(N), keys(N)).wait()
    return {p.name: p.read_bytes() for p in staging.iterdir() if p.suffix in (".kv", ".idx")}


def _victim_restores(path: Path) -> np.ndarray:
    dst = cache("row", DIMS_A)
    with kvxfer.Store(path, capacity=CAP, layout=dst.spec) as st:
        st.restore(keys(N), dst.spec, np.arange(N)).wait()
    assert dst.untouched(np.arange(N))
    return np.ascontiguousarray(dst.logical()[:, :, :N])


@pytest.fixture
def shared() -> Path:
    """A sticky, world-writable directory every uid can reach (what /dev/shm is)."""
    d = Path(tempfile.mkdtemp(prefix="kvxfer-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _plant(shared: Path, files: dict[str, bytes]) -> Path:
    """As the attacker uid: make ``shared/kv`` first and put ``files`` in it."""
    path = shared / "kv"

    def make() -> None:
        os.mkdir(path, 0o755)
        for name, data in files.items():
            fd = os.open(path / name, os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, data)
            os.close(fd)

    as_user(attacker(), make)
    assert path.stat().st_uid != os.geteuid()
    return path


def test_a_directory_another_uid_made_is_refused(tmp_path, shared) -> None:
    path = _plant(shared, _attackers_files(tmp_path / "staging"))
    with pytest.raises(StorePermissionError, match="belongs to uid"):
        kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec)
    assert sorted(p.suffix for p in path.iterdir()) == [".idx", ".kv"]  # nothing made there either


def test_control_without_the_check_the_attackers_rows_are_restored(tmp_path, shared, monkeypatch) -> None:
    path = _plant(shared, _attackers_files(tmp_path / "staging"))
    monkeypatch.setattr(dirs, "_check", lambda st, what, where: None)
    got = _victim_restores(path)  # DONE, digests and all
    assert np.array_equal(got, logical(DIMS_A, seed=666)[:, :, :N])
    assert not np.array_equal(got, logical(DIMS_A)[:, :, :N])


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_may_write_is_refused(tmp_path, mode) -> None:
    path = tmp_path / "s"
    path.mkdir(mode=0o700)
    path.chmod(mode)
    with pytest.raises(StorePermissionError, match="writable by group or others"):
        kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec)
    assert list(path.iterdir()) == []
    path.chmod(0o700)  # control: the same directory, ours alone
    X = logical(DIMS_A)
    with kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec) as st:
        st.offload(cache("row", DIMS_A, X).spec, np.arange(N), keys(N)).wait()
    assert np.array_equal(_victim_restores(path), X[:, :, :N])


def test_a_file_of_another_uid_in_our_directory_is_refused(tmp_path) -> None:
    pw = attacker()
    path = tmp_path / "s"
    with kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec) as st:
        st.offload(cache("row", DIMS_A, logical(DIMS_A)).spec, np.arange(N), keys(N)).wait()
    os.chown(path / f"slab-{_fp()}.idx", pw.pw_uid, pw.pw_gid)
    with pytest.raises(StorePermissionError, match="belongs to uid"):
        kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec)
    os.chown(path / f"slab-{_fp()}.idx", os.geteuid(), os.getegid())  # control: ours again, it opens
    assert np.array_equal(_victim_restores(path), logical(DIMS_A)[:, :, :N])


def _legacy_create(self: dirs.StoreDir, name: str) -> tuple[int, str]:
    """How files were created before the fix: a predictable name, following links, truncating."""
    tmp = f"{name}.tmp-{os.getpid()}"
    return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=self.fd), tmp


@pytest.mark.parametrize("legacy", [False, True], ids=["fixed", "control"])
def test_symlinks_at_the_temporary_names_are_never_followed(tmp_path, legacy, monkeypatch) -> None:
    precious = tmp_path / "precious"
    precious.write_bytes(b"P" * 5000)
    path = tmp_path / "s"
    path.mkdir(mode=0o700)
    for ext in ("kv", "idx"):
        os.symlink(precious, path / f"slab-{_fp()}.{ext}.tmp-{os.getpid()}")
    if legacy:
        monkeypatch.setattr(dirs.StoreDir, "create", _legacy_create)
        monkeypatch.setattr(dirs.StoreDir, "sweep", lambda self, prefix: None)
    try:
        with kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec) as st:
            st.offload(cache("row", DIMS_A, logical(DIMS_A)).spec, [0], [b"a"]).wait()
    except StoreError:
        assert legacy  # the legacy store wrote its slab and its journal into one file: it fails too
    if legacy:
        assert precious.read_bytes() != b"P" * 5000  # the victim's own file was overwritten
    else:
        assert precious.read_bytes() == b"P" * 5000
        assert not any(".tmp-" in p.name for p in path.iterdir())  # the planted links were swept


@pytest.mark.parametrize("ext", ["kv", "idx", "lock"])
def test_a_symlink_at_a_files_name_is_refused(tmp_path, ext) -> None:
    precious = tmp_path / "precious"
    precious.write_bytes(b"P" * 5000)
    path = tmp_path / "s"
    with kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec):
        pass
    (path / f"slab-{_fp()}.{ext}").unlink()
    os.symlink(precious, path / f"slab-{_fp()}.{ext}")
    with pytest.raises(StorePermissionError, match="symlink"):
        kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec)
    assert precious.read_bytes() == b"P" * 5000
    (path / f"slab-{_fp()}.{ext}").unlink()  # control: without the link the store opens (a missing slab: empty)
    kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec).close()


@pytest.mark.parametrize("bad", ["", "a\0b", 12, "file"])
def test_a_path_that_is_no_directory_is_typed(tmp_path, bad) -> None:
    if bad == "file":
        bad = tmp_path / "f"
        bad.write_bytes(b"x")
    with pytest.raises(StoreError):
        kvxfer.Store(bad, capacity=CAP, layout=cache("row", DIMS_A).spec)
    kvxfer.Store(tmp_path / "d", capacity=CAP, layout=cache("row", DIMS_A).spec).close()  # control


def _craft_header(path: Path, body: bytes) -> None:
    slab = path / f"slab-{_fp()}.kv"
    with open(slab, "r+b") as f:
        f.write((b"KVXFSLAB" + struct.pack("<II", 1, len(body)) + body).ljust(HEADER, b"\0"))


def test_a_crafted_slab_header_is_a_short_typed_error(tmp_path) -> None:
    path = tmp_path / "s"
    kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec).close()
    deep = b"[" * 4000 + b"]" * 4000
    deep = deep[:2000] + deep[-2000:]  # 2000 levels, inside the 4 KiB header
    huge = json.dumps({"fingerprint": _fp(), "slots": 1 << 20, "stride": "x" * 4000}).encode()
    for body in (deep, huge):
        _craft_header(path, body)
        with pytest.raises(StoreError) as err:
            kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec)
        assert len(str(err.value)) < 500 and not isinstance(err.value.__context__, RecursionError)
    # Controls: the crafted inputs are what they claim to be.
    with pytest.raises(RecursionError):
        json.loads(deep)
    d = json.loads(huge)
    assert d["slots"] * len(d["stride"]) >= 1 << 30  # the message the old code computed


def test_the_journal_is_read_a_chunk_at_a_time(tmp_path, monkeypatch) -> None:
    """Opening a store and a view over a journal four chunks long: no read larger than a chunk,
    and the put behind all the drops is found. Control: a chunk as large as the file is seen."""
    path = tmp_path / "s"
    X = logical(DIMS_A)
    with kvxfer.Store(path, capacity=CAP, layout=cache("row", DIMS_A).spec) as st:
        st.offload(cache("row", DIMS_A, X).spec, [5], [b"last"]).wait()
        e = st._index.entries[b"last"]
        idx = Path(st._slab.index_path)
        handle = ViewHandle.of(st)
    head = idx.read_bytes()
    drop = journal.encode_drop(b"d" * 1000)
    idx.write_bytes(head[:-len(journal.encode_put(b"last", e.generation, e.slot, e.digest))]
                    + drop * (4 * journal.CHUNK // len(drop)) + journal.encode_put(b"last", e.generation, e.slot,
                                                                                     e.digest))
    size = idx.stat().st_size

    def largest(chunk: int) -> int:
        monkeypatch.setattr(journal, "CHUNK", chunk)
        seen = [0]
        real_read, real_pread = os.read, os.pread

        def read(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            seen[0] = max(seen[0], len(data))
            return data

        def pread(fd: int, n: int, at: int) -> bytes:
            data = real_pread(fd, n, at)
            seen[0] = max(seen[0], len(data))
            return data

        monkeypatch.setattr(os, "read", read)
        monkeypatch.setattr(os, "pread", pread)
        try:
            assert IndexView(handle).lookup([b"last"]).all()
            dst = cache("row", DIMS_A)
            with kvxfer.Store(path, capacity=CAP, layout=dst.spec) as st:
                st.restore([b"last"], dst.spec, [0]).wait()
        finally:
            monkeypatch.setattr(os, "read", real_read)
            monkeypatch.setattr(os, "pread", real_pread)
        assert np.array_equal(dst.logical()[:, :, 0], X[:, :, 5]) and dst.untouched([0])
        return seen[0]

    long = idx.read_bytes()
    assert size > 3 * journal.CHUNK
    assert largest(journal.CHUNK) <= max(journal.CHUNK, HEADER)
    idx.write_bytes(long)
    assert largest(1 << 30) >= size  # control: the probe sees a whole-file read
    assert SENTINEL == 0xAA
