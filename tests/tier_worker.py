"""A child process of the cluster-tier tests: one Mooncake Store client that offloads or restores.

    python tests/tier_worker.py offload --master H:P --hostname H --segment BYTES --seed S --blocks 0,1 --tag k
    python tests/tier_worker.py restore --master H:P --hostname H --blocks 3,4 --tag k --out FILE.npy

``offload`` fills a per-layer cache from the logical array of ``--seed`` (tests/store_caches.py),
offloads ``--blocks`` under keys ``<tag><i>``, prints one JSON line and then holds its segment
(the objects live there) until its stdin closes. ``restore`` restores the keys into a
sentinel-filled row cache's ``--blocks``, saves the cache's logical array to ``--out`` and
prints one JSON line (the error's type name when the restore failed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from store_caches import DIMS, cache, keys, logical  # noqa: E402

from kvxfer.tiers import MooncakeTier  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("offload", "restore"))
    ap.add_argument("--master", required=True)
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--segment", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--blocks", required=True)
    ap.add_argument("--tag", default="k")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dims = DIMS["padded"]
    blocks = [int(b) for b in a.blocks.split(",")]
    ks = keys(len(blocks), a.tag)
    c = cache("layer", dims, logical(dims, a.seed) if a.mode == "offload" else None)
    if a.mode == "restore":
        c = cache("row", dims)
    tier = MooncakeTier(a.master, layout=c.spec, hostname=a.hostname, segment=a.segment, buffer=1 << 20, timeout=10)
    try:
        if a.mode == "offload":
            tier.offload(c.spec, blocks, ks).wait()
            print(json.dumps({"offloaded": len(ks)}), flush=True)
            sys.stdin.read()  # hold the segment until the parent is done
            return
        err = None
        try:
            tier.restore(ks, c.spec, blocks).wait()
        except Exception as exc:
            err = type(exc).__name__
        np.save(a.out, np.ascontiguousarray(c.logical()))
        print(json.dumps({"error": err}), flush=True)
    finally:
        tier.close()


if __name__ == "__main__":
    main()
