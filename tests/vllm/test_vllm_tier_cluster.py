"""KvxferStoreTier on the cluster tier (``mooncake_master``) through vLLM's real TieringOffloadingManager.

The same manager as test_vllm_tier.py (tier_site.py), the tier a :class:`kvxfer.tiers.MooncakeTier`
on a real ``mooncake_master`` on loopback; the tier's process lends the only segment. Rows are
each key's pattern (tier_site.pattern, the independent reference); the primary is refilled
with the sentinel before a promotion, and every row is compared after. One tier per module:
a Mooncake client takes about 2 s to leave.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.errors import InvalidArgumentError, InvalidTimeoutError, StoreUnavailableError
from kvxfer.integrations.vllm.tier import KvxferStoreTier
from kvxfer.testing.mooncake_master import MooncakeMaster, require
from kvxfer.testing.ports import free_port
from kvxfer.tiers import MooncakeTier
from kvxfer.tiers.objects import HEADER
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from tier_site import CHUNKS, SENTINEL, Region, build, keys, pattern, promote, rebuild, store

pytestmark = [pytest.mark.multiprocess]




@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    require()
    with MooncakeMaster(lease_ms=1500, client_ttl=2) as m:
        yield m


@pytest.fixture(scope="module")
def cluster(master: MooncakeMaster) -> Iterator[tuple[KvxferStoreTier, Region]]:
    _, tier, region = build(None, mooncake_master=master.address, mooncake_segment=16 << 20,
                            mooncake_buffer=256 << 10, mooncake_timeout=10.0)
    yield tier, region
    tier.shutdown()


def _evict_then_sentinel(mgr, region: Region, victims: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    evicted = store(mgr, region, "filler-" + victims[0].hex()[:8], keys("filler-" + victims[0].hex()[:8], CHUNKS))
    assert set(victims) <= set(evicted)
    region.arr[:] = SENTINEL


def _check_rows(region: Region, rows: dict[bytes, int]) -> None:
    ref = np.full_like(region.arr, SENTINEL)
    for k, r in rows.items():
        ref[r] = pattern(k)
    assert np.array_equal(region.arr, ref)


def test_store_evict_promote_bytes_equal_through_the_cluster(cluster) -> None:  # type: ignore[no-untyped-def]
    tier, region = cluster
    assert isinstance(tier.store, MooncakeTier)
    mgr = rebuild(tier, region)
    ks = keys("cl-a", 4)
    store(mgr, region, "cl-a", ks)
    assert tier.store.lookup([tier._key(k) for k in ks]).all()  # the objects are in the cluster
    _evict_then_sentinel(mgr, region, ks)
    rows = promote(mgr, tier, "cl-b", ks)
    assert rows is not None and len(set(rows.values())) == 4
    _check_rows(region, rows)


def _flip(tier: KvxferStoreTier, key: bytes, at: int = HEADER + 777) -> tuple[bytes, bytes]:
    """Flip one row byte of ``key``'s object in the cluster (another writer's upsert); returns
    the object before and after, read back from the cluster."""
    t = tier.store
    assert isinstance(t, MooncakeTier)
    (name,) = t.names([tier._key(key)])
    buf = np.zeros(t._bounce.object_len, dtype=np.uint8)

    def read() -> bytes:
        buf[:] = 0
        assert t._store.get_into(name, buf.ctypes.data, buf.nbytes) == buf.nbytes
        return buf.tobytes()

    before = bytearray(read())
    before_bytes = bytes(before)
    before[at] ^= 0x5A
    assert t._store.upsert(name, bytes(before)) == 0
    return before_bytes, read()


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control-checks-off"])
def test_a_corrupted_object_is_a_failed_job_never_bytes(cluster, checked: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    tier, region = cluster
    mgr = rebuild(tier, region)
    tag = f"cl-c-{checked}"
    ks = keys(tag, 4)
    store(mgr, region, tag, ks)
    _evict_then_sentinel(mgr, region, ks)
    old, new = _flip(tier, ks[1])
    # The corruption reached the object: exactly one byte differs, read back from the cluster.
    assert sum(a != b for a, b in zip(old, new)) == 1 and len(old) == len(new)
    errors = tier.errors
    if not checked:  # the tier's checks bypassed: every fetched object passes
        monkeypatch.setattr(tier.store, "_verdict",
                            lambda got, heads, digests, names: (got < 0, np.ones(got.shape[0], dtype=bool)))
    rows = promote(mgr, tier, tag + "-p", ks)
    if checked:
        assert rows is None  # the promotion failed: vLLM recomputes
        assert np.all(region.arr == SENTINEL)  # 0 bytes of the job reached the primary
        assert tier.errors > errors
    else:  # what the checks stop: the flipped byte served to vLLM as KV
        assert rows is not None
        bad = {k: int(np.count_nonzero(region.arr[r] != pattern(k))) for k, r in rows.items()}
        assert bad == {ks[0]: 0, ks[1]: 1, ks[2]: 0, ks[3]: 0}


def test_another_namespace_never_meets_the_rows(cluster, master: MooncakeMaster) -> None:  # type: ignore[no-untyped-def]
    """An engine of another namespace (another model, shape or explicit namespace) on the same
    master: its fingerprint differs, so the first engine's keys are misses there. Control: the
    same key is a HIT in the first engine's tier."""
    tier, region = cluster
    mgr = rebuild(tier, region)
    ks = keys("cl-ns", 2)
    store(mgr, region, "cl-ns", ks)
    ctx = ReqContext(req_id="ns")
    assert [tier.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 2
    _, other, _ = build(None, mooncake_master=master.address, mooncake_buffer=64 << 10, mooncake_timeout=10.0,
                        namespace="another-model")
    try:
        assert other.store.geometry.fingerprint != tier.store.geometry.fingerprint
        assert [other.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 2
    finally:
        other.shutdown()


BAD = {
    "both-tiers": {"store_path": "/nonexistent-kvxfer", "capacity_bytes": 1 << 20, "mooncake_master": "127.0.0.1:1"},
    "no-tier": {},
    "master-no-port": {"mooncake_master": "127.0.0.1"},
    "master-port-0": {"mooncake_master": "127.0.0.1:0"},
    "master-not-str": {"mooncake_master": 5},
    "master-huge": {"mooncake_master": "h" * 100_000 + ":1"},
    "segment-negative": {"mooncake_master": "127.0.0.1:1", "mooncake_segment": -1},
    "segment-tiny": {"mooncake_master": "127.0.0.1:1", "mooncake_segment": 4096},
    "segment-str": {"mooncake_master": "127.0.0.1:1", "mooncake_segment": "16M"},
    "buffer-bool": {"mooncake_master": "127.0.0.1:1", "mooncake_buffer": True},
    "timeout-nan": {"mooncake_master": "127.0.0.1:1", "mooncake_timeout": float("nan")},
    "timeout-negative": {"mooncake_master": "127.0.0.1:1", "mooncake_timeout": -1.0},
    "capacity-on-cluster": {"mooncake_master": "127.0.0.1:1", "capacity_bytes": 1 << 20},
    "capacity-str": {"store_path": "/nonexistent-kvxfer", "capacity_bytes": "1G"},
}


@pytest.mark.parametrize("conf", list(BAD.values()), ids=list(BAD))
def test_a_malformed_tier_config_is_a_typed_error(conf: dict) -> None:
    require()
    region = Region()
    with pytest.raises((InvalidArgumentError, InvalidTimeoutError)):
        KvxferStoreTier(object(), region.create_kv_memoryview(), "KvxferStoreTier", **conf)  # type: ignore[arg-type]


def test_the_master_absent_is_a_typed_error_within_the_deadline() -> None:
    """Nothing listens at the master's address: a typed error at once (not Mooncake's 90 s
    ``setup()``), raised where vLLM builds its tiers."""
    require()
    port = free_port(host="127.0.0.1")  # reserved, nothing listens
    with pytest.raises(StoreUnavailableError, match="does not answer"):
        build(None, mooncake_master=f"127.0.0.1:{port}", mooncake_timeout=2.0)
