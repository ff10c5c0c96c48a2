"""KvxferStoreTier through vLLM's real TieringOffloadingManager on CPU (tier_site.py).

Bytes move for real: the "GPU" writes a pattern derived from each key into the rows vLLM
chose, vLLM cascades them to the tier, evicts them from the primary by storing more, and
promotes them back into a primary refilled with the sentinel; the test compares every row
against the key's pattern (promoted rows) or the sentinel (all others).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvxfer.errors import InvalidArgumentError
from kvxfer.integrations.vllm.tier import KvxferStoreTier
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from tier_site import CHUNKS, ROW, SENTINEL, build, keys, pattern, promote, store

HERE = Path(__file__).resolve().parent


def _evict_then_sentinel(mgr, tier, region, victims: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    """Store enough other chunks that vLLM evicts ``victims`` from the primary, then refill the
    primary with the sentinel (every row that a promotion does not write must stay so)."""
    evicted = store(mgr, region, "filler", keys("filler", CHUNKS))
    assert set(victims) <= set(evicted)
    region.arr[:] = SENTINEL


def _check_rows(region, rows: dict[bytes, int]) -> None:  # type: ignore[no-untyped-def]
    ref = np.full_like(region.arr, SENTINEL)
    for k, r in rows.items():
        ref[r] = pattern(k)
    assert np.array_equal(region.arr, ref)


def _dir(tmp_path: Path) -> str:
    d = tmp_path / "tier"
    d.mkdir(mode=0o700)
    return str(d)


def test_store_evict_promote_bytes_equal(tmp_path: Path) -> None:
    mgr, tier, region = build(_dir(tmp_path))
    ks = keys("a", 4)
    store(mgr, region, "a", ks)
    assert len(tier.store) == 4
    _evict_then_sentinel(mgr, tier, region, ks)
    rows = promote(mgr, tier, "b", ks)
    assert rows is not None and len(set(rows.values())) == 4
    _check_rows(region, rows)
    st = tier.store
    mgr.shutdown()
    assert st._closed


@pytest.mark.parametrize("stage", ["call", "written"])
def test_sigkill_mid_store_leaves_only_whole_entries(tmp_path: Path, stage: str) -> None:
    path = _dir(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    p = subprocess.run([sys.executable, str(HERE / "tier_site.py"), "kill", path, stage], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert "stored" in p.stdout
    mgr, tier, region = build(path)
    ctx = ReqContext(req_id="probe")
    assert [tier.lookup(k, ctx) for k in keys("torn", 4)] == [LookupResult.MISS] * 4
    # control: the request stored before the kill is found, whole, by the new process
    whole = keys("whole", 4)
    assert [tier.lookup(k, ctx) for k in whole] == [LookupResult.HIT] * 4
    rows = promote(mgr, tier, "again", whole)
    assert rows is not None
    _check_rows(region, rows)
    mgr.shutdown()


def _flip_every_row(tier: KvxferStoreTier, offset: int = 777) -> None:
    slab = tier.store.path  # the slab file (slab-FP.kv)
    assert os.path.basename(slab).startswith("slab-") and slab.endswith(".kv")
    stride = tier.store.geometry.stride
    with open(slab, "r+b") as f:
        for s in range(tier.store.slots):
            f.seek(4096 + s * stride + offset)
            b = f.read(1)
            f.seek(4096 + s * stride + offset)
            f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("digests", [True, False], ids=["checked", "control-digests-off"])
def test_flipped_byte_on_disk_is_a_failed_job_never_bytes(tmp_path: Path, digests: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, tier, region = build(_dir(tmp_path))
    if not digests:  # the check bypassed: every row's digest reads as 0, written and checked
        monkeypatch.setattr(tier.store, "_digest_slots", lambda s: np.zeros(s.shape[0], dtype=np.uint64))
        monkeypatch.setattr(tier.store, "_digest_local", lambda c, b: np.zeros(b.shape[0], dtype=np.uint64))
    ks = keys("c", 4)
    store(mgr, region, "c", ks)
    _evict_then_sentinel(mgr, tier, region, ks)
    _flip_every_row(tier)
    rows = promote(mgr, tier, "d", ks)
    if digests:
        assert rows is None  # the promotion failed: vLLM recomputes
        # 0 corrupted bytes stay in the primary: each chunk is untouched, or was read, failed its
        # digest and was zeroed before the job was reported
        assert all(np.all(r == SENTINEL) or not r.any() for r in region.arr)
        assert [tier.lookup(k, ReqContext(req_id="e")) for k in ks] == [LookupResult.MISS] * 4
        assert tier.errors >= 1
    else:  # what the digests stop: the flipped byte served to vLLM as KV
        assert rows is not None
        bad = sum(int(np.count_nonzero(region.arr[r] != pattern(k))) for k, r in rows.items())
        assert bad == 4
    mgr.shutdown()


def _job(jid: object, ks: object, ids: object, promo: bool = False) -> TransferJob:
    return TransferJob(job_id=jid, keys=ks, chunk_ids=ids, is_promotion=promo,  # type: ignore[arg-type]
                       req_context=ReqContext(req_id="hostile"))


HOSTILE = {
    "str-key": (["abc"], np.array([0])),
    "empty-key": ([b""], np.array([0])),
    "huge-key": ([b"k" * 100_000], np.array([0])),
    "keys-not-a-list": (b"abcdefgh", np.array([0])),
    "keys-none": (None, np.array([0])),
    "too-many-keys": ([bytes([i]) * 8 for i in range(CHUNKS + 1)], np.arange(CHUNKS + 1)),
    "dup-key": ([b"k1234567", b"k1234567"], np.array([0, 1])),
    "ids-float": ([b"k1234567"], np.array([0.0])),
    "ids-2d": ([b"k1234567"], np.array([[0]])),
    "ids-list": ([b"k1234567"], [0]),
    "ids-out-of-range": ([b"k1234567"], np.array([CHUNKS])),
    "ids-negative": ([b"k1234567"], np.array([-1])),
    "ids-huge": ([b"k1234567"], np.array([2**62])),
    "ids-mismatch": ([b"k1234567", b"k7654321"], np.array([0])),
    "ids-dup": ([b"k1234567", b"k7654321"], np.array([3, 3])),
}


@pytest.mark.parametrize("load", [False, True], ids=["store", "load"])
def test_hostile_jobs_and_keys_are_contained_and_fail(tmp_path: Path, load: bool) -> None:
    mgr, tier, region = build(_dir(tmp_path))
    good = keys("g", 2)
    store(mgr, region, "g", good)
    region.arr[:] = SENTINEL
    before_keys = sorted(tier.store.keys())
    submit = tier.submit_load if load else tier.submit_store
    for i, (ks, ids) in enumerate(HOSTILE.values()):
        assert submit(_job(100 + i, ks, ids, load)) is None
    for bad_id in ("x", True, None, 1.5):
        assert submit(_job(bad_id, [good[0]], np.array([0]), load)) is None
    assert submit("not a job") is None  # type: ignore[arg-type]
    for k in ("abc", b"", b"k" * 100_000, None, 7):
        assert tier.lookup(k, ReqContext(req_id="hostile")) is LookupResult.MISS  # type: ignore[arg-type]
    tier.drain_jobs()
    done = {r.job_id: r.success for r in tier.get_finished_jobs()}
    assert done == {100 + i: False for i in range(len(HOSTILE))}  # each one reported, as a failure
    assert np.all(region.arr == SENTINEL) and sorted(tier.store.keys()) == before_keys
    mgr.shutdown()


class _Forgetful(dict):  # type: ignore[type-arg]
    """The tier's job table with the in-flight check bypassed: no job id is ever "in flight"."""

    def __contains__(self, key: object) -> bool:
        return False


@pytest.mark.parametrize("checked", [True, False], ids=["refused", "control-check-off"])
def test_a_replayed_job_id_in_flight_is_refused(tmp_path: Path, checked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job id replayed while the first job is in flight is refused: the first job's bytes are
    stored and reported once, the replay's never land. Control: without the check the replay
    takes over the id, its bytes land in the slab and the first job's report is lost."""
    mgr, tier, region = build(_dir(tmp_path))
    first, replay = keys("first", 1)[0], keys("replay", 1)[0]
    region.arr[1], region.arr[2] = pattern(first), pattern(replay)
    if not checked:
        monkeypatch.setattr(tier, "_jobs", _Forgetful())
    tier.submit_store(_job(500, [first], np.array([1])))
    t_first = tier._jobs.get(500)
    tier.submit_store(_job(500, [replay], np.array([2])))
    tier.drain_jobs()
    if t_first is not None and t_first.transfer is not None:
        t_first.transfer.wait()  # the first job's worker has returned either way
    done = [(r.job_id, r.success) for r in tier.get_finished_jobs()]
    ctx = ReqContext(req_id="h")
    if checked:
        assert done == [(500, True)] and tier.errors == 1
        assert tier.lookup(first, ctx) is LookupResult.HIT and tier.lookup(replay, ctx) is LookupResult.MISS
        region.arr[:] = SENTINEL  # the first job's bytes, read back through the tier
        tier.submit_load(_job(501, [first], np.array([5]), True))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(501, True)]
        ref = np.full_like(region.arr, SENTINEL)
        ref[5] = pattern(first)
        assert np.array_equal(region.arr, ref)
    else:  # what the check stops: the replay's bytes are stored under the replayed id
        assert tier.lookup(replay, ctx) is LookupResult.HIT and tier.errors == 0
        assert done == [(500, True)]  # one report for two jobs: the first job's is lost
    mgr.shutdown()


def test_control_hostile_job_raises_without_the_boundary(tmp_path: Path) -> None:
    """What the boundary contains: the unwrapped callbacks raise typed errors into the caller."""
    mgr, tier, region = build(_dir(tmp_path))
    for ks, ids in HOSTILE.values():
        with pytest.raises(InvalidArgumentError):
            KvxferStoreTier.submit_store.__wrapped__(tier, _job(1, ks, ids))  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError):
        KvxferStoreTier.lookup.__wrapped__(tier, "abc", ReqContext(req_id="h"))  # type: ignore[attr-defined]
    mgr.shutdown()


def test_row_is_a_whole_chunk_and_a_job_is_few_calls(tmp_path: Path) -> None:
    """The slab's row is vLLM's chunk; a job of consecutive rows is one system call."""
    mgr, tier, region = build(_dir(tmp_path))
    assert tier.store.geometry.row_len == ROW
    ks = keys("f", 4)
    region.arr[:4] = np.stack([pattern(k) for k in ks])
    t = tier.store.offload(tier.spec, np.arange(4), [b"kvxfer-vllm-tier-v1\0" + k for k in ks]).wait()
    assert t.stats.posts == 1
    mgr.shutdown()


def test_selected_by_vllms_factory_from_the_extra_config(tmp_path: Path) -> None:
    """The config docs/engines.md gives: vLLM's factory imports and builds the tier from it."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from tier_site import Region

    region = Region()
    conf = {"type": "KvxferStoreTier", "module_path": "kvxfer.integrations.vllm.tier",
            "store_path": _dir(tmp_path), "capacity_bytes": 1 << 20, "locality": "LOCAL"}
    tier = SecondaryTierFactory.create_secondary_tier(conf, region.create_kv_memoryview(), SimpleNamespace())
    assert isinstance(tier, KvxferStoreTier) and tier.store.slots == (1 << 20) // tier.store.geometry.stride
    tier.shutdown()
