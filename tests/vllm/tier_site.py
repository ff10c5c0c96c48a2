"""vLLM's real tiering manager on CPU with :class:`KvxferStoreTier` as its secondary tier.

The primary is vLLM's ``CPUPrimaryTierOffloadingManager`` over a numpy region standing in for
its shared mmap (same shape: ``num_chunks`` rows of one chunk each), so the manager, its
eviction and its promotions are vLLM's own; only the GPU<->primary copy, which needs a GPU,
is done by the test (it writes the pattern into the rows vLLM chose).

Run as a script (``tier_site.py kill PATH STAGE``) it stores one request, then a second one
whose store job is SIGKILLed at ``STAGE`` (the store's fault hook), for the crash test.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvxfer.integrations.vllm.tier import KvxferStoreTier
from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

CHUNKS = 8
ROW = 3 * 4096 + 100  # not a 4 KiB multiple: the slab pads each row
SENTINEL = 0xAA
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


class Region:
    """Stands in for vLLM's SharedOffloadRegion: what the primary tier asks of it."""

    def __init__(self, chunks: int = CHUNKS, row: int = ROW) -> None:
        self.num_chunks = chunks
        self.arr = np.full((chunks, row), SENTINEL, dtype=np.uint8)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.arr)

    def cleanup(self) -> None:
        pass


def keys(tag: str, n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), 0) for i in range(n)]


def pattern(key: bytes, row: int = ROW) -> np.ndarray:
    """The bytes a chunk holds, derived from its key alone (the independent reference)."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, row, dtype=np.uint8)


def build(path: str | None, capacity_rows: int = 32, **kw: Any) -> tuple[TieringOffloadingManager, KvxferStoreTier,
                                                                         Region]:
    """vLLM's manager over a fresh region, its tier a local store at ``path`` (None: the tier
    is configured by ``kw`` alone, e.g. ``mooncake_master``)."""
    region = Region()
    primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)  # type: ignore[arg-type]
    if path is not None:
        kw.update(store_path=path, capacity_bytes=capacity_rows * 16384)
    tier = KvxferStoreTier(SimpleNamespace(), primary.get_kv_memoryview(), "KvxferStoreTier", **kw)
    return TieringOffloadingManager(primary, [tier]), tier, region


def rebuild(tier: KvxferStoreTier, region: Region) -> TieringOffloadingManager:
    """A new manager (an empty primary) over an existing tier and its region."""
    primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)  # type: ignore[arg-type]
    return TieringOffloadingManager(primary, [tier])


def settle(mgr: TieringOffloadingManager, tier: KvxferStoreTier) -> None:
    """Every tier job finished and seen by vLLM: two scheduler steps (a step's first poll may
    already have run when the jobs finished; the next step's poll reports them)."""
    tier.drain_jobs()
    mgr.on_schedule_end(END)
    mgr.on_schedule_end(END)


def store(mgr: TieringOffloadingManager, region: Region, req: str, ks: list[bytes], *, wait: bool = True) -> list[bytes]:
    """A request stores ``ks``: vLLM picks primary rows, the "GPU" writes the pattern there,
    complete_store cascades to the tier. Returns the keys vLLM evicted from the primary."""
    ctx = ReqContext(req_id=req)
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(ks, ctx)
    assert out is not None and list(out.keys_to_store) == ks
    for k, c in zip(ks, out.store_spec.chunk_ids.tolist()):  # type: ignore[attr-defined]
        region.arr[c] = pattern(k)
    mgr.complete_store(ks, ctx)
    mgr.on_request_finished(ctx)
    if wait:
        settle(mgr, mgr.secondary_tiers[0])  # type: ignore[arg-type]
    return list(out.evicted_keys)


def promote(mgr: TieringOffloadingManager, tier: KvxferStoreTier, req: str, ks: list[bytes]) -> dict[bytes, int] | None:
    """A request finds ``ks`` only in the tier: vLLM promotes them; returns key -> primary row
    once they are HITs in the primary, or None if the promotion failed."""
    ctx = ReqContext(req_id=req)
    mgr.on_new_request(ctx)
    first = [mgr.lookup(k, ctx) for k in ks]
    mgr.on_schedule_end(END)  # flushes the promotions: submit_load
    settle(mgr, tier)
    again = [mgr.lookup(k, ctx) for k in ks]
    if any(r.name != "HIT" for r in again):
        mgr.on_request_finished(ctx)
        return None
    spec = mgr.prepare_load(ks, ctx)
    rows = dict(zip(ks, spec.chunk_ids.tolist()))  # type: ignore[attr-defined]
    mgr.complete_load(ks, ctx)
    mgr.on_request_finished(ctx)
    assert all(r.name in ("HIT_PENDING", "RETRY") for r in first), first
    return rows


def _kill_child(path: str, stage: str) -> None:
    mgr, tier, region = build(path)
    store(mgr, region, "whole", keys("whole", 4))
    print("stored", flush=True)

    def fault(name: str) -> None:
        if name == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    tier.store._fault = fault
    store(mgr, region, "torn", keys("torn", 4), wait=False)
    time.sleep(30)  # the store's worker kills this process first
    sys.exit(3)


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        _kill_child(sys.argv[2], sys.argv[3])
