"""The cluster tier over a real Mooncake Store master: round trips, processes, crafted objects.

Every transfer moves real bytes: sources come from a logical array, destinations start as
0xAA, and results are compared with numpy indexing over the logical array, the blocks written
and the blocks left alone. Each safety test has a control: the same attack with the tier's
checks bypassed (``_verdict`` monkeypatched to accept everything) lands wrong bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from mooncake_fixtures import master, require_mooncake, worker  # noqa: F401
from store_caches import DIMS, SENTINEL, cache, keys, logical

from kvxfer.errors import (InvalidArgumentError, StoreBusyError, StoreCorruptError, StoreMissError,
                           StoreUnavailableError, TransferCancelledError, TransferTimeoutError)
from kvxfer.testing.lines import Channel
from kvxfer.testing.ports import free_port
from kvxfer.tiers import MooncakeTier, Tier
from kvxfer.tiers.objects import HEADER

pytestmark = [pytest.mark.multiprocess]

DIMS_ = DIMS["padded"]
X = logical(DIMS_, seed=3)


def tier(master, layout, **kw) -> MooncakeTier:  # noqa: F811
    kw.setdefault("segment", 16 << 20)
    kw.setdefault("buffer", 64 << 10)
    kw.setdefault("timeout", 10)
    return MooncakeTier(master.address, layout=layout, **kw)


@pytest.fixture(scope="module")
def holder(master) -> MooncakeTier:  # noqa: F811
    """A client lending a segment (a Mooncake client takes about 2 s to leave: one per module)."""
    with tier(master, cache("layer", DIMS_).spec) as t:
        yield t


@pytest.fixture
def t(holder, monkeypatch) -> MooncakeTier:
    """The module's tier, its test hooks restored after each test."""
    monkeypatch.setattr(holder, "_fault", None)
    yield holder


def expected(dst_blocks: list[int], src_blocks: list[int], src: np.ndarray = X) -> np.ndarray:
    want = np.full_like(src, 0)
    want.view(np.uint8)[...] = SENTINEL
    want[:, :, dst_blocks] = src[:, :, src_blocks]
    return want


def accept_all(self, got, heads, digests, names):
    """The control: no fetch failure and no check (what a tier without them would copy)."""
    return np.zeros(got.shape[0], dtype=bool), np.ones(got.shape[0], dtype=bool)


@pytest.mark.parametrize("src_kind,dst_kind", [("layer", "row"), ("row", "layer")])
def test_round_trip_is_byte_exact_over_several_rounds(t, monkeypatch, src_kind, dst_kind) -> None:
    src, dst = cache(src_kind, DIMS_, X), cache(dst_kind, DIMS_)
    ks = keys(12, f"rt-{src_kind}-")
    monkeypatch.setattr(t._bounce, "slots", 5)  # 12 rows in rounds of 5
    assert isinstance(t, Tier)
    off = t.offload(src.spec, list(range(12)), ks).wait()
    assert off.stats.telemetry == [{"objects": 12, "ios": 3}]
    assert t.lookup(ks + [b"absent"]).tolist() == [True] * 12 + [False]
    assert t.prefix(ks[:3] + [b"absent"] + ks[3:]) == 3
    dst_blocks, src_blocks = [20, 2, 9, 14, 0, 7, 23], [0, 11, 5, 6, 1, 2, 3]
    t.restore([ks[i] for i in src_blocks], dst.spec, dst_blocks).wait()
    assert np.array_equal(dst.logical(), expected(dst_blocks, src_blocks))


def test_keys_are_namespaced_by_the_layout_fingerprint(master, t) -> None:  # noqa: F811
    src = cache("layer", DIMS_, X)
    other = cache("layer", DIMS["aligned"])
    ks = keys(2, "ns-")
    a = t
    with tier(master, other.spec, segment=0) as b, tier(master, src.spec, segment=0, model="another-model") as c:
        a.offload(src.spec, [0, 1], ks).wait()
        assert a.lookup(ks).all()
        assert not b.lookup(ks).any() and not c.lookup(ks).any()  # another layout or model never meets them
        with pytest.raises(StoreMissError):
            c.restore(ks, src.spec, [0, 1]).wait()


def test_offload_in_one_process_restore_in_another(master, tmp_path) -> None:  # noqa: F811
    src_blocks, dst_blocks = [4, 0, 17, 9], [1, 22, 5, 13]
    holder = worker(["offload", "--master", master.address, "--segment", str(16 << 20), "--seed", "3",
                     "--blocks", ",".join(map(str, src_blocks)), "--tag", "xp-"])
    try:
        assert Channel(holder).read(120) == {"offloaded": 4}
        out = tmp_path / "restored.npy"
        r = worker(["restore", "--master", master.address, "--blocks", ",".join(map(str, dst_blocks)),
                    "--tag", "xp-", "--out", str(out)])
        assert json.loads(r.communicate(timeout=60)[0].strip().splitlines()[-1]) == {"error": None}
        assert np.array_equal(np.load(out), expected(dst_blocks, src_blocks))
    finally:
        holder.stdin.close()
        holder.wait(30)


def _raw(t: MooncakeTier, name: str, data: bytes) -> None:
    assert t._store.upsert(name, data) == 0


def _crafts(t: MooncakeTier, ks: list[bytes]) -> dict[str, bytes]:
    """Objects under ``ks[1]``'s name that are not its row: each should be refused."""
    names = t.names(ks)
    buf = np.zeros(t._bounce.object_len, dtype=np.uint8)
    assert t._store.get_into(names[0], buf.ctypes.data, buf.nbytes) == buf.nbytes  # ks[0]'s genuine object
    good0 = buf.tobytes()
    flipped = bytearray(good0)
    flipped[HEADER + 100] ^= 1
    magic = bytearray(good0)
    magic[0:8] = b"NOTKVXF!"
    return {"another-keys-object": good0,  # a whole, valid object, but bound to another name
            "flipped-row-byte": bytes(flipped), "foreign-magic": bytes(magic),
            "short": good0[:-16], "long": good0 + b"\0" * 64, "zeros": bytes(len(good0))}


@pytest.mark.parametrize("craft", ["another-keys-object", "flipped-row-byte", "foreign-magic", "short", "long",
                                   "zeros"])
def test_a_crafted_or_foreign_object_is_a_typed_miss(t, monkeypatch, craft) -> None:
    src = cache("layer", DIMS_, X)
    ks = keys(2, f"craft-{craft}-")
    t.offload(src.spec, [3, 8], ks).wait()
    # A name's object replaced by another writer (rewriting ks[0]'s bytes under ks[1]'s name).
    _raw(t, t.names(ks)[1], _crafts(t, ks)[craft])
    dst = cache("row", DIMS_)
    with pytest.raises(StoreCorruptError) as e:
        t.restore(ks, dst.spec, [0, 1]).wait()
    assert e.value.keys == [ks[1]]
    assert dst.untouched([])  # nothing copied: the whole round is refused
    t.restore(ks[:1], dst.spec, [0]).wait()  # the genuine one still restores
    assert np.array_equal(dst.logical(), expected([0], [3]))
    # Control: without the checks the crafted bytes land in the cache.
    if craft == "long":
        return  # Mooncake itself refuses an object larger than the buffer (-600): no bytes to land
    monkeypatch.setattr(t, "_verdict", accept_all.__get__(t))
    t.restore(ks[1:], dst.spec, [1]).wait()
    assert not np.array_equal(dst.logical()[:, :, 1], X[:, :, 8])


def test_the_master_absent_at_start_is_a_typed_error_not_a_90s_setup() -> None:
    require_mooncake()
    port = free_port(host="127.0.0.1")  # reserved, nothing listens
    src = cache("layer", DIMS_, X)
    with pytest.raises(StoreUnavailableError, match="does not answer"):
        MooncakeTier(f"127.0.0.1:{port}", layout=src.spec, timeout=2)
    with pytest.raises(InvalidArgumentError):
        MooncakeTier("127.0.0.1", layout=src.spec, timeout=2)
    # Control: without the probe, the client's own setup() has not returned after 2 s (it holds
    # the GIL meanwhile: no thread of that process could even time it out).
    code = ("from mooncake.store import MooncakeDistributedStore as S;"
            f"print(S().setup('127.0.0.1','P2PHANDSHAKE',0,1<<20,'tcp','','127.0.0.1:{port}'))")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=2)


def test_a_leased_object_is_retried_or_a_typed_busy_never_a_hang(t) -> None:
    src = cache("layer", DIMS_, X)
    ks = keys(2, "lease-")
    t.offload(src.spec, [0, 1], ks).wait()
    dst = cache("row", DIMS_)
    t.restore(ks[:1], dst.spec, [0]).wait()  # the read leases ks[0]
    # Control: the raw client cannot remove it now (-706): a discard that did not retry would not.
    assert t._store.remove(t.names(ks)[0]) == -706
    with pytest.raises(StoreBusyError, match="leased"):
        t.discard(ks[:1], timeout=0.2)
    assert t.discard(ks, timeout=10) == 2  # retried until the lease ended
    assert not t.lookup(ks).any()


def _blocked_at(t: MooncakeTier, stage: str) -> tuple[threading.Event, threading.Event]:
    reached, go = threading.Event(), threading.Event()

    def hook(s: str) -> None:
        if s == stage:
            reached.set()
            go.wait(30)

    t._fault = hook
    return reached, go


@pytest.mark.parametrize("end", ["cancel", "deadline", "control"])
def test_nothing_lands_after_a_cancel_or_a_deadline(t, end) -> None:
    src = cache("layer", DIMS_, X)
    ks = keys(3, f"end-{end}-")
    t.offload(src.spec, [5, 6, 7], ks).wait()
    dst = cache("row", DIMS_)
    reached, go = _blocked_at(t, "verified")  # fetched and checked, about to copy
    tr = t.restore(ks, dst.spec, [0, 1, 2], timeout=5 if end != "deadline" else 0.5)
    assert reached.wait(30)
    if end == "cancel":
        tr.cancel()
    elif end == "deadline":
        with pytest.raises(TransferTimeoutError):
            tr.wait()
    go.set()
    job = tr._posts[0].handle
    job.future.exception(30)  # the job ran to its end
    if end == "control":  # the same restore, left alone, lands the rows
        tr.wait()
        assert np.array_equal(dst.logical(), expected([0, 1, 2], [5, 6, 7]))
        return
    assert isinstance(job.future.exception(), TransferCancelledError)
    assert dst.untouched([])


def test_import_loads_no_mooncake_and_a_missing_wheel_names_the_pip_command(master) -> None:  # noqa: F811
    code = ("import sys, json\n"
            "import kvxfer, kvxfer.tiers, numpy as np\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'mooncake')\n"
            "sys.modules['mooncake'] = None  # the wheel absent\n"
            "spec = kvxfer.spec_from_arrays({'x': np.zeros((4, 64), np.uint8)})\n"
            "try:\n"
            f"    kvxfer.tiers.MooncakeTier('{master.address}', layout=spec, timeout=5)\n"
            "    err = None\n"
            "except kvxfer.errors.MissingDependencyError as exc:\n"
            "    err = str(exc)\n"
            "print(json.dumps([loaded, err]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded, err = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == []
    assert err is not None and "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1" in err
