"""The fence's cost: NIXL READs over UCX's TCP transport with the bounce area on and off.

A peer process (``python -m kvxfer.testing.peer``, ``UCX_TLS=tcp``) holds a packed source of
``--blocks`` blocks of ``--layers`` x ``--page`` bytes; this process READs every block into a
destination, once per sample, with ``fence_reads=True`` (the default over TCP: the READ lands
in a private area and is copied out once DONE) and ``fence_reads=False`` (straight into the
destination, as before issue 30), alternating so that load drifts hit both. After each case
the destination is checked byte for byte against the peer's pages. Prints medians and p90.
Figures: BENCHMARKS.md ("The fence over TCP").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ["UCX_TLS"] = "tcp"

import numpy as np  # noqa: E402

from kvxfer import Agent  # noqa: E402
from kvxfer.testing.buffers import make_cache  # noqa: E402
from kvxfer.testing.peer import PeerProcess, spawn_args  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _timing import Column, print_table, samples  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page", type=int, default=256 << 10)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    geom = dict(num_layers=args.layers, page=args.page)
    peer = PeerProcess(spawn_args("nixl", name="prefill", cache="packed", blocks=args.blocks, layers=args.layers,
                                  page=args.page, seed=5, replicated=True), env={"UCX_TLS": "tcp"})
    ids = list(range(args.blocks))
    try:
        agents, dsts = {}, {}
        for fence in (True, False):
            dsts[fence] = make_cache("packed", num_blocks=args.blocks, **geom)
            a = agents[fence] = Agent(f"decode-{int(fence)}", backend="nixl", fence_reads=fence)
            a.register(dsts[fence].views, replicated=True)
            name = a.add_peer(peer.metadata)
            a.read(name, ids, ids).wait(60)  # warm: connection and lists
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeat):
            for fence in (True, False):
                times[fence] += samples(lambda: agents[fence].read("prefill", ids, ids).wait(60), 1)
        ref = make_cache("packed", num_blocks=args.blocks, seed=5, **geom).layer_pages()
        for fence in (True, False):
            np.testing.assert_array_equal(dsts[fence].layer_pages(), ref)
            agents[fence].close()
        nbytes = args.blocks * args.layers * args.page
        rows = [{"fence_reads": str(f), "MiB": nbytes / 2**20, "median_ms": statistics.median(t) * 1e3,
                 "p90_ms": sorted(t)[int(0.9 * (len(t) - 1))] * 1e3,
                 "GB_s": nbytes / statistics.median(t) / 1e9} for f, t in times.items()]
        print_table(rows, [Column("fence_reads"), Column("MiB", fmt="{:.0f}"), Column("median_ms", fmt="{:.1f}"),
                           Column("p90_ms", fmt="{:.1f}"), Column("GB_s", fmt="{:.2f}")])
    finally:
        peer.close()


if __name__ == "__main__":
    main()
