"""``kvxfer bench --store PATH``: offload and restore GB/s through a :class:`kvxfer.Store`, every byte checked.

A fresh store in a temporary folder under ``PATH`` (the disk being measured; removed after)
holds one slab sized for the largest request. For each local layout (the local side of
``--layouts``) and request size, each run offloads random blocks of a seeded source cache
under fresh keys, restores them into random blocks of a sentinel-filled destination, and
checks that the destination blocks hold the source's bytes and that nothing else changed;
checks run outside the timed part. Times are the transfers' own. The data path is the one
the store takes for ``--backend`` (``pwritev``/``preadv``, or the backend's file path such
as ``nixl-posix``), shown in the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from typing import Any

import numpy as np

from ..table import Column, count, print_table
from .output import CliError, check_memory, emit_json
from .progress import Steps

__all__ = ["run"]


def run(args: argparse.Namespace, geometry: Any, layouts: list[tuple[str, bool]], options: dict[str, Any]) -> int:
    """``layouts``: the local layouts to measure, each with whether it is packed (one row per block)."""
    from ..agent import Agent
    from ..store import Store
    from ..store.slab import geometry as slab_geometry
    from .._buffers import allocate

    if args.memory != "DRAM":
        raise CliError("--store measures host (DRAM) caches; VRAM goes through benchmarks/gpu_store.sh")
    if not os.path.isdir(args.store):
        raise CliError(f"--store: folder {args.store} does not exist")
    sizes = sorted(set(args.tokens))
    nmax = geometry.blocks_for(sizes[-1])
    pool = nmax + max(4, nmax // 8)
    check_memory(2 * pool * geometry.row, "this bench")
    local_layouts = dict(layouts)
    rows: list[dict[str, Any]] = []
    work = tempfile.mkdtemp(dir=args.store, prefix="kvxfer-bench-store-")
    try:
        with Steps("kvxfer bench --store", len(local_layouts) * len(sizes) * (args.repeat + 1)) as steps:
            for layout in local_layouts:
                with steps.step(f"allocating the caches ({layout}, {pool:,} blocks of {geometry.row / 1e6:.2f} MB)"):
                    src = allocate(geometry, pool, packed=local_layouts[layout])
                    src.fill_blocks(args.seed)
                    dst = allocate(geometry, pool, packed=local_layouts[layout])
                with Agent("bench-src", backend=args.backend, timeout=args.timeout, **options) as a, \
                        Agent("bench-dst", backend=args.backend, timeout=args.timeout, **options) as b:
                    spec = src.register(a)
                    dst.register(b)
                    cap = nmax * slab_geometry(spec).stride
                    with Store(os.path.join(work, layout), capacity=cap, layout=spec, timeout=args.timeout) as st:
                        for tokens in sizes:
                            n = geometry.blocks_for(tokens)
                            point = f"{layout} {tokens:,} tokens"
                            with steps.step(f"{point}, {args.repeat + 1} runs"):
                                rows += _measure(args, a, b, st, src, dst, n, pool, steps, point, layout, tokens)
                del src, dst
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        emit_json(rows)
        return 0
    print_table(rows, [Column("op"), Column("layout", "local"), Column("tokens", fmt=count),
                       Column("blocks", fmt=count), Column("path"), Column("posts", fmt=count),
                       Column("descriptors", fmt=count), Column("bytes", "GB", lambda v: f"{v / 1e9:.3f}"),
                       Column("median_seconds", "median ms", lambda v: f"{v * 1e3:.2f}"),
                       Column("gbps", "GB/s", "{:.2f}"), Column("verified", "verified runs")],
                title=f"kvxfer bench --store {args.store}: {args.backend}, {geometry.name} "
                      f"({geometry.row / 1e6:.2f} MB rows), DRAM; median of {args.repeat}")
    return 0


def _measure(args: argparse.Namespace, a: Any, b: Any, st: Any, src: Any, dst: Any, n: int, pool: int,
             steps: Steps, point: str, layout: str, tokens: int) -> list[dict[str, Any]]:
    from ..errors import VerificationError

    rng = np.random.default_rng((args.seed, n))
    times: dict[str, list[float]] = {"offload": [], "restore": []}
    last: dict[str, Any] = {}
    verified = 0
    for i in range(args.repeat + 1):  # run 0 warms up (plans, page cache, the file path's registrations)
        sb, db = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
        keys = [b"bench:%d:%d" % (i, k) for k in range(n)]
        run = "warm-up" if i == 0 else f"run {i}/{args.repeat}"
        with steps.step(f"{point}, {run}: offload and restore"):
            st.discard(st.keys())
            last["offload"] = a.offload(st, sb, keys).wait(args.timeout)
            dst.reset()
            last["restore"] = b.restore(st, keys, db).wait(args.timeout)
        with steps.step(f"{point}, {run}: verifying {n:,} blocks and the sentinel"):
            problem = dst.verify(db, sb, args.seed)
        if problem:
            raise VerificationError(f"VERIFY FAILED at {n} blocks: {problem}")
        verified += 1
        if i:
            for op, t in last.items():
                times[op].append(t.stats.seconds)
        steps.advance()
    out = []
    for op, t in last.items():
        med = statistics.median(times[op])
        s = t.stats
        out.append({"op": op, "backend": args.backend, "layout": layout, "tokens": tokens, "blocks": n,
                    "path": s.path, "posts": s.posts, "descriptors": s.descriptors, "bytes": s.nbytes,
                    "median_seconds": med, "min_seconds": min(times[op]), "gbps": s.nbytes / med / 1e9 if med else None,
                    "verified": verified})
    return out
