"""Attacks on KvxferHiCache: hostile keys and indices, another uid's store, a cancel in flight.

Each has its control: the same attack with the defence bypassed shows the bad outcome (an
exception into SGLang's storage thread, the attacker's rows opened, bytes landing in the host
pool after the call reported the page not loaded).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from kvxfer.errors import InvalidArgumentError, StorePermissionError
from kvxfer.integrations.sglang.backend import KvxferHiCache
from kvxfer.store import dirs, fileio

from kvxfer.testing.other_uid import as_user, attacker
from sglang_site import PAGE, SENTINEL, backend, config, expected, fill, indices, keys, pool, raw


def _dir(tmp_path: Path) -> str:
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    return str(d)


HOSTILE_KEYS: dict[str, Any] = {
    "path-traversal": "../../../etc/passwd",
    "slash": "a/b",
    "nul": "abc\x00def",
    "huge": "a" * 100_000,
    "empty": "",
    "bytes": b"abcdef",
    "int": 7,
    "none": None,
}
GOOD = keys("g", 1)[0]
HOSTILE_INDICES: dict[str, Any] = {
    "out-of-range": indices([10_000]),
    "negative": torch.arange(-PAGE, 0),
    "unaligned": torch.arange(1, PAGE + 1),
    "not-one-page": torch.tensor([0, 2, 4, 6]),
    "short": torch.arange(PAGE - 1),
    "float": indices([1]).double(),
    "2-d": indices([1]).reshape(1, PAGE),
    "list": list(range(PAGE)),
    "none": None,
}


def _calls(b: KvxferHiCache, k: Any, idx: Any, unwrapped: bool = False) -> list[Any]:
    """Every method SGLang calls with a key (and host indices)."""
    f = (lambda m: getattr(KvxferHiCache, m).__wrapped__.__get__(b)) if unwrapped else (lambda m: getattr(b, m))
    return [f("exists")(k), f("batch_exists")([k]), f("batch_set_v1")([k], idx), f("batch_get_v1")([k], idx)]


def test_hostile_keys_and_indices_are_typed_misses_and_move_nothing(tmp_path: Path) -> None:
    p = pool()
    b = backend(p, config(_dir(tmp_path)))
    fill(p, [GOOD], [0])
    assert b.batch_set_v1([GOOD], indices([0])) == [True]
    before, pool_before = b.store.keys(), raw(p).copy()
    for name, k in HOSTILE_KEYS.items():
        assert _calls(b, k, indices([1])) == [False, 0, [False], [False]], name
    for name, idx in HOSTILE_INDICES.items():
        assert b.batch_get_v1([GOOD], idx) == [False], name
        assert b.batch_set_v1(keys("new", 1), idx) == [False], name
    assert b.batch_get_v1([GOOD, GOOD], indices([1, 2])) == [False, False]  # a key twice
    assert b.batch_get_v1(keys("x", 2), indices([1, 1])) == [False, False]  # a page twice
    assert b.store.keys() == before and np.array_equal(raw(p), pool_before)
    assert b.errors >= len(HOSTILE_KEYS) + 2 * len(HOSTILE_INDICES)
    # the same backend still serves a good page
    raw(p)[:] = SENTINEL
    assert b.batch_get_v1([GOOD], indices([3])) == [True]
    assert np.array_equal(raw(p), expected(p, [GOOD], [3]))
    b.close()


def test_control_hostile_input_raises_into_sglang_without_the_boundary(tmp_path: Path) -> None:
    """What the boundary contains: unwrapped, each call raises a typed error into the caller
    (SGLang's storage thread has no handler around it)."""
    p = pool()
    b = backend(p, config(_dir(tmp_path)))
    unwrapped = lambda m: getattr(KvxferHiCache, m).__wrapped__.__get__(b)  # noqa: E731
    for name, k in HOSTILE_KEYS.items():
        for m in ("exists", "batch_set_v1", "batch_get_v1"):
            with pytest.raises(InvalidArgumentError):
                unwrapped(m)(k) if m == "exists" else unwrapped(m)([k], indices([1]))
    for name, idx in HOSTILE_INDICES.items():
        with pytest.raises(InvalidArgumentError):
            unwrapped("batch_get_v1")([GOOD], idx)
    b.close()


@pytest.fixture
def shared() -> Iterator[Path]:
    """A sticky, world-writable directory every uid can reach (what /dev/shm is)."""
    d = Path(tempfile.mkdtemp(prefix="kvxfer-sglang-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _planted(shared: Path) -> str:
    """``shared/kv`` made first by the attacker uid, waiting for a victim to store pages there."""
    path = shared / "kv"
    as_user(attacker(), lambda: os.mkdir(path, 0o755))
    assert path.stat().st_uid != os.geteuid()
    return str(path)


@pytest.mark.parametrize("checked", [True, False], ids=["refused", "control-check-off"])
def test_another_uids_store_directory_is_refused(shared: Path, checked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _planted(shared)
    p = pool()
    if checked:
        with pytest.raises(StorePermissionError, match="belongs to uid"):
            backend(p, config(path))
        assert os.listdir(path) == []  # nothing made there
    else:  # without the check, the victim's pages go to a directory the attacker owns (and may rewrite)
        monkeypatch.setattr(dirs, "_check", lambda st, what, where: None)
        b = backend(p, config(path))
        fill(p, [GOOD], [0])
        assert b.batch_set_v1([GOOD], indices([0])) == [True]
        assert any(n.endswith(".kv") for n in os.listdir(path))
        b.close()


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "control-fence-off"])
def test_a_load_cancelled_in_flight_writes_nothing_after_it_returned(tmp_path: Path, fenced: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's read is held right before its system call until the call's timeout has
    cancelled it; the call reports every page not loaded, and the pool must not change after."""
    p = pool()
    b = backend(p, config(_dir(tmp_path), timeout=0.2))
    ks = keys("t", 2)
    fill(p, ks, [0, 1])
    assert b.batch_set_v1(ks, indices([0, 1])) == [True, True]
    raw(p)[:] = SENTINEL
    cancelling, go = threading.Event(), threading.Event()
    real_cancel = fileio.Job.cancel

    def cancel(job: fileio.Job) -> None:
        cancelling.set()
        if fenced:
            real_cancel(job)  # returns once the held read has ended
        else:
            job.cancelled = True  # the fence bypassed: return at once

    monkeypatch.setattr(fileio.Job, "cancel", cancel)
    b.store._fault = lambda stage: go.wait(30) if stage == "issue" else None
    releaser = threading.Thread(target=lambda: cancelling.wait(30) and fenced and go.set())
    releaser.start()
    assert b.batch_get_v1(ks, indices([4, 5])) == [False, False]
    after = raw(p).copy()
    go.set()  # the held read goes on now, if it still can
    releaser.join()
    b.close()  # waits for the store's threads: whatever could land has landed
    assert cancelling.is_set()  # the timeout did cancel the load while its read was held
    if fenced:
        assert np.array_equal(raw(p), after)  # nothing landed after the call returned
    else:  # what the fence stops: the read lands in pages SGLang was told were not loaded
        assert np.all(after == SENTINEL)
        assert np.array_equal(raw(p), expected(p, ks, [4, 5]))
