"""Planning cost for a 100k-token request on a 61-layer MLA geometry.

    python benchmarks/bench_plan.py [--tokens 100000] [--repeat 200]

1,563 random blocks (64-token blocks, 576 bf16 channels, 61 layers): whole rows (both sides
packed) and split rows (remote per-layer: 95,343 descriptors). The first call of a spec pair
pays for member matching and is reported separately; steady state is what a serving engine
sees on every request. Targets on a 2-core machine: whole rows < 1 ms, split < 10 ms.

A second table uses consecutive block ids (what a block allocator usually hands out) and
shows how many descriptors remain: as planned, as a run-merging backend posts them (runs),
and after the planner's own coalescing, for packed rows, split rows and per-layer regions
on both sides.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from _timing import Column, count, print_table, samples

from kvxfer import plan
from kvxfer.geometry import PRESETS


def _time(fn, repeat: int) -> tuple[float, float]:
    ts = samples(fn, repeat)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    p = PRESETS["mla-61"]
    n = p.blocks_for(args.tokens)
    pool = 4 * n
    rng = np.random.default_rng(0)
    lb, rb = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
    rows = []
    for label, remote_packed, target in (("whole rows", True, 1.0), ("split rows (per layer)", False, 10.0)):
        local = p.spec(pool)
        remote = p.spec(pool, packed=remote_packed)
        t0 = time.perf_counter()
        first = plan(local, remote, lb, rb)
        first_ms = (time.perf_counter() - t0) * 1e3
        med, best = _time(lambda: plan(local, remote, lb, rb), args.repeat)
        rows.append({"case": label, "descriptors": first.descriptors, "first": first_ms, "median": med, "min": best,
                     "target": target})
    # Explicit descriptor arrays, for backends that take addresses rather than indices.
    local, remote = p.spec(pool), p.spec(pool, packed=False)
    pl = plan(local, remote, lb, rb)
    med, best = _time(lambda: pl.remote_descriptors(), max(10, args.repeat // 10))
    rows.append({"case": "explicit split arrays", "descriptors": pl.descriptors, "median": med, "min": best})
    med, best = _time(lambda: plan(local, remote, lb, rb, coalesce=True), max(10, args.repeat // 10))
    rows.append({"case": "split + coalesce", "descriptors": plan(local, remote, lb, rb, coalesce=True).descriptors,
                 "median": med, "min": best})
    ms = "{:.3f}"
    print_table(rows, [Column("case"), Column("descriptors", fmt=count), Column("first", "first ms", ms),
                       Column("median", "median ms", ms), Column("min", "min ms", ms),
                       Column("target", "target ms", "{:.1f}")],
                title=f"mla-61, {args.tokens} tokens = {n} blocks of {p.row / 1e6:.2f} MB rows, pool {pool} blocks")
    consecutive(p, n, pool, max(10, args.repeat // 10))


def consecutive(p, n: int, pool: int, repeat: int) -> None:
    """Descriptor counts for consecutive ids: planned, merged by a backend, coalesced."""
    lb, rb = np.arange(n) + pool // 2, np.arange(n)
    rows = []
    for label, lpacked, rpacked in (("whole rows", True, True), ("split rows (remote layers)", True, False),
                                    ("per-layer both sides", False, False)):
        local, remote = p.spec(pool, packed=lpacked), p.spec(pool, packed=rpacked)
        planned = plan(local, remote, lb, rb)
        merged = plan(local, remote, lb, rb, coalesce=True)
        med, _ = _time(lambda: plan(local, remote, lb, rb, coalesce=True), repeat)
        rows.append({"case": label, "planned": planned.descriptors, "runs": planned.runs,
                     "coalesced": merged.descriptors, "ms": med})
    print_table(rows, [Column("case"), Column("planned", fmt=count), Column("runs", fmt=count),
                       Column("coalesced", fmt=count), Column("ms", "coalesce ms", "{:.3f}")],
                title=f"consecutive block ids ({n} blocks)")


if __name__ == "__main__":
    main()
