"""Loopback bandwidth against a plain numpy copy of the same bytes, in the same run.

    python benchmarks/bench_loopback.py [--tokens 16384] [--repeat 5]

Prefill holds a block-outermost 61-layer MLA cache (4.5 MB rows); decode pulls a request of
random blocks (a) into a packed cache as whole rows and (b) into per-layer regions (split
rows, 61 descriptors per block). The numpy baselines copy the same spans with one
``np.copyto`` per row (or per page); the ceiling is one contiguous ``np.copyto`` of the same
number of bytes.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from _timing import Column, count, print_table, samples

import kvxfer
from kvxfer.geometry import PRESETS


def _best(fn, repeat: int) -> float:
    return statistics.median(samples(fn, repeat))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    p = PRESETS["mla-61"]
    n = p.blocks_for(args.tokens)
    pool = n + 32
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (pool, p.row), dtype=np.uint8)
    dst_rows = np.full((pool, p.row), 0xAA, np.uint8)
    dst_layers = [np.full((pool, p.page), 0xAA, np.uint8) for _ in range(p.layers)]
    sb, db = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
    nbytes = n * p.row

    prefill = kvxfer.Agent("prefill", backend="loopback")
    prefill.register({f"layer.{i}": src[:, i * p.page:(i + 1) * p.page] for i in range(p.layers)}, replicated=True)
    rows = kvxfer.Agent("decode-rows", backend="loopback")
    rows.register({f"layer.{i}": dst_rows[:, i * p.page:(i + 1) * p.page] for i in range(p.layers)}, replicated=True)
    layers = kvxfer.Agent("decode-layers", backend="loopback")
    layers.register({f"layer.{i}": d for i, d in enumerate(dst_layers)}, replicated=True)
    peer_r, peer_l = rows.add_peer(prefill.metadata()), layers.add_peer(prefill.metadata())

    pairs = list(zip(db.tolist(), sb.tolist()))

    def numpy_rows() -> None:  # the same spans, one np.copyto per row
        for d, s in pairs:
            np.copyto(dst_rows[d], src[s])

    def numpy_layers() -> None:  # the same spans, one np.copyto per (layer, block) page
        for i, dl in enumerate(dst_layers):
            lo, hi = i * p.page, (i + 1) * p.page
            for d, s in pairs:
                np.copyto(dl[d], src[s, lo:hi])

    flat_src, flat_dst = src.reshape(-1)[:nbytes], dst_rows.reshape(-1)[:nbytes]

    def numpy_contiguous() -> None:  # the memcpy ceiling: same bytes, one span
        np.copyto(flat_dst, flat_src)

    results = []
    for label, fn in (
        ("numpy contiguous copy", numpy_contiguous),
        ("numpy copyto per row", numpy_rows),
        ("kvxfer loopback, whole rows", lambda: rows.read(peer_r, db, sb).wait(120)),
        ("numpy copyto per page", numpy_layers),
        ("kvxfer loopback, per layer", lambda: layers.read(peer_l, db, sb).wait(120)),
    ):
        fn()  # warm: page faults, plan caches
        results.append((label, _best(fn, args.repeat)))
    assert (dst_rows[db] == src[sb]).all()
    assert all((d[db] == src[sb, i * p.page:(i + 1) * p.page]).all() for i, d in enumerate(dst_layers))
    pr = rows.plan(peer_r, db, sb)
    pl = layers.plan(peer_l, db, sb)
    desc = {"kvxfer loopback, whole rows": pr.descriptors, "kvxfer loopback, per layer": pl.descriptors}
    print_table([{"copy": label, "descriptors": desc.get(label), "ms": t * 1e3, "gbps": nbytes / t / 1e9}
                 for label, t in results],
                [Column("copy"), Column("descriptors", fmt=count), Column("ms", fmt="{:.1f}"),
                 Column("gbps", "GB/s", "{:.2f}")],
                title=f"mla-61, {n} blocks x {p.row / 1e6:.2f} MB = {nbytes / 1e9:.2f} GB per request; "
                      f"median of {args.repeat}")
    for a in (rows, layers, prefill):
        a.close()


if __name__ == "__main__":
    main()
