"""Planning cost of a heterogeneous request: decode TP2 gathering heads from prefill TP8.

    python benchmarks/bench_reshard.py [--tokens 100000] [--repeat 50]

A GQA model of 32 layers, 8 KV heads of 128 dims (bf16), 16-token HND pages, one region per
layer and K/V. Decode rank 0 of TP2 holds heads [0, 4) and reads one head from each of
prefill ranks 0-3 of TP8. Reported: the first call (the gather decided once per set of
specs) and steady state (per request: descriptors for every peer, merged). Target on a
2-core machine: < 5 ms per request.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from _timing import samples

import kvxfer
from kvxfer.planner import plan_gather
from kvxfer.pairing import gather

LAYERS, HEADS, DIM, TOKENS = 32, 8, 128, 16


def spec(tp: int, rank: int, blocks: int, base: int) -> kvxfer.KVCacheSpec:
    h = max(1, HEADS // tp)
    first = rank * HEADS // tp if HEADS >= tp else rank * HEADS // tp
    pg = kvxfer.PageFormat("bfloat16", 2, "HND", (h, TOKENS, DIM))
    allocs, regions = [], []
    for i in range(LAYERS * 2):
        m = kvxfer.Member(f"layer.{i // 2}.{'kv'[i % 2]}", pg.nbytes, 0, False, pg, "kv"[i % 2],
                          kvxfer.Shard(rank, tp, (first, first + h), HEADS), i // 2)
        allocs.append(kvxfer.Allocation(base + i * (1 << 32), pg.nbytes * blocks))
        regions.append(kvxfer.Region(i, 0, blocks, kvxfer.PackedLayout(pg.nbytes, (m,))))
    return kvxfer.KVCacheSpec(tuple(allocs), tuple(regions), layout="LBHNC", block_tokens=TOKENS, tp_rank=rank,
                              tp_size=tp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    n = -(-args.tokens // TOKENS)
    local = spec(2, 0, 2 * n, 1 << 40)
    remotes = {f"p{r}": spec(8, r, 2 * n, (r + 2) << 44) for r in range(8)}
    rng = np.random.default_rng(0)
    lb = rng.permutation(2 * n)[:n]
    rbs = {k: rng.permutation(2 * n)[:n] for k in remotes}
    t0 = time.perf_counter()
    g = gather(local, remotes)
    first = (time.perf_counter() - t0) * 1e3
    plans = plan_gather(g, local, remotes, lb, rbs)
    ts = samples(lambda: plan_gather(g, local, remotes, lb, rbs), args.repeat)
    print(f"TP8 -> TP2 GQA, {args.tokens} tokens = {n} blocks; peers read: {sorted(plans)}")
    print(f"descriptors: {sum(p.descriptors for p in plans.values()):,} "
          f"({g.per_block('p0')} per block per peer), bytes: {sum(p.nbytes for p in plans.values()):,}")
    print(f"gather (once per spec set): {first:.2f} ms; per request: median {statistics.median(ts) * 1e3:.2f} ms, "
          f"min {min(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
