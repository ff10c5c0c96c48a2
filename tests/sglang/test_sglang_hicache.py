"""KvxferHiCache through SGLang's real storage factory and host pool, on CPU (sglang_site.py).

Bytes move for real: pages of SGLang's ``MHATokenToKVPoolHost`` are filled with a pattern
derived from each key, written through the backend, the pool is refilled with the sentinel,
and the pages are loaded back into *other* host pages; the whole pool is compared with the
reference (pattern where loaded, sentinel everywhere else), and each loaded page with what
SGLang's own ``get_data_page`` reads there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvxfer.integrations.sglang.backend import KvxferHiCache

from sglang_site import SENTINEL, backend, config, expected, fill, indices, keys, pattern, pool, raw

LAYOUTS = ["page_first", "page_first_direct"]


def _dir(tmp_path: Path) -> str:
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    return str(d)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_through_sglangs_factory_and_host_pool(tmp_path: Path, layout: str) -> None:
    p = pool(layout)
    b = backend(p, config(_dir(tmp_path)))
    assert isinstance(b, KvxferHiCache)
    ks, src, dst = keys("a", 3), [3, 5, 6], [1, 2, 7]
    fill(p, ks, src)
    assert b.batch_exists(ks) == 0
    assert b.batch_set_v1(ks, indices(src)) == [True] * 3
    assert b.batch_exists(ks + keys("absent", 1)) == 3
    assert b.batch_exists(keys("absent", 1) + ks) == 0  # a prefix, as SGLang counts it
    raw(p)[:] = SENTINEL
    assert b.batch_get_v1(ks + keys("absent", 1), indices(dst + [9])) == [True, True, True, False]
    assert np.array_equal(raw(p), expected(p, ks, dst))  # what changed, and that nothing else did
    for k, pg in zip(ks, dst):  # SGLang's own reading of the page agrees
        got = p.get_data_page(pg * p.page_size, flat=True).view(torch.uint8).numpy()
        assert np.array_equal(got, pattern(k, raw(p).shape[2]).ravel())
    assert b.batch_set_v1(ks, indices(src)) == [True] * 3 and len(b.store) == 3  # stored once
    b.close()


def test_flat_page_path_reads_what_the_zero_copy_path_wrote(tmp_path: Path) -> None:
    """SGLang's older path (one flat page per key) and the v1 path share the row format."""
    p = pool()
    b = backend(p, config(_dir(tmp_path)))
    ks = keys("f", 2)
    fill(p, ks[:1], [4])
    assert b.batch_set_v1(ks[:1], indices([4])) == [True]
    flat = torch.from_numpy(pattern(ks[1], raw(p).shape[2]).ravel().copy()).view(torch.float16)
    assert b.batch_set([ks[1]], [flat]) is True
    dummies = [p.get_dummy_flat_data_page() for _ in range(3)]
    for d in dummies:
        d.view(torch.uint8).fill_(SENTINEL)
    got = b.batch_get(ks + keys("absent", 1), dummies)
    assert got[2] is None and np.all(dummies[2].view(torch.uint8).numpy() == SENTINEL)
    for k, t in zip(ks, got[:2]):
        assert np.array_equal(t.view(torch.uint8).numpy(), pattern(k, raw(p).shape[2]).ravel())
    assert b.exists(ks[1]) and not b.exists(keys("absent", 1)[0])
    b.clear()
    assert not b.exists(ks[0]) and len(b.store) == 0
    b.close()


def test_each_tp_rank_gets_its_own_slab(tmp_path: Path) -> None:
    """``tp_rank``/``tp_size`` of SGLang's storage config choose the slab: another rank's pages
    (other heads, same keys) are never served. Control: the same rank, reopened, serves them."""
    d = _dir(tmp_path)
    p0 = pool()
    b0 = backend(p0, config(d, tp_rank=0, tp_size=2))
    ks = keys("r", 2)
    fill(p0, ks, [0, 1])
    assert b0.batch_set_v1(ks, indices([0, 1])) == [True, True]
    b1 = backend(pool(), config(d, tp_rank=1, tp_size=2))
    assert b1.store.path != b0.store.path and b1.batch_exists(ks) == 0
    b0.close()
    b1.close()
    p = pool()
    again = backend(p, config(d, tp_rank=0, tp_size=2))
    assert again.batch_get_v1(ks, indices([2, 3])) == [True, True]
    assert np.array_equal(raw(p), expected(p, ks, [2, 3]))
    again.close()


def _flip_every_row(b: KvxferHiCache, offset: int = 777) -> None:
    st = b.store
    with open(st.path, "r+b") as f:
        for s in range(st.slots):
            f.seek(4096 + s * st.geometry.stride + offset)
            x = f.read(1)
            f.seek(4096 + s * st.geometry.stride + offset)
            f.write(bytes([x[0] ^ 0x5A]))


@pytest.mark.parametrize("digests", [True, False], ids=["checked", "control-digests-off"])
def test_a_corrupted_row_is_a_miss_never_bytes(tmp_path: Path, digests: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    p = pool()
    b = backend(p, config(_dir(tmp_path)))
    if not digests:  # the check bypassed: every row's digest reads as 0, written and checked
        monkeypatch.setattr(b.store, "_digest_slots", lambda s: np.zeros(s.shape[0], dtype=np.uint64))
    ks = keys("c", 3)
    fill(p, ks, [0, 1, 2])
    assert b.batch_set_v1(ks, indices([0, 1, 2])) == [True] * 3
    _flip_every_row(b)
    raw(p)[:] = SENTINEL
    got = b.batch_get_v1(ks, indices([5, 6, 7]))
    if digests:
        assert got == [False] * 3
        assert np.all(raw(p) == SENTINEL)  # 0 corrupted bytes (0 bytes at all) reached the pool
        assert b.batch_exists(ks) == 0 and b.errors >= 1  # dropped: the next lookup is a miss
    else:  # what the digests stop: the flipped byte served to SGLang as KV
        assert got == [True] * 3
        assert int(np.count_nonzero(raw(p) != expected(p, ks, [5, 6, 7]))) == 3
    b.close()


def test_importing_the_package_imports_neither_sglang_nor_torch() -> None:
    code = ("import sys, kvxfer, kvxfer.integrations.sglang, kvxfer.integrations.sglang.pages; "
            "bad = [m for m in ('sglang', 'torch') if m in sys.modules]; assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
