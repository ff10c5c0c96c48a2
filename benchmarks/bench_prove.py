"""What proving NIXL metadata in a helper process costs per ``add_peer`` (:mod:`kvxfer.prove`).

    python benchmarks/bench_prove.py [--repeat 30]

Backend-level ``add_remote`` + ``remove_remote`` of a peer in another NIXL backend of this
process, median and slowest of ``--repeat`` runs each:

* ``off``: ``prove_metadata=False`` (the blob goes to this process's NIXL only);
* ``signed``: the default ``prove_metadata="auto"`` on a backend whose agent verifies a
  token (``peers_authenticated``): signed metadata is not proven;
* ``first``: proving on (``True``, or ``"auto"`` without a token), a blob the helper has not seen (the peer registers a new buffer in
  place of its last before each run, so its metadata is new each time); helper running;
* ``cached``: proving on, the same blob again (a digest look-up, no helper round trip);
* ``helper start``: a fresh helper process (Python, NIXL import, agent), once per process
  and after each crash; paid ahead of the first ``add_peer`` by ``start_soon``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvxfer import Allocation
from kvxfer.table import Column, print_table
from kvxfer.prove import Prover


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    from kvxfer_nixl import _probe
    from kvxfer_nixl.backend import NixlBackend

    keep: list[np.ndarray] = []
    handle = None
    peer = NixlBackend("bench-peer", prove_metadata=False)
    rows = []
    for case in ("off", "signed", "first", "cached"):
        me = NixlBackend(f"bench-{case}", prove_metadata={"off": False, "signed": "auto"}.get(case, True))
        me.peers_authenticated = case == "signed"  # what an Agent with a token sets
        if me._proving():
            me._prover.start()  # measured separately below
        times = []
        for _ in range(args.repeat):
            if case != "cached" or handle is None:  # one registration, a new one each time
                if handle is not None:
                    peer.deregister(handle)
                buf = np.zeros(4096, np.uint8)
                keep.append(buf)
                handle = peer.register([Allocation(buf.ctypes.data, buf.nbytes)])
            blob = peer.local_metadata()
            t = time.perf_counter()
            me.add_remote("bench-peer", blob)
            times.append(time.perf_counter() - t)
            me.remove_remote("bench-peer")
        if case == "cached":
            times = times[1:]  # the first of them proved the blob
        rows.append({"case": case, "median": statistics.median(times) * 1e3, "max": max(times) * 1e3,
                     "n": len(times)})
        me.close()
    starts = []
    for _ in range(3):
        p = Prover(_probe._TARGET, {"backends": ["UCX"]})
        t = time.perf_counter()
        p.start()
        starts.append(time.perf_counter() - t)
        p.close()
    rows.append({"case": "helper start", "median": statistics.median(starts) * 1e3, "max": max(starts) * 1e3,
                 "n": len(starts)})
    print_table(rows, ["case", Column("median", "median ms", "{:,.2f}"), Column("max", "slowest ms", "{:,.2f}"), "n"],
                title="NIXL add_remote + remove_remote, with and without proving")
    peer.close()


if __name__ == "__main__":
    main()
